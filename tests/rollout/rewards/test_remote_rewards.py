"""Rewards from outside the trainer (issue 19): a reward server (`--rm-url`, upstream's remote_rm) that fails for a
moment, and a judge model (GenRM, `--genrm-model-path`) served by the embedded engine, both through `relax train`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from relax.cli.main import main
from relax.data.sample import Sample
from relax.rollout.rewards.genrm import GenerativeReward, GenRMSettings, VerdictError, parse_verdict
from relax.rollout.rewards.remote import RemoteReward, RemoteRewardError
from relax.telemetry.metrics_file import read_metrics
from tests.support.tiny_assets import build_tokenizer

TOKEN = "rm-secret-7f3a"


def server_reward(response: str) -> float:
    return sum(ch.isdigit() for ch in response) / max(len(response), 1)


class FlakyRewardServer:
    """A reward server on 127.0.0.1 that answers each response's first request 503 and drops the connection of
    its second without an answer; the third gets ``server_reward``. ``status`` answers every request with that
    code instead."""

    def __init__(self, status: int | None = None) -> None:
        self.attempts: dict[str, int] = {}
        self.paths: list[str] = []
        lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    owner.paths.append(self.path)
                    attempt = owner.attempts[body["response"]] = owner.attempts.get(body["response"], 0) + 1
                if status is not None or attempt == 1:
                    self.send_response(status or 503)
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                if attempt == 2:
                    self.close_connection = True  # a dropped connection: no status line at all
                    return
                answer = json.dumps({"reward": server_reward(body["response"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://user:{TOKEN}@127.0.0.1:{self.httpd.server_port}/score?token={TOKEN}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def flaky():
    server = FlakyRewardServer()
    yield server
    server.stop()


def _train(tiny_workspace, run_dir, *extra) -> int:
    """A tiny run scored by a remote reward; --reward-timeout far above a loaded machine's call (the default 5 s is
    a production bound, and a test must not race it: a slow call would score 0 and change what is asserted)."""
    return main(["train", "--reward-timeout", "300", "--hf-checkpoint", str(tiny_workspace / "model"), "--prompt-data",
                 str(tiny_workspace / "train.jsonl"), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-max-response-len", "4", "--num-rollout", "2", "--output-dir", str(run_dir),
                 "--dump-samples", "4", "--no-use-tensorboard", *extra])


def test_a_run_scores_with_a_reward_server_that_fails_for_a_moment(flaky, tiny_workspace, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(tiny_workspace, run_dir, "--rm-url", flaky.url) == 0
    console = capsys.readouterr()
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "reward/remote_retries" in row]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # every sample: a 503 and a dropped connection retried, then scored; none failed
        assert row["reward/remote_retries"] == 2 * 4 and row["reward/num_errors"] == 0, row
    for line in (run_dir / "samples" / "rollout_000002.jsonl").read_text().splitlines():
        sample = json.loads(line)
        assert sample["reward"] == pytest.approx(server_reward(sample["response"]))
    assert all(path == f"/score?token={TOKEN}" for path in flaky.paths)  # the URL reached the server whole
    for text in (console.out, console.err, (run_dir / "run.log").read_text(), (run_dir / "config.yaml").read_text()):
        assert TOKEN not in text


def test_upstream_remote_rm_type_names_the_same_reward(flaky, tiny_workspace, tmp_path):
    assert _train(tiny_workspace, tmp_path / "run", "--rm-type", "remote_rm", "--rm-url", flaky.url) == 0
    assert _train(tiny_workspace, tmp_path / "no_url", "--rm-type", "remote_rm") == 2


def test_a_refusing_server_is_not_retried_and_a_dead_one_gives_up_naming_it_without_its_token():
    refusing = FlakyRewardServer(status=400)
    sample = Sample(index=0, prompt="1+1=", response="2", label="2")
    try:
        reward = RemoteReward(refusing.url)
        with pytest.raises(RemoteRewardError, match=r"answered 400") as caught:
            asyncio.run(reward(None, sample))
        assert refusing.attempts == {"2": 1} and TOKEN not in str(caught.value)
        assert f"127.0.0.1:{refusing.httpd.server_port}/score" in str(caught.value)  # redacted: ***@ ... ?token=***
    finally:
        refusing.stop()
    dead = RemoteReward(refusing.url, max_attempts=3, first_backoff_s=0.01)  # its port is closed now
    with pytest.raises(RemoteRewardError, match="failed 3 times") as caught:
        asyncio.run(dead(None, sample))
    assert TOKEN not in str(caught.value) and dead.pop_metrics() == {"reward/remote_retries": 2}


@pytest.mark.parametrize("text, verdict", [("\\boxed{0.75}", 0.75), ("the score: 3 and then score: 1", 1.0),
                                           ("Yes, it is right.", 1.0), ("no", 0.0), ("\\boxed{correct}", 1.0)])
def test_verdicts_are_read_from_the_judges_answer(text, verdict):
    assert parse_verdict(text) == verdict


def test_an_answer_without_a_verdict_is_an_error():
    with pytest.raises(VerdictError, match="holds no verdict"):
        parse_verdict("maybe 12")


def build_bigram_judge(directory: Path, answer: str) -> Path:
    """A tiny Qwen3 whose next token depends on the last one only (its layers add nothing to the residual stream,
    the embeddings are one-hot, the head maps each token to its successor): after a prompt ending in a newline it
    writes ``answer`` and stops, whatever it was asked. A judge whose verdict is known before it is asked."""
    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False, max_position_embeddings=512,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = transformers.Qwen3ForCausalLM(config)
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    chain = dict(zip([tokenizer.convert_tokens_to_ids("\n"), *ids], [*ids, tokenizer.eos_token_id]))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, 64))
        head = torch.zeros(vocab, 64)
        for token, successor in chain.items():
            head[successor, token] = 10.0
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("answer, reward", [("yes", 1.0), ("no", 0.0)])
def test_a_run_scores_with_a_judge_model(answer, reward, tiny_workspace, tmp_path):
    judge = build_bigram_judge(tmp_path / "judge", answer)
    run_dir = tmp_path / "run"
    assert _train(tiny_workspace, run_dir, "--genrm-model-path", str(judge), "--genrm-sampling-config",
                  '{"temperature": 0, "max_response_len": 8}') == 0
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if "reward/genrm_verdicts" in row]
    assert [row["reward/genrm_verdicts"] for row in rows] == [4, 4]
    assert all(row["reward/num_errors"] == 0 and row["rollout/reward_mean"] == reward for row in rows), rows


def test_the_judge_sees_the_template_with_the_sample_and_decodes_concurrent_verdicts_together(tmp_path):
    judge = build_bigram_judge(tmp_path / "judge", "yes")
    settings = GenRMSettings.from_flags(str(judge), "judge {prompt} then {response} label {label}", {"temperature": 0},
                                        None, "cpu", "float32")
    reward = GenerativeReward(settings)
    samples = [Sample(index=i, prompt=f"{i}+1=", response=str(i + 1), label=str(i + 1)) for i in range(6)]

    async def all_at_once():
        return await asyncio.gather(*(reward(SimpleNamespace(), sample) for sample in samples))

    assert asyncio.run(all_at_once()) == [1.0] * 6
    prompt = reward.tokenizer.decode(reward._judge_prompt(samples[2]))
    assert "judge 2+1= then 3 label 3" in prompt and prompt.endswith("assistant\n")
    (batcher,) = reward._batchers.values()
    assert batcher.engine_calls < len(samples)  # the concurrent verdicts shared engine calls
    with pytest.raises(ValueError, match="never shows the judge the {response}"):
        GenRMSettings.from_flags(str(judge), "no response here", None, None, "cpu", "float32")
    with pytest.raises(ValueError, match=r"--genrm-sampling-config: unknown key\(s\) \['temp'\]"):
        GenRMSettings.from_flags(str(judge), None, {"temp": 0}, None, "cpu", "float32")
