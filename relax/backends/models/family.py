"""What differs between the Hugging Face model families Relax runs: which class loads a folder,
which tokens stand for media, and how a multimodal forward gets its inputs and positions.

Text models (Qwen3, ...), vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and the omni
thinkers (Qwen2.5-Omni, Qwen3-Omni) differ in these few places only; the engine and the trainer
call the functions here and stay family-agnostic. Multimodal inputs are the processor tensors of
`relax.data.multimodal` (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
``video_grid_thw``, ``video_second_per_grid``, ``input_features``, ``feature_attention_mask``) for
one or several sequences, concatenated in sequence order.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
)

logger = logging.getLogger(__name__)

# The names the model families give the same input; the forward takes whichever its signature has.
_INPUT_ALIASES = {
    "video_second_per_grid": ("second_per_grid_ts", "video_second_per_grid"),
}
VISION_TOWER_ATTRIBUTES = ("visual", "vision_tower", "vision_model")
AUDIO_TOWER_ATTRIBUTES = ("audio_tower",)


def model_class(config) -> type[PreTrainedModel] | None:
    """The generation class the config names (an omni thinker or a VL model has no AutoModelForCausalLM mapping
    in every transformers release); None: AutoModelForCausalLM's."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None and hasattr(cls, "get_output_embeddings"):
            return cls
    return None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# How a folder's weights are loaded, and so which weights they must hold: "generation" the model with its generation
# head (`load_model`); "reward_model" a trained sequence classifier, its score head included (--rm-path);
# "new_score_head" a sequence classifier whose one-label ``score`` head training creates when the folder lacks it
# (`load_score_model`: --loss-type rm, the critic).
LoadAs = Literal["generation", "reward_model", "new_score_head"]


def model_folder_problem(path: str | Path, needs_tokenizer: bool = True,
                         load_as: LoadAs = "generation") -> str | None:
    """What keeps ``path`` from being a Hugging Face model folder Relax can load (None: nothing): it must exist
    (Relax never downloads: a Hub id is said to be one), hold config.json, weights that fit it (``load_as``) and
    (``needs_tokenizer``) a tokenizer."""
    return model_config_problem(path) or model_files_problem(path, needs_tokenizer, load_as)


def model_config_problem(path: str | Path) -> str | None:
    """`model_folder_problem`'s first half: the folder exists and holds a config.json transformers can read."""
    folder = Path(path)
    if not folder.exists():
        if _HUB_ID.match(str(path)):
            return (f"{path}: no such folder; it looks like a Hugging Face Hub id, and Relax never downloads: "
                    f"fetch the model where the hub is reachable (huggingface-cli download {path} --local-dir DIR) "
                    "and give that folder")
        return f"{path}: no such folder"
    if not folder.is_dir():
        return f"{path}: not a folder (give the Hugging Face model folder, not a file in it)"
    if not (folder / "config.json").is_file():
        return f"{path}: not a Hugging Face model folder (no config.json)"
    try:
        AutoConfig.from_pretrained(folder)
    except Exception as err:  # transformers raises OSError, ValueError or a JSON error for one damaged file
        return f"{path}: its config.json cannot be read ({_reason(err)})"
    return None


def model_files_problem(path: str | Path, needs_tokenizer: bool = True, load_as: LoadAs = "generation") -> str | None:
    """`model_folder_problem`'s second half: weights whose safetensors headers read (and every shard an index
    names) and that fit the model the config describes (`weights_problem`), and (``needs_tokenizer``) a tokenizer
    that loads."""
    folder = Path(path)
    if not any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_FILES):
        return f"{path}: holds no weights (no *.safetensors or pytorch_model*.bin files)"
    if needs_tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return f"{path}: holds no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}; save it with tokenizer.save_pretrained)"
    problem = _safetensors_problem(folder)
    if problem is None and next(folder.glob("*.safetensors"), None) is not None:
        problem = weights_problem(folder, load_as)  # (pytorch_model*.bin files would be read whole to be checked)
    if problem is None and needs_tokenizer:
        try:
            problem = tokenizer_fit_problem(folder, read_tokenizer(folder))
        except ValueError as err:
            problem = str(err)
    return problem


