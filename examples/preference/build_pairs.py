"""Preference pairs from the quickstart's addition task: the correct sum chosen, a wrong one rejected.

Every training problem of examples/quickstart/data/train.jsonl becomes one pair; the held-out problems
(examples/quickstart/data/test.jsonl) are never trained on: their pairs measure a reward model's pair accuracy on
problems it never saw. Two kinds of wrong answer, drawn with fixed seeds:

- ``pairs.jsonl``, ``held_out_pairs.jsonl`` (DPO's data): the correct sum with one digit changed, a near miss;
- ``model_pairs.jsonl`` (the reward model's training data): four pairs per problem, two with wrong answers of the
  warm-started quickstart model itself, sampled as RL samples it (temperature 1; the first two distinct well-formed
  wrong numbers of 8 samples, near misses where there are fewer), and two near misses; ``held_out_model_pairs.jsonl``:
  one of the model's wrong answers per held-out problem. A reward model that RL will query must rank the policy's own
  mistakes below the right answer (docs/training_modes.md says what a weaker one does to RL).

``--policy FOLDER`` samples the wrong answers from another model, e.g. a policy trained against the reward model:
its mistakes are where that reward model was wrong (a second round of reward-model training, iterated RLHF).

Usage: python examples/preference/build_pairs.py [--out examples/preference/data] [--policy FOLDER]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "quickstart"
SEED = 3141
SAMPLES = 8
BATCH = 512


def near_miss(answer: str, rng: random.Random) -> str:
    """``answer`` with one digit replaced by another (never a leading zero)."""
    position = rng.randrange(len(answer))
    choices = [d for d in "0123456789" if d != answer[position] and not (position == 0 and d == "0")]
    return answer[:position] + rng.choice(choices) + answer[position + 1:]


def model_mistakes(rows: list[dict], seed: int, policy: Path = QUICKSTART / "model") -> list[list[str]]:
    """Per row, the distinct well-formed wrong answers among ``SAMPLES`` samples of ``policy``, in order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    mistakes: list[list[str]] = []
    for start in range(0, len(rows), BATCH):
        batch = rows[start:start + BATCH]
        prompts = [tokenizer(r["input"], add_special_tokens=False)["input_ids"] for r in batch]
        width = max(map(len, prompts))  # left-padded: the prompts end where generation starts
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts]).repeat_interleave(SAMPLES, dim=0)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=(ids != 0).long(), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
        answers = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        for i, row in enumerate(batch):
            wrong = [a.strip() for a in answers[i * SAMPLES:(i + 1) * SAMPLES]
                     if a.strip().isascii() and a.strip().isdigit() and a.strip() != row["label"]]
            mistakes.append(list(dict.fromkeys(wrong)))
    return mistakes


def write_pairs(path: Path, rows: list[dict], rejected: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for row, wrong in zip(rows, rejected):
            out.write(json.dumps({"input": row["input"], "chosen": row["label"], "rejected": wrong}) + "\n")


def build(out_dir: Path, with_model: bool = True, policy: Path = QUICKSTART / "model") -> int:
    rng = random.Random(SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {name: [json.loads(line) for line in (QUICKSTART / "data" / f"{name}.jsonl").read_text().splitlines()
                     if line] for name in ("train", "test")}
    near = {name: [near_miss(row["label"], rng) for row in rows] for name, rows in splits.items()}
    write_pairs(out_dir / "pairs.jsonl", splits["train"], near["train"])
    write_pairs(out_dir / "held_out_pairs.jsonl", splits["test"], near["test"])
    if with_model:
        train, test = model_mistakes(splits["train"], SEED, policy), model_mistakes(splits["test"], SEED + 1, policy)
        rows, rejected = [], []
        for row, wrong in zip(splits["train"], train):
            for answer in (wrong + [near_miss(row["label"], rng) for _ in range(2)])[:2]:
                rows.append(row)
                rejected.append(answer)
            for _ in range(2):
                rows.append(row)
                rejected.append(near_miss(row["label"], rng))
        write_pairs(out_dir / "model_pairs.jsonl", rows, rejected)
        write_pairs(out_dir / "held_out_model_pairs.jsonl", splits["test"],
                    [wrong[0] if wrong else near for wrong, near in zip(test, near["test"])])
    return len(splits["train"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "data")
    parser.add_argument("--near-misses-only", action="store_true",
                        help="only pairs.jsonl and held_out_pairs.jsonl (no sampling from the model)")
    parser.add_argument("--policy", type=Path, default=QUICKSTART / "model",
                        help="the model whose wrong answers are sampled (default: the warm-started quickstart model)")
    args = parser.parse_args(argv)
    count = build(args.out, with_model=not args.near_misses_only, policy=args.policy)
    print(f"wrote the pairs of {count} training problems and of the held-out problems to {args.out}")


if __name__ == "__main__":
    main()
