"""Issue 28, items 18-24: a new user's first hour, and the secrets and exposure of the set-up.

Set-up that verifies itself, the CPU thread count chosen by measurement, missing extras named before any work,
export that never overwrites silently and carries a processor, LoRA adapters tied to their base model, messages that
name the mistake (and the flag that fixes it), and reports that say what they count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from relax.cli.args import parse_config
from relax.cli.main import main
from relax.config import ConfigError
from relax.telemetry.plots import plot_run
from relax.utils import cpu_threads
from tests.support.runs import ROOT, run_relax, tiny_train_args
from tests.support.tiny_assets import build_tiny_model_dir


def _relax(capsys, *argv: str) -> tuple[int, str, str]:
    """`relax ...` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- 19: set-up verifies its result ---------------------------------------------------------------------------------
def test_setup_fails_loudly_when_relax_is_not_installed(tmp_path):
    """The verification of scripts/setup.sh, run with a python whose pip 'succeeded' without installing relax-rl."""
    clone = tmp_path / "clone"
    (clone / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", clone / "scripts" / "setup.sh")
    fake = tmp_path / "bin"
    fake.mkdir()
    venv_python = clone / ".venv" / "bin"
    # python3 -m venv makes a venv whose pip does nothing and whose python cannot import relax
    (fake / "python3").write_text(f"""#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p {venv_python}
  printf '#!/bin/sh\\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then exit 0; fi\\nexec {sys.executable} -I -S "$@"\\n' > {venv_python}/python
  chmod +x {venv_python}/python
  printf 'PATH={venv_python}:$PATH\\n' > {venv_python}/activate
  exit 0
fi
exec {sys.executable} "$@"
""")
    (fake / "python3").chmod(0o755)
    result = subprocess.run(["bash", "scripts/setup.sh", "test"], cwd=clone, capture_output=True, text=True,
                            env={**os.environ, "PATH": f"{fake}:/usr/bin:/bin"}, timeout=120)
    assert result.returncode != 0
    assert "FAILED" in result.stderr and "relax-rl is not installed" in result.stderr
    assert (clone / ".venv" / "setup.log").is_file()


def test_relax_version(capsys):
    code, out, _ = _relax(capsys, "--version")
    assert code == 0 and out.startswith("relax ")


# ---- 20: the CPU thread count ---------------------------------------------------------------------------------------
def test_cpu_threads_are_measured_within_the_free_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads, how = cpu_threads.choose_cpu_threads(64)
    assert 1 <= threads <= cpu_threads.free_cores() and how.startswith("measured")
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (64.0, 64.0, 64.0))  # a machine busy elsewhere
    assert cpu_threads.free_cores() == 1 and cpu_threads.choose_cpu_threads(4096)[0] == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.choose_cpu_threads(64) == (3, "$OMP_NUM_THREADS")
    assert cpu_threads.choose_cpu_threads(64, configured=2) == (2, "--cpu-threads")