def tokenizer_fit_problem(path: str | Path, tokenizer) -> str | None:
    """A tokenizer with more tokens than the model has embedding rows (one taken from another model): a prompt holding
    one of the extra tokens failed inside the embedding mid-run (IndexError), or the chat template's own special
    tokens did at the first step. Fewer tokens than rows is common (rows padded to a multiple of 64 or 128)."""
    rows = getattr(AutoConfig.from_pretrained(path).get_text_config(), "vocab_size", None)
    if rows is None or len(tokenizer) <= rows:
        return None
    extra = sorted((token for token, index in tokenizer.get_vocab().items() if index >= rows),
                   key=lambda token: tokenizer.convert_tokens_to_ids(token))
    return (f"{path}: its tokenizer has {len(tokenizer)} tokens, more than the model's {rows} embedding rows "
            f"(config.json vocab_size): token ids {rows}-{len(tokenizer) - 1} ({', '.join(map(repr, extra[:3]))}"
            f"{', ...' if len(extra) > 3 else ''}) would fail inside the model; is the tokenizer another model's?")


@functools.lru_cache(maxsize=16)
def cached_config(model_path: str | Path | None):
    """The folder's config, read once a folder (the multi-turn loop asks at every episode); None where there is no
    folder or it cannot be read (preflight names such a folder before anything calls this). Not to be changed."""
    if not model_path:
        return None
    try:
        return AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None


def model_positions(model_path: str | Path | None) -> int | None:
    """The model's positions (its text config's max_position_embeddings), None where the folder does not say."""
    config = cached_config(model_path)
    positions = getattr(config.get_text_config(), "max_position_embeddings", None) if config is not None else None
    return int(positions) if isinstance(positions, int) and positions > 0 else None


def read_tokenizer(path: str | Path):
    """The folder's tokenizer; a ValueError naming the folder when it does not load (a damaged tokenizer.json fails
    inside tokenizers, sentencepiece or json). For callers that use the tokenizer, so it is loaded once."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - each library raises its own kinds
        raise ValueError(f"{path}: its tokenizer cannot be loaded ({_reason(err)})") from None


def _safetensors_problem(folder: Path) -> str | None:
    """A damaged or truncated weights file, or a shard the index names that is missing: found by reading each
    file's header (safetensors checks it against the file's size), not its tensors, so a large model costs
    milliseconds here instead of a traceback minutes into loading."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_bytes())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return f"{index}: not a safetensors index ({_reason(err)})"
        missing = sorted(str(shard) for shard in shards if not (folder / str(shard)).is_file())
        if missing:
            return f"{index}: names {len(missing)} missing weight file(s): {', '.join(missing[:3])}"
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as err:  # safetensors' own error type, or OSError for an unreadable file
            return f"{file}: not a readable safetensors file ({_reason(err)})"
    return None


def weights_problem(path: str | Path, load_as: LoadAs = "generation") -> str | None:
    """The folder's weights against the model its config.json describes, loaded the way ``load_as`` says onto the
    meta device (tensor names and shapes from the files' headers, by transformers' own mapping of checkpoint names,
    no tensor read): a config that builds no model, tensors of other shapes, or tensors the model needs that the
    files lack (transformers would initialise those at random and go on: a pretrained model partly noise)."""
    try:
        with MODEL_CONSTRUCTION_LOCK:
            _, info = _loader(path, load_as)(device_map="meta", ignore_mismatched_sizes=True,
                                             output_loading_info=True)
    except Exception as err:  # noqa: BLE001 - a config of impossible sizes fails inside torch or the family
        return f"{path}: its config.json describes no model that can be built ({_reason(err)})"
    return loading_problem(path, info, load_as)


