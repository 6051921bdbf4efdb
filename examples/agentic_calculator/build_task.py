"""Build the agentic calculator task offline, deterministically: data, a tiny Qwen3 with a chat template, a warm start.

The task is exact multiplication of 3-4 digit numbers (products of 5-8 digits). A 2.4 M-parameter model cannot
multiply such numbers itself (its greedy accuracy without the tool is printed, and is 0), but it can learn to hand the
product to a calculator tool and copy the result back:

    user:      What is 4821*937? Use the calculator, then answer <answer>N</answer>.
    assistant: <tool_call>{"name":"calculator","arguments":{"expression":"4821*937"}}</tool_call>
    tool:      <tool_response>\n4517277\n</tool_response>
    assistant: <answer>4517277</answer>

The warm start is supervised training on a few such traces (loss on the assistant turns only, cut into turns by relax's
own multi-turn SFT code) from an imperfect demonstrator: on about a quarter of the traces (first operand even) it
answers from memory instead of calling the tool. The warm model copies that habit, cannot multiply, and is wrong on
those prompts; it also copies operands wrongly now and then. Held-out accuracy and the tool-call rate therefore start
low, and multi-turn GRPO with an exact-match reward has room to raise both (see README.md).

Outputs (under ``--out``, default: this script's folder):
  data/train.jsonl   RL prompts: {"input": [user message], "tools": ["calculator"], "label": "4517277"}
  data/test.jsonl    held-out problems, disjoint from the RL prompts and the SFT traces; the same rows plus
                     "metadata": {"split": "test"}
  data/sft.jsonl     the warm-start traces, as relax SFT conversation rows
  model/             Qwen3ForCausalLM + tokenizer (with the chat template) + generation_config.json

Usage: python examples/agentic_calculator/build_task.py [--out DIR] [--watch-every N] [--sft-steps N]
"""

from __future__ import annotations

import random
import shutil
import sys
import time
from pathlib import Path

from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quickstart"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agentic_common"))
import tool_warm_start as warm  # the chat tokenizer, the warm start and the episode evaluation shared with search_r1
from build_quickstart import build_model, write_jsonl  # the shared tiny Qwen3
from reward import final_answer  # graded as the RL reward grades

from relax.rollout.agentic.tool_parser import format_tool_responses
from relax.rollout.agentic.tools import calculator_tool

SEED = 4321

# Operands of 3 or 4 digits (each length equally likely): products of 5 to 8 digits, far beyond what the tiny model
# can compute (it does not even add 4-digit numbers reliably, see the quickstart), trivial for the calculator.
DIGIT_LENGTHS = (3, 4)
NUM_TRAIN = 4000
NUM_TEST = 200

# The dial of the warm start: few traces, a fixed number of steps. Chosen so the held-out accuracy with the tool starts
# low (the script prints it) and the mistakes left are the ones RL can fix: copying digits and the call format.
NUM_SFT_TRACES = 200
SFT_STEPS = 200
# The demonstrator can be imperfect: on the problems a rule picks it answers from memory, without the calculator (right,
# in its traces). The warm model learns that habit but cannot multiply, so on those prompts it guesses and is always
# wrong: room for RL to make it call the tool there too. "none": every trace calls the tool. "3x3": both operands have
# 3 digits. "even" (the default): the first operand is even, a cue unrelated to how hard the call is to copy.
MEMORY_RULES = {
    "none": lambda pair: False,
    "3x3": lambda pair: all(len(str(operand)) == 3 for operand in pair),
    "even": lambda pair: pair[0] % 2 == 0,
}
MEMORY_RULE = "even"
# ...but every this-many-th such problem it still hands to the calculator, so the warm model keeps a chance of calling
# the tool there that sampled RL episodes can find (on 3x3 problems the chance that a warm model's first token opens
# a call was 0.05% with no such trace, 8.5% with every third, 30% with every second).
MEMORY_CALL_EVERY = 2

# The per-turn token budget of the builder's own greedy evaluation: config.yaml's --rollout-max-response-len.
# A call takes about 62 tokens and an answer up to 26.
TURN_MAX_TOKENS = 72

CALCULATOR = calculator_tool()  # relax's built-in tool: the RL run executes exactly this one
TOOLS = {CALCULATOR.name: CALCULATOR}
QUESTION = "What is {a}*{b}? Use the calculator, then answer <answer>N</answer>."

# ----------------------------------------------------------------------------------------------------------- data


def sample_operand(rng: random.Random) -> int:
    digits = rng.choice(DIGIT_LENGTHS)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def sample_disjoint_problems(rng: random.Random, sizes: list[int]) -> list[list[tuple[int, int]]]:
    """Distinct (a, b) pairs cut into groups of the given sizes, so the test set shares no problem with the RL prompts
    or the SFT traces."""
    seen: set[tuple[int, int]] = set()
    pairs: list[tuple[int, int]] = []
    while len(pairs) < sum(sizes):
        pair = (sample_operand(rng), sample_operand(rng))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    groups, start = [], 0
    for size in sizes:
        groups.append(pairs[start : start + size])
        start += size
    return groups


