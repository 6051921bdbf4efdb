"""What the tool-use examples share: a tiny chat model with tool markup, a supervised warm start on tool traces, and
the greedy multi-turn evaluation that plays episodes exactly as relax's tool environment does.

Used by ``examples/agentic_calculator/build_task.py`` (a calculator) and ``examples/search_r1/build_task.py`` (a
BM25 search tool). Each example owns its task (data, demonstrator, reward); this module owns nothing task-specific:
every function is handed the tools and the grading function.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quickstart"))
from build_quickstart import build_tokenizer  # noqa: E402  (the quickstart's character tokenizer)

from relax.data.sft_dataset import conversation_segments  # noqa: E402
from relax.rollout.agentic.multi_turn import ObservationEncoder  # noqa: E402
from relax.rollout.agentic.tool_env import ToolEnv  # noqa: E402
from relax.rollout.agentic.tool_parser import get_tool_call_parser  # noqa: E402
from relax.rollout.agentic.tools import Tool  # noqa: E402

TOOL_MARKUP_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOL_CALL_PARSER = "hermes"

# ChatML without newlines between turns, so a turn is exactly what the model writes, ending at <|im_end|> (its eos),
# and an observation appended by the multi-turn loop starts with <|im_start|>. The tools are listed by name only: a
# character-level model pays one token per character, and the full JSON schema would triple the prompt. The template
# leaves a tool message's content as it is: relax's tool environment already wraps results in <tool_response>.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: "
    "{%- for tool in tools %} {{ tool.function.name }}{%- endfor %}<|im_end|>{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SFT_BATCH_SIZE = 32
SFT_LR = 1e-3
SFT_WARMUP_STEPS = 10


def make_deterministic(seed: int) -> None:
    """Same seed, one thread, deterministic kernels: re-running a build rewrites identical files."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def build_chat_tokenizer() -> PreTrainedTokenizerFast:
    """The quickstart's character tokenizer plus the tool markup as single tokens (as in Qwen3's real vocabulary)
    and the chat template above."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(TOOL_MARKUP_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tool_call_text(tool: Tool, **arguments: str) -> str:
    """A Hermes tool call, as the model writes it (compact JSON: fewer characters to learn and to generate)."""
    call = {"name": tool.name, "arguments": arguments}
    return "<tool_call>" + json.dumps(call, separators=(",", ":")) + "</tool_call>"


def answer_text(answer: str) -> str:
    return f"<answer>{answer}</answer>"


def tool_specs(row: dict, tools: dict[str, Tool]) -> list[dict]:
    """The specs the chat template gets for a row's tool names, as relax's dataset loader passes them."""
    return [tools[name].spec() for name in row["tools"]]


def answered_from_memory(picked: list[bool], call_every: int) -> list[bool]:
    """The imperfect demonstrator's choice: the traces a task's rule picked answer without the tool, except every
    ``call_every``-th of them (so the warm model keeps a chance of calling there that sampled RL episodes can find)."""
    rank = [sum(picked[: i + 1]) - 1 for i in range(len(picked))]
    return [is_picked and rank[i] % call_every != 0 for i, is_picked in enumerate(picked)]


def warm_start_arguments(description: str, default_out: Path, sft_steps: int, sft_traces: int,
                         memory_call_every: int) -> argparse.ArgumentParser:
    """The command line the tool examples' builders share; each adds its own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out, help="output folder")
    parser.add_argument("--watch-every", type=int, default=None,
                        help="also print held-out figures every this many SFT steps (for tuning)")
    parser.add_argument("--sft-steps", type=int, default=sft_steps,
                        help=f"warm-start steps (default {sft_steps}): the dial of how good the start model is")
    parser.add_argument("--sft-traces", type=int, default=sft_traces, help=f"warm-start traces (default {sft_traces})")
    parser.add_argument("--memory-call-every", type=int, default=memory_call_every,
                        help=f"the demonstrator still calls the tool on every this-many-th problem its rule answers "
                             f"from memory (default {memory_call_every})")
    return parser


# ---------------------------------------------------------------------------------------------------------- SFT


def encode_trace(tokenizer: PreTrainedTokenizerFast, row: dict, tools: dict[str, Tool]) -> tuple[list[int], list[int]]:
    """Token ids of a trace and their labels (-100 outside the assistant turns), cut by relax's SFT code so the warm
    start learns exactly what ``relax train --loss-type sft`` would."""
    segments = conversation_segments(row["input"], tokenizer, {"tools": tool_specs(row, tools)})
    ids, labels = [], []
    for text, learn in segments:
        segment_ids = tokenizer.encode(text)
        ids += segment_ids
        labels += segment_ids if learn else [-100] * len(segment_ids)
    return ids, labels


def collate(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in encoded)
    return {
        "input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in encoded]),
        "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in encoded]),
        "labels": torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in encoded]),
    }