def loading_problem(path: str | Path, info: dict, load_as: LoadAs = "generation") -> str | None:
    """What transformers' loading info (``output_loading_info``) says is wrong with the folder's weights, None if
    nothing. Tensors the files hold that the model has no place for are no problem (a checkpoint may keep heads the
    class does not build, such as multi-token-prediction layers): `_checked_load` logs them."""
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda entry: entry[0])
    if mismatched:
        shown = "; ".join(f"{name} {list(stored)} in the files, {list(expected)} by the config"
                          for name, stored, expected, *_ in mismatched[:3])
        return (f"{path}: its weights do not fit its config.json: {len(mismatched)} tensor(s) of other shapes "
                f"({shown}{'; ...' if len(mismatched) > 3 else ''})")
    missing = sorted(name for name in info.get("missing_keys") or ()
                     if not (load_as == "new_score_head" and name.split(".")[0] == "score"))
    if missing:
        return (f"{path}: its weight files lack {len(missing)} tensor(s) the model needs ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}); transformers would start them at random")
    return None


def _loader(path: str | Path, load_as: LoadAs, config=None):
    """``from_pretrained`` of the class ``load_as`` loads the folder with (`load_model`, `load_score_model`)."""
    config = config or AutoConfig.from_pretrained(path)
    if load_as == "generation":
        cls = model_class(config) or AutoModelForCausalLM
        return lambda **kwargs: cls.from_pretrained(path, config=config, **kwargs)
    if load_as == "new_score_head":
        config.num_labels = 1
    return lambda **kwargs: AutoModelForSequenceClassification.from_pretrained(path, config=config, **kwargs)


def _reason(err: BaseException) -> str:
    """The exception's type and the first line of its message (transformers appends paragraphs of advice)."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


# Held while transformers builds a model. Its loading patches process-wide state (parameters are created on the meta
# device, then filled), so two threads building models at once interleave the patches: one model keeps meta
# parameters, and a patch can outlive both, so that every later model of the process is built on meta. The reward
# model scorer loads in a worker thread beside the trainer's and the engine's loads: every construction takes this.
MODEL_CONSTRUCTION_LOCK = threading.RLock()


def load_model(path: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """The folder's model with its generation head, by the class its config names (`model_class`)."""
    return _checked_load(path, "generation", dtype=dtype)


def _checked_load(path: str | Path, load_as: LoadAs, config=None, **kwargs) -> PreTrainedModel:
    """The folder's model loaded as ``load_as`` says, refused (ValueError) where its weights do not fill it: the
    load's own check, for callers that did not ask `model_folder_problem` first (where they can name the flag)."""
    with MODEL_CONSTRUCTION_LOCK:
        model, info = _loader(path, load_as, config)(ignore_mismatched_sizes=True, output_loading_info=True, **kwargs)
    problem = loading_problem(path, info, load_as)
    if problem is not None:
        raise ValueError(problem)
    if info.get("unexpected_keys"):
        unexpected = sorted(info["unexpected_keys"])
        logger.warning("%s: %d tensor(s) of the weight files are not used by the model: %s", path, len(unexpected),
                       ", ".join(unexpected[:5]) + (", ..." if len(unexpected) > 5 else ""))
    return model


def load_score_model(path: str | Path, dtype: torch.dtype, pad_token_id: int) -> PreTrainedModel:
    """A reward model from the folder: its sequence-classification class with one label (a causal LM's body
    and a new scalar ``score`` head, or a reward model's own head). The config names that class and the pad token
    (where the model pools a sequence: its last token that is not padding), so the config saved beside a checkpoint
    makes `model_from_config` build the same model and an export load with ``AutoModelForSequenceClassification``."""
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "num_labels", 1) != 1 and _is_score_model(config):
        raise ValueError(f"{path}: a sequence classifier with {config.num_labels} labels, not a reward model (1)")
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_id
    model = _checked_load(path, "new_score_head", config, dtype=dtype)
    model.config.architectures = [type(model).__name__]
    return model


