"""Rule rewards for short text answers: ``multiple_choice``, ``f1`` and ``exact_match``."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from relax.rollout.rewards.boxed import has_box, last_boxed_content
from relax.rollout.rewards.registry import register_reward

CHOICE_LETTERS = "ABCDEFGHIJ"

# Where a model states its choice, most explicit first; the last match of the first pattern
# that matches wins, so a final statement overrides options discussed along the way.
_CHOICE_PATTERNS = (
    re.compile(rf"(?i:answer)\s*(?:is)?\s*[:：]?\s*\(?([{CHOICE_LETTERS}])\b"),  # "Answer: B", "answer is (B)"
    re.compile(rf"(?:^|\s)\(?([{CHOICE_LETTERS}])\)?[.)]?\s*$"),  # a lone letter closing the response
    re.compile(rf"\(([{CHOICE_LETTERS}])\)"),  # "(B)" anywhere
)
_BOXED_CHOICE = re.compile(rf"^\s*(?:\\text\{{)?\(?([{CHOICE_LETTERS}])\b")


def extract_choice(response: str) -> str | None:
    """The choice letter (A-J) a response settles on, or None if it names none.

    A ``\\boxed{}`` answer wins (a last box that was never closed is no answer); then ``Answer: X``,
    then a letter standing alone at the very end, then the last ``(X)``.
    """
    if has_box(response):
        return _boxed_choice(response)
    for pattern in _CHOICE_PATTERNS:
        matches = pattern.findall(response)
        if matches:
            return matches[-1]
    return None


def _boxed_choice(response: str) -> str | None:
    boxed = last_boxed_content(response)
    match = _BOXED_CHOICE.match(boxed) if boxed is not None else None
    return match.group(1) if match else None


@register_reward("multiple_choice", extract=extract_choice, extract_boxed=_boxed_choice)
def grade_multiple_choice(choice: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if the chosen letter equals the label letter ("B", "b", "(B)" or "B."), else 0.0."""
    expected = str(label).strip().strip("().").upper()
    if len(expected) != 1 or expected not in CHOICE_LETTERS:
        raise ValueError(f"the multiple_choice label must be one letter A-J, got {str(label)!r}")
    return 1.0 if choice == expected else 0.0


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _squad_tokens(text: str) -> list[str]:
    """SQuAD normalization: lowercase, drop punctuation and articles, split on whitespace."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token-level F1; two answers that normalize to nothing match each other only."""
    predicted, expected = _squad_tokens(prediction), _squad_tokens(reference)
    if not predicted or not expected:
        return float(predicted == expected)
    overlap = sum((Counter(predicted) & Counter(expected)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(predicted), overlap / len(expected)
    return 2 * precision * recall / (precision + recall)


@register_reward("f1")
def score_f1(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """Token F1 in [0, 1] against the label, or the best over a list of acceptable answers (as SQuAD does)."""
    references = label if isinstance(label, (list, tuple)) else [label]
    if not references:
        raise ValueError("the f1 label is an empty list of answers")
    return max(token_f1(response, str(reference)) for reference in references)


@register_reward("exact_match")
def score_exact_match(response: str, label: Any, metadata: dict[str, Any]) -> float:
    """1.0 if the response equals the label after stripping surrounding whitespace, else 0.0."""
    return 1.0 if response.strip() == str(label).strip() else 0.0
