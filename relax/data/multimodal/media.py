"""Resolve a media item (image, video or audio) to local bytes or a local path, and decode images.

A dataset cell may hold a media item in any of these forms (the same for all three media types):

- a local path (`str` or `os.PathLike`), or a `file://` URL;
- raw bytes (`bytes`, `bytearray`, `memoryview`);
- a base64 string, or a `data:` URI (`data:image/png;base64,...`; URL-encoded payloads too);
- a dict `{"bytes": ...}`, `{"base64": ...}` or `{"path": ...}` (Hugging Face `datasets` and OpenAI-style payloads;
  `bytes` wins over `path` when both are present, as `datasets` stores `{"bytes": b, "path": None}`);
- for images only, a decoded `PIL.Image.Image`.

http(s) URLs are rejected with a clear `MediaError`: rollout machines have no network access and fetching inside
the rollout loop would stall it; download media into the dataset first.

`resolve_source` does the format dispatch once for every media type; `load_image` decodes images fully (PIL opens
lazily, and a lazily opened image whose buffer is gone fails later on another thread with a confusing error).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

from relax.data.multimodal.errors import MediaError

_BASE64_RE = re.compile(r"^[A-Za-z0-9+/\s]+={0,2}\s*$")
_MAX_PATH_LEN = 4096


@dataclass(frozen=True)
class MediaSource:
    """A resolved media item: exactly one of `path` (a local file) or `data` (the encoded bytes)."""

    path: str | None = None
    data: bytes | None = None

    def open(self) -> str | io.BytesIO:
        """A value that PIL, PyAV and soundfile all accept: the path, or a fresh in-memory file."""
        return self.path if self.path is not None else io.BytesIO(self.data)

    def describe(self) -> str:
        return repr(self.path) if self.path is not None else f"<{len(self.data)} bytes>"


def resolve_source(item: Any) -> MediaSource:
    """Turn any accepted media form (see the module docstring) into a `MediaSource`; raise `MediaError` otherwise."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        return _nonempty(MediaSource(data=bytes(item)))
    if isinstance(item, str):
        return _resolve_string(item)
    if isinstance(item, os.PathLike):
        return _existing_path(os.fspath(item))
    if isinstance(item, dict):
        return _resolve_dict(item)
    raise MediaError(f"unsupported media item of type {type(item).__name__}")


def _nonempty(source: MediaSource) -> MediaSource:
    if source.data is not None and not source.data:
        raise MediaError("empty media payload (0 bytes)")
    return source


def _resolve_dict(item: dict) -> MediaSource:
    raw = item.get("bytes")
    if raw is not None:
        return resolve_source(raw)
    b64 = item.get("base64")
    if b64 is not None:
        return _nonempty(MediaSource(data=_b64decode(b64)))
    path = item.get("path")
    if path is not None:
        return _resolve_string(path)
    raise MediaError(f"media dict needs a 'bytes', 'base64' or 'path' entry, got keys {sorted(item)}")


def _resolve_string(item: str) -> MediaSource:
    text = item.strip()
    lowered = text[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise MediaError(
            f"remote media are not fetched (no network access during rollout): {text[:200]!r}; "
            "download it into the dataset as a path or bytes"
        )
    if lowered.startswith("file://"):
        return _existing_path(urllib.parse.unquote(text[len("file://"):]))
    if lowered.startswith("data:"):
        return _nonempty(MediaSource(data=decode_data_uri(text)))
    if len(text) <= _MAX_PATH_LEN and os.path.exists(text):
        return _existing_path(text)
    if len(text) >= 16 and _BASE64_RE.match(text[:_MAX_PATH_LEN]):
        try:
            return _nonempty(MediaSource(data=_b64decode(text)))
        except MediaError:
            pass
    shown = text if len(text) <= 200 else text[:200] + "..."
    raise MediaError(f"file not found: {shown!r}")


def _existing_path(path: str) -> MediaSource:
    if not os.path.isfile(path):
        raise MediaError(f"file not found: {path!r}")
    if os.path.getsize(path) == 0:
        raise MediaError(f"empty media file (0 bytes): {path!r}")
    return MediaSource(path=path)


def _b64decode(text: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise MediaError(f"invalid base64 payload ({err})") from None


def decode_data_uri(uri: str) -> bytes:
    """Decode an RFC 2397 `data:` URI (base64 or URL-encoded) to bytes."""
    head, sep, body = uri.partition(",")
    if not sep or not body:
        raise MediaError(f"malformed data URI: {uri[:40]!r}")
    if head.lower().endswith(";base64"):
        return _b64decode(body)
    return urllib.parse.unquote_to_bytes(body)


def load_image(item: Any) -> Image.Image:
    """Decode an image item to a fully loaded `PIL.Image` (mode unchanged; see `image.to_rgb`)."""
    if isinstance(item, Image.Image):
        return item
    source = resolve_source(item)
    try:
        img = Image.open(source.open())
        img.load()  # PIL closes a file it opened itself once a single-frame image is loaded
        return img
    except Image.DecompressionBombError as err:
        raise MediaError(f"image too large ({err})") from None
    except UnidentifiedImageError:
        raise MediaError("corrupt image (cannot identify image file)") from None
    except (OSError, SyntaxError, ValueError) as err:  # truncated data, bad chunks
        raise MediaError(f"corrupt image ({err})") from None