def run_sft(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, traces: list[dict], tools: dict[str, Tool],
            rng: random.Random, steps: int, on_step: Callable[[int], None] | None = None) -> None:
    """AdamW over the few traces, reshuffled each epoch; ``on_step(step)`` lets the caller watch progress. The
    learning rate warms up, then stays constant, so the model after N steps does not depend on ``steps``."""
    encoded = [encode_trace(tokenizer, row, tools) for row in traces]
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / SFT_WARMUP_STEPS))
    order: list[int] = []
    for step in range(steps):
        if len(order) < SFT_BATCH_SIZE:
            epoch = list(range(len(encoded)))
            rng.shuffle(epoch)
            order += epoch
        batch, order = [encoded[i] for i in order[:SFT_BATCH_SIZE]], order[SFT_BATCH_SIZE:]
        model.train()
        loss = model(**collate(batch, tokenizer.pad_token_id)).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"sft step {step:4d}  loss {loss.item():.4f}", flush=True)
        if on_step is not None:
            on_step(step + 1)
    model.eval()


# --------------------------------------------------------------------------------------------------- evaluation


def prompt_ids(tokenizer: PreTrainedTokenizerFast, row: dict, tools: dict[str, Tool], suffix: str = "") -> list[int]:
    text = tokenizer.apply_chat_template(row["input"], tools=tool_specs(row, tools), add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text + suffix)


def tool_step(encoder: ObservationEncoder, tools: list[Tool], turn_ids: list[int],
              turn_text: str) -> tuple[bool, list[int]]:
    """Relax's tool environment on one model turn: (did a tool run successfully, the observation tokens the
    multi-turn loop appends; none when the turn made no call and so ends the episode)."""
    env = ToolEnv(tools, get_tool_call_parser(TOOL_CALL_PARSER), timeout_s=5.0, chat_template=CHAT_TEMPLATE)
    observation, done, info = asyncio.run(env.step(turn_text))
    succeeded = info["tool_stats"]["successful_calls"] > 0
    if done:
        return succeeded, []
    ids, _ = encoder.encode(env.format_observation(observation))
    return succeeded, encoder.close_turn(turn_ids) + ids


@torch.no_grad()
def greedy_turns(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, contexts: list[list[int]],
                 max_new_tokens: int) -> list[list[int]]:
    """One greedy model turn per context: the new ids up to and including eos (all of them when eos never came)."""
    width = max(len(ids) for ids in contexts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in contexts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in contexts])
    generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                               max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    turns = []
    for row in generated[:, width:].tolist():
        turns.append(row[: row.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in row else row)
    return turns


def evaluate_with_tool(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: list[dict],
                       tools: dict[str, Tool], final_answer: Callable[[str], str | None],
                       turn_max_tokens: int) -> dict:
    """Greedy two-turn episodes as the RL run plays them (``--max-turns 2``): held-out accuracy, the share of
    episodes whose tool call ran successfully and the share that called at all."""
    encoder = ObservationEncoder(tokenizer, {})
    contexts = [prompt_ids(tokenizer, row, tools) for row in rows]
    call_turns = greedy_turns(model, tokenizer, contexts, turn_max_tokens)
    steps = [tool_step(encoder, [tools[name] for name in row["tools"]], turn,
                       tokenizer.decode(turn, skip_special_tokens=True)) for row, turn in zip(rows, call_turns)]
    answers = [final_answer(tokenizer.decode(turn, skip_special_tokens=True)) for turn in call_turns]
    continuing = [i for i, (_, observation) in enumerate(steps) if observation]
    if continuing:
        second = greedy_turns(model, tokenizer, [contexts[i] + call_turns[i] + steps[i][1] for i in continuing],
                              turn_max_tokens)
        for i, turn in zip(continuing, second):
            answers[i] = final_answer(tokenizer.decode(turn, skip_special_tokens=True))
    correct = sum(answer == row["label"] for answer, row in zip(answers, rows))
    return {"accuracy": correct / len(rows), "tool_call_success": sum(ok for ok, _ in steps) / len(rows),
            "called_tool": len(continuing) / len(rows)}


def evaluate_without_tool(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, rows: list[dict],
                          tools: dict[str, Tool], final_answer: Callable[[str], str | None],
                          turn_max_tokens: int) -> float:
    """Accuracy when the model must answer by itself: its first turn is forced to open with ``<answer>``."""
    turns = greedy_turns(model, tokenizer, [prompt_ids(tokenizer, row, tools, "<answer>") for row in rows],
                         turn_max_tokens)
    answers = [final_answer("<answer>" + tokenizer.decode(turn, skip_special_tokens=True)) for turn in turns]
    return sum(answer == row["label"] for answer, row in zip(answers, rows)) / len(rows)
