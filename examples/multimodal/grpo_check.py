"""A self-contained GRPO smoke check of a built task (plain torch + HF generate, no relax): loads the saved model
folder with the Auto classes, reads the jsonl rows and their media files (paths relative to the jsonl folder), and
runs on-policy GRPO (one update per step, group-normalised exact-match rewards), printing the held-out greedy
accuracy every ``--eval-every`` steps and the time per step. It exists to show the warm-started assets leave RL
headroom; the real training runs through ``relax train --config <task>/config.yaml``.

Usage: python examples/multimodal/grpo_check.py --task shapes|tones [--steps 200] [--lr 1e-4] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mm_common import no_video, placeholder_ids, set_threads


def load_task(task: str, folder: Path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(folder / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    if task == "shapes":
        from PIL import Image
        from transformers import AutoImageProcessor, Qwen2_5_VLProcessor

        processor = no_video(Qwen2_5_VLProcessor)(
            image_processor=AutoImageProcessor.from_pretrained(folder / "model"), tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
        media_key, kind, kwarg = "images", "image", "images"
        load_media = lambda path: Image.open(path).convert("RGB")
    else:
        import soundfile
        from transformers import AutoFeatureExtractor, AutoImageProcessor, Qwen2_5OmniProcessor

        processor = no_video(Qwen2_5OmniProcessor)(
            image_processor=AutoImageProcessor.from_pretrained(folder / "model"),
            feature_extractor=AutoFeatureExtractor.from_pretrained(folder / "model"), tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
        media_key, kind, kwarg = "audios", "audio", "audio"
        load_media = lambda path: soundfile.read(path, dtype="float32")[0]

    def read(split: str):
        path = folder / "data" / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out = []
        for row in rows:
            question = row["prompt"].replace(f"<{kind}>", "")
            messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            media = [load_media(path.parent / p) for p in row[media_key]]  # relative to the jsonl folder
            out.append((prompt, media[0], row["label"]))
        return out

    return model, tokenizer, processor, kwarg, read("train"), read("test")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=["shapes", "tones"], required=True)
    parser.add_argument("--folder", type=Path, default=None, help="default: examples/multimodal/<task>")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    torch.manual_seed(0)
    folder = args.folder or Path(__file__).resolve().parent / args.task
    model, tokenizer, processor, kwarg, train, test = load_task(args.task, folder)
    eos, pad, suppress = tokenizer.eos_token_id, tokenizer.pad_token_id, placeholder_ids(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(0)

    def encode(rows):
        return dict(processor(text=[r[0] for r in rows], **{kwarg: [r[1] for r in rows]}, return_tensors="pt"))

    def rewards_of(completions, rows):
        out = []
        for completion, row in zip(completions, rows):
            ok = eos in completion and tokenizer.decode(completion[:completion.index(eos)]).strip() == row[2]
            out.append(1.0 if ok else 0.0)
        return out

    @torch.no_grad()
    def evaluate():
        model.eval()
        correct = 0
        for start in range(0, len(test), 100):
            rows = test[start:start + 100]
            batch = encode(rows)
            gen = model.generate(**batch, do_sample=False, max_new_tokens=4, eos_token_id=eos, pad_token_id=pad,
                                 suppress_tokens=suppress)
            correct += sum(rewards_of(gen[:, batch["input_ids"].shape[1]:].tolist(), rows))
        return correct / len(test)

    print(f"step    0  held-out greedy accuracy {evaluate():.1%}", flush=True)
    step_times = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        rows = [row for row in rng.sample(train, args.prompts) for _ in range(args.samples)]
        batch = encode(rows)
        prompt_len = batch["input_ids"].shape[1]
        model.eval()
        with torch.no_grad():
            gen = model.generate(**batch, do_sample=True, temperature=1.0, max_new_tokens=4, eos_token_id=eos,
                                 pad_token_id=pad, suppress_tokens=suppress)
        completion = gen[:, prompt_len:]
        rewards = torch.tensor(rewards_of(completion.tolist(), rows)).view(args.prompts, args.samples)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        # response mask: tokens up to and including the first eos
        is_eos = (completion == eos).int()
        mask = ((is_eos.cumsum(1) - is_eos) == 0).float()
        model.train()
        forward = dict(batch, input_ids=gen,
                       attention_mask=torch.cat([batch["attention_mask"], mask.long()], dim=1))
        if "mm_token_type_ids" in batch:  # Qwen-VL: must cover prompt + completion
            forward["mm_token_type_ids"] = torch.cat(
                [batch["mm_token_type_ids"], torch.zeros_like(completion)], dim=1)
        logits = model(**forward).logits[:, prompt_len - 1:-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        per_sample = (logprobs * mask).sum(1) / mask.sum(1).clamp(min=1)
        loss = -(advantages * per_sample).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t0)
        if step % 10 == 0:
            print(f"step {step:4d}  mean reward {rewards.mean():.3f}  {sum(step_times[-10:]) / 10:.2f} s/step",
                  flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            print(f"step {step:4d}  held-out greedy accuracy {evaluate():.1%}", flush=True)


if __name__ == "__main__":
    main()
