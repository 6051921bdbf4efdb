"""`MediaError`: the one exception type of the multimodal layer.

Every failure while reading or processing a row's media (missing file, corrupt image, zero-length video,
unreadable audio, placeholder/media mismatch, a worker that died) is raised as a `MediaError`, so callers
catch one type and the message always says *where* the problem is, e.g.::

    row 12, field 'images'[1]: corrupt image (cannot identify image file)

Low-level loaders do not know the row they serve, so they raise `MediaError(reason)` without a location;
`media_context(row, field, index)` adds it on the way up and also turns stray library exceptions
(PIL, PyAV, soundfile) into a `MediaError` so no bare third-party traceback reaches the rollout loop.
The class pickles with its location, so errors cross process-pool boundaries intact.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class MediaError(ValueError):
    """A media item could not be loaded or processed; `row`, `field`, `index` locate it when known."""

    def __init__(self, reason: str, row: int | None = None, field: str | None = None, index: int | None = None):
        self.reason = reason
        self.row = row
        self.field = field
        self.index = index
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.row is not None:
            where.append(f"row {self.row + 1}")  # `row` is the 0-based position; shown from 1, as lines are
        if self.field is not None:
            where.append(f"field '{self.field}'" + (f"[{self.index}]" if self.index is not None else ""))
        return f"{', '.join(where)}: {self.reason}" if where else self.reason

    def located(self, row: int | None, field: str | None = None, index: int | None = None) -> MediaError:
        """Return a copy with missing location parts filled in (parts already set are kept)."""
        return MediaError(
            self.reason,
            row=self.row if self.row is not None else row,
            field=self.field if self.field is not None else field,
            index=self.index if self.index is not None else index,
        )

    def __reduce__(self):
        return (MediaError, (self.reason, self.row, self.field, self.index))


@contextmanager
def media_context(row: int | None, field: str | None = None, index: int | None = None) -> Iterator[None]:
    """Attach a row/field location to any error raised inside the block.

    `MediaError`s get the location filled in; any other exception (a library bug or an unexpected input) becomes a
    `MediaError` carrying the original type and message, chained with `from` for debugging.
    """
    try:
        yield
    except MediaError as err:
        raise err.located(row, field, index) from err.__cause__
    except Exception as err:
        raise MediaError(f"{type(err).__name__}: {err}", row, field, index) from err