# ---- 21: extras named before any work -------------------------------------------------------------------------------
def test_a_missing_extra_is_named_before_a_run_directory_exists(tiny_workspace, tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    out = tmp_path / "never"
    code, _, err = _relax(capsys, "train", *tiny_train_args(tiny_workspace, out, "--placement", "ray"))
    assert code == 2 and 'pip install -e ".[ray]"' in err and "Traceback" not in err
    assert not out.exists()


# ---- 22: export -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run(tiny_workspace, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    shutil.copytree(tiny_workspace / "model", base)
    out = root / "run"
    args = tiny_train_args(tiny_workspace, out, "--num-rollout", "1", "--skip-eval-before-train", "--lora-rank", "4",
                           "--dump-samples", "0", "--no-use-tensorboard")
    args[args.index("--hf-checkpoint") + 1] = str(base)
    result = run_relax("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return base, out


def test_export_refuses_a_used_folder_unless_told(lora_run, tmp_path, capsys):
    _, run = lora_run
    target = tmp_path / "hf"
    assert _relax(capsys, "export", str(run), str(target))[0] == 0
    (target / "mine.txt").write_text("keep?")
    code, _, err = _relax(capsys, "export", str(run), str(target))
    assert code == 2 and "--overwrite" in err and (target / "mine.txt").exists()
    assert _relax(capsys, "export", str(run), str(target), "--overwrite")[0] == 0
    assert not (target / "mine.txt").exists() and (target / "config.json").is_file()
    assert "torch.distributed is disabled" not in capsys.readouterr().err


def test_export_to_where_nothing_can_be_written_is_refused_before_loading(lora_run, tmp_path, capsys):
    """An output inside a file (or anywhere the folder cannot be made) is named with exit status 2 before the
    checkpoint loads; it was a traceback after the load."""
    _, run = lora_run
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "hf"
    code, _, err = _relax(capsys, "export", str(run), str(target))
    assert code == 2 and f"{target}: cannot write there (Not a directory)" in err and "Traceback" not in err, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]


def test_a_run_folder_that_cannot_be_made_is_named(tiny_workspace, tmp_path, capsys):
    """--output-dir, --save or --timeline-dump-dir inside a file: exit status 2 naming the flag, before training
    (--save failed at the first checkpoint, after a step's work; --timeline-dump-dir at the first step, with a
    traceback), and no folder left behind."""
    (tmp_path / "a-file").write_text("")
    cases = {"--output-dir": ["--output-dir", str(tmp_path / "a-file" / "run")],
             "--save": ["--output-dir", str(tmp_path / "run"), "--save", str(tmp_path / "a-file" / "ck")],
             "--timeline-dump-dir": ["--output-dir", str(tmp_path / "run"), "--timeline-dump-dir",
                                     str(tmp_path / "a-file" / "timeline")]}
    for name, flags in cases.items():
        code, _, err = _relax(capsys, "train", *tiny_train_args(tiny_workspace, tmp_path / "unused", "--num-rollout",
                                                                "1", *flags))
        assert code == 2 and f"{name} {tmp_path / 'a-file'}/" in err and "cannot make the folder" in err, err
        assert sorted(path.name for path in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize(("flags", "named"), [
    (["--max-total-tokens", str(10**12)], "--max-total-tokens 1000000000000: a KV pool of 1,000,000,000,000 tokens "
                                          "takes"),
    (["--lora-rank", str(10**8)], "--lora-rank 100000000: 89,600,000,000 adapter parameters, more than the model's "
                                  "own"),
])
def test_a_size_no_memory_can_hold_is_refused_before_the_model_loads(flags, named, tiny_workspace, tmp_path, capsys):
    """A KV pool or LoRA adapters larger than anything could hold failed in torch's allocator once the model had
    loaded (a 381 GiB or 95 GiB request, a traceback naming no setting, exit status 1): exit 2 naming the flag and
    the sizes, before a run directory exists."""
    code, _, err = _relax(capsys, "train", *tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "1",
                                                            *flags))
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_pool_that_cannot_hold_a_response_is_refused_naming_both_flags(tiny_workspace, tmp_path, capsys):
    """The engine ends a sequence at its --max-total-tokens pool with "length": a pool smaller than a prompt token and
    one response would cut every response short of --rollout-max-response-len (or --eval-max-response-len)."""
    for flags, named in ((["--rollout-max-response-len", "80"], "fewer than a prompt token and a response of "
                                                                 "--rollout-max-response-len 80"),
                         (["--eval-max-response-len", "100"], "--eval-max-response-len 100")):
        code, _, err = _relax(capsys, "train", *tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout",
                                                                "1", "--max-total-tokens", "70", "--page-size", "16",
                                                                *flags))
        assert code == 2 and "--max-total-tokens 70: the engine's KV pool holds 64 token slots" in err, err
        assert named in err and "give at least" in err and "Traceback" not in err, err
        assert not (tmp_path / "run").exists()


def test_resuming_with_another_model_is_refused_before_it_loads(lora_run, tiny_workspace, tmp_path, capsys):
    """--load of a run whose checkpoints hold other shapes than --hf-checkpoint: exit status 2 naming both flags and
    the fields that differ (it was torch's size-mismatch traceback after the load, exit status 1)."""
    _, run = lora_run
    wider = build_tiny_model_dir(tmp_path / "wider", hidden_size=96)
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    args = tiny_train_args(tiny_workspace, moved, "--num-rollout", "2", "--load", str(moved))
    args[args.index("--hf-checkpoint") + 1] = str(wider)
    code, _, err = _relax(capsys, "train", *args)
    assert code == 2 and f"--load {moved}: its checkpoints are of another model than --hf-checkpoint {wider}" in err
    assert "hidden_size 64 there, 96 here" in err and "Traceback" not in err, err


