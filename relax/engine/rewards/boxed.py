"""Find the final ``\\boxed{...}`` answer in a model response.

Math prompts ask the model to put its final answer in ``\\boxed{}``; the reasoning before it
often contains other boxed or numeric values, so only the last box counts.
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
