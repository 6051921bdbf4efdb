"""What the math rewards do to an answer before grading it: common notations made plain, and hedges found.

Notations (`normalize_notation`): a correct answer written in a notation the graders do not read scored 0, and
math-verify alone misses these too (docs/rewards.md):

- Unicode: vulgar fractions (``½`` -> ``\\frac{1}{2}``, ``1½`` -> ``(1+\\frac{1}{2})``), superscripts (``2³`` ->
  ``2^{3}``), ``∞`` -> ``\\infty``, minus look-alikes (U+2212, U+FE63, U+FF0D) -> ``-``, then NFKC (full-width
  digits and letters ``４２`` -> ``42``);
- digit-group separators between groups of three digits: thin and no-break spaces (U+2009, U+202F, U+00A0), LaTeX
  spaces (``\\,`` ``\\;`` ``\\:`` ``\\!`` ``\\ ``) and ``{,}`` (``12\\,345`` -> ``12345``; math-verify read it
  as 357). A plain space is not taken as a separator (``12 345`` may be two numbers);
- scientific notation ``1.2e3`` / ``1.2E-3`` (`scientific_to_latex` writes the exact decimal, ``1200``, for
  math-verify, which read ``1.2e3`` as 1.2 * e * 3).

Hedges (`hedged`): an answer that names several candidates where one value is asked for scores 0 (a policy that
learns to hedge would otherwise be paid for it): candidates joined by "or", ``\\lor``, ``\\vee``, ``∨``; a ``±``
/ ``\\pm`` / ``∓``; an equation between two different numbers (``3 = 4``). A label that is itself a set is graded
as a set by math-verify (equal sets only).
"""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal, InvalidOperation
from fractions import Fraction

MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_SUPERSCRIPTS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻", "0123456789+-")
_SUPERSCRIPT_RUN = re.compile(r"[⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻]+")
_VULGAR = re.compile(r"(\d?)([\u00bc-\u00be\u2150-\u215e])")
# Between two digit groups, the last of exactly three digits: thin/no-break spaces, LaTeX spacing, {,}.
_GROUP_SEPARATOR = re.compile(r"(?<=\d)(?:\\[,;:!]|\\ |\{,\}|[\u2009\u202f\u00a0])(?=\d{3}(?!\d))")
_SCIENTIFIC = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)[eE]([+-]?\d+)(?![\w.])")

_HEDGE_WORDS = re.compile(r"\\lor\b|\\vee\b|∨|\\pm\b|\\mp\b|±|∓|\bor\b|\\text\{\s*or\s*\}", re.IGNORECASE)
_PLAIN_NUMBER = r"-?\d+(?:\.\d+)?"
# "a = b" between two bare numbers; `hedged` skips one whose left number ends an expression (48 + 24 = 72).
_NUMBER_EQUATION = re.compile(rf"(?<![\d.])({_PLAIN_NUMBER})\s*=\s*({_PLAIN_NUMBER})(?!\d|\.\d)")
# What ends an expression before "= b": an operator (also as a LaTeX command) or a closing bracket.
_EXPRESSION_END = re.compile(r"(?:[+\-*/×÷·^)\]}]|\\(?:times|cdot|div|pm|mp))\s*$")
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+(?=[^\d])|\n")


def normalize_notation(text: str) -> str:
    """``text`` with the notations of the module doc made plain (idempotent)."""
    text = _VULGAR.sub(_vulgar_fraction, text)
    text = _SUPERSCRIPT_RUN.sub(lambda m: "^{" + m.group(0).translate(_SUPERSCRIPTS) + "}", text)
    text = text.replace("∞", "\\infty ").translate(MINUS_SIGNS)
    text = _GROUP_SEPARATOR.sub("", text)  # before NFKC, which turns thin and no-break spaces into plain ones
    return unicodedata.normalize("NFKC", text)


def _vulgar_fraction(match: re.Match) -> str:
    value = Fraction(unicodedata.numeric(match.group(2))).limit_denominator(16)
    fraction = f"\\frac{{{value.numerator}}}{{{value.denominator}}}"
    return f"({match.group(1)}+{fraction})" if match.group(1) else fraction


def scientific_to_latex(text: str) -> str:
    """``1.2e3`` -> ``1200``, ``1.2e-3`` -> ``0.0012``: the exact decimal (math-verify read ``1.2e3`` as
    1.2 * e * 3, and compares a float product such as 0.1 * 10^-1 with 1/100 as unequal)."""
    return _SCIENTIFIC.sub(_plain_decimal, text)


def _plain_decimal(match: re.Match) -> str:
    exponent = int(match.group(2))
    if abs(exponent) > 100:  # not worth a hundred-digit string: left as a product
        return f"{match.group(1)}\\times10^{{{exponent}}}"
    return format(Decimal(f"{match.group(1)}e{exponent}").normalize(), "f")


def hedged(text: str) -> bool:
    """Whether ``text`` names several candidates (see the module doc)."""
    if _HEDGE_WORDS.search(text):
        return True
    for match in _NUMBER_EQUATION.finditer(text):
        before = text[:match.start()]
        if (before and (before[-1].isalnum() or before[-1] == "_")) or _EXPRESSION_END.search(before):
            continue  # the left side ends a name (a3) or an expression (48 + 24 = 72), not a value of its own
        try:
            if Decimal(match.group(1)) != Decimal(match.group(2)):
                return True
        except InvalidOperation:
            continue
    return False


def final_statement(response: str) -> str | None:
    """The sentence (or line) of a free-text response that states its answer: the last one holding a digit (or
    infinity), None when none does."""
    sentences = [s for s in _SENTENCE_BREAK.split(response) if re.search(r"\d|\\infty", s)]
    return sentences[-1] if sentences else None
