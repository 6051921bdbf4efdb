"""Prompt datasets: read jsonl/parquet rows and turn them into prompt `Sample`s.

Errors name the file, the row and the field, so a bad row is found without guessing. Rows are numbered
from 1 in every message, like the lines of a jsonl file (`row_label`); `Sample.index` stays the 0-based
position in the file.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax.data.chat_template import render_prompt, template_kwargs_problem
from relax.data.sample import Sample

logger = logging.getLogger("relax.data")

_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<stop>-?\d*)\]$")


class DatasetError(ValueError):
    """The data is unusable; the message names the file and, where known, the row and field."""


def row_label(path: Path | str, row_index: int) -> str:
    """``file: row N`` for the 0-based ``row_index``, counted from 1 as lines are."""
    return f"{path}: row {row_index + 1}"


def parse_data_spec(spec: str) -> tuple[Path, slice]:
    """``file.jsonl@[10:20]`` → (path, slice(10, 20)) (0-based, end excluded, as Python slices); a plain path
    selects every row."""
    match = _SLICE.match(spec)
    if not match:
        if "@[" in spec and not Path(spec).exists():
            raise DatasetError(f"{spec}: malformed row slice; expected FILE@[START:STOP] with integers (either may "
                               "be left out), e.g. data.jsonl@[0:100]")
        return Path(spec), slice(None)
    to_int = lambda text: int(text) if text else None  # noqa: E731
    return Path(match["path"]), slice(to_int(match["start"]), to_int(match["stop"]))


def read_spec_rows(spec: str) -> tuple[Path, list[tuple[int, dict[str, Any]]]]:
    """The file of a data spec (`parse_data_spec`) and its selected rows with their 0-based row numbers; a slice
    that selects nothing is refused."""
    path, row_slice = parse_data_spec(spec)
    rows = read_rows(path)
    indexed = list(enumerate(rows))[row_slice]
    if not indexed:
        raise DatasetError(f"{spec}: the slice selects no rows (the file has {len(rows)})")
    return path, indexed


def read_rows(path: Path) -> list[dict[str, Any]]:
    """All rows of a .jsonl, .json (JSON lines, or one array of objects) or .parquet file, each a dict."""
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    if path.suffix == ".parquet":
        rows = _read_parquet(path)
    elif path.suffix == ".json" and _holds_a_json_array(path):
        rows = _read_json_array(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _read_jsonl(path)
    else:
        raise DatasetError(f"{path}: unsupported format {path.suffix!r}; use .jsonl, .json or .parquet")
    if not rows:
        raise DatasetError(f"{path}: the file holds no rows")
    return rows


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        handle = path.open("rb")  # bytes: a line that is not UTF-8 is named by its number, as a JSON error is
    except OSError as err:
        raise DatasetError(f"{path}: cannot be read ({err.strerror or err})") from None
    with handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")  # a BOM, as Windows tools write
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}: line {line_number}: not UTF-8 text (byte {err.start} of the line: "
                                   f"{err.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{path}: line {line_number}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}: line {line_number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _holds_a_json_array(path: Path) -> bool:
    """A .json file is JSON lines (upstream's and most exports' meaning) unless it opens with ``[``: then it is one
    array of row objects, as `json.dump(rows, file)` and pandas' ``to_json(orient="records")`` write it."""
    try:
        with path.open("rb") as handle:
            head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    except OSError:
        return False  # _read_jsonl names the error
    return head.startswith(b"[")


def _read_json_array(path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: line {err.lineno}: invalid JSON ({err.msg})") from None
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{row_label(path, index)}: expected a JSON object, got {type(row).__name__}")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several error types for damaged files
        raise DatasetError(f"{path}: unreadable parquet file ({err})") from None


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """The prompt's token ids. A prompt of no tokens raises ValueError: the engine has nothing to continue from,
    and a response's first token nothing it is predicted from."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("the prompt is empty: it renders to no tokens")
    return ids


@dataclass(frozen=True)
class AnswerRoom:
    """The token slots a prompt and its answer share (`relax.backends.inference.answer_room`)."""

    tokens: int
    bound: str  # what sets it, for messages: "the model's 256 positions (max_position_embeddings)"

    @classmethod
    def of_positions(cls, positions: int) -> AnswerRoom:
        return cls(positions, f"the model's {positions} positions (max_position_embeddings)")

    def refuses(self, prompt_tokens: int) -> bool:
        """A prompt that leaves no room for one answer token."""
        return prompt_tokens >= self.tokens


@dataclass(frozen=True)
class PromptFormat:
    """How rows become prompts (the data settings of `RelaxConfig`)."""

    input_key: str = "input"
    label_key: str | None = "label"
    metadata_key: str = "metadata"
    apply_chat_template: bool = False
    apply_chat_template_kwargs: dict[str, Any] | None = None
    system_prompt: str | None = None
    max_prompt_len: int | None = None
    # The token slots a prompt and its answer share on the run's engine: a prompt that fills them leaves no room for
    # one answer token and is dropped (counted), as upstream's default --rollout-max-prompt-len (the context less
    # one) drops it; the engine had refused it mid-run, ending the run.
    answer_room: AnswerRoom | None = None
    # The model's positions (max_position_embeddings): a training sequence (SFT, a preference pair's completion)
    # longer than them is dropped (counted); it had trained on positions the model never saw (RoPE models compute
    # them without complaint).
    model_positions: int | None = None
    multimodal_keys: dict[str, str] | None = None  # media type -> column (--multimodal-keys)
    skip_bad_samples: bool = False
    tool_key: str | None = None  # column of the tools a row offers (--tool-key): names or OpenAI-style specs
    tool_specs: dict[str, dict[str, Any]] | None = None  # every executable tool's spec, by name
    default_tools: tuple[str, ...] = ()  # tool names offered by rows without the column (--tools)
    required_label_for: str | None = None  # the rule reward (--rm-type) that compares every response with a label


def load_prompt_samples(spec: str, tokenizer: Any, fmt: PromptFormat) -> list[Sample]:
    """Prompt samples of a data spec. ``Sample.index`` is the row number in the file; prompts
    longer than ``fmt.max_prompt_len`` tokens are dropped (and the count is logged)."""
    path, indexed = read_spec_rows(spec)
    if fmt.multimodal_keys:
        if fmt.tool_key or fmt.default_tools:  # media prompts are rendered later, without tools: fail, not drop them
            raise DatasetError(f"{spec}: --tool-key and --tools do not work with --multimodal-keys yet")
        return _multimodal_prompt_samples(path, indexed, fmt)
    samples, too_long, no_room = [], 0, 0
    for row_index, row in indexed:
        where = row_label(path, row_index)
        if fmt.input_key not in row:
            raise DatasetError(f"{where}: missing prompt field {fmt.input_key!r} (set --input-key); row has {sorted(row)}")
        label = _label(row, fmt, where)
        metadata = row_metadata(row, fmt, where)
        tools = _row_tool_specs(row, fmt, where)
        row_kwargs = metadata.get("apply_chat_template_kwargs")
        row_kwargs = {} if row_kwargs is None else row_kwargs  # a null column of a table export: none given
        problem = template_kwargs_problem(row_kwargs)
        if problem:
            raise DatasetError(f"{where}: field {fmt.metadata_key!r}: apply_chat_template_kwargs {problem}")
        try:
            text = render_prompt(row[fmt.input_key], tokenizer, fmt.apply_chat_template, fmt.system_prompt,
                                 {**(fmt.apply_chat_template_kwargs or {}), **row_kwargs}, tools=tools)
            tokens = encode_prompt(tokenizer, text)
        except ValueError as err:
            raise DatasetError(f"{where}: field {fmt.input_key!r}: {err}") from None
        if fmt.max_prompt_len is not None and len(tokens) > fmt.max_prompt_len:
            too_long += 1
            continue
        if fmt.answer_room is not None and fmt.answer_room.refuses(len(tokens)):
            no_room += 1
            continue
        if tools:
            metadata["tools"] = tools
        samples.append(Sample(index=row_index, prompt=text, label=label, metadata=metadata, tokens=list(tokens)))
    return kept_or_refused(spec, path, samples, "prompt", [
        (too_long, f"longer than --rollout-max-prompt-len ({fmt.max_prompt_len} tokens)"),
        (no_room, f"that leave no room for an answer within {fmt.answer_room and fmt.answer_room.bound}")])


def kept_or_refused(spec: str, path: Path, kept: list, noun: str, dropped: list[tuple[int, str]]) -> list:
    """``kept``, the rows a loader kept, with a warning counting those it dropped (``dropped``: how many and why);
    a DatasetError naming the file when none is left."""
    bounds = [f"{count} {why}" for count, why in dropped if count]
    if bounds and kept:
        logger.warning("%s: dropped %ss: %s", path, noun, " and ".join(bounds))
    if not kept:
        left = f"no {noun} left after dropping {' and '.join(bounds)}" if bounds else f"no {noun}"
        raise DatasetError(f"{spec}: {left}")
    return kept


def past_positions(fmt: PromptFormat) -> str:
    """Why a training sequence longer than the model's positions is dropped (`PromptFormat.model_positions`)."""
    return f"longer than the model's {fmt.model_positions} positions (max_position_embeddings)"


def row_metadata(row: dict[str, Any], fmt: PromptFormat, where: str) -> dict[str, Any]:
    """A copy of the row's metadata object (``--metadata-key``; missing or null: empty). Anything else is refused
    rather than dropped: the metadata carries the row's reward type and template variables."""
    metadata = row.get(fmt.metadata_key)
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise DatasetError(f"{where}: field {fmt.metadata_key!r} must be an object, got {type(metadata).__name__}")
    return dict(metadata)


def _label(row: dict[str, Any], fmt: PromptFormat, where: str) -> Any:
    """The row's label; with a rule reward a missing (or null, or empty) one is a data error here, at load, rather
    than a reward of 0 for every response to it."""
    label = row.get(fmt.label_key) if fmt.label_key else None
    if fmt.required_label_for and (label is None or label == ""):
        state = "is empty" if label == "" else "is null" if fmt.label_key in row else "is missing"
        raise DatasetError(f"{where}: label field {fmt.label_key!r} {state}; --rm-type {fmt.required_label_for} "
                           "compares every response with a label (set --label-key, or score with --custom-rm-path)")
    return label


def _row_tool_specs(row: dict[str, Any], fmt: PromptFormat, where: str) -> list[dict[str, Any]] | None:
    """The OpenAI-style specs of the tools a row offers: its ``--tool-key`` column (a list, or a JSON string of
    one, of tool names and specs), else ``fmt.default_tools``; None when it offers none. These specs go into the
    prompt (through the chat template) and into ``Sample.metadata["tools"]``, where the tool environment reads
    which tools the episode may call."""
    entries = row.get(fmt.tool_key) if fmt.tool_key else None
    source = f"field {fmt.tool_key!r}"
    if entries is None:
        entries, source = list(fmt.default_tools), "--tools"
    if isinstance(entries, str):
        try:
            entries = json.loads(entries)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{where}: {source}: invalid JSON ({err.msg})") from None
    if not isinstance(entries, list):
        raise DatasetError(f"{where}: {source}: expected a list of tool names or specs, got {type(entries).__name__}")
    return [_tool_spec(entry, fmt, f"{where}: {source}") for entry in entries] or None


def _tool_spec(entry: Any, fmt: PromptFormat, where: str) -> dict[str, Any]:
    """A tool name or spec as ``{"type": "function", "function": {...}}``; its name must be a known tool."""
    known = fmt.tool_specs or {}
    if isinstance(entry, dict):
        spec = entry if "function" in entry else {"type": "function", "function": entry}
        name = spec["function"].get("name") if isinstance(spec["function"], dict) else None
    else:
        spec, name = known.get(entry) if isinstance(entry, str) else None, entry
    if not isinstance(name, str) or not name:
        raise DatasetError(f"{where}: expected a tool name or an OpenAI-style function spec, got {entry!r:.80}")
    if name not in known:
        raise DatasetError(f"{where}: unknown tool {name!r}; known: {', '.join(sorted(known)) or 'none'} "
                           "(add your own with --tools pkg.module:function)")
    return spec


def _relative_to(folder: Path, item: Any) -> Any:
    """A media path relative to the data file's folder, made absolute (other forms unchanged)."""
    if isinstance(item, str) and "://" not in item and not item.startswith("data:") and len(item) < 4096:
        candidate = folder / item
        if not Path(item).is_absolute() and candidate.exists():
            return str(candidate)
    return item


def _multimodal_prompt_samples(path: Path, indexed: list[tuple[int, dict[str, Any]]],
                               fmt: PromptFormat) -> list[Sample]:
    """Prompt samples whose media are resolved later, in the rollout's worker pool: here the
    placeholders are matched to the media columns (so a mismatch fails before any work) and the
    raw media references are kept in ``multimodal_inputs`` by type."""
    from relax.data.multimodal import MediaError, resolve_row
    from relax.data.multimodal.placeholders import column_items

    samples, skipped = [], 0
    for row_index, row in indexed:
        if fmt.input_key not in row:
            raise DatasetError(f"{row_label(path, row_index)}: missing prompt field {fmt.input_key!r} (set --input-key)")
        label = _label(row, fmt, row_label(path, row_index))
        media = {kind: [_relative_to(path.parent, item) for item in column_items(row, column)]
                 for kind, column in fmt.multimodal_keys.items()}
        try:
            resolve_row({**row, **{fmt.multimodal_keys[k]: v for k, v in media.items()}}, fmt.multimodal_keys,
                        row_index=row_index, prompt_key=fmt.input_key)
        except MediaError as err:
            if fmt.skip_bad_samples:
                skipped += 1
                logger.warning("%s: skipped: %s", path, err)
                continue
            raise DatasetError(f"{path}: {err}") from None
        metadata = row_metadata(row, fmt, row_label(path, row_index))
        samples.append(Sample(index=row_index, prompt=row[fmt.input_key], label=label, metadata=metadata,
                              multimodal_inputs={kind: items for kind, items in media.items() if items}))
    if skipped:
        logger.warning("%s: skipped %d rows with bad media (--skip-bad-samples)", path, skipped)
    if not samples:
        raise DatasetError(f"{path}: no usable row")
    return samples