def load_reward_model(path: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """A trained reward model as saved (--rm-path): its sequence-classification class and its own score head."""
    return _checked_load(path, "reward_model", dtype=dtype)


def _is_score_model(config) -> bool:
    return any(name.endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or [])


def model_from_config(config, dtype: torch.dtype) -> PreTrainedModel:
    """A randomly initialised model of the config's generation class (`model_class`), weights to be loaded."""
    cls = model_class(config)
    with MODEL_CONSTRUCTION_LOCK:
        return cls._from_config(config, dtype=dtype) if cls is not None else \
            AutoModelForCausalLM.from_config(config, dtype=dtype)


def _config_value(config, *names: str) -> int | None:
    for holder in (config, getattr(config, "thinker_config", None)):
        for name in names:
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                return int(value)
    return None


@dataclass(frozen=True)
class MediaTokens:
    """The placeholder token ids of a model (None where the family has no such modality)."""

    image: int | None = None
    video: int | None = None
    audio: int | None = None
    # The tokens around a media item (vision / audio start and end): the families' 3D rope reads a vision start
    # as "media follows", so a response must not contain one either.
    boundaries: tuple[int, ...] = ()

    @classmethod
    def of(cls, config) -> MediaTokens:
        media = cls(
            image=_config_value(config, "image_token_id", "image_token_index"),
            video=_config_value(config, "video_token_id", "video_token_index"),
            audio=_config_value(config, "audio_token_id", "audio_token_index"),
        )
        if not media.ids:
            return media
        names = ("vision_start_token_id", "vision_end_token_id", "audio_start_token_id", "audio_end_token_id")
        boundaries = tuple(dict.fromkeys(i for i in (_config_value(config, name) for name in names) if i is not None))
        return dataclasses.replace(media, boundaries=boundaries)

    @property
    def ids(self) -> list[int]:
        return [i for i in (self.image, self.video, self.audio) if i is not None]

    @property
    def never_generated(self) -> list[int]:
        """What a model must never write in a response (the engine masks them, the trainer's log-probs too):
        media placeholders and the boundaries around media."""
        return [*self.ids, *(i for i in self.boundaries if i not in self.ids)]

    def type_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``mm_token_type_ids``: 0 text, 1 image, 2 video (what Qwen-VL's rope index reads)."""
        types = torch.zeros_like(input_ids, dtype=torch.int32)
        if self.image is not None:
            types[input_ids == self.image] = 1
        if self.video is not None:
            types[input_ids == self.video] = 2
        return types


def is_multimodal(model: PreTrainedModel) -> bool:
    return bool(MediaTokens.of(model.config).ids)


def audio_token_count(feature_length: int) -> int:
    """Tokens of a clip of ``feature_length`` mel frames after the Whisper-style encoder's two
    stride-2 stages (Qwen2-Audio / Qwen2.5-Omni)."""
    after_conv = (feature_length - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def is_qwen3_omni(config) -> bool:
    """The Qwen3-Omni thinker (or the whole omni model): its own audio token count and audio inside video."""
    return str(getattr(config, "model_type", "")).startswith("qwen3_omni_moe")


def audio_token_counter(config) -> Callable[[int], int]:
    """The model's tokens per clip of N mel frames: Qwen3-Omni's chunked audio encoder counts by its own rule
    (transformers' function for the family, with the model's window), the others as `audio_token_count`."""
    if not is_qwen3_omni(config):
        return audio_token_count
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    audio = getattr(config, "audio_config", None) or config.thinker_config.audio_config
    return lambda frames: int(_get_feat_extract_output_lengths(torch.tensor(frames), audio.n_window))


def placeholder_counts(inputs: dict[str, torch.Tensor], merge_size: int,
                       audio_tokens: Callable[[int], int] = audio_token_count) -> dict[str, list[int]]:
    """How many placeholder tokens each media item takes in the prompt, per kind, in order."""
    counts: dict[str, list[int]] = {}
    for kind, key in (("image", "image_grid_thw"), ("video", "video_grid_thw")):
        if key in inputs:
            counts[kind] = [int(grid.prod()) // merge_size**2 for grid in torch.as_tensor(inputs[key])]
    if "feature_attention_mask" in inputs:
        counts["audio"] = [audio_tokens(int(n)) for n in torch.as_tensor(inputs["feature_attention_mask"]).sum(-1)]
    return counts


def expand_placeholders(token_ids: list[int], tokens: MediaTokens, counts: dict[str, list[int]],
                        video_tokens: list[list[int]] | None = None) -> list[int]:
    """Repeat each media placeholder token by its item's token count (the processor's expansion); with
    ``video_tokens`` (audio in video), video i's placeholder becomes ``video_tokens[i]`` instead.

    Raises ValueError when the prompt's placeholders and the media items do not pair up."""
    remaining = {kind: list(values) for kind, values in counts.items()}
    if video_tokens is not None:
        remaining["video"] = list(video_tokens)
    by_id = {getattr(tokens, kind): kind for kind in ("image", "video", "audio") if getattr(tokens, kind) is not None}
    out: list[int] = []
    for token in token_ids:
        kind = by_id.get(token)
        if kind is None:
            out.append(token)
            continue
        if not remaining.get(kind):
            raise ValueError(f"the prompt has more {kind} placeholders than {kind} items")
        item = remaining[kind].pop(0)
        out.extend(item if isinstance(item, list) else [token] * item)
    left = {kind: len(values) for kind, values in remaining.items() if values}
    if left:
        raise ValueError(f"media items without a placeholder in the rendered prompt: {left}")
    return out


def audio_in_video_tokens(config, grid_thw: torch.Tensor, merge_size: int, seconds_per_grid: float,
                          audio_tokens: int, audio_end: int) -> list[int]:
    """The tokens that stand for one video with its sound track in the prompt of a Qwen3-Omni thinker
    (use_audio_in_video): audio start, then the video's tokens (each temporal grid at its start time) and the
    audio's tokens (one per position of ``position_id_per_seconds``) merged by time, video first at a tie, then
    ``audio_end`` (the tokenizer's audio end token); its 3D rope (``get_rope_index``) walks the same order."""
    media = MediaTokens.of(config)
    start, per_second = _config_value(config, "audio_start_token_id"), _config_value(config, "position_id_per_seconds")
    if start is None or per_second is None:
        raise ValueError(f"{type(config).__name__} does not interleave audio with video (use_audio_in_video)")
    frames, height, width = (int(v) for v in grid_thw)
    per_frame = (height // merge_size) * (width // merge_size)
    video_times = [t * seconds_per_grid * per_second for t in range(frames) for _ in range(per_frame)]
    out, v, a = [start], 0, 0
    while v < len(video_times) and a < audio_tokens:
        if video_times[v] <= a:
            out.append(media.video)
            v += 1
        else:
            out.append(media.audio)
            a += 1
    out += [media.video] * (len(video_times) - v) + [media.audio] * (audio_tokens - a)
    return out + [audio_end]


# Families whose processor writes a video as one block per temporal patch, each after its timestamp text
# (``<1.5 seconds><|vision_start|>pads<|vision_end|>``), and whose rope index splits the video's grid per patch
_TIMESTAMPED_VIDEO_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def has_timestamped_video(config) -> bool:
    """Whether the model lays a video out frame by frame with timestamps (Qwen3-VL, Qwen3.5)."""
    return getattr(config, "model_type", None) in _TIMESTAMPED_VIDEO_TYPES


def timestamped_video_tokens(config, grid_thw: torch.Tensor, merge_size: int, grid_seconds: list[float],
                             encode: Callable[[str], list[int]]) -> list[int]:
    """The tokens that stand for one video's placeholder in a Qwen3-VL-style prompt: per temporal patch,
    ``encode(f"<{seconds:.1f} seconds>")``, vision start, the patch's video tokens, vision end (the placeholder
    sits inside the template's own vision start/end, as in transformers' processor)."""
    media = MediaTokens.of(config)
    start, end = (_config_value(config, name) for name in ("vision_start_token_id", "vision_end_token_id"))
    frames, height, width = (int(v) for v in grid_thw)
    if start is None or end is None or len(grid_seconds) != frames:
        raise ValueError(f"{type(config).__name__}: a video of {frames} temporal patches with "
                         f"{len(grid_seconds)} timestamps (or no vision start/end tokens)")
    per_frame = [start] + [media.video] * ((height // merge_size) * (width // merge_size)) + [end]
    return [token for seconds in grid_seconds for token in encode(f"<{seconds:.1f} seconds>") + per_frame]


def has_audio_in_video(config, input_ids: torch.Tensor) -> bool:
    """Whether a video of ``input_ids`` carries its sound track (a vision start right before an audio start)."""
    vision_start, audio_start = (_config_value(config, name) for name in ("vision_start_token_id",
                                                                           "audio_start_token_id"))
    if vision_start is None or audio_start is None or input_ids.shape[-1] < 2:
        return False
    return bool(((input_ids[..., :-1] == vision_start) & (input_ids[..., 1:] == audio_start)).any())


def concat_inputs(per_sequence: list[dict[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """Several sequences' processor tensors as one forward's inputs (concatenated in order)."""
    merged: dict[str, list[torch.Tensor]] = {}
    for inputs in per_sequence:
        for key, value in (inputs or {}).items():
            merged.setdefault(key, []).append(torch.as_tensor(value))
    return {key: torch.cat(values) for key, values in merged.items()}


def _accepted(fn, candidates: dict[str, object]) -> dict[str, object]:
    parameters = inspect.signature(fn).parameters
    return {name: value for name, value in candidates.items() if name in parameters and value is not None}


def forward_inputs(model: PreTrainedModel, inputs: dict[str, torch.Tensor], input_ids: torch.Tensor,
                   device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The keyword arguments of ``model.forward`` for these processor tensors (on ``device``;
    floating tensors in ``dtype``), with ``mm_token_type_ids`` derived from ``input_ids``."""
    candidates: dict[str, object] = {}
    for key, value in inputs.items():
        tensor = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        for name in _INPUT_ALIASES.get(key, (key,)):
            candidates[name] = tensor
    candidates["mm_token_type_ids"] = MediaTokens.of(model.config).type_ids(input_ids)
    return _accepted(model.forward, candidates)


def rope_positions(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   inputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """3D (multimodal rope) position ids ``[3, B, S]`` of a padded batch, or None for models with
    plain positions. Decoding continues each row at its last position + 1 in all three axes."""
    owner = next((m for m in (model, getattr(model, "model", None)) if m is not None and hasattr(m, "get_rope_index")),
                 None)
    if owner is None:
        return None
    device = input_ids.device
    candidates = {
        "input_ids": input_ids, "attention_mask": attention_mask,
        "mm_token_type_ids": MediaTokens.of(model.config).type_ids(input_ids),
        "image_grid_thw": inputs.get("image_grid_thw"), "video_grid_thw": inputs.get("video_grid_thw"),
        "second_per_grid_ts": inputs.get("video_second_per_grid"), "second_per_grids": inputs.get("video_second_per_grid"),
    }
    if "feature_attention_mask" in inputs:
        candidates["audio_seqlens"] = inputs["feature_attention_mask"].sum(-1)
    candidates = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in candidates.items()}
    if "use_audio_in_video" in inspect.signature(owner.get_rope_index).parameters:  # the omni thinkers
        candidates["use_audio_in_video"] = has_audio_in_video(model.config, input_ids)
    positions, _ = owner.get_rope_index(**_accepted(owner.get_rope_index, candidates))
    return positions


def freeze_towers(model: PreTrainedModel, vision: bool, audio: bool) -> int:
    """Turn off gradients of the vision and/or audio encoder; returns the parameters frozen."""
    frozen = 0
    for attributes, wanted in ((VISION_TOWER_ATTRIBUTES, vision), (AUDIO_TOWER_ATTRIBUTES, audio)):
        if not wanted:
            continue
        for holder in (model, getattr(model, "model", None)):
            for name in attributes:
                tower = getattr(holder, name, None) if holder is not None else None
                if isinstance(tower, torch.nn.Module):
                    for param in tower.parameters():
                        if param.requires_grad:
                            param.requires_grad_(False)
                            frozen += param.numel()
    return frozen
