"""Build the Search-R1-style task offline, deterministically: a corpus, questions that need a lookup, a tiny Qwen3 with
a chat template, and a warm start.

The corpus describes made-up towns, one passage each, and every town has a twin that its passage names:

    Velorn: code 48213. Twin town: Quashi.

A question asks for a town's code. Codes are random, so the answer cannot be known without the search tool (the
model's accuracy without it is printed, and is 0 on the held-out towns, which no prompt or trace ever names). A search
for the town returns, by BM25 with the passage's title indexed beside its text, its own passage first and then the
passage of the town whose twin it is: the model has to copy the name exactly into the query (a misspelt name finds
nothing) and copy the code of the first result, not the distractor's.

    user:      What is the code of Velorn? Search, then answer <answer>N</answer>.
    assistant: <tool_call>{"name":"search","arguments":{"query":"Velorn"}}</tool_call>
    tool:      <tool_response>\\n1. Velorn: code 48213. Twin town: Quashi.\\n2. Bimaro: code 22222. ...</tool_response>
    assistant: <answer>48213</answer>

The warm start, as in the calculator example, is supervised training on a few traces of an imperfect demonstrator:
for towns whose name has an even number of letters it answers from memory (right in its traces, hopeless for a model
that has not read the passage), except on every second such town. Held-out accuracy and the search rate therefore
start low, and multi-turn GRPO with an exact-match reward has room to raise both (see README.md).

Outputs (under ``--out``, default: this script's folder):
  data/corpus.jsonl  the passages the search tool indexes: {"title": "Velorn", "text": "Velorn: code 48213. ..."}
  data/train.jsonl   RL prompts: {"input": [user message], "tools": ["search"], "label": "48213"}
  data/test.jsonl    held-out questions about towns no prompt or trace names; the same rows plus
                     "metadata": {"split": "test"}
  data/sft.jsonl     the warm-start traces, as relax SFT conversation rows
  model/             Qwen3ForCausalLM + tokenizer (with the chat template) + generation_config.json

Usage: python examples/search_r1/build_task.py [--out DIR] [--watch-every N] [--sft-steps N]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "quickstart"))
sys.path.insert(0, str(HERE.parent / "agentic_common"))
import tool_warm_start as warm  # noqa: E402  (the chat tokenizer, warm start and evaluation shared with the calculator)
from build_quickstart import build_model, write_jsonl  # noqa: E402  (the shared tiny Qwen3)
from reward_log import final_answer  # noqa: E402  (graded as the RL reward grades)

from relax.rollout.agentic.tool_parser import format_tool_responses  # noqa: E402
from relax.rollout.agentic.tools import Tool  # noqa: E402

SEED = 2718

NUM_TRAIN = 2000
NUM_TEST = 200
NUM_SFT_TRACES = 200
SFT_STEPS = 300
CODE_DIGITS = 5
# The imperfect demonstrator (see the module doc): towns with an even-length name are answered from memory, except
# every MEMORY_CALL_EVERY-th of them.
MEMORY_CALL_EVERY = 2

# The per-turn token budget: config.yaml's --rollout-max-response-len. A call takes about 55 tokens, an answer 23.
TURN_MAX_TOKENS = 64

QUESTION = "What is the code of {name}? Search, then answer <answer>N</answer>."
ONSETS = ["b", "br", "d", "f", "g", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "z"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "n", "r", "l", "s", "x"]


def build_search_tool(corpus: Path) -> Tool:
    """The recipe's search tool over ``corpus``, as ``--tools search_tool:search`` loads it in the RL run."""
    os.environ["SEARCH_R1_CORPUS"] = str(corpus)
    sys.path.insert(0, str(HERE))
    from relax.rollout.agentic.tools import load_user_tool

    return load_user_tool("search_tool:search")


# ----------------------------------------------------------------------------------------------------------- data


def town_names(rng: random.Random, count: int) -> list[str]:
    """Distinct pronounceable names of 2-3 syllables (5-9 letters), so a name is one BM25 term."""
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < count:
        syllables = [rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.choice((2, 3)))]
        name = ("".join(syllables) + rng.choice(CODAS)).capitalize()
        if name not in seen and 5 <= len(name) <= 9:
            seen.add(name)
            names.append(name)
    return names


def build_towns(rng: random.Random, count: int) -> dict[str, dict]:
    """name -> {"code", "twin"}: a random code of CODE_DIGITS digits, and as twin the next town of one random cycle
    through all of them, so every name is in exactly two passages, its own and its predecessor's: a search for it
    always returns both (more towns naming it could push its own passage out of the top results)."""
    names = town_names(rng, count)
    cycle = names[:]
    rng.shuffle(cycle)
    twin = {name: cycle[(i + 1) % len(cycle)] for i, name in enumerate(cycle)}
    return {name: {"code": str(rng.randint(10 ** (CODE_DIGITS - 1), 10**CODE_DIGITS - 1)), "twin": twin[name]}
            for name in names}


