"""A GGUF file as a model source: dequantised once by transformers into a Hugging Face folder (safetensors weights,
config, tokenizer and chat template), cached by the file's content hash, so that everything downstream (training,
engines, export, resume, LoRA) sees an ordinary model folder.

The cache lives under ``$RELAX_GGUF_CACHE`` (default ``~/.cache/relax/gguf``), one folder per file content
(``<sha256 prefix>``); a folder is complete when its ``relax_gguf_source.json`` exists (written last, after the folder
was moved into place in one rename), so a process killed mid-way leaves nothing half-written to reuse, and processes
converting the same file at once (the ranks of a ``torchrun``) each write their own temporary folder and the first
rename wins.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"
_MARKER = "relax_gguf_source.json"
_HASH_CHUNK = 8 << 20


def is_gguf(path: str | Path | None) -> bool:
    return path is not None and str(path).lower().endswith(GGUF_SUFFIX)


def cache_root() -> Path:
    return Path(os.environ.get("RELAX_GGUF_CACHE") or Path.home() / ".cache" / "relax" / "gguf")


def _content_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                         desc=f"hashing {path.name}", leave=False) as bar:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _check_readable(path: Path) -> None:
    if not path.is_file():
        raise ValueError(f"{path}: no such GGUF file")
    with path.open("rb") as handle:
        if handle.read(4) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")


def hf_folder_of_gguf(path: str | Path, root: Path | None = None) -> Path:
    """The cached Hugging Face folder of the GGUF file ``path``, made on first use. Raises ValueError naming the file
    for a missing, corrupt or unsupported file (an architecture transformers cannot dequantise)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.backends.models.family import MODEL_CONSTRUCTION_LOCK

    path = Path(path).expanduser().resolve()
    _check_readable(path)
    digest = _content_hash(path)
    root = root or cache_root()
    folder = root / digest[:16]
    if (folder / _MARKER).is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=root))
    try:
        try:
            with MODEL_CONSTRUCTION_LOCK:
                model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as err:  # transformers' reader and converters raise many kinds for one bad file
            raise ValueError(f"{path}: transformers cannot load this GGUF file as a causal language model "
                             f"({type(err).__name__}: {err})") from None
        # dequantised to float32 already: an ordinary model now (transformers would refuse to save it as "quantised")
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(folder)
        except OSError:  # another process put the same file's folder in place first (complete: renamed when saved)
            if not folder.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    (folder / _MARKER).write_text(json.dumps({"source": str(path), "sha256": digest}) + "\n")
    return folder
