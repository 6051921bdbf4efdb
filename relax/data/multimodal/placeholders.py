"""Turn a row's prompt plus its media columns into chat messages with typed content items, in prompt order.

A row's prompt is either a string or a list of chat messages. Text may contain the placeholders `<image>`, `<video>`
and `<audio>`; each one takes the next unused item of that type from the row's media column (the column names come
from `--multimodal-keys`, see `settings.parse_multimodal_keys`). A message's content may also be a list of typed
items:

- `{"type": "text", "text": ...}` (placeholders inside are expanded too);
- `{"type": "image" | "video" | "audio", "<type>": value}`: inline media, used as is;
- `{"type": "image" | "video" | "audio"}` without a value: a placeholder, like `<image>` in text;
- `{"type": "image_url", "image_url": {"url": ...}}` (also `video_url` / `audio_url`; a bare string url works):
  inline media in OpenAI form;
- `{"type": "input_audio", "input_audio": {"data": <base64>, ...}}`: OpenAI inline audio.

The output content is a list of `{"type": "text", "text": ...}` and `{"type": kind, kind: value}` items, the form
Qwen-VL chat templates and processors consume, plus a `media` list of `MediaRef`s saying where each item came from
(column and index, or position in the prompt) so a later decode error can name the exact cell.

Every placeholder must find an item and every column item must be used: a placeholder without media, or media left
without a placeholder, raises `MediaError` naming the row and the column.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax.data.multimodal.errors import MediaError
from relax.data.multimodal.settings import MEDIA_TYPES, MULTIMODAL_KEYS_FLAG

PLACEHOLDER_RE = re.compile(r"<(image|video|audio)>")
_URL_TYPES = {f"{kind}_url": kind for kind in MEDIA_TYPES}


@dataclass(frozen=True)
class MediaRef:
    """One media item of a prompt: its type, raw value and where it came from (for error messages)."""

    kind: str
    value: Any
    field: str  # a column name, or a prompt location like "prompt[0].content[2]"
    index: int | None = None  # position within the column; None for inline items


@dataclass
class ResolvedPrompt:
    """Chat messages with typed content items, and the media they reference in order of appearance."""

    messages: list[dict]
    media: list[MediaRef] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[MediaRef]:
        return [ref for ref in self.media if ref.kind == kind]


class _ColumnCursor:
    """Hands out a row's column items in order and reports what is missing or left over."""

    def __init__(self, kind: str, column: str | None, items: Sequence[Any], row: int | None):
        self.kind, self.column, self.items, self.row = kind, column, items, row
        self.used = 0

    def take(self, where: str) -> MediaRef:
        if self.column is None:
            raise MediaError(
                f"<{self.kind}> placeholder but {MULTIMODAL_KEYS_FLAG} maps no column for {self.kind!r}",
                self.row,
                where,
            )
        if self.used >= len(self.items):
            raise MediaError(
                f"<{self.kind}> placeholder #{self.used + 1} has no media (column holds {len(self.items)})",
                self.row,
                self.column,
                self.used,
            )
        ref = MediaRef(self.kind, self.items[self.used], self.column, self.used)
        self.used += 1
        return ref

    def check_all_used(self) -> None:
        if self.used < len(self.items):
            left = len(self.items) - self.used
            raise MediaError(
                f"{left} {self.kind} item(s) left without a placeholder ({self.used} placeholders for "
                f"{len(self.items)} items)",
                self.row,
                self.column,
                self.used,
            )


def column_items(row: Mapping[str, Any], column: str) -> list[Any]:
    """A row's media column as a list: missing or None is empty, a single value becomes a one-item list."""
    value = row.get(column)
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def resolve_row(
    row: Mapping[str, Any], keys: Mapping[str, str], *, row_index: int | None = None, prompt_key: str = "prompt"
) -> ResolvedPrompt:
    """`resolve_prompt` for a dataset row: the prompt under `prompt_key`, media columns per `keys`."""
    if prompt_key not in row:
        raise MediaError("row has no prompt", row_index, prompt_key)
    columns = {kind: (column, column_items(row, column)) for kind, column in keys.items()}
    return resolve_prompt(row[prompt_key], columns, row_index=row_index, prompt_field=prompt_key)


