"""The CLI and the run directory tried as a new user would (issue 14, items 23-29): the saved config hides only
secrets and re-runs, a run always ends with a checkpoint (and an evaluation), a run directory is never mixed
with another run, and every mistake gets a message that says what is wrong, before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from relax.cli.args import build_parser, parse_config
from relax.cli.common import resolved_config_text
from relax.config import RelaxConfig
from relax.telemetry.metrics_file import read_metrics
from tests.support.runs import ROOT, SUBPROCESS_TIMEOUT_S, run_relax, tiny_train_args

EXAMPLE_CONFIGS = sorted(p.relative_to(ROOT) for p in (ROOT / "examples").rglob("config.yaml"))
SECRET = "sk-do-not-save-9f3"


# ---- 23. only the secret fields are hidden -----------------------------------------------------------------------
def test_the_saved_config_hides_exactly_the_secret_fields():
    cfg = parse_config(["--input-key", "question", "--label-key", "answer", "--metadata-key", "meta",
                        "--tool-key", "tools", "--rollout-stop-token-ids", "7", "--calculate-per-token-loss",
                        "--image-max-token-num", "99", "--rollout-api-port", "8123", "--rollout-api-key", SECRET])
    text = resolved_config_text(cfg)
    saved = yaml.safe_load(text)
    assert SECRET not in text and "***" not in text
    assert saved["rollout_api_key"] is None and "# rollout_api_key: set for this run, not saved" in text
    assert (saved["input_key"], saved["label_key"], saved["metadata_key"], saved["tool_key"]) == \
        ("question", "answer", "meta", "tools")
    assert saved["rollout_stop_token_ids"] == [7] and saved["calculate_per_token_loss"] is True
    assert saved["image_max_token_num"] == 99
    assert set(RelaxConfig.secret_fields()) == {"rollout_api_key", "rollout_engine_api_key", "notify_urls", "rm_url"}


# ---- 24. the saved config re-runs ----------------------------------------------------------------------------
@pytest.mark.parametrize("example", EXAMPLE_CONFIGS, ids=str)
def test_every_examples_saved_config_round_trips(example, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = parse_config(["--config", str(example), "--output-dir", str(tmp_path / "run")])
    saved = tmp_path / "config.yaml"
    saved.write_text(resolved_config_text(cfg))
    again = parse_config(["--config", str(saved)])
    assert again.model_dump() == cfg.model_dump()


def test_a_saved_config_of_a_switched_off_feature_reruns(tmp_path):
    """Defaults of features that are off (external engines, critic, distillation) spelled out in a file are not
    'set': the file re-runs; a changed one still needs its feature."""
    saved = tmp_path / "config.yaml"
    saved.write_text(resolved_config_text(RelaxConfig()))
    parse_config(["--config", str(saved)])
    with pytest.raises(ValueError, match="--rollout-engine-protocol needs --rollout-external"):
        parse_config(["--config", str(saved), "--rollout-engine-protocol", "openai"])


# ---- 25, 26, 29: one short run, then what a user does next ------------------------------------------------------
@pytest.fixture(scope="module")
def short_run(tiny_workspace, tmp_path_factory):
    """Two steps with held-out data, no --save-interval and no --eval-interval; the data uses other key names."""
    root = tmp_path_factory.mktemp("short")
    for name in ("train", "test"):
        rows = [json.loads(line) for line in (tiny_workspace / f"{name}.jsonl").read_text().splitlines()]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"question": r["input"], "answer": r["label"]}) + "\n"
                                                    for r in rows))
    args = ["--hf-checkpoint", str(tiny_workspace / "model"), "--prompt-data", str(root / "train.jsonl"),
            "--eval-prompt-data", "held_out", str(root / "test.jsonl"), "--input-key", "question",
            "--label-key", "answer", "--rm-type", "exact_match", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4", "--micro-batch-size", "4",
            "--num-rollout", "2", "--output-dir", str(root / "run")]
    result = run_relax("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, args, result


def test_a_run_ends_with_a_checkpoint_and_an_evaluation(short_run):
    root, _, result = short_run
    checkpoints = root / "run" / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert f"final checkpoint: {checkpoints / 'iter_0000002'}" in result.stdout
    assert "held-out accuracy:" in result.stdout and "before training ->" in result.stdout
    assert [row["step"] for row in read_metrics(root / "run" / "metrics.jsonl") if "eval/accuracy" in row] == [0, 2]


def test_export_and_eval_of_the_run_need_nothing_else(short_run, tmp_path):
    root, _, _ = short_run
    exported = run_relax("export", str(root / "run"), str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    # eval takes --input-key / --label-key / --rm-type and the eval sets from the run's saved config
    evaluated = run_relax("eval", "--load", str(root / "run"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "held_out: accuracy" in evaluated.stdout


def test_a_used_output_dir_is_refused_without_load_or_overwrite(short_run):
    root, args, _ = short_run
    again = run_relax("train", *args)
    assert again.returncode == 2
    assert f"--output-dir {root / 'run'} already holds a run" in again.stderr and "--overwrite" in again.stderr
    assert [row["step"] for row in read_metrics(root / "run" / "metrics.jsonl")] == [0, 1, 2]  # untouched


def test_overwrite_starts_the_run_afresh(short_run, tmp_path):
    root, args, _ = short_run
    fresh = tmp_path / "fresh"
    first = run_relax("train", *args, "--output-dir", str(fresh), "--num-rollout", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    (fresh / "notes.txt").write_text("mine")
    again = run_relax("train", *args, "--output-dir", str(fresh), "--num-rollout", "1", "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert [row["step"] for row in read_metrics(fresh / "metrics.jsonl")] == [0, 1]
    assert {p.name for p in (fresh / "checkpoints").glob("iter_*")} == {"iter_0000001"}
    assert (fresh / "notes.txt").read_text() == "mine"  # only the run's own files go


def test_the_saved_config_of_a_real_run_reruns(short_run, tmp_path):
    root, _, _ = short_run
    rerun = run_relax("train", "--config", str(root / "run" / "config.yaml"), "--output-dir", str(tmp_path / "re"),
                      "--num-rollout", "1")
    assert rerun.returncode == 0, rerun.stderr[-3000:]


# ---- 27, 28: mistakes are named, before anything is written -------------------------------------------------------
def _fails_up_front(tmp_path: Path, *args: str) -> str:
    out = tmp_path / "never"
    result = run_relax("train", *args, "--output-dir", str(out))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "resolved config" not in result.stderr and "Traceback" not in result.stderr
    assert not out.exists(), "a failed start left a run directory behind"
    return result.stderr


def test_a_row_without_its_label_is_refused_at_load(tiny_workspace, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n{"input": "2+2="}\n{"input": "3+3=", "label": null}\n')
    args = tiny_train_args(tiny_workspace, tmp_path / "unused", "--num-rollout", "1")
    args[args.index("--prompt-data") + 1] = str(data)
    at = args.index("--custom-rm-path")
    args[at:at + 2] = ["--rm-type", "exact_match"]
    stderr = _fails_up_front(tmp_path, *args)
    assert f"{data}: row 2: label field 'label' is missing" in stderr


@pytest.mark.parametrize("prompt, shown", [("null", "got null"), ("7", "got int"), ('{"a": 1}', "got dict")])
def test_a_prompt_that_is_no_prompt_is_named(tiny_workspace, tmp_path, prompt, shown):
    data = tmp_path / "data.jsonl"
    data.write_text('{"input": "1+1=", "label": "2"}\n' + f'{{"input": {prompt}, "label": "2"}}\n')
    args = tiny_train_args(tiny_workspace, tmp_path / "unused", "--num-rollout", "1")
    args[args.index("--prompt-data") + 1] = str(data)
    stderr = _fails_up_front(tmp_path, *args)
    assert f"{data}: row 2: field 'input'" in stderr and shown in stderr
    assert "--apply-chat-template" not in stderr


@pytest.mark.parametrize("change, message", [
    (("--prompt-data", "{data}@[0:abc]"), "malformed row slice"),
    (("--prompt-data", "{root}/missing.jsonl"), "missing.jsonl: file not found"),
    (("--rm-type", "nope"), "unknown reward type 'nope'"),
    (("--rollout-max-response-len", "256"), "--rollout-max-response-len 256: the model at"),
    (("--lrr", "1e-3"), "unknown flag --lrr; did you mean --lr"),
    (("--rollout-batchsize", "2"), "did you mean --rollout-batch-size"),
])
def test_config_mistakes_fail_before_any_output(tiny_workspace, tmp_path, change, message):
    flag, value = change
    value = value.format(data=tiny_workspace / "train.jsonl", root=tmp_path)
    args = tiny_train_args(tiny_workspace, tmp_path / "unused", "--num-rollout", "1")
    if flag == "--rm-type":
        at = args.index("--custom-rm-path")
        args[at:at + 2] = []
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    assert message in _fails_up_front(tmp_path, *args)


def test_every_command_imports_its_libraries_offline():
    """Relax never downloads: each command's module is imported after HF_HUB_OFFLINE is set (huggingface_hub reads
    it once, when imported), and `relax --help` loads neither torch nor transformers."""
    from relax.cli.main import COMMANDS

    script = (
        "import sys\n"
        "from relax.cli.main import command_function, main\n"
        "assert main(['--version']) == 0 and not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)\n"
        "for command in sys.argv[1:]:\n"
        "    command_function(command)\n"
        "import huggingface_hub.constants\n"
        "assert huggingface_hub.constants.HF_HUB_OFFLINE, 'a command imported huggingface_hub online'\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", script, *COMMANDS], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr


def test_an_unknown_command_says_so_and_suggests_one():
    result = run_relax("trian")
    assert result.returncode == 2 and "unknown command 'trian' (did you mean 'train'?)" in result.stderr


def test_export_errors_name_its_own_arguments(tmp_path):
    result = run_relax("export", str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2 and "no checkpoint found" in result.stderr and "--load" not in result.stderr


def test_boolean_flags_have_no_double_negatives():
    options = {o for action in build_parser()._actions for o in action.option_strings}
    assert "--no-save-optim" in options and not any(o.startswith("--no-no-") for o in options)
    assert parse_config(["--no-save-optim"]).no_save_optim is True


def _default_sigint() -> None:
    """A terminal's Ctrl-C reaches a process whose SIGINT is in its default state; a test runner started in the
    background (`nohup ... &`) passes SIGINT on as ignored, which would make these tests measure nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("delay_s", [0.3, 0.8, 1.5, 2.2, 3.0])