def passage(name: str, town: dict) -> str:
    return f"{name}: code {town['code']}. Twin town: {town['twin']}."


def prompt_row(name: str, town: dict, tool: Tool) -> dict:
    return {"input": [{"role": "user", "content": QUESTION.format(name=name)}], "tools": [tool.name],
            "label": town["code"]}


def direct_row(name: str, town: dict, tool: Tool) -> dict:
    """A trace that answers at once, without searching."""
    return {"input": prompt_row(name, town, tool)["input"]
            + [{"role": "assistant", "content": warm.answer_text(town["code"])}], "tools": [tool.name]}


def trace_row(name: str, town: dict, tool: Tool) -> dict:
    """A successful search trace: search the name, read the results (the tool's real output), answer the code."""
    messages = prompt_row(name, town, tool)["input"] + [
        {"role": "assistant", "content": warm.tool_call_text(tool, query=name)},
        {"role": "tool", "content": format_tool_responses([tool.function(query=name)])},
        {"role": "assistant", "content": warm.answer_text(town["code"])},
    ]
    return {"input": messages, "tools": [tool.name]}


# --------------------------------------------------------------------------------------------------------- main


def build(out_dir: Path, watch_every: int | None = None, sft_steps: int = SFT_STEPS,
          sft_traces: int = NUM_SFT_TRACES, memory_call_every: int = MEMORY_CALL_EVERY) -> dict:
    """Write the corpus, the data and the warm-started model under ``out_dir``; return the held-out measurements."""
    warm.make_deterministic(SEED)
    rng = random.Random(SEED)
    towns = build_towns(rng, NUM_TRAIN + NUM_TEST + sft_traces)
    corpus = out_dir / "data" / "corpus.jsonl"
    write_jsonl(corpus, [{"title": name, "text": passage(name, town)} for name, town in towns.items()])
    tool = build_search_tool(corpus)
    tools = {tool.name: tool}

    names = list(towns)
    train, test, sft = (names[:NUM_TRAIN], names[NUM_TRAIN : NUM_TRAIN + NUM_TEST], names[NUM_TRAIN + NUM_TEST :])
    # The split lets the reward log tell held-out episodes from training ones (see reward.py).
    test_rows = [{**prompt_row(name, towns[name], tool), "metadata": {"split": "test"}} for name in test]
    from_memory = warm.answered_from_memory([len(name) % 2 == 0 for name in sft], memory_call_every)
    traces = [direct_row(name, towns[name], tool) if direct else trace_row(name, towns[name], tool)
              for name, direct in zip(sft, from_memory)]
    print(f"corpus: {len(towns)} passages; SFT traces: {len(traces)}, {sum(from_memory)} of them answered from memory",
          flush=True)
    write_jsonl(out_dir / "data" / "train.jsonl", [prompt_row(name, towns[name], tool) for name in train])
    write_jsonl(out_dir / "data" / "test.jsonl", test_rows)
    write_jsonl(out_dir / "data" / "sft.jsonl", traces)

    tokenizer = warm.build_chat_tokenizer()
    model = build_model(tokenizer)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(tokenizer)}", flush=True)

    def evaluate() -> dict:
        return warm.evaluate_with_tool(model, tokenizer, test_rows, tools, final_answer, TURN_MAX_TOKENS)

    def watch(step: int) -> None:  # tuning aid: held-out figures during the warm start
        if watch_every and step % watch_every == 0:
            print(f"  step {step}: {evaluate()}", flush=True)

    warm.run_sft(model, tokenizer, traces, tools, rng, steps=sft_steps, on_step=watch)

    model_dir = out_dir / "model"
    shutil.rmtree(model_dir, ignore_errors=True)  # no stale files from an earlier configuration
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    measured = {**evaluate(), "accuracy_without_tool": warm.evaluate_without_tool(
        model, tokenizer, test_rows, tools, final_answer, TURN_MAX_TOKENS)}
    (out_dir / "data" / "warm_start.json").write_text(json.dumps(measured, indent=2) + "\n")
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = warm.warm_start_arguments(__doc__.split("\n\n")[0], HERE, SFT_STEPS, NUM_SFT_TRACES,
                                       MEMORY_CALL_EVERY)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    measured = build(args.out, args.watch_every, args.sft_steps, args.sft_traces, args.memory_call_every)
    print(f"held-out ({NUM_TEST} towns, greedy, two turns): accuracy {measured['accuracy']:.1%}, "
          f"episodes with a search {measured['called_tool']:.1%}, "
          f"successful searches {measured['tool_call_success']:.1%}; "
          f"accuracy without the tool {measured['accuracy_without_tool']:.1%}")
    print(f"wrote {args.out}/data and {args.out}/model in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