def resolve_prompt(
    prompt: str | Sequence[Mapping[str, Any]],
    columns: Mapping[str, tuple[str, Sequence[Any]]],
    *,
    row_index: int | None = None,
    prompt_field: str = "prompt",
) -> ResolvedPrompt:
    """Expand placeholders of `prompt` with the items of `columns` (`{kind: (column_name, items)}`)."""
    cursors = {
        kind: _ColumnCursor(kind, *columns.get(kind, (None, ())), row=row_index) for kind in MEDIA_TYPES
    }
    media: list[MediaRef] = []
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": _expand_text(prompt, cursors, media, prompt_field)}]
    elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        messages = [
            _resolve_message(message, cursors, media, f"{prompt_field}[{m}]", row_index)
            for m, message in enumerate(prompt)
        ]
    else:
        raise MediaError(f"prompt must be a string or a list of messages, got {type(prompt).__name__}", row_index,
                         prompt_field)
    for cursor in cursors.values():
        cursor.check_all_used()
    return ResolvedPrompt(messages, media)


def _resolve_message(
    message: Mapping[str, Any], cursors: dict, media: list[MediaRef], where: str, row: int | None
) -> dict:
    content = message.get("content")
    if content is None:
        items: list[dict] = []
    elif isinstance(content, str):
        items = _expand_text(content, cursors, media, f"{where}.content")
    elif isinstance(content, Sequence):
        items = []
        for j, item in enumerate(content):
            items.extend(_resolve_item(item, cursors, media, f"{where}.content[{j}]", row))
    else:
        raise MediaError(f"message content must be a string or a list, got {type(content).__name__}", row, where)
    return {**message, "content": items}


def _resolve_item(item: Any, cursors: dict, media: list[MediaRef], where: str, row: int | None) -> list[dict]:
    if isinstance(item, str):
        return _expand_text(item, cursors, media, where)
    if not isinstance(item, Mapping):
        raise MediaError(f"content item must be a dict, got {type(item).__name__}", row, where)
    kind = item.get("type")
    if kind == "text":
        return _expand_text(item.get("text") or "", cursors, media, where)
    if kind in MEDIA_TYPES:
        value = item.get(kind)
        ref = cursors[kind].take(where) if value is None else MediaRef(kind, value, where)
        return [_append(media, ref)]
    if kind in _URL_TYPES:
        url = item.get(kind)
        url = url.get("url") if isinstance(url, Mapping) else url
        if not url:
            raise MediaError(f"{kind} item without a url", row, where)
        return [_append(media, MediaRef(_URL_TYPES[kind], url, where))]
    if kind == "input_audio":
        payload = item.get("input_audio") or {}
        data = payload.get("data") if isinstance(payload, Mapping) else None
        if not data:
            raise MediaError("input_audio item without data", row, where)
        return [_append(media, MediaRef("audio", {"base64": data}, where))]
    raise MediaError(f"unknown content item type {kind!r}", row, where)


def _append(media: list[MediaRef], ref: MediaRef) -> dict:
    media.append(ref)
    return {"type": ref.kind, ref.kind: ref.value}


def _expand_text(text: str, cursors: dict, media: list[MediaRef], where: str) -> list[dict]:
    """Split text at placeholders: text pieces become text items, placeholders take the next column item."""
    items: list[dict] = []
    pos = 0
    for match in PLACEHOLDER_RE.finditer(text):
        if match.start() > pos:
            items.append({"type": "text", "text": text[pos : match.start()]})
        items.append(_append(media, cursors[match.group(1)].take(where)))
        pos = match.end()
    if pos < len(text):
        items.append({"type": "text", "text": text[pos:]})
    return items
