"""Bring a model file larger than one device call may carry (64 MiB, with the working tree) to the GPU machine.

``pack`` compresses the file (xz: the Q4_1 SmolLM2 GGUF goes from 98.4 MB to 90.5 MB) and cuts it into parts under
``--part-mib``; each part travels in its own call (``carry: [".weights/part-N"]``) while the machine stays warm, and
is stored there outside the repository; ``unpack`` joins the stored parts, decompresses them and checks the original's
SHA-256 (written by ``pack`` into ``manifest.json``, which travels with the last part). benchmarks/README.md gives
the calls.

    python benchmarks/gguf_parts.py pack FILE --out .weights --part-mib 38,49       # here
    python benchmarks/gguf_parts.py store .weights /tmp/w                           # there, after each call
    python benchmarks/gguf_parts.py unpack /tmp/w /tmp/w/SmolLM2-135M-Instruct.Q4_1.gguf   # there, at the end
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
from pathlib import Path

_CHUNK = 8 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pack(source: Path, out: Path, part_mib: list[int]) -> list[Path]:
    """``source`` compressed and cut: part i holds at most part_mib[i] MiB (the last size repeats)."""
    out.mkdir(parents=True, exist_ok=True)
    packed = lzma.compress(source.read_bytes(), preset=6)
    parts, offset = [], 0
    while offset < len(packed):
        size = part_mib[min(len(parts), len(part_mib) - 1)] << 20
        folder = out / f"part-{len(parts) + 1}"
        folder.mkdir(exist_ok=True)
        (folder / "data").write_bytes(packed[offset:offset + size])
        parts.append(folder)
        offset += size
    manifest = {"name": source.name, "bytes": source.stat().st_size, "sha256": sha256(source), "parts": len(parts)}
    (parts[-1] / "manifest.json").write_text(json.dumps(manifest))
    return parts


def store(carried: Path, store_dir: Path) -> None:
    """Copy the parts that came with this call into ``store_dir`` (kept on the machine between calls)."""
    store_dir.mkdir(parents=True, exist_ok=True)
    for folder in sorted(carried.glob("part-*")):
        shutil.copytree(folder, store_dir / folder.name, dirs_exist_ok=True)
        print(f"stored {folder.name}: {(folder / 'data').stat().st_size} bytes")


def unpack(store_dir: Path, target: Path) -> Path:
    manifests = list(store_dir.glob("part-*/manifest.json"))
    if not manifests:
        raise SystemExit(f"{store_dir}: no manifest yet (the last part has not arrived)")
    manifest = json.loads(manifests[0].read_text())
    folders = [store_dir / f"part-{i}" for i in range(1, manifest["parts"] + 1)]
    absent = [folder.name for folder in folders if not (folder / "data").is_file()]
    if absent:
        raise SystemExit(f"{store_dir}: parts {absent} missing (the machine was given back in between?)")
    data = lzma.decompress(b"".join((folder / "data").read_bytes() for folder in folders))
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    if len(data) != manifest["bytes"] or sha256(partial) != manifest["sha256"]:
        raise SystemExit(f"{target}: the joined parts do not match {manifest['name']}'s size and SHA-256")
    partial.rename(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    packing = commands.add_parser("pack")
    packing.add_argument("source", type=Path)
    packing.add_argument("--out", type=Path, default=Path(".weights"))
    packing.add_argument("--part-mib", default="38,49", help="MiB per part, comma-separated; the last repeats")
    storing = commands.add_parser("store")
    storing.add_argument("carried", type=Path)
    storing.add_argument("store_dir", type=Path)
    unpacking = commands.add_parser("unpack")
    unpacking.add_argument("store_dir", type=Path)
    unpacking.add_argument("target", type=Path)
    args = parser.parse_args()
    if args.command == "pack":
        for folder in pack(args.source, args.out, [int(v) for v in args.part_mib.split(",")]):
            print(f"{folder}: {(folder / 'data').stat().st_size / 2**20:.1f} MiB")
    elif args.command == "store":
        store(args.carried, args.store_dir)
    else:
        print(f"{unpack(args.store_dir, args.target)}: complete, SHA-256 checked")


if __name__ == "__main__":
    main()