def test_resuming_with_other_adapters_or_none_is_refused_before_the_model_loads(lora_run, tiny_workspace, tmp_path,
                                                                               capsys):
    """A LoRA run resumed with another rank, or without LoRA, and a full fine-tune resumed with LoRA: exit status 2
    naming the settings (each was a size-mismatch or missing-key traceback after the load), and the run's
    config.yaml is left as it was (the failed start used to overwrite it with the refused settings)."""
    base, run = lora_run
    moved = tmp_path / "lora-run"
    shutil.copytree(run, moved)
    saved_config = (moved / "config.yaml").read_text()
    resume = tiny_train_args(tiny_workspace, moved, "--num-rollout", "2", "--load", str(moved))
    resume[resume.index("--hf-checkpoint") + 1] = str(base)
    for extra, message in ((["--lora-rank", "8"], "trained with other LoRA settings (--lora-rank 4 there, 8 here)"),
                           ([], "its checkpoints hold LoRA adapters (rank 4); resume with --lora-rank 4")):
        code, _, err = _relax(capsys, "train", *resume, *extra)
        assert code == 2 and message in err and "Traceback" not in err, err
        assert (moved / "config.yaml").read_text() == saved_config
    full = tmp_path / "full-run"
    assert _relax(capsys, "train", *tiny_train_args(tiny_workspace, full, "--num-rollout", "1",
                                                     "--skip-eval-before-train"))[0] == 0
    code, _, err = _relax(capsys, "train", *tiny_train_args(tiny_workspace, full, "--num-rollout", "2", "--load",
                                                             str(full), "--lora-rank", "4"))
    assert code == 2 and "hold a full fine-tune, not adapters; resume without --lora-rank" in err, err


def test_lora_adapters_refuse_a_changed_base_model(lora_run, tmp_path, capsys):
    base, run = lora_run
    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-64] + bytes(64))  # the base changed in place (another fine-tune)
        code, _, err = _relax(capsys, "export", str(moved), str(tmp_path / "out"))
        assert code == 2 and "has changed since the adapters" in err
        code, _, err = _relax(capsys, "eval", "--load", str(moved))
        assert code == 2 and "has changed since the adapters" in err
    finally:
        weights.write_bytes(original)
    assert _relax(capsys, "export", str(moved), str(tmp_path / "out"))[0] == 0


# ---- 23: messages -----------------------------------------------------------------------------------------------------
def test_model_folder_problems_are_named(tiny_workspace, tmp_path, capsys):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_workspace / "model", no_weights)
    (no_weights / "model.safetensors").unlink()
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_workspace / "model", no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    cases = {str(no_weights): "holds no weights", str(no_tokenizer): "holds no tokenizer",
             str(tmp_path / "nowhere"): "no such folder", "Qwen/Qwen3-0.6B": "Relax never downloads",
             **_damaged_model_folders(tiny_workspace / "model", tmp_path)}
    for path, message in cases.items():
        args = tiny_train_args(tiny_workspace, tmp_path / "never", "--num-rollout", "1")
        args[args.index("--hf-checkpoint") + 1] = path
        code, _, err = _relax(capsys, "train", *args)
        assert code == 2 and message in err and "Traceback" not in err, (path, err)
        code, _, err = _relax(capsys, "serve", "--hf-checkpoint", path, "--port", "1")
        assert code == 2 and message in err, (path, err)


def test_a_chat_template_that_does_not_parse_is_named_as_the_model_s(tiny_workspace, tmp_path, capsys):
    """--apply-chat-template with a model whose template is broken: it had been reported against the first row."""
    model = tmp_path / "model"
    shutil.copytree(tiny_workspace / "model", model)
    (model / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] }}")
    args = tiny_train_args(tiny_workspace, tmp_path / "never", "--num-rollout", "1", "--apply-chat-template")
    args[args.index("--hf-checkpoint") + 1] = str(model)
    code, _, err = _relax(capsys, "train", *args)
    assert code == 2 and "Traceback" not in err and not (tmp_path / "never").exists(), err
    assert f"--apply-chat-template: the model at {model}: its chat template does not parse (line 1: Unexpected " \
           "end of template" in err, err


