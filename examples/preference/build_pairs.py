"""Preference pairs from the quickstart's addition task: the correct sum chosen, a wrong one rejected.

Every training problem of examples/quickstart/data/train.jsonl becomes one pair. The rejected answer is the correct
sum with one digit changed (a near miss, the kind of mistake the warm-started model makes), drawn with a fixed seed;
the held-out problems (examples/quickstart/data/test.jsonl) are never paired.

Usage: python examples/preference/build_pairs.py [--out examples/preference/data]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICKSTART_DATA = HERE.parent / "quickstart" / "data"
SEED = 3141


def near_miss(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit replaced by another (never a leading zero)."""
    position = rng.randrange(len(answer))
    choices = [d for d in "0123456789" if d != answer[position] and not (position == 0 and d == "0")]
    return answer[:position] + rng.choice(choices) + answer[position + 1:]


def build(out_dir: Path) -> int:
    rng = random.Random(SEED)
    rows = [json.loads(line) for line in (QUICKSTART_DATA / "train.jsonl").read_text().splitlines() if line]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "pairs.jsonl", "w", encoding="utf-8") as pairs:
        for row in rows:
            pairs.write(json.dumps({"input": row["input"], "chosen": row["label"],
                                    "rejected": near_miss(row["label"], rng)}) + "\n")
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "data")
    args = parser.parse_args(argv)
    print(f"wrote {build(args.out)} pairs to {args.out / 'pairs.jsonl'}")


if __name__ == "__main__":
    main()
