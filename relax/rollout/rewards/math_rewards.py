"""Rule rewards for math answers: ``math`` (symbolic), ``gsm8k`` (numeric) and ``dapo`` (string match).

They differ in how much they forgive: ``math`` asks math-verify whether two expressions are
equal (``1/2`` matches ``0.5``), ``gsm8k`` compares plain numbers, and ``dapo`` reproduces
DAPO's normalized string match (and its -1 penalty) so results are comparable with DAPO runs.
``math`` and ``gsm8k`` read common notations first and refuse hedged answers (`relax.rollout.rewards.notation`).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal
from typing import Any

from relax.rollout.rewards.boxed import boxed_or_whole, has_box, last_boxed_content, last_tag_content
from relax.rollout.rewards.notation import (
    MINUS_SIGNS,
    final_statement,
    hedged,
    normalize_notation,
    scientific_to_latex,
)
from relax.rollout.rewards.registry import register_reward

# math-verify's limit for parsing and for comparing one pair of answers (its default), for direct calls on a main
# thread. `RewardComputer`'s worker processes set it to None: there the kill at --reward-timeout bounds each call.
MATH_VERIFY_TIMEOUT_S: int | None = 5

_PERCENT = re.compile(r"\\?%\s*$")


def _math_verify_timeout_s() -> int | None:
    """math-verify enforces its timeout with SIGALRM, which only the main thread may set (in any
    other thread the call fails and math-verify reports "no answer"). Off the main thread the
    check runs without a time limit of its own: `RewardComputer` bounds it from outside."""
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_latex_box(answer: str) -> str:
    """An extracted answer in the form math-verify reads: inside ``\\boxed{}`` (bare LaTeX such as
    ``\\frac{1}{2}`` parses only inside math delimiters). A trailing percent sign is dropped: ``50\\%``
    equals 50 (not 0.5), as the MATH answer normalisation does."""
    answer = _PERCENT.sub("", answer.strip())
    return answer if "$" in answer.replace("\\$", "") else f"\\boxed{{{answer}}}"


def extract_math_answer(response: str) -> str | None:
    """What math-verify is given: the last ``\\boxed{}``, else the last ``<answer>...</answer>`` (as a box), else
    the whole response (math-verify finds the answer itself). None when the response was cut off inside its
    last box or answer tag: an earlier box is a stale answer, not this one."""
    if has_box(response):
        boxed = last_boxed_content(response)
        return None if boxed is None else _as_latex_box(boxed)
    if "<answer>" in response:
        tagged = last_tag_content(response, "answer")
        return None if tagged is None else _as_latex_box(tagged)
    return response


def _extract_boxed_math_answer(response: str) -> str | None:
    boxed = last_boxed_content(response)
    return None if boxed is None else _as_latex_box(boxed)


@register_reward("math", extract=extract_math_answer, extract_boxed=_extract_boxed_math_answer, isolated=True)
def grade_math(answer: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if ``answer`` (math-verify input, see `extract_math_answer`) equals the label symbolically, else 0.0.

    Notations are made plain first (`normalize_notation`). A hedge scores 0 where the label is one value: a boxed
    answer's "or" / ``\\lor`` candidates become a set, which math-verify compares with the label as a set (so a
    set label is still matched by the same set); a free-text answer whose final statement hedges, and any answer
    equating two different numbers, score 0. A label math-verify cannot read raises: that is a data error, not a
    wrong answer.
    """
    # Imported here: math-verify pulls in sympy (about a second), which runs without the math reward need not pay.
    from math_verify import parse, verify

    timeout_s = _math_verify_timeout_s()
    gold_text = _PERCENT.sub("", scientific_to_latex(normalize_notation(str(label).strip())))
    if "$" not in gold_text and "\\boxed" not in gold_text:
        gold_text = f"${gold_text}$"  # math-verify reads bare LaTeX such as x^2+1 only inside math delimiters
    gold = parse(gold_text, parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"math-verify cannot parse the label {str(label)!r}")
    answer = scientific_to_latex(normalize_notation(answer))
    if has_box(answer):
        answer = _LOGICAL_OR.sub(r"\\text{ or }", answer)  # math-verify keeps only the last of "3 \lor 4"
        if hedged(_strip_or(answer)):  # an equation between two different numbers
            return 0.0
    else:
        statement = final_statement(answer)
        if statement is not None and hedged(statement) and _one_value(gold):
            return 0.0
    parsed = parse(answer, parsing_timeout=timeout_s)
    if not parsed:
        return 0.0
    return 1.0 if verify(gold, parsed, timeout_seconds=timeout_s) else 0.0