def test_a_prompt_that_fills_the_model_s_positions_is_dropped_at_load_not_mid_run(tiny_workspace, tmp_path, capsys):
    """Without --rollout-max-prompt-len a prompt of 403 tokens reached the engine of a model with 256 positions,
    which refused it mid-run ("leave no room for an answer"): the run ended with a traceback."""
    rows = [json.loads(line) for line in (tiny_workspace / "train.jsonl").read_text().splitlines()[:15]]
    rows.insert(7, {"input": "1" * 400 + "+1=", "label": "x"})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "4", "--skip-eval-before-train")
    args[args.index("--prompt-data") + 1] = str(data)
    code, _, err = _relax(capsys, "train", *args)
    assert code == 0, err[-3000:]
    assert "dropped prompts: 1 that leave no room for an answer within the model's 256 positions" in err


@pytest.mark.parametrize("flags, says", [
    (["--rollout-stop-token-ids", "42", "43"], "--rollout-stop-token-ids 43: the model at {model} has 43 tokens "
                                               "(ids 0 to 42); no response could ever end with it"),
    (["--rollout-stop-token-ids", "-1"], "--rollout-stop-token-ids: -1 is no token id"),
    (["--rollout-stop", "="], None),  # a real stop string is taken
    (["--rollout-stop", "=", ""], "--rollout-stop: an empty stop string matches after any token"),
])
def test_stops_that_could_never_match_or_match_anywhere_are_refused(tiny_workspace, tmp_path, capsys, flags, says):
    """They had been taken, and did nothing (an id past the vocabulary, or below 0; an empty string, which the
    engine drops as one that would end every response at its first token)."""
    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "1", "--skip-eval-before-train", *flags)
    code, _, err = _relax(capsys, "train", *args)
    if says is None:
        assert code == 0, err[-2000:]
        return
    assert code == 2 and says.format(model=tiny_workspace / "model") in err and not (tmp_path / "run").exists(), err


def _damaged_model_folders(model, root) -> dict[str, str]:
    """Copies of a good model folder with one file damaged as downloads and disks damage them (or a config edited
    to another size, weights that lost a tensor: transformers started those at random), each with what the
    refusal must say (the damage used to surface as a library's traceback and exit status 1, which a supervised
    run takes for a machine fault and restarts)."""
    weights = (model / "model.safetensors").read_bytes()
    damage = {
        "config-not-json": ("config.json", b'{"model_type": "qwen3", ', "its config.json cannot be read"),
        "config-not-utf8": ("config.json", b"\xff\xfe{}", "its config.json cannot be read"),
        "config-unknown-type": ("config.json", json.dumps({"model_type": "no-such-family"}).encode(),
                                "its config.json cannot be read"),
        "tokenizer-not-json": ("tokenizer.json", b'{"version": ', "its tokenizer cannot be loaded"),
        "weights-truncated": ("model.safetensors", weights[:-100], "model.safetensors: not a readable safetensors"),
        "weights-garbage": ("model.safetensors", bytes(range(256)) * 4, "model.safetensors: not a readable"),
        "config-of-another-size": ("config.json", json.dumps({**json.loads((model / "config.json").read_text()),
                                                               "hidden_size": 128}).encode(),
                                   "its weights do not fit its config.json: 20 tensor(s) of other shapes"),
        "weights-lack-a-tensor": ("model.safetensors", _without(weights, "model.layers.1.mlp.down_proj.weight"),
                                  "its weight files lack 1 tensor(s) the model needs"),
        "index-names-a-missing-shard": ("model.safetensors.index.json",
                                        json.dumps({"weight_map": {"lm_head.weight": "model-2.safetensors"}}).encode(),
                                        "names 1 missing weight file(s): model-2.safetensors"),
    }
    cases = {}
    for name, (file, content, message) in damage.items():
        folder = root / name
        shutil.copytree(model, folder)
        (folder / file).write_bytes(content)
        cases[str(folder)] = message
    smaller = build_tiny_model_dir(root / "tokenizer-of-another-model", vocab_size=30)  # (the tokenizer has 43)
    cases[str(smaller)] = "its tokenizer has 43 tokens, more than the model's 30 embedding rows"
    return cases


def _without(weights: bytes, name: str) -> bytes:
    from safetensors.torch import load, save

    tensors = load(weights)
    tensors.pop(name)
    return save(tensors, metadata={"format": "pt"})


