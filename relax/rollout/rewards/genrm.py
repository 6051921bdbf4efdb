"""A generative reward model (GenRM, LLM-as-judge; upstream's ``--genrm-model-path``): a judge model served by an
embedded inference engine reads the prompt, the reference answer and the response, and its verdict is the reward.

The judge's prompt is ``--genrm-prompt-template`` (Python format fields ``{prompt}``, ``{response}``, ``{label}``;
`DEFAULT_TEMPLATE` asks for a ``\\boxed{}`` score), rendered as one user message through the judge's chat template
when it has one. Its sampling is ``--genrm-sampling-config`` (upstream's keys and defaults: temperature 0.1, top_p
1.0, top_k -1, max_response_len 4096), seeded per sample, so a resumed run gets the same verdicts. The engine is
``--genrm-engine-config`` (device, dtype, engine_core, mem_fraction_static, max_batch_size; default: the run's
device and dtype); it loads at the first verdict, in the process that scores (the rollout's, under Ray placement),
and concurrent verdicts are decoded as one batch. A verdict the parser cannot read fails that sample's reward like
any failing reward (0, counted in ``reward/num_errors``, logged once); ``reward/genrm_verdicts`` counts the
verdicts given.

Verdicts (`parse_verdict`): the number in the last ``\\boxed{}``, else after the last ``score:``, else a leading
yes (1) or no (0).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relax.backends.inference.base import GenerationRequest, SamplingParams
from relax.backends.inference.batcher import RequestBatcher
from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.models.family import model_folder_problem
from relax.rollout.rewards.boxed import last_boxed_content

DEFAULT_TEMPLATE = (
    "You are grading a response to a question.\n\nQuestion:\n{prompt}\n\nReference answer:\n{label}\n\n"
    "Response:\n{response}\n\nIs the response correct? Answer with a score between 0 and 1 in \\boxed{{}}."
)
SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "max_response_len": int}
ENGINE_KEYS = {"device": str, "dtype": str, "engine_core": str, "mem_fraction_static": float, "max_batch_size": int}
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_YES_NO = re.compile(r"\s*\W*(yes|no|correct|incorrect)\b", re.IGNORECASE)


class VerdictError(ValueError):
    """The judge's answer holds no verdict the parser can read."""


def parse_verdict(text: str) -> float:
    boxed = last_boxed_content(text)
    if boxed is not None:
        number = _NUMBER.search(boxed)
        if number is not None:
            return float(number.group())
        answer = _YES_NO.match(boxed)
        if answer is not None:
            return 1.0 if answer.group(1).lower() in ("yes", "correct") else 0.0
    scores = _SCORE.findall(text)
    if scores:
        return float(scores[-1])
    answer = _YES_NO.match(text)
    if answer is not None:
        return 1.0 if answer.group(1).lower() in ("yes", "correct") else 0.0
    raise VerdictError(f"the judge's answer holds no verdict (no \\boxed{{}} number, score:, yes or no): "
                       f"{text[:120]!r}")


def _checked(config: dict[str, Any] | None, keys: dict[str, type], flag: str) -> dict[str, Any]:
    config = dict(config or {})
    unknown = sorted(set(config) - set(keys))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {unknown}; known: {sorted(keys)}")
    return {key: keys[key](value) for key, value in config.items()}


@dataclass(frozen=True)
class GenRMSettings:
    model_path: str
    template: str = DEFAULT_TEMPLATE
    sampling: dict[str, Any] = field(default_factory=dict)  # --genrm-sampling-config
    engine: dict[str, Any] = field(default_factory=dict)  # --genrm-engine-config

    @classmethod
    def from_flags(cls, model_path: str, template: str | None, sampling: dict | None, engine: dict | None,
                   device: str, dtype: str) -> GenRMSettings:
        """Checked settings (raises ValueError naming the flag and key); ``template`` is the template itself or
        the path of a file holding it."""
        problem = model_folder_problem(model_path)
        if problem is not None:
            raise ValueError(f"--genrm-model-path {problem}")
        if template is not None and Path(template).is_file():
            try:
                template = Path(template).read_text(encoding="utf-8")
            except (OSError, UnicodeError) as err:
                raise ValueError(f"--genrm-prompt-template {template}: unreadable ({err})") from None
        template = template or DEFAULT_TEMPLATE
        try:
            template.format(prompt="", response="", label="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"--genrm-prompt-template: the fields are {{prompt}}, {{response}} and {{label}} "
                             f"(double other braces): {type(err).__name__}: {err}") from None
        if "{response}" not in template:
            raise ValueError("--genrm-prompt-template never shows the judge the {response}")
        sampling = {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 4096,
                    **_checked(sampling, SAMPLING_KEYS, "--genrm-sampling-config")}
        engine = {"device": device, "dtype": dtype, **_checked(engine, ENGINE_KEYS, "--genrm-engine-config")}
        return cls(model_path, template, sampling, engine)


class GenerativeReward:
    """``await reward(args, sample) -> float``: the judge's verdict on the sample (module doc)."""

    def __init__(self, settings: GenRMSettings) -> None:
        self.settings = settings
        self.engine = None  # loaded at the first verdict
        self.tokenizer = None
        self._load_lock = threading.Lock()  # a thread lock: verdicts may come from several event loops
        self._batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per event loop
        self._request_ids = itertools.count()
        self.verdicts = 0

    def pop_metrics(self) -> dict[str, int]:
        verdicts, self.verdicts = self.verdicts, 0
        return {"reward/genrm_verdicts": verdicts}

    async def __call__(self, args: Any, sample: Any) -> float:
        batcher = await self._batcher()
        sampling = self.settings.sampling
        request = GenerationRequest(
            request_id=f"genrm-{next(self._request_ids)}",
            input_ids=self._judge_prompt(sample),
            sampling_params=SamplingParams(max_new_tokens=sampling["max_response_len"],
                                           temperature=sampling["temperature"], top_p=sampling["top_p"],
                                           top_k=sampling["top_k"],
                                           seed=zlib.crc32(f"{sample.index}:{sample.response}".encode())))
        (output,) = await batcher.generate([request])
        verdict = parse_verdict(output.text)
        self.verdicts += 1
        return verdict

    def _judge_prompt(self, sample: Any) -> list[int]:
        text = self.settings.template.format(prompt=_prompt_text(sample.prompt), response=sample.response,
                                             label="" if sample.label is None else sample.label)
        if getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=False))
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    async def _batcher(self) -> RequestBatcher:
        loop = asyncio.get_running_loop()
        if self.engine is None:
            await asyncio.to_thread(self._load)
        batcher = self._batchers.get(loop)
        if batcher is None:
            batcher = self._batchers[loop] = RequestBatcher(self.engine)
            batcher.start()
        return batcher

    def _load(self) -> None:
        with self._load_lock:
            if self.engine is not None:
                return
            config = self.settings.engine
            core = CoreSettings(mode=config.get("engine_core", "auto"),
                                **{key: config[key] for key in ("mem_fraction_static",) if key in config})
            self.engine = EmbeddedEngine.from_pretrained(
                self.settings.model_path, dtype=getattr(torch, config["dtype"]), device=config["device"],
                max_batch_size=config.get("max_batch_size"), core=core)
            self.tokenizer = self.engine.tokenizer


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message.get('role', 'user')}: {message.get('content')}" for message in prompt or [])
