"""Procedural math word problems for SmolLM2-135M-Instruct, GSM8K-style, offline and deterministic.

Four difficulty levels, each a family of templates filled with random names, objects and numbers:

  level 1  one operation on small numbers        "What is 27 + 45?"
  level 2  a one-step word problem               "Mia has 12 apples. She buys 7 more. How many apples does she have?"
  level 3  a two-step word problem               buy, then give away / share / pay for
  level 4  a three-step word problem             rates, groups and change, as in GSM8K

Every answer is a whole number >= 0. The training prompts and the held-out test set are drawn from disjoint seeds and
any test question that also appears among the training prompts is dropped, so the test set is never seen in
training. Prompts are chat messages (the model's chat template is applied at rollout) ending "Answer with a number.",
as the model is asked in its own model card's style; the ``math`` reward grades the response (math-verify reads the
final statement's number; a ``\\boxed{}`` answer, should the model learn to give one, is read first).

Outputs (under ``--out``, default ``examples/smollm2_math/data``):
  train.jsonl   {"input": [{"role": "user", "content": ...}], "label": "42", "metadata": {"level": 2}}
  test.jsonl    the held-out problems, the same fields
  train_level1.jsonl, test_level1.jsonl   the same rows of level 1 only (the CPU configuration's)

Usage: python examples/smollm2_math/build_data.py [--out DIR] [--train N] [--test N]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

TRAIN_SEED = 20261203
TEST_SEED = 777
INSTRUCTION = "Answer with a number."

NAMES = ("Mia", "Noah", "Ava", "Liam", "Emma", "Lucas", "Sofia", "Omar", "Yuki", "Ravi", "Lena", "Tom", "Zara", "Ivan",
         "Chen", "Amara", "Diego", "Nora", "Sam", "Leila")
OBJECTS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "eggs",
           "balloons", "candles", "buttons", "toy cars", "oranges")
CONTAINERS = (("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("jar", "jars"), ("crate", "crates"))

Problem = tuple[str, int]


def _level1(rng: random.Random) -> Problem:
    kind = rng.choice("+-*")
    if kind == "+":
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        return f"What is {a} + {b}?", a + b
    if kind == "-":
        a = rng.randint(10, 90)
        b = rng.randint(1, a)
        return f"What is {a} - {b}?", a - b
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    return f"What is {a} * {b}?", a * b


def _level2(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(3, 40), rng.randint(2, 30)
        return f"{name} has {a} {obj}. {name} buys {b} more. How many {obj} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {obj} and gives {b} of them to a friend. How many {obj} are left?", a - b
    if kind == 2:
        (box, boxes), n, k = rng.choice(CONTAINERS), rng.randint(2, 9), rng.randint(2, 12)
        return f"There are {n} {boxes}. Each {box} holds {k} {obj}. How many {obj} are there in all?", n * k
    n, k = rng.randint(2, 8), rng.randint(2, 10)
    return f"{name} shares {n * k} {obj} equally among {n} friends. How many {obj} does each friend get?", k


def _level3(rng: random.Random) -> Problem:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(5, 40), rng.randint(5, 40)
        c = rng.randint(1, a + b - 1)
        return (f"{name} picks {a} {obj} in the morning and {b} in the afternoon, then gives away {c}. "
                f"How many {obj} does {name} have left?"), a + b - c
    if kind == 1:
        (box, boxes), n, k, extra = rng.choice(CONTAINERS), rng.randint(2, 8), rng.randint(3, 12), rng.randint(1, 20)
        return (f"{name} has {n} {boxes} with {k} {obj} in each {box}, and {extra} loose {obj}. "
                f"How many {obj} does {name} have?"), n * k + extra
    if kind == 2:
        price, n = rng.randint(2, 9), rng.randint(2, 9)
        paid = price * n + rng.randint(0, 20)
        return (f"One notebook costs ${price}. {name} buys {n} notebooks and pays with ${paid}. "
                f"How many dollars of change does {name} get?"), paid - price * n
    n, k = rng.randint(2, 6), rng.randint(2, 8)
    eaten = rng.randint(1, n * k - 1)
    return (f"{name} bakes {n} trays of {k} cookies and eats {eaten} of them. "
            f"How many cookies are left?"), n * k - eaten


def _level4(rng: random.Random) -> Problem:
    name, other = rng.sample(NAMES, 2)
    kind = rng.randrange(3)
    if kind == 0:
        per_hour, hours, days = rng.randint(3, 12), rng.randint(2, 6), rng.randint(2, 5)
        spent = rng.randint(1, per_hour * hours * days - 1)
        return (f"{name} earns ${per_hour} an hour and works {hours} hours a day for {days} days. "
                f"Then {name} spends ${spent} on a gift. How many dollars does {name} have left?"), \
            per_hour * hours * days - spent
    if kind == 1:
        a = rng.randint(4, 30)
        factor, extra = rng.randint(2, 4), rng.randint(1, 15)
        return (f"{name} has {a} marbles. {other} has {factor} times as many marbles as {name}, plus {extra}. "
                f"How many marbles do they have together?"), a + factor * a + extra
    (_, boxes), n, k = rng.choice(CONTAINERS), rng.randint(3, 9), rng.randint(4, 12)
    sold, per = rng.randint(1, n - 1), rng.randint(1, min(6, k - 1))
    return (f"A shop has {n} {boxes} of {k} oranges. It sells {sold} {boxes} and then {per} more oranges. "
            f"How many oranges are left?"), (n - sold) * k - per


LEVELS: dict[int, Callable[[random.Random], Problem]] = {1: _level1, 2: _level2, 3: _level3, 4: _level4}
# The CPU configuration's subset (the same rows, filtered): the level a 135M model learns first (19% -> 88% in 20
# steps on the GPU), so that two cores show the reward rising within minutes.
EASY_LEVELS = (1,)


def problems(count: int, seed: int) -> list[dict]:
    """`count` rows, the levels in equal shares (round robin), from one seeded generator."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        level = 1 + index % len(LEVELS)
        question, answer = LEVELS[level](rng)
        assert answer >= 0, (question, answer)
        rows.append({"input": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}], "label": str(answer),
                     "metadata": {"level": level}})
    return rows


def build(out: Path, num_train: int = 8000, num_test: int = 400) -> tuple[list[dict], list[dict]]:
    train = problems(num_train, TRAIN_SEED)
    seen = {row["input"][0]["content"] for row in train}
    test = [row for row in problems(num_test * 2, TEST_SEED) if row["input"][0]["content"] not in seen]
    # Keep the levels balanced after dropping repeats, and interleaved (1, 2, 3, 4, 1, ...) so that any prefix of the
    # file (`test.jsonl@[0:100]`, the CPU configuration's evaluation) is balanced too.
    by_level = [[r for r in test if r["metadata"]["level"] == level][: num_test // len(LEVELS)] for level in LEVELS]
    test = [row for group in zip(*by_level) for row in group]
    easy = lambda rows: [row for row in rows if row["metadata"]["level"] in EASY_LEVELS]  # noqa: E731
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("test.jsonl", test), ("train_level1.jsonl", easy(train)),
                       ("test_level1.jsonl", easy(test))):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return train, test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--train", type=int, default=8000)
    parser.add_argument("--test", type=int, default=400)
    args = parser.parse_args()
    train, test = build(args.out, args.train, args.test)
    print(f"{len(train)} training prompts, {len(test)} held-out problems -> {args.out}")


if __name__ == "__main__":
    main()