_PLUGIN_FLAGS = ("--custom-rm-path", "--custom-advantage-function-path", "--custom-policy-loss-function-path",
                 "--dynamic-sampling-filter-path", "--custom-generate-function-path", "--rollout-interaction-env-path",
                 "--tools")


def test_every_plugin_flag_refuses_every_kind_of_bad_plugin_naming_itself(tiny_workspace, tmp_path, capsys,
                                                                          monkeypatch):
    """A module that does not parse, one that raises on import, a name that is not a function, a missing name, a
    path without a module: each flag that names user code refuses each of them before a run directory exists, with
    exit status 2 and the flag in the message (--tools named a non-function in a traceback, and --custom-rm-path
    too, with exit status 1)."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "relax_test_unparsable.py").write_text("def build_env(:\n    pass\n")
    (plugins / "relax_test_raising.py").write_text("raise RuntimeError('at import')\n")
    (plugins / "relax_test_constants.py").write_text("build_env = 3\n")
    monkeypatch.syspath_prepend(str(plugins))
    bad = {"relax_test_unparsable:build_env": "SyntaxError", "relax_test_raising:build_env": "at import",
           "relax_test_constants:build_env": "not a function", "relax_test_constants:absent": "no attribute",
           "nomodule": "expected 'package.module:function'"}
    for flag_name in _PLUGIN_FLAGS:
        for path, reason in bad.items():
            if flag_name == "--rollout-interaction-env-path":  # a module (its build_env) or a module:function
                path = path.removesuffix(":build_env")
                reason = {"not a function": "not a function", "no attribute": "no attribute"}.get(reason, reason)
                if path == "nomodule":
                    reason = "No module named 'nomodule'"
            extra = ("--rm-type", "none") if flag_name == "--custom-rm-path" else ()
            args = tiny_train_args(tiny_workspace, tmp_path / "never", *extra)
            if flag_name == "--custom-rm-path":
                args[args.index("--custom-rm-path") + 1] = path
            else:
                args += [flag_name, path]
            code, _, err = _relax(capsys, "train", *args)
            assert code == 2 and flag_name in err and reason in err and "Traceback" not in err, (flag_name, path, err)
            assert not (tmp_path / "never").exists()


def test_eval_of_a_missing_load_says_so(capsys, tmp_path):
    code, _, err = _relax(capsys, "eval", "--load", str(tmp_path / "gone"))
    assert code == 2 and "no such folder" in err and "--eval-prompt-data" not in err


@pytest.mark.parametrize(("given", "suggested"), [("--learning-rate", "--lr"), ("--rollout_batch_size",
                                                                                  "--rollout-batch-size"),
                                                  ("--num-rollouts", "--num-rollout"), ("--model", "--hf-checkpoint")])
def test_unknown_flags_get_the_right_suggestion(given, suggested):
    with pytest.raises(ConfigError, match=f"did you mean {suggested}"):
        parse_config([given, "1"])


def test_every_unknown_yaml_key_is_reported_at_once(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 1.0\nrollout-batchsize: 3\nlr: 0.1\nnot_a_thing: 1\n")
    with pytest.raises(ConfigError) as error:
        parse_config(["--config", str(config)])
    message = str(error.value)
    assert "'learning_rate'; did you mean 'lr'" in message and "'rollout_batchsize'" in message
    assert "rollout_batch_size" in message and "'not_a_thing'" in message


def test_a_config_file_that_is_no_text_is_named(tmp_path, capsys):
    (tmp_path / "binary.yaml").write_bytes(b"lr: 0.1\n\xff\xfe\x00")
    (tmp_path / "folder.yaml").mkdir()
    for name, message in (("binary.yaml", "is not UTF-8 text"), ("folder.yaml", "cannot be read")):
        code, _, err = _relax(capsys, "train", "--config", str(tmp_path / name))
        assert code == 2 and f"--config: {tmp_path / name}" in err and message in err, err
        assert "Traceback" not in err


def test_a_bad_value_is_one_line_not_the_usage(capsys):
    code, _, err = _relax(capsys, "train", "--lr", "abc")
    assert code == 2 and "--lr" in err and len(err.splitlines()) <= 3 and "usage:" not in err


def test_serve_flags_are_checked(capsys, tiny_workspace):
    code, _, err = _relax(capsys, "serve", "--hf-checkpoint", str(tiny_workspace / "model"), "--prot", "5")
    assert code == 2 and "did you mean --port" in err
    code, _, err = _relax(capsys, "serve", "--hf-checkpoint", str(tiny_workspace / "model"), "--port", "99999")
    assert code == 2 and "99999" in err and "1-65535" in err


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--cpu-threads", "100000", "must be from 0 to 1024"),  # torch's thread pool had segfaulted the server
    ("--batch-window-ms", "1e12", "must be from 0 to 10000"),  # every request would wait that long
    ("--batch-window-ms", "-1", "must be from 0 to 10000"),  # had named an internal window_s
    ("--header-timeout-s", "inf", "must be a finite number > 0"), ("--body-timeout-s", "nan", "finite number > 0"),
    ("--mem-fraction-static", "2", "must be from 0.001 to 0.999"),
    ("--api-key", "", "is blank"),  # an unset shell variable: it had served an empty bearer token
    ("--api-key", "  ", "is blank"), ("--weight-update-root", "", "is blank"), ("--served-model-name", "", "is blank"),
])
def test_serve_refuses_values_that_are_no_bound_or_blank(capsys, tiny_workspace, flag, value, says):
    code, _, err = _relax(capsys, "serve", "--hf-checkpoint", str(tiny_workspace / "model"), flag, value)
    assert code == 2 and f"argument {flag}: " in err and says in err and "Traceback" not in err, err


def test_relax_scale_without_an_api_says_so(capsys):
    from relax.distributed.process_group import free_loopback_port

    url = f"http://127.0.0.1:{free_loopback_port()}"
    for argv in (("engines", "--url", url), ("status", "--url", url, "out", "x"), ("status", "out", "x", "--url", url)):
        code, _, err = _relax(capsys, "scale", *argv)
        assert code == 1 and "no answer" in err and "Traceback" not in err, err


def test_relax_scale_refuses_a_url_that_is_not_one_at_once(capsys):
    for url in ("user:s3cret-pw@127.0.0.1:8100", "localhost:8100", "ftp://127.0.0.1/x"):
        code, _, err = _relax(capsys, "scale", "engines", "--url", url)
        assert code == 2 and "--url" in err and "s3cret-pw" not in err and "no answer" not in err, err


@pytest.mark.parametrize("answer", [b"hello", b"[1, 2]", b'{"detail": "something else"}'])
def test_relax_scale_against_a_server_that_is_not_the_api_says_so(capsys, answer):
    """A 200 that is not the API's JSON (another server on that port) had ended in a traceback."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for argv in (("engines",), ("status", "out", "x"), ("out", "--num-replicas", "2")):
            code, _, err = _relax(capsys, "scale", *argv, "--url", url)
            if argv == ("engines",) and answer.startswith(b"{"):
                assert code == 0  # /engines is any JSON object
                continue
            assert code == 1 and "not the scaling API's" in err and "Traceback" not in err, (argv, err)
    finally:
        server.shutdown()
        thread.join(10)


