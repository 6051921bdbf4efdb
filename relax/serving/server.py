"""Load a model folder into an `EmbeddedEngine` and serve it with uvicorn (`relax serve`)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from relax.backends.inference.embedded import CoreSettings, EmbeddedEngine
from relax.backends.models.family import model_folder_problem
from relax.serving.app import create_app
from relax.serving.limits import GenerationLimits
from relax.utils.cpu_threads import set_cpu_threads
from relax.utils.http_server import HTTPLimits, ListenError, listening_socket, uvicorn_config

API_KEY_ENV = "RELAX_API_KEY"
logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name if name != "auto" else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def serve(hf_checkpoint: str, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None,
          device: str = "auto", dtype: str = "auto", served_model_name: str | None = None,
          max_batch_size: int | None = None, batch_window_ms: float = 5.0, log_level: str = "info",
          weight_update_root: str | None = None, core: CoreSettings | None = None,
          http_limits: HTTPLimits | None = None, generation_limits: GenerationLimits | None = None,
          cpu_threads: int = 0) -> None:
    """Block serving ``hf_checkpoint`` until interrupted. ``api_key`` (or $RELAX_API_KEY) guards the
    control endpoints; ``weight_update_root`` bounds the paths /update_weights_from_disk may load; ``core`` sizes the
    engine (default: the KV pool takes 0.85 of the free device memory); ``http_limits`` and ``generation_limits``
    bound what one client may take (docs/serving.md)."""
    core = core or CoreSettings(mem_fraction_static=0.85)
    import uvicorn

    path = Path(hf_checkpoint)
    problem = model_folder_problem(path)
    if problem is not None:
        raise ValueError(f"--hf-checkpoint {problem}")
    api_key = resolve_api_key(api_key)
    if weight_update_root is not None and not Path(weight_update_root).is_dir():
        raise ValueError(f"--weight-update-root {weight_update_root}: not a directory")
    torch_device = resolve_device(device)
    try:  # before the model loads: a taken port fails in a second, naming the flag
        listener = listening_socket(host, port, "--port")
    except ListenError as err:
        raise ValueError(str(err)) from None
    # Until uvicorn serves, a client's connection waits in the socket's backlog (a readiness poll times out and
    # polls again) instead of being refused.
    with contextlib.ExitStack() as on_failure:
        on_failure.callback(listener.close)
        if torch_device.type == "cpu":
            from transformers import AutoConfig

            set_cpu_threads(AutoConfig.from_pretrained(str(path)).get_text_config().hidden_size, cpu_threads)
        # Alone on its device, a server may take most of the free memory for its KV pool (the default); one
        # started beside a trainer (--rollout-engine-protocol relax) gets the run's --mem-fraction-static.
        engine = EmbeddedEngine.from_pretrained(str(path), dtype=resolve_dtype(dtype, torch_device),
                                                device=torch_device, max_batch_size=max_batch_size, core=core)
        on_failure.pop_all()  # loaded: the socket is uvicorn's from here
    app = create_app(engine, engine.tokenizer, model_name=served_model_name or path.name, model_path=str(path),
                     api_key=api_key, batch_window_s=batch_window_ms / 1000, weight_update_root=weight_update_root,
                     generation_limits=generation_limits)
    logger.warning("relax serve: %s listening on http://%s:%d (control endpoints %s; weight updates from %s)", path,
                   host, port, "need a bearer token" if api_key else "are open: no API key set",
                   weight_update_root or "any path")
    server = uvicorn.Server(uvicorn_config(app, http_limits, host=host, port=port, log_level=log_level))
    server.run(sockets=[listener])


def resolve_api_key(flag_value: str | None) -> str | None:
    """One rule for every server Relax starts: the flag, else $RELAX_API_KEY, else none (open)."""
    return flag_value or os.environ.get(API_KEY_ENV) or None
