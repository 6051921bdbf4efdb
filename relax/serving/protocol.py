"""Request bodies of `relax serve`: SGLang's native protocol and the OpenAI protocol (pydantic).

Unknown fields are ignored (clients of SGLang and vLLM send options this server has no use for,
such as ``no_stop_trim`` or ``skip_special_tokens``); known fields are checked strictly (no bool
for an int, no string for a number), and a bad value is answered with HTTP 400 naming the field path
(see `relax.serving.sglang_routes` and `relax.serving.openai_routes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from relax.backends.inference.base import SamplingParams
from relax.data.chat_template import template_kwargs_problem


class _Body(BaseModel):
    # Strict: a body that breaks the published schema (`false` as a token id, "16" as max_new_tokens) is a
    # client bug, answered with 400 rather than silently coerced. JSON integers still fill float fields.
    # No NaN or infinity in any number (Python's JSON reader accepts the literals `NaN` and `Infinity`).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats_are_integers(cls, data: Any) -> Any:
        # JSON Schema counts 16.0 as an integer (and clients that compute a length send it); strict ints would not.
        return _integral_floats_to_int(data)


def _integral_floats_to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_to_int(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral_floats_to_int(item) for key, item in value.items()}
    return value


# Every number a client sends is bounded by what it means, and never beyond int64: an unbounded integer (2**70, a
# 4,000-digit one) would be accepted and then poison what it touches (a weight version no later update can pass).
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# A token id is an index into the model's embedding table; its upper bound depends on the model: the app checks
# it and writes it into the published schema where this marker is.
TOKEN_ID_MARKER = "x-token-id"
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, json_schema_extra={TOKEN_ID_MARKER: True})]
# A prompt: a non-empty string or a non-empty list of token ids; a batch is a non-empty list of prompts.
PromptText = Annotated[str, Field(min_length=1)]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]
# Tokens to generate: the app publishes (and checks) the model's context length as their maximum.
NewTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
NEW_TOKEN_FIELDS = {"SGLangSamplingParams": ["max_new_tokens"], "CompletionRequest": ["max_tokens"],
                    "ChatCompletionRequest": ["max_tokens", "max_completion_tokens"]}
# top_k <= 0 disables the filter (SGLang and vLLM spell it -1, newer vLLM 0); above the vocabulary it filters nothing.
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
# Temperatures below GREEDY_TEMPERATURE are greedy (`SamplingParams`); above MAX_TEMPERATURE sampling is uniform
# to float32's precision, and past float32's range the scaled logits would be NaN.
MAX_TEMPERATURE = 1000.0
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)]
WeightVersion = Annotated[int, Field(ge=0, le=INT64_MAX)]
# Stop strings are searched after every token: their number and length are bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_STRINGS)] | None
RequestId = Annotated[str, Field(max_length=256)]
Name = Annotated[str, Field(max_length=256)]
# A rendezvous longer than a day is a typo; the bound also keeps timedelta(seconds=...) from overflowing.
MAX_GROUP_TIMEOUT_S = 86400.0
MAX_GROUP_SIZE = 65536  # members of one weight-sync group (one trainer and its engines)
# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]; outside it torch raises an error that names no field.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]


def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# pydantic puts the member of a union that failed into the error location ("input_ids", "list[constrained-int]",
# 0; "sampling_params", "SGLangSamplingParams", "temperature"); those parts name types, not fields, and would only
# confuse a client looking for the field path. Field names are snake_case, model names CamelCase.
_UNION_MEMBER_TAGS = {"body", "str", "int", "float", "bool", "none", "list", "dict"}


def _is_field(part: int | str) -> bool:
    return isinstance(part, int) or (part.isidentifier() and part not in _UNION_MEMBER_TAGS
                                     and not part[:1].isupper())


def describe_validation_errors(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors of a request as one message (``field.path: problem; ...``) and the field path of the most
    telling one. A union reports an error per member; the member that matched the shape fails on a value (a bound,
    a length, a literal) rather than on a type, or failed deeper inside. A body that is not JSON at all is reported
    as the body's fault, with the character where parsing stopped (FastAPI puts that offset where a field would
    be)."""
    broken = next((error for error in errors if error.get("type") == "json_invalid"), None)
    if broken is not None:
        offset = next((part for part in broken.get("loc", ()) if isinstance(part, int)), None)
        reason = (broken.get("ctx") or {}).get("error") or broken.get("msg") or "invalid JSON"
        where = f" at character {offset}" if offset is not None else ""
        return f"body: not valid JSON{where} ({reason})", "body"

    def path(error: dict[str, Any]) -> list[str]:
        return [str(part) for part in error.get("loc", ()) if _is_field(part)]

    def telling(error: dict[str, Any]) -> tuple[bool, int]:
        kind = str(error.get("type", ""))
        return not (kind.endswith("_type") or kind == "none_required"), len(path(error))

    problems = [f"{'.'.join(path(e)) or 'body'}: {str(e.get('msg', '')).removeprefix('Value error, ')}"
                for e in errors]
    best = path(max(errors, key=telling)) if errors else []
    return "; ".join(problems) or "invalid request body", ".".join(best) or None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = Field(None, description="the path of the offending field, e.g. sampling_params.temperature")
    code: int


