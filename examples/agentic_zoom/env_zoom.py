"""The zoom-in environment (upstream's DeepEyes ``image_zoom_in_tool``) and its reward, for vision-language episodes.

An episode: the model sees the task's image (downscaled to the model's token budget) and a question about a small
object. Each turn it may call

    <tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [x1, y1, x2, y2]}}</tool_call>

with the box (two opposite corners, in either order) on a 0-1000 grid over the full-resolution image (0,0 top left;
1000,1000 bottom right). The environment
crops that region of the original image (clamped to the image, grown to at least ``MIN_DIMENSION`` = 28 px per side
around its centre, upstream's bound), resizes the crop to fit ``ZOOM_SIZE`` and shows it to the model in a
``<tool_response>`` message, so the next turn sees the small object at full detail. A turn with ``<answer>...</answer>``
or without a tool call ends the episode. A malformed call (unparsable, another tool, bad arguments, an empty box or one
wholly outside the image) gets an error text instead of a crop, and the model may try again.

Use with ``--rollout-interaction-env-path examples.agentic_zoom.env_zoom`` and
``--custom-rm-path examples.agentic_zoom.env_zoom:zoom_reward`` (the repository root on ``PYTHONPATH``), and with
``--multimodal-keys`` so that observation images are processed like prompt images.
"""

from __future__ import annotations

import math
import re
from typing import Any

from PIL import Image

from relax.data.multimodal.image import to_rgb
from relax.data.multimodal.media import load_image
from relax.data.sample import Sample
from relax.rollout.agentic.env import BaseInteractionEnv, Message, Observation
from relax.rollout.agentic.tool_parser import ParsedMessage, parse_hermes_tool_calls, tool_results_message

TOOL_NAME = "image_zoom_in_tool"
GRID = 1000            # bbox coordinates are on a 0-GRID normalized grid
MIN_DIMENSION = 28     # upstream's smallest crop side, in pixels of the original image (one 2x2-merged vision token)
ZOOM_SIZE = 56         # the crop is resized to fit ZOOM_SIZE x ZOOM_SIZE: 4 vision tokens for the tiny model
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ZoomError(ValueError):
    """A zoom call the environment cannot serve; the message is what the model is shown."""


# ----------------------------------------------------------------------------------------------------- crop math


def bbox_arguments(arguments: dict[str, Any]) -> tuple[float, float, float, float]:
    """The ``bbox_2d`` argument as ``(x1, y1, x2, y2)`` with x1 < x2 and y1 < y2 (grid units). The four numbers are
    two opposite corners, in either order (a model that swaps them still names a region); a box of zero width or
    height names none and is a ``ZoomError``, as are a wrong shape, non-numbers and other arguments."""
    unknown = sorted(set(arguments) - {"bbox_2d"})
    if unknown:
        raise ZoomError(f"unknown argument(s) {', '.join(unknown)}; expected bbox_2d")
    box = arguments.get("bbox_2d")
    if not isinstance(box, list | tuple) or len(box) != 4:
        raise ZoomError("bbox_2d must be a list of four numbers [x1, y1, x2, y2]")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in box):
        raise ZoomError("bbox_2d must hold four finite numbers")
    (x1, x2), (y1, y2) = sorted((float(box[0]), float(box[2]))), sorted((float(box[1]), float(box[3])))
    if x1 == x2 or y1 == y2:
        raise ZoomError(f"bbox_2d {list(box)} is empty: x1 = x2 or y1 = y2")
    return x1, y1, x2, y2


def _grow_span(start: float, end: float, minimum: float, limit: float) -> tuple[float, float]:
    """``[start, end]`` widened around its centre to at least ``minimum`` (at most ``limit``), shifted inside
    ``[0, limit]``."""
    length = min(max(end - start, minimum), limit)
    centre = (start + end) / 2
    start = min(max(centre - length / 2, 0.0), limit - length)
    return start, start + length


