"""What every `relax` command shares: quiet libraries, logging into the run directory, the saved config, notifiers,
argument types. Nothing here imports torch: `relax --help` and `relax --version` stay fast."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from relax.telemetry.notify import Notifier, split_urls
from relax.utils.errors import RunFault


def offline_environment() -> None:
    """Relax never downloads (a model is a local folder) and tokenizers keep to one thread per process. Set before
    a command imports transformers: huggingface_hub reads HF_HUB_OFFLINE once, when it is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def quiet_libraries() -> None:
    offline_environment()
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def setup_logging(run_dir: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(run_dir / "run.log"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=handlers, force=True)
    # The console shows warnings and the progress bar; run.log keeps the per-step lines.
    handlers[0].setLevel(logging.WARNING)
    # httpx logs every request's URL at INFO, and a URL may hold a token (--rm-url): warnings only.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def resolved_config_text(cfg) -> str:
    """config.yaml: every setting, so that `relax train --config` re-runs it; a secret that was set is left out (and
    said so in a comment), never written."""
    settings, set_secrets = cfg.shareable_settings()
    notes = "".join(f"# {name}: set for this run, not saved (give {flag_of(name)} again)\n" for name in set_secrets)
    return notes + yaml.safe_dump(settings, sort_keys=False)


def flag_of(name: str) -> str:
    """``rollout_batch_size`` -> ``--rollout-batch-size`` (as `relax.config.flag`, without importing the config)."""
    return "--" + name.replace("_", "-")


def build_notifier(cfg) -> Notifier:
    secrets = [getattr(cfg, name) for name in cfg.secret_fields() if isinstance(getattr(cfg, name), str)]
    return Notifier(split_urls(cfg.notify_urls), secrets, run_name=Path(cfg.output_dir).name)


def port_number(text: str) -> int:
    """A TCP port, 1-65535 (argparse's error names the flag)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (1-65535)")
    return port


def positive(kind: type) -> Any:
    """An argparse type: a finite number > 0 (an infinite timeout or size is no bound)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
        return value

    parse.__name__ = kind.__name__
    return parse


def in_range(kind: type, low: float, high: float) -> Any:
    """An argparse type: a number from ``low`` to ``high`` (a finite one)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} must be from {low:g} to {high:g}")
        return value

    parse.__name__ = kind.__name__
    return parse


def nonblank(text: str) -> str:
    """An argparse type: a string with something in it (an empty one is an unset shell variable, or a stray quote:
    as a token it would have opened the server to anyone sending an empty one, as a folder meant the working
    directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is blank (an unset shell variable?); leave the flag out instead")
    return text


def causes(err: BaseException) -> list[BaseException]:
    """``err`` and its chain of ``__cause__`` (at most 20: a cycle must not loop)."""
    chain = [err]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    return chain


def run_fault(err: BaseException):
    """The `RunFault` in ``err``'s chain of causes, or None."""
    return next((cause for cause in causes(err) if isinstance(cause, RunFault)), None)


def cause_first(err: BaseException) -> str:
    """The innermost cause of a chained error first (a full disk's OSError rather than the wrapper's message)."""
    return " <- ".join(f"{type(e).__name__}: {e}" for e in reversed(causes(err)))


def log_to_run_file(message: str, exc_info: BaseException | None = None) -> None:
    """Into run.log (the console gets the message from the caller): a run's fatal error stays with its log."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            record = logging.LogRecord("relax", logging.ERROR, __file__, 0, message, None,
                                       (type(exc_info), exc_info, exc_info.__traceback__) if exc_info else None)
            handler.handle(record)


def with_model_folders(cfg):
    """``cfg`` with each model named as a GGUF file (``--hf-checkpoint``, or it and ``--gguf-file``;
    ``--teacher-hf-checkpoint``, ``--genrm-model-path``) replaced by its
    cached Hugging Face folder (`relax.backends.models.gguf_source`), made on first use; a bad file is a ConfigError
    naming the flag and the file."""
    from relax.backends.models.gguf_source import hf_folder_of_gguf, is_gguf
    from relax.config import ConfigError

    updates = {}
    sources = {"hf_checkpoint": cfg.model_source, "teacher_hf_checkpoint": cfg.teacher_hf_checkpoint,
               "genrm_model_path": cfg.genrm_model_path}
    for name, value in sources.items():
        if is_gguf(value):
            try:
                updates[name] = str(hf_folder_of_gguf(value))
            except ValueError as err:
                raise ConfigError(f"{flag_of(name)} {err}") from None
            logging.getLogger("relax").info("%s %s: dequantised into %s", flag_of(name), value, updates[name])
    if "hf_checkpoint" in updates:
        updates["gguf_file"] = None  # folded into the dequantised folder
    return cfg.model_copy(update=updates) if updates else cfg
