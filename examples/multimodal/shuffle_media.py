"""Write a copy of a multimodal jsonl whose media column is permuted across rows (the control run:
each prompt keeps its label but gets another row's media, so the media no longer predict the reward).

    python examples/multimodal/shuffle_media.py IN.jsonl OUT.jsonl --column images [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--column", required=True, help="the media column to permute (images, audios, videos)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.source.read_text().splitlines() if line.strip()]
    media = [row[args.column] for row in rows]
    random.Random(args.seed).shuffle(media)
    for row, items in zip(rows, media):
        row[args.column] = items
    # Relative media paths stay valid: the copy is written next to the source.
    if args.target.parent.resolve() != args.source.parent.resolve():
        raise SystemExit("write the shuffled copy into the source's folder so relative media paths still resolve")
    args.target.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{args.target}: {len(rows)} rows, column {args.column!r} permuted (seed {args.seed})")


if __name__ == "__main__":
    main()
