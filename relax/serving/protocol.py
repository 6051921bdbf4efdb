"""Request bodies of `relax serve`: SGLang's native protocol and the OpenAI protocol (pydantic).

Unknown fields are ignored (clients of SGLang and vLLM send options this server has no use for,
such as ``no_stop_trim`` or ``skip_special_tokens``); known fields are checked, and a bad value is
answered with HTTP 400 naming the field path (see `relax.serving.app`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.backends.inference.base import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# ----------------------------------------------------------------------------- SGLang native


class SGLangSamplingParams(_Body):
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    no_stop_trim: bool = False  # keep a matched stop string in "text" (output_ids always keep it)

    def to_engine(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop=_as_list(self.stop), stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class GenerateRequest(_Body):
    """``POST /generate``: one prompt (``text`` str or ``input_ids`` list of ints) or a batch (lists)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    rid: str | list[str] | None = None
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt_field(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.stream:
            raise ValueError("stream: streaming is not supported on /generate (use /v1/completions with stream)")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


class AbortRequest(_Body):
    rid: str | list[str] = ""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(_Body):
    """``model_path``: a Hugging Face folder (``*.safetensors`` files), a root of versioned directories
    written by `relax.distributed.weight_disk` (the newest version, or ``weight_version``), or one
    ``vNNNNNNNN`` directory of such a root."""

    model_path: str = Field(min_length=1)
    weight_version: int | None = Field(None, ge=0)
    load_format: str | None = None


# ----------------------------------------------------------------------------- OpenAI


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM / SGLang extensions.
    top_k: int = -1
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def to_engine(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop=_as_list(self.stop), stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: Literal[False] = False


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)


class InitWeightsUpdateGroupRequest(_Body):
    """Join the trainer's weight-sync process group (the trainer is rank 0 and hosts the store at
    ``master_address:master_port``); this server takes rank ``rank_offset``."""

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    backend: Literal["gloo", "nccl"] = "gloo"
    group_name: str = "weight_sync"
    timeout_s: float = Field(120.0, gt=0)


class UpdateWeightsFromDistributedRequest(_Body):
    """Receive the next version over the joined group: the trainer broadcasts a manifest (names, shapes, dtypes,
    version) and then the buckets (relax.distributed.weight_broadcast). SGLang's per-call ``names``/``dtypes``/
    ``shapes`` are accepted and ignored: the manifest carries them."""

    weight_version: int | None = Field(None, ge=0)
    group_name: str = "weight_sync"
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None