def crop_box(bbox: tuple[float, float, float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """The pixel box ``(left, top, right, bottom)`` of a grid bbox on a ``width`` x ``height`` image: scaled,
    clamped to the image, then grown to at least ``MIN_DIMENSION`` px per side (or the whole side of a smaller
    image). A box wholly outside the image is a ``ZoomError``."""
    x1, y1, x2, y2 = bbox
    left, right = (min(max(v / GRID * width, 0.0), width) for v in (x1, x2))
    top, bottom = (min(max(v / GRID * height, 0.0), height) for v in (y1, y2))
    if right <= left or bottom <= top:
        raise ZoomError(f"bbox_2d {[round(v) for v in bbox]} lies outside the image (the grid is 0-{GRID})")
    left, right = _grow_span(left, right, MIN_DIMENSION, width)
    top, bottom = _grow_span(top, bottom, MIN_DIMENSION, height)
    return round(left), round(top), round(right), round(bottom)


def zoom(image: Image.Image, bbox: tuple[float, float, float, float]) -> Image.Image:
    """The region of ``image`` under the grid ``bbox``, resized (aspect kept) so its longer side is ``ZOOM_SIZE`` and
    its shorter side at least ``MIN_DIMENSION`` px; the media processor then aligns it to the vision patches."""
    crop = image.crop(crop_box(bbox, image.width, image.height))
    scale = ZOOM_SIZE / max(crop.width, crop.height)
    size = (max(MIN_DIMENSION, round(crop.width * scale)), max(MIN_DIMENSION, round(crop.height * scale)))
    return crop.resize(size, Image.Resampling.BICUBIC)


# ----------------------------------------------------------------------------------------------------- environment


class ZoomEnv(BaseInteractionEnv):
    """One episode over ``image`` (the full-resolution original). ``stats`` counts the episode's zooms (calls that
    returned a crop) and errors (malformed or refused calls); every step's info carries them."""

    def __init__(self, image: Image.Image, chat_template: str | None = None):
        self.image = to_rgb(image)
        self.chat_template = chat_template  # decides the role of the result message (see tool_results_message)
        self.stats = {"zooms": 0, "errors": 0}

    def step(self, response_text: str) -> tuple[Observation, bool, dict[str, Any]]:
        parsed = parse_hermes_tool_calls(response_text)
        if _ANSWER.search(response_text) or not (parsed.tool_calls or parsed.errors):
            return {}, True, self._info(zoomed=False)
        try:
            crop, box = self._serve(parsed)
        except ZoomError as err:
            self.stats["errors"] += 1
            message = tool_results_message([f"Error: {err}"], self.chat_template)
            return {"obs_str": message["content"], "role": message["role"]}, False, self._info(zoomed=False)
        self.stats["zooms"] += 1
        message = tool_results_message([f"Zoomed in on {box}."], self.chat_template)
        observation = {"obs_str": message["content"], "role": message["role"],
                       "multi_modal_data": {"image": [crop]}}
        return observation, False, self._info(zoomed=True)

    def _serve(self, parsed: ParsedMessage) -> tuple[Image.Image, list[int]]:
        """The crop of the turn's one call and its grid box; every other case is a ``ZoomError``."""
        if parsed.errors:
            raise ZoomError(f"could not parse the tool call: {parsed.errors[0]}")
        if len(parsed.tool_calls) > 1:
            raise ZoomError("one zoom per turn, please")
        call = parsed.tool_calls[0]
        if call.name != TOOL_NAME:
            raise ZoomError(f"unknown tool {call.name!r}; available: {TOOL_NAME}")
        bbox = bbox_arguments(call.arguments)
        return zoom(self.image, bbox), [round(v) for v in bbox]

    def format_observation(self, observation: Observation) -> Message:
        """The crop inside the ``<tool_response>`` block, before its text (DeepEyes' layout)."""
        images = (observation.get("multi_modal_data") or {}).get("image") or []
        if not images:
            return super().format_observation(observation)
        opening = "<tool_response>\n"
        text = observation["obs_str"].removeprefix(opening)
        content = [{"type": "text", "text": opening}, *({"type": "image", "image": image} for image in images),
                   {"type": "text", "text": text}]
        return {"role": observation.get("role", "user"), "content": content}

    def _info(self, zoomed: bool) -> dict[str, Any]:
        return {"zoomed": zoomed, **self.stats}


def build_env(sample: Sample, args: Any) -> ZoomEnv:
    """The environment of one sample: its first image (``--multimodal-keys``), at full resolution."""
    images = (sample.multimodal_inputs or {}).get("image") or []
    if not images:
        raise ValueError(f"sample {sample.index}: the zoom environment needs an image (set --multimodal-keys)")
    tokenizer = getattr(args, "tokenizer", None)
    return ZoomEnv(load_image(images[0]), chat_template=getattr(tokenizer, "chat_template", None))


# ----------------------------------------------------------------------------------------------------------- reward


def final_answer(sample: Sample) -> str | None:
    """The text inside ``<answer>...</answer>`` of the episode's last model turn (None without one)."""
    traces = sample.metadata.get("rollout_traces") or []
    text = traces[-1]["response_text"] if traces else (sample.response or "")
    match = _ANSWER.search(text)
    return match.group(1).strip() if match else None


def episode_zoom_stats(sample: Sample) -> dict[str, int]:
    """The episode's zoom and error counts (from its last step's info)."""
    for trace in reversed(sample.metadata.get("rollout_traces") or []):
        info = trace.get("env_info") or {}
        if "zooms" in info:
            return {"zooms": info["zooms"], "errors": info["errors"]}
    return {"zooms": 0, "errors": 0}


def zoom_reward(args: Any, sample: Sample) -> dict[str, float]:
    """``score = acc - 0.2 * format_error + 0.2 * (acc and zoomed)``, in the spirit of DeepEyes' ``0.8 acc +
    0.2 format + 1.2 tool`` with the accuracy dominant:

    - ``acc``: 1 when the final turn's ``<answer>`` equals the label (case and surrounding spaces ignored);
    - ``format_error``: 1 when the final turn has no ``<answer>...</answer>`` or any zoom call was malformed;
    - the tool bonus is paid only with a correct answer (as upstream), so calling the tool is never worth more than
      answering right.

    ``score > 0`` exactly when the answer is right, so ``rollout/accuracy`` is the answer accuracy.
    """
    answer = final_answer(sample)
    stats = episode_zoom_stats(sample)
    acc = float(answer is not None and answer.lower() == str(sample.label).strip().lower())
    format_error = float(answer is None or stats["errors"] > 0)
    tool = float(acc > 0 and stats["zooms"] > 0)
    return {"score": acc - 0.2 * format_error + 0.2 * tool, "acc": acc, "format_error": format_error, "tool": tool}