def test_ctrl_c_at_any_moment_of_start_up_ends_the_run_without_a_traceback(tiny_workspace, tmp_path, delay_s):
    """Ctrl-C while the interpreter starts, imports, loads the model or builds the roles: exit 130 (or the
    signal's own death, before Python's handler exists), never a traceback, never a run that trains on."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "relax.cli.main", "train", *tiny_train_args(tiny_workspace, tmp_path / "run",
                                                                         "--num-rollout", "5000")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_sigint)
    time.sleep(delay_s)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert process.returncode in (130, -signal.SIGINT), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    # If the training loop was reached, the Ctrl-C stopped it at its first step boundary, not at step 5000
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl") if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert len(rows) < 100, len(rows)


def test_a_ctrl_c_during_a_deferred_import_is_acted_on_when_it_ends():
    """`interrupts.deferred`: a SIGINT inside (where torch's native import could abort the interpreter) is only
    recorded; the block runs to its end, then the interrupt is raised."""
    script = (
        "import os, signal\n"
        "from relax.utils import interrupts\n"
        "interrupts.install()\n"
        "try:\n"
        "    with interrupts.deferred():\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        import time; time.sleep(0.2)\n"
        "        print('block finished', flush=True)\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted after it', interrupts.received(), flush=True)\n"
        "print('handler back', signal.getsignal(signal.SIGINT).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_default_sigint)
    assert result.stdout.split("\n")[:3] == ["block finished", "interrupted after it True",
                                              "handler back _record_and_interrupt"], result.stdout + result.stderr


def test_a_ctrl_c_that_a_library_swallowed_still_stops_the_command():
    """A library that catches the KeyboardInterrupt of a Ctrl-C (or wraps it in its own error) during start-up
    cannot lose it: `relax.utils.interrupts` records the signal and the run ends as interrupted."""
    script = (
        "import os, signal\n"
        "from relax.utils import interrupts\n"
        "interrupts.install()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    import time; time.sleep(5)\n"
        "except KeyboardInterrupt:\n"
        "    pass  # as a library's `except BaseException` would\n"
        "try:\n"
        "    interrupts.raise_if_received()\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped')\n"
        "try:\n"
        "    try:\n"
        "        raise KeyboardInterrupt\n"
        "    except KeyboardInterrupt as inner:\n"
        "        raise ModuleNotFoundError(\"Could not import module 'PreTrainedModel'\") from inner\n"
        "except ModuleNotFoundError as wrapped:\n"
        "    print('wrapped', interrupts.caused_by_interrupt(wrapped), interrupts.caused_by_interrupt(ValueError()))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, preexec_fn=_default_sigint)
    assert result.stdout.split("\n")[:2] == ["stopped", "wrapped True False"], result.stderr


def test_the_weight_buffer_size_sets_the_buckets_of_a_sync(tiny_workspace, tmp_path):
    """--update-weight-buffer-size (upstream's flag) is the bucket size of every weight sync."""
    buckets = {}
    for size in ("536870912", "65536"):
        out = tmp_path / size
        result = run_relax("train", *tiny_train_args(tiny_workspace, out, "--num-rollout", "1",
                                                     "--skip-eval-before-train", "--update-weight-buffer-size", size))
        assert result.returncode == 0, result.stderr[-3000:]
        (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "perf/weight_sync_buckets" in r]
        buckets[size] = row["perf/weight_sync_buckets"]
    assert buckets["536870912"] == 1 and buckets["65536"] > 1


@pytest.mark.parametrize("surfaced_as", [RecursionError, ImportError, AttributeError])
def test_a_ctrl_c_that_an_import_turns_into_another_error_still_ends_the_command_as_interrupted(
        monkeypatch, capsys, surfaced_as):
    """A SIGINT during the command's imports, swallowed by the library being imported and surfacing as another
    error (numpy interrupted mid-import raises RecursionError at its next use): exit 130, no traceback."""
    from relax.cli import main as cli_main
    from relax.utils import interrupts

    def interrupted_import(command):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # a real signal, to the handler `main` installs
            time.sleep(5)  # the handler raises here
        except KeyboardInterrupt:
            raise surfaced_as("a half-imported module") from None
        raise AssertionError("no KeyboardInterrupt from the SIGINT")

    monkeypatch.setattr(cli_main, "command_function", interrupted_import)
    monkeypatch.setattr(interrupts, "_received", [])  # this process's record, not the test worker's
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a terminal (not the runner's)
    try:
        assert cli_main.main(["train"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "relax train: interrupted" in capsys.readouterr().err


INTERRUPTED_IMPORT = """
import importlib.abc, runpy, sys
TARGET = sys.argv[1]
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            raise KeyboardInterrupt  # as Python's SIGINT handler raises it inside an import (a suite run's traceback)
sys.meta_path.insert(0, Interrupt())
sys.argv = ["relax", "train", "--help"]
runpy.run_module("relax.cli.main", run_name="__main__")
"""


@pytest.mark.parametrize("module", ["difflib", "yaml", "relax.telemetry.notify", "relax.utils.errors",
                                    "relax.utils.interrupts"])
def test_ctrl_c_inside_the_clis_first_imports_ends_quietly(module):
    """Deterministic form of the Ctrl-C test above for the window before main() runs: an interrupt raised while
    `relax.cli.main` imports any of its modules ends with exit 130 and no traceback."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, module], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 130, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "interrupted" in done.stderr, done.stderr[-2000:]
