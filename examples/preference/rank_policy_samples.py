"""How often a reward model ranks the policy's own samples right: for each held-out problem, the quickstart model
samples 8 answers at temperature 1 (as GRPO does), the reward model scores them, and every correct answer is
compared with every wrong one of its problem. Prints the share ranked right (a pairwise AUC) and the sample accuracy.
Several reward models: each one's share, and the ensemble's as `--rm-path` with several folders makes it (each
member's scores standardised, here by their moments over all the samples, then reduced by --reduce, the
reduction `--rm-ensemble-reduce` applies).

Usage: python examples/preference/rank_policy_samples.py runs/preference_rm/reward_model [MORE ...] [--problems FILE]
       [--reduce mean|min|mean_minus_std] [--std-coef 1.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from relax.rollout.rewards.reward_model import ENSEMBLE_REDUCTIONS, reduce_scores

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "quickstart"
SAMPLES = 8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reward_models", type=Path, nargs="+")
    parser.add_argument("--problems", type=Path, default=QUICKSTART / "data" / "test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reduce", default="mean", choices=ENSEMBLE_REDUCTIONS)
    parser.add_argument("--std-coef", type=float, default=1.0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART / "model")
    policy = AutoModelForCausalLM.from_pretrained(QUICKSTART / "model").eval()
    scorers = [AutoModelForSequenceClassification.from_pretrained(path).eval() for path in args.reward_models]
    problems = []  # per problem: (whether each answer is right, each scorer's scores)
    for line in args.problems.read_text().splitlines():
        row = json.loads(line)
        prompt = tokenizer(row["input"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = policy.generate(torch.tensor([prompt] * SAMPLES), do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
            answers, scores = [], [[] for _ in scorers]
            for sequence in out:
                response = sequence[len(prompt):].tolist()
                if tokenizer.eos_token_id in response:  # the sample as the engine reports it: up to its EOS
                    response = response[:response.index(tokenizer.eos_token_id) + 1]
                answers.append(tokenizer.decode(response, skip_special_tokens=True).strip() == row["label"])
                for own, scorer in zip(scores, scorers):
                    own.append(scorer(input_ids=torch.tensor([prompt + response])).logits.item())
        problems.append((answers, scores))
    correct = sum(sum(answers) for answers, _ in problems)
    print(f"policy samples correct: {correct / (SAMPLES * len(problems)):.3f}")
    for index, path in enumerate(args.reward_models):
        right, compared = ranked_right([(answers, scores[index]) for answers, scores in problems])
        print(f"{path}: correct ranked above wrong: {right / max(compared, 1):.3f} of {compared} pairs")
    if len(scorers) > 1:
        moments = [(statistics.fmean(all_scores), statistics.stdev(all_scores)) for all_scores in
                   ([score for _, scores in problems for score in scores[i]] for i in range(len(scorers)))]
        reduced = []
        for answers, scores in problems:
            standardised = [[(score - mean) / std for score in own] for own, (mean, std) in zip(scores, moments)]
            reduced.append((answers, [reduce_scores(list(column), args.reduce, args.std_coef)
                                      for column in zip(*standardised)]))
        right, compared = ranked_right(reduced)
        print(f"ensemble ({args.reduce}): correct ranked above wrong: {right / max(compared, 1):.3f} of {compared} "
              "pairs")


def ranked_right(problems: list[tuple[list[bool], list[float]]]) -> tuple[int, int]:
    """How many (correct, wrong) answer pairs of one problem the scores order right, of how many."""
    right = compared = 0
    for answers, scores in problems:
        for i in range(len(answers)):
            for j in range(len(answers)):
                if answers[i] and not answers[j]:
                    compared += 1
                    right += scores[i] > scores[j]
    return right, compared


if __name__ == "__main__":
    main()