_LOGICAL_OR = re.compile(r"\\lor\b|\\vee\b|∨")
_OR_WORDS = re.compile(r"\\text\{\s*or\s*\}|\bor\b")


def _strip_or(text: str) -> str:
    """``text`` without its "or" words: math-verify reads them as a set, which it grades as a set."""
    return _OR_WORDS.sub(",", text)


def _one_value(gold: list) -> bool:
    """The label is one value, not a set, tuple or interval of them."""
    import sympy

    return not any(isinstance(item, (sympy.Set, sympy.Tuple, tuple, list, set)) for item in gold[:1])


GSM8K_ANSWER_MARKER = "####"
# A number: digits with thousands commas (groups of three only: "1,2" is two numbers) or without, decimals.
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


def _numbers(text: str) -> list[Decimal]:
    """Numbers in ``text``, thousands separators removed ("$1,200.50" gives 1200.50, "12\\,345" 12345); a Unicode
    minus (U+2212 and its look-alikes) is a minus."""
    return [Decimal(match.replace(",", "")) for match in _NUMBER.findall(normalize_notation(text))]


def _gsm8k_label(text: str) -> Decimal | None:
    """The label's number: the first after the last ``####`` (GSM8K's answer line), else the last one."""
    if GSM8K_ANSWER_MARKER in text:
        after_marker = _numbers(text.rsplit(GSM8K_ANSWER_MARKER, 1)[1])
        return after_marker[0] if after_marker else None
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def gsm8k_response_answer(text: str) -> Decimal | None:
    """A response's final answer as one number, or None when it does not give exactly one: the text after the last
    ``####``, else the final statement (`final_statement`) from its last "=" on; a hedge (``3 or 4``, ``\\pm 3``,
    ``3 = 4``) or several numbers there (``(1, 2)``, ``[0, 1)``, ``0/0``) are no single answer."""
    text = normalize_notation(text)
    if GSM8K_ANSWER_MARKER in text:
        region = text.rsplit(GSM8K_ANSWER_MARKER, 1)[1]
    else:
        region = final_statement(text) or ""
    if hedged(region):
        return None
    numbers = _numbers(region.rsplit("=", 1)[-1])
    return numbers[0] if len(numbers) == 1 else None


@register_reward("gsm8k", extract=boxed_or_whole)
def grade_gsm8k(answer: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if the response's final answer is one number equal to the label's, else 0.0 (`gsm8k_response_answer`).
    The answer is the last box's content when the response has a box (none if it was cut off inside it).

    The label may be the bare answer or a full GSM8K solution ending in ``#### N``. Decimal
    comparison makes "18" equal "18.00" without float rounding.
    """
    expected = _gsm8k_label(str(label))
    if expected is None:
        raise ValueError(f"the gsm8k label has no number: {str(label)!r}")
    return 1.0 if gsm8k_response_answer(answer) == expected else 0.0


# DAPO grades only the tail of a response: the longest MATH-500 answer is 159 characters.
DAPO_RESPONSE_TAIL_CHARS = 300
_DAPO_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's answer normalization, with the lists as DAPO's math_dapo reward uses them.
_DAPO_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)  # fmt: skip
_DAPO_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
_DAPO_UNWRAPPINGS = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep only the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrta -> \sqrt{a}
)


def normalize_dapo_answer(answer: str) -> str:
    """Minerva/DAPO normalization: keep the right-hand side of an equation, drop spaces, units
    and text wrappers, expand shorthand TeX and thousands separators ("1,000" becomes "1000")."""
    answer = answer.translate(MINUS_SIGNS).split("=")[-1]  # only this: DAPO's own match, comparable with DAPO runs
    for before, after in _DAPO_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _DAPO_REMOVED_EXPRESSIONS:
        answer = answer.replace(expression, "")
    for pattern, replacement in _DAPO_UNWRAPPINGS:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_dapo_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` in the response's tail, or None (DAPO's format)."""
    answer_lines = _DAPO_ANSWER_LINE.findall(response[-DAPO_RESPONSE_TAIL_CHARS:])
    return answer_lines[-1] if answer_lines else None


@register_reward("dapo", extract=extract_dapo_answer, no_answer=-1.0)
def grade_dapo(answer: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if the normalized answer equals the normalized label, else -1.0 (as DAPO; a response with no
    ``Answer:`` line, or with ``boxed_dapo`` no box, is wrong too)."""
    return 1.0 if normalize_dapo_answer(answer) == normalize_dapo_answer(str(label)) else -1.0
