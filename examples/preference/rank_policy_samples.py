"""How often a reward model ranks the policy's own samples right: for each held-out problem, the quickstart model
samples 8 answers at temperature 1 (as GRPO does), the reward model scores them, and every correct answer is
compared with every wrong one of its problem. Prints the share ranked right (a pairwise AUC) and the sample accuracy.

Usage: python examples/preference/rank_policy_samples.py runs/preference_rm/reward_model [--problems FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

HERE = Path(__file__).resolve().parent
QUICKSTART = HERE.parent / "quickstart"
SAMPLES = 8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reward_model", type=Path)
    parser.add_argument("--problems", type=Path, default=QUICKSTART / "data" / "test.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(QUICKSTART / "model")
    policy = AutoModelForCausalLM.from_pretrained(QUICKSTART / "model").eval()
    scorer = AutoModelForSequenceClassification.from_pretrained(args.reward_model).eval()
    right = compared = correct = sampled = 0
    for line in args.problems.read_text().splitlines():
        row = json.loads(line)
        prompt = tokenizer(row["input"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = policy.generate(torch.tensor([prompt] * SAMPLES), do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, max_new_tokens=8, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
            answers, scores = [], []
            for sequence in out:
                response = sequence[len(prompt):].tolist()
                if tokenizer.eos_token_id in response:  # the sample as the engine reports it: up to its EOS
                    response = response[:response.index(tokenizer.eos_token_id) + 1]
                answers.append(tokenizer.decode(response, skip_special_tokens=True).strip() == row["label"])
                scores.append(scorer(input_ids=torch.tensor([prompt + response])).logits.item())
        correct += sum(answers)
        sampled += len(answers)
        for i in range(SAMPLES):
            for j in range(SAMPLES):
                if answers[i] and not answers[j]:
                    compared += 1
                    right += scores[i] > scores[j]
    print(f"policy samples correct: {correct / sampled:.3f}; correct ranked above wrong: "
          f"{right / max(compared, 1):.3f} of {compared} pairs")


if __name__ == "__main__":
    main()