class ErrorResponse(BaseModel):
    """Every 4xx answer (OpenAI's error shape); a bad body is 400 with the field path in ``error.param``."""

    error: ErrorDetail


# ----------------------------------------------------------------------------- SGLang native


class SGLangSamplingParams(_Body):
    max_new_tokens: NewTokens = 128
    temperature: Temperature = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: TopK = -1
    stop: Stop = None
    stop_token_ids: StopTokenIds = None
    ignore_eos: bool = False
    seed: Seed | None = None
    no_stop_trim: bool = False  # keep a matched stop string in "text" (output_ids always keep it)

    def to_engine(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop=_as_list(self.stop), stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class GenerateRequest(_Body):
    """``POST /generate``: one prompt (``text`` str or ``input_ids`` list of ints) or a batch (lists)."""

    # The schema states "exactly one of text and input_ids" (null is accepted, but not published: a client
    # following the schema never sends both).
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})

    text: PromptText | Annotated[list[PromptText], Field(min_length=1)] | SkipJsonSchema[None] = None
    input_ids: PromptIds | Annotated[list[PromptIds], Field(min_length=1)] | SkipJsonSchema[None] = None
    # One set for every prompt, or (as SGLang) one per prompt of a batch.
    sampling_params: SGLangSamplingParams | Annotated[list[SGLangSamplingParams], Field(min_length=1)] = Field(
        default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    # The experts each MoE layer chose for every token fed to the model, in meta_info["routed_experts"] (SGLang's
    # field and format: base64 of the int32 [tokens - 1, layers, top_k] array, flattened).
    return_routed_experts: bool = False
    rid: RequestId | list[RequestId] | None = None
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
    rid: RequestId | list[RequestId] = ""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(_Body):
    """``model_path``: a Hugging Face folder (``*.safetensors`` files), a root of versioned directories
    written by `relax.distributed.weight_disk` (the newest version, or ``weight_version``), or one
    ``vNNNNNNNN`` directory of such a root."""

    model_path: str = Field(min_length=1, max_length=4096)
    weight_version: WeightVersion | None = None
    load_format: Name | None = None


# ----------------------------------------------------------------------------- OpenAI


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    model: Name | None = None
    max_tokens: NewTokens | None = None
    temperature: Temperature = 1.0
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=64)
    stop: Stop = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM / SGLang extensions.
    top_k: TopK = -1
    ignore_eos: bool = False
    stop_token_ids: StopTokenIds = None

    def to_engine(self, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            stop=_as_list(self.stop), stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            seed=self.seed,
        )


class CompletionRequest(_OpenAISampling):
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1)] | PromptIds | Annotated[
        list[PromptIds], Field(min_length=1)]
    max_tokens: NewTokens | None = 16
    # How many alternatives per token (OpenAI allows 5, vLLM 20); only the sampled token's log-prob is returned here.
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False


class TextPart(_Body):
    """A content part of a chat message; text only (image parts are not supported yet)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: NewTokens | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)
    # vLLM / SGLang extension: variables of the served chat template, e.g. {"enable_thinking": false} for Qwen3.
    # Not the template itself: a client's `chat_template` could loop without bound in the server's thread.
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        problem = None if value is None else template_kwargs_problem(value, frozenset({"chat_template"}))
        if problem:
            raise ValueError(problem)
        return value


class InitWeightsUpdateGroupRequest(_Body):
    """Join the trainer's weight-sync process group (the trainer is rank 0 and hosts the store at
    ``master_address:master_port``); this server takes rank ``rank_offset``."""

    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=MAX_GROUP_SIZE)
    world_size: int = Field(ge=2, le=MAX_GROUP_SIZE)
    backend: Literal["gloo", "nccl"] = "gloo"
    group_name: Name = "weight_sync"
    timeout_s: float = Field(120.0, gt=0, le=MAX_GROUP_TIMEOUT_S)


class UpdateWeightsFromDistributedRequest(_Body):
    """Receive the next version over the joined group: the trainer broadcasts a manifest (names, shapes, dtypes,
    version) and then the buckets (relax.distributed.weight_broadcast). SGLang's per-call ``names``/``dtypes``/
    ``shapes`` are accepted and ignored: the manifest carries them."""

    weight_version: WeightVersion | None = None
    group_name: Name = "weight_sync"
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[Annotated[int, Field(ge=0, le=INT64_MAX)]]] | None = None
