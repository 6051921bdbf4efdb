"""Find a response's final answer: the last ``\\boxed{...}``, or the last ``<answer>...</answer>``.

Math prompts ask the model to put its final answer in ``\\boxed{}``; the reasoning before it
often contains other boxed or numeric values, so only the last box counts. A response cut off
inside its last box (or answer tag) has no answer: an earlier, abandoned box is not graded in
its place.
"""

from __future__ import annotations

BOXED_OPENING = "\\boxed{"


def last_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, nested braces included.

    Returns None when there is no box or the last box is never closed (a response cut off
    by the token limit), so half an answer is not graded as if it were complete.
    """
    start = text.rfind(BOXED_OPENING)
    if start < 0:
        return None
    depth = 0
    for position in range(start + len(BOXED_OPENING) - 1, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(BOXED_OPENING) : position]
    return None


def last_tag_content(text: str, tag: str) -> str | None:
    """The content of the last ``<tag>...</tag>``; None without one, or when the last opening is never closed."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    start = text.rfind(opening)
    if start < 0:
        return None
    end = text.find(closing, start)
    return None if end < 0 else text[start + len(opening) : end]


def has_box(text: str) -> bool:
    return BOXED_OPENING in text


def boxed_or_whole(response: str) -> str | None:
    """The last box's content when the response has a box (None if that box is unclosed), else the response."""
    return last_boxed_content(response) if has_box(response) else response