def test_a_yaml_setting_is_cleared_from_the_command_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rm_type: math\n")
    assert parse_config(["--config", str(config)]).rm_type == "math"
    assert parse_config(["--config", str(config), "--rm-type", "none"]).rm_type is None
    with pytest.raises(ConfigError, match="--<flag> none"):
        parse_config(["--config", str(config), "--n-samples-per-prompt", "0"])


def test_relax_health_shows_engines_by_name(capsys, tmp_path):
    (tmp_path / "health.json").write_text(json.dumps({
        "time": 0, "pid": 1, "roles": {}, "engines": [{"engine": "EmbeddedEngine(Qwen3ForCausalLM on cpu, #0)",
                                                        "healthy": True}]}))
    code, out, _ = _relax(capsys, "health", str(tmp_path))
    assert code == 0 and "object at 0x" not in out and "EmbeddedEngine(" in out


def test_an_embedded_engine_has_a_readable_name(tiny_workspace):
    from relax.backends.inference.embedded import EmbeddedEngine
    from relax.backends.inference.router import engine_name

    engine = EmbeddedEngine.from_pretrained(str(tiny_workspace / "model"))
    assert "object at" not in engine_name(engine) and "EmbeddedEngine(" in engine_name(engine)


# ---- 24: reports ------------------------------------------------------------------------------------------------------
def test_accuracy_is_what_the_reward_calls_correct():
    from relax.components.rollout import summarize_samples
    from relax.data.sample import Sample

    samples = [Sample(index=i, tokens=[1, 2], response_length=1, reward=reward)
               for i, reward in enumerate([{"score": 0.9, "acc": False}, {"score": 0.2, "acc": True}, 0.5, 0.0])]
    assert summarize_samples(samples, "rollout")["rollout/accuracy"] == 0.5