def prompt_row(pair: tuple[int, int]) -> dict:
    """An RL prompt row: the user turn, the tool offered (by name; relax expands it to the tool's spec), the exact
    product as the label."""
    a, b = pair
    return {"input": [{"role": "user", "content": QUESTION.format(a=a, b=b)}], "tools": [CALCULATOR.name],
            "label": str(a * b)}


def direct_row(pair: tuple[int, int]) -> dict:
    """A trace that answers at once, without the calculator."""
    a, b = pair
    return {"input": prompt_row(pair)["input"] + [{"role": "assistant", "content": warm.answer_text(str(a * b))}],
            "tools": [CALCULATOR.name]}


def trace_row(pair: tuple[int, int]) -> dict:
    """A successful tool-use trace for SFT: call the calculator, read its result, answer with it."""
    a, b = pair
    messages = prompt_row(pair)["input"] + [
        {"role": "assistant", "content": warm.tool_call_text(CALCULATOR, expression=f"{a}*{b}")},
        {"role": "tool", "content": format_tool_responses([str(a * b)])},  # as the tool environment writes it
        {"role": "assistant", "content": warm.answer_text(str(a * b))},
    ]
    return {"input": messages, "tools": [CALCULATOR.name]}


# --------------------------------------------------------------------------------------------------------- main


def answered_from_memory(pairs: list[tuple[int, int]], rule: str, call_every: int) -> list[bool]:
    """Which traces answer without the calculator: those ``MEMORY_RULES[rule]`` picks, except every
    ``call_every``-th of them."""
    return warm.answered_from_memory([MEMORY_RULES[rule](pair) for pair in pairs], call_every)


def evaluate_with_tool(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: list[dict]) -> dict:
    return warm.evaluate_with_tool(model, tokenizer, rows, TOOLS, final_answer, TURN_MAX_TOKENS)


def build(out_dir: Path, watch_every: int | None = None, sft_steps: int = SFT_STEPS,
          sft_traces: int = NUM_SFT_TRACES, memory_rule: str = MEMORY_RULE,
          memory_call_every: int = MEMORY_CALL_EVERY) -> dict:
    """Write the data and the warm-started model under ``out_dir``; return the held-out measurements."""
    warm.make_deterministic(SEED)
    rng = random.Random(SEED)
    train_pairs, test_pairs, sft_pairs = sample_disjoint_problems(rng, [NUM_TRAIN, NUM_TEST, sft_traces])
    # The split lets the reward log tell held-out episodes from training ones (see reward.py).
    test_rows = [{**prompt_row(p), "metadata": {"split": "test"}} for p in test_pairs]
    from_memory = answered_from_memory(sft_pairs, memory_rule, memory_call_every)
    traces = [direct_row(p) if direct else trace_row(p) for p, direct in zip(sft_pairs, from_memory)]
    print(f"SFT traces: {len(traces)}, {sum(from_memory)} of them answered from memory", flush=True)
    write_jsonl(out_dir / "data" / "train.jsonl", [prompt_row(p) for p in train_pairs])
    write_jsonl(out_dir / "data" / "test.jsonl", test_rows)
    write_jsonl(out_dir / "data" / "sft.jsonl", traces)

    tokenizer = warm.build_chat_tokenizer()
    model = build_model(tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}", flush=True)

    def watch(step: int) -> None:  # tuning aid: held-out figures during the warm start
        if watch_every and step % watch_every == 0:
            print(f"  step {step}: {evaluate_with_tool(model, tokenizer, test_rows)}", flush=True)

    warm.run_sft(model, tokenizer, traces, TOOLS, rng, steps=sft_steps, on_step=watch)

    model_dir = out_dir / "model"
    shutil.rmtree(model_dir, ignore_errors=True)  # no stale files from an earlier configuration
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return {**evaluate_with_tool(model, tokenizer, test_rows),
            "accuracy_without_tool": warm.evaluate_without_tool(model, tokenizer, test_rows, TOOLS, final_answer,
                                                                TURN_MAX_TOKENS)}


def main(argv: list[str] | None = None) -> None:
    parser = warm.warm_start_arguments(__doc__.split("\n\n")[0], Path(__file__).resolve().parent, SFT_STEPS,
                                       NUM_SFT_TRACES, MEMORY_CALL_EVERY)
    parser.add_argument("--memory-rule", choices=sorted(MEMORY_RULES), default=MEMORY_RULE,
                        help=f"which traces answer without the tool (default {MEMORY_RULE}; see MEMORY_RULES)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    measured = build(args.out, args.watch_every, args.sft_steps, args.sft_traces, args.memory_rule,
                     args.memory_call_every)
    print(f"held-out ({NUM_TEST} problems, greedy, two turns): accuracy {measured['accuracy']:.1%}, "
          f"episodes with a call {measured['called_tool']:.1%}, "
          f"valid calculator calls {measured['tool_call_success']:.1%}; "
          f"accuracy without the tool {measured['accuracy_without_tool']:.1%}")
    print(f"wrote {args.out}/data and {args.out}/model in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
