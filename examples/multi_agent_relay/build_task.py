"""Build the relay example offline, in seconds: three-number sums and the quickstart's model with a chat template.

The data: ``a+b+c`` with a + b <= 499 and c in [100, 499], so both agents' sums stay in the range the quickstart
model was warm-started on (3-digit operands of 100-499, see examples/quickstart/build_quickstart.py). 4000 training
prompts and 200 held-out ones, disjoint.

The model: examples/quickstart/model (its weights and tokenizer as they are) with a chat template that renders a
message as its bare text, so an agent's context is exactly the quickstart's ``a+b=`` prompt format.

Usage: python examples/multi_agent_relay/build_task.py [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
from pathlib import Path

from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "quickstart"
sys.path.insert(0, str(QUICKSTART))
from build_quickstart import write_jsonl  # noqa: E402

SEED = 5150
NUM_TRAIN = 4000
NUM_TEST = 200
BARE_TEMPLATE = "{%- for message in messages %}{{ message.content }}{%- endfor %}"


def sample_problems(rng: random.Random, count: int) -> list[tuple[int, int, int]]:
    """Distinct (a, b, c) with a, b >= 100, a + b <= 499 and c in [100, 499]."""
    problems: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int, int]] = set()
    while len(problems) < count:
        a = rng.randint(100, 399)
        problem = (a, rng.randint(100, 499 - a), rng.randint(100, 499))
        if problem not in seen:
            seen.add(problem)
            problems.append(problem)
    return problems


def row(problem: tuple[int, int, int]) -> dict[str, str]:
    a, b, c = problem
    return {"input": f"{a}+{b}+{c}", "label": str(a + b + c)}


def build(out_dir: Path) -> None:
    problems = sample_problems(random.Random(SEED), NUM_TRAIN + NUM_TEST)
    write_jsonl(out_dir / "data" / "train.jsonl", [row(p) for p in problems[:NUM_TRAIN]])
    write_jsonl(out_dir / "data" / "test.jsonl", [row(p) for p in problems[NUM_TRAIN:]])
    model_dir = out_dir / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.copytree(QUICKSTART / "model", model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = BARE_TEMPLATE
    tokenizer.save_pretrained(model_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output folder")
    args = parser.parse_args(argv)
    build(args.out)
    print(f"wrote {args.out}/data ({NUM_TRAIN} + {NUM_TEST} problems) and {args.out}/model")


if __name__ == "__main__":
    main()