def test_a_run_whose_reward_always_fails_exits_1_saying_so(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    args = tiny_train_args(tiny_workspace, out, "--num-rollout", "1", "--skip-eval-before-train", "--custom-rm-path",
                           "tests.support.e2e_rewards:fails_on_odd_index", "--dump-samples", "0")
    some = run_relax("train", *args)
    assert some.returncode == 0 and re.search(r"the reward failed on \d+ of 16 samples", some.stderr), some.stderr
    args[args.index("tests.support.e2e_rewards:fails_on_odd_index")] = "tests.support.e2e_rewards:always_raises"
    args[args.index("--output-dir") + 1] = str(tmp_path / "all")
    every = run_relax("train", *args)
    assert every.returncode == 1 and "the reward failed on every sample" in every.stderr


def test_plots_leave_out_flat_zero_and_duplicate_curves(tmp_path):
    rows = [{"step": s, "train/kl_loss": 0.0, "train/ppo_kl": 0.0, "eval/accuracy": s / 10,
             "eval/held_out/accuracy": s / 10, "rollout/reward_mean": s} for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = {p.name for p in plot_run(tmp_path)}
    assert "kl.png" not in written and "accuracy.png" in written and "reward.png" in written


def test_sft_s_final_line_lists_what_it_wrote(tiny_workspace, tmp_path):
    out = tmp_path / "sft"
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    args = tiny_train_args(tiny_workspace, out, "--num-rollout", "1", "--loss-type", "sft", "--skip-eval-before-train",
                           "--no-use-tensorboard")
    args[args.index("--prompt-data") + 1] = str(data)
    result = run_relax("train", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("run directory:"))
    assert "samples/" not in line and "tensorboard/" not in line and "metrics.jsonl" in line


# ---- 18: secrets and exposure -------------------------------------------------------------------------------------------
def test_the_scaling_token_from_the_environment_reaches_the_ray_processes(monkeypatch):
    from relax.core.placement.ray.service import config_for_workers

    monkeypatch.setenv("RELAX_API_KEY", "env-token-1234")
    cfg = parse_config(["--rollout-api-port", "8123"])
    assert cfg.rollout_api_key is None and config_for_workers(cfg).rollout_api_key == "env-token-1234"
    assert config_for_workers(parse_config([])).rollout_api_key is None  # no API: nothing to carry


def test_a_reward_server_that_echoes_its_url_leaks_no_token():
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from relax.data.sample import Sample
    from relax.rollout.rewards.remote import RemoteReward, RemoteRewardError

    token = "echoed-secret-9c1"

    class Echo(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = f"bad request to http://u:{token}@{self.headers['Host']}{self.path} ({token})".encode()
            self.send_response(400)
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        reward = RemoteReward(f"http://u:{token}@127.0.0.1:{httpd.server_port}/score?token={token}")
        sample = Sample(index=0, tokens=[1], response_length=1, response="x")
        with pytest.raises(RemoteRewardError) as caught:
            asyncio.run(reward(None, sample))
        assert token not in str(caught.value) and "answered 400" in str(caught.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.xdist_group("ray")  # Ray in this process: with the other such tests, one after the other
def test_a_local_ray_listens_on_loopback_only_and_prestarts_no_idle_workers():
    """Its raylet starts no Python worker before one is asked for: Ray's default prestarts some when the driver
    connects (two here), and Relax's actors never used them (`relax.utils.local_ray`)."""
    pytest.importorskip("ray")
    import psutil  # Ray's and TransferQueue's dependency
    import ray

    from relax.utils.local_ray import start_local_ray
    from tests.core.placement.test_ray_placement import non_loopback_listeners

    if ray.is_initialized():
        pytest.skip("a Ray of another test is running in this process")
    start_local_ray(2)
    try:
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        assert non_loopback_listeners(os.getpid()) == []
        raylet = psutil.Process(ray._private.worker._global_node.all_processes["raylet"][0].process.pid)
        idle = [child.pid for child in raylet.children() if " ".join(child.cmdline()).startswith("ray::IDLE")]
        assert idle == []
    finally:
        ray.shutdown()

