"""A GGUF file as a model source (issue 31): a tiny Llama written to GGUF by the `gguf` package inside the test, loaded
through Relax's path (`hf_folder_of_gguf`, and `--hf-checkpoint model.gguf`), gives the source model's logits and
tokens; the folder is made once per file content; a missing, foreign, corrupt or unsupported file is refused naming
it; `relax train` runs two steps from the GGUF file; `--gguf-file` names the file inside a folder; `relax serve`
answers from a GGUF file over HTTP."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch

from relax.backends.models.family import load_model
from relax.backends.models.gguf_source import hf_folder_of_gguf
from tests.support.tiny_gguf import tiny_llama, write_gguf

# Q8_0 keeps each block of 32 weights as int8 with one scale: on this model the logits move by at most this much
# (measured 4.7e-3 on logits of about unit size)
Q8_0_LOGIT_ERROR = 0.02


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    model, tokenizer = tiny_llama()
    files = {kind: write_gguf(model, tokenizer, root / f"tiny-{kind}.gguf", quantized=kind == "q8_0")
             for kind in ("f32", "q8_0")}
    return model, tokenizer, files


@pytest.mark.parametrize("kind, tolerance", [("f32", 1e-6), ("q8_0", Q8_0_LOGIT_ERROR)])
def test_a_gguf_file_loads_as_the_model_it_was_written_from(source, kind, tolerance, tmp_path, monkeypatch):
    model, tokenizer, files = source
    monkeypatch.setenv("RELAX_GGUF_CACHE", str(tmp_path / "cache"))
    folder = hf_folder_of_gguf(files[kind])
    assert folder.parent == tmp_path / "cache" and (folder / "config.json").is_file()
    loaded = load_model(folder, torch.float32).eval()
    from transformers import AutoTokenizer

    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    text = "12+34=46"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(loaded_tokenizer(text, return_tensors="pt").input_ids, ids)
    assert loaded_tokenizer.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        expected, got = model(ids).logits, loaded(ids).logits
    assert float((got - expected).abs().max()) <= tolerance
    assert kind == "f32" or float((got - expected).abs().max()) > 0  # (Q8_0 did quantise)

    # made once per file content: the second call is the cached folder (transformers is not asked again)
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("converted again"))
    assert hf_folder_of_gguf(files[kind]) == folder
    copy = tmp_path / "renamed.gguf"
    shutil.copy(files[kind], copy)
    assert hf_folder_of_gguf(copy) == folder  # the same content under another name


def test_a_bad_gguf_file_is_refused_naming_it(source, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_GGUF_CACHE", str(tmp_path / "cache"))
    _, _, files = source
    with pytest.raises(ValueError, match=f"{tmp_path / 'missing.gguf'}: no such GGUF file"):
        hf_folder_of_gguf(tmp_path / "missing.gguf")
    foreign = tmp_path / "weights.gguf"
    foreign.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=f"{foreign}: not a GGUF file"):
        hf_folder_of_gguf(foreign)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(files["f32"].read_bytes()[:4096])
    with pytest.raises(ValueError, match=f"{truncated}: transformers cannot load this GGUF file"):
        hf_folder_of_gguf(truncated)
    unsupported = tmp_path / "unsupported.gguf"  # an architecture transformers does not dequantise
    writer = gguf.GGUFWriter(str(unsupported), "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"{unsupported}: transformers cannot load this GGUF file"):
        hf_folder_of_gguf(unsupported)
    assert not any((tmp_path / "cache").glob(".*"))  # no half-made folder left behind


def test_relax_train_runs_two_steps_from_a_gguf_file(source, tiny_workspace, tmp_path, monkeypatch):
    from tests.support.runs import run_relax, tiny_train_args

    _, _, files = source
    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "2", "--skip-eval-before-train")
    args[args.index("--hf-checkpoint") + 1] = str(files["q8_0"])
    result = run_relax("train", *args, env={"RELAX_GGUF_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 2" in (tmp_path / "run" / "run.log").read_text()
    bad = tiny_train_args(tiny_workspace, tmp_path / "bad", "--num-rollout", "1")
    bad[bad.index("--hf-checkpoint") + 1] = str(tmp_path / "missing.gguf")
    result = run_relax("train", *bad, env={"RELAX_GGUF_CACHE": str(tmp_path / "cache")})
    assert result.returncode != 0
    assert f"--hf-checkpoint {tmp_path / 'missing.gguf'}: no such GGUF file" in result.stderr


def test_gguf_file_names_the_file_inside_the_checkpoint_folder(source, tmp_path, monkeypatch):
    """`--hf-checkpoint FOLDER --gguf-file NAME` is `--hf-checkpoint FOLDER/NAME`; misuse is refused naming the flag."""
    from relax.cli.args import parse_config
    from relax.cli.common import with_model_folders
    from relax.config import ConfigError

    _, _, files = source
    monkeypatch.setenv("RELAX_GGUF_CACHE", str(tmp_path / "cache"))
    path = files["f32"]
    base = ["--prompt-data", str(tmp_path / "unused.jsonl"), "--rm-type", "exact_match", "--label-key", "label"]
    cfg = parse_config([*base, "--hf-checkpoint", str(path.parent), "--gguf-file", path.name])
    assert cfg.model_source == str(path)
    resolved = with_model_folders(cfg)
    assert resolved.hf_checkpoint == str(hf_folder_of_gguf(path)) and resolved.gguf_file is None
    assert with_model_folders(parse_config([*base, "--hf-checkpoint", str(path)])).hf_checkpoint == resolved.hf_checkpoint
    judged = with_model_folders(parse_config([*base, "--hf-checkpoint", str(path), "--genrm-model-path", str(path)]))
    assert judged.genrm_model_path == resolved.hf_checkpoint  # the judge model too
    for argv, message in (
        ([*base, "--gguf-file", path.name], "--gguf-file names a file inside --hf-checkpoint"),
        ([*base, "--hf-checkpoint", str(path), "--gguf-file", path.name], "is a GGUF file already"),
        ([*base, "--hf-checkpoint", str(path.parent), "--gguf-file", "model.safetensors"], "ending in .gguf"),
        ([*base, "--hf-checkpoint", str(path.parent), "--gguf-file", "sub/x.gguf"], "ending in .gguf"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config(argv)
    from relax.cli.serve import model_source  # relax serve applies the same rule to its two flags

    assert model_source(str(path.parent), path.name) == str(path)
    with pytest.raises(ValueError, match="--gguf-file model.safetensors: expected a file name ending in .gguf"):
        model_source(str(path.parent), "model.safetensors")
    missing = parse_config([*base, "--hf-checkpoint", str(path.parent), "--gguf-file", "absent.gguf"])
    with pytest.raises(ConfigError, match=f"--hf-checkpoint {path.parent / 'absent.gguf'}: no such GGUF file"):
        with_model_folders(missing)


def test_relax_serve_answers_from_a_gguf_file(source, tmp_path):
    """`relax serve --hf-checkpoint FOLDER --gguf-file NAME` over real HTTP on 127.0.0.1: greedy tokens equal the
    source model's."""
    import httpx

    from tests.support.http_servers import ServeProcess

    model, tokenizer, files = source
    path = files["f32"]
    with ServeProcess("--hf-checkpoint", str(path.parent), "--gguf-file", path.name, "--device", "cpu",
                      env={"RELAX_GGUF_CACHE": str(tmp_path / "cache")}, timeout_s=90) as serving:
        prompt = [int(t) for t in tokenizer("12+34=")["input_ids"]]
        body = httpx.post(f"{serving.url}/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                     "ignore_eos": True}}).json()
        served = body["output_ids"]
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                                      min_new_tokens=4)[0, len(prompt):].tolist()
        assert served[:4] == expected
