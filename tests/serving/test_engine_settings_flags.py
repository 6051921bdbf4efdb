"""The engine's settings (its KV pool, pages, prefill budget, CUDA graphs) act wherever the run builds an engine,
and are refused where it builds none. With --rollout-engine-protocol relax the run's `relax serve` processes had
been started without --max-total-tokens, --page-size, --max-prefill-tokens, --cuda-graph-max-bs and
--disable-cuda-graph (`relax serve` had no such flags), and with servers the run does not start (SGLang, vLLM,
OpenAI) the flags were taken and did nothing."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.backends.inference.embedded import CoreSettings
from relax.backends.inference.remote.launched_relax import core_arguments
from relax.cli import serve as serve_cli
from relax.cli.args import parse_config
from relax.cli.main import main
from relax.config import ConfigError
from relax.config.rules import ENGINE_SETTINGS
from relax.core.engines.embedded import core_settings
from relax.core.engines.factory import build_relax_server_engine

EXTERNAL = ["--n-samples-per-prompt", "4", "--rollout-external", "--rollout-external-engine-addrs",
            "http://127.0.0.1:9"]
CHANGED = {"engine_core": ["--engine-core", "off"], "mem_fraction_static": ["--mem-fraction-static", "0.5"],
           "max_total_tokens": ["--max-total-tokens", "4096"], "max_prefill_tokens": ["--max-prefill-tokens", "512"],
           "page_size": ["--page-size", "8"], "cuda_graph_max_bs": ["--cuda-graph-max-bs", "64"],
           "disable_cuda_graph": ["--disable-cuda-graph"]}


@st.composite
def core_settings_values(draw) -> CoreSettings:
    page = draw(st.integers(1, 256))
    return CoreSettings(
        mode=draw(st.sampled_from(["auto", "on", "off"])),
        mem_fraction_static=draw(st.floats(0.001, 0.999)),
        max_total_tokens=draw(st.one_of(st.none(), st.integers(max(64, page), 10**7))),
        max_prefill_tokens=draw(st.integers(16, 10**6)), page_size=page, cuda_graphs=draw(st.booleans()),
        max_graph_batch=draw(st.integers(1, 512)), kv_cache_dtype=draw(st.sampled_from(["auto", "fp8_e4m3"])))


@settings(max_examples=60, deadline=None)
@given(core=core_settings_values())
def test_a_launched_server_is_started_with_the_run_s_engine_settings(core):
    args = serve_cli.serve_parser().parse_args(["--hf-checkpoint", "model", *core_arguments(core)])
    assert serve_cli.core_settings_of(args) == core


def test_every_engine_setting_reaches_the_servers_the_run_starts(tiny_workspace, tmp_path):
    assert set(CHANGED) == set(ENGINE_SETTINGS)
    flags = [flag for name, flag in CHANGED.items() if name != "engine_core"]
    cfg = parse_config([*EXTERNAL, "--hf-checkpoint", str(tiny_workspace / "model"), "--rollout-engine-protocol",
                        "relax", *sum(flags, [])])
    engine = build_relax_server_engine(cfg, "http://127.0.0.1:9", tmp_path / "weights")
    (tmp_path / "weights").mkdir()
    args = serve_cli.serve_parser().parse_args(engine.arguments()[1:])
    expected = dataclasses.replace(core_settings(cfg), fp8=False, session_idle_s=CoreSettings().session_idle_s)
    assert serve_cli.core_settings_of(args) == expected
    assert expected.max_total_tokens == 4096 and expected.page_size == 8 and not expected.cuda_graphs


@pytest.mark.parametrize("name", ENGINE_SETTINGS)
@pytest.mark.parametrize("protocol", ["sglang", "openai", "vllm"])
def test_an_engine_setting_is_refused_where_the_run_builds_no_engine(name, protocol):
    with pytest.raises(ConfigError, match=f"{CHANGED[name][0]}: settings of an engine the run builds"):
        parse_config([*EXTERNAL, "--rollout-engine-protocol", protocol, *CHANGED[name]])


def test_an_engine_teacher_takes_the_engine_settings_beside_external_servers(tmp_path):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    cfg = parse_config([*EXTERNAL, "--use-opd", "--opd-type", "engine", "--teacher-hf-checkpoint", str(teacher),
                        "--opd-kl-coef", "1.0", "--max-total-tokens", "4096"])
    assert core_settings(cfg).max_total_tokens == 4096


@pytest.mark.parametrize(("flags", "message"), [
    (["--max-total-tokens", "64", "--page-size", "65"], "--max-total-tokens 64 holds no page of --page-size 65"),
    (["--max-total-tokens", "32"], "--max-total-tokens: 32 must be from 64"),
    (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs: 0 must be from 1"),
])
def test_relax_serve_refuses_engine_settings_it_cannot_build_before_loading(tiny_workspace, capsys, flags,
                                                                            message):
    code = main(["serve", "--hf-checkpoint", str(tiny_workspace / "model"), "--device", "cpu", *flags])
    assert code == 2 and message in capsys.readouterr().err


def test_relax_eval_builds_its_engine_with_the_engine_settings(tiny_workspace, monkeypatch, capsys):
    """`relax eval` built its engine with the defaults whatever the flags said (its held-out prompts were kept for
    the --max-total-tokens pool all the same)."""
    import relax.cli.evaluate as evaluate

    built = []

    class Recorded(evaluate.EmbeddedEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(evaluate, "EmbeddedEngine", Recorded)
    code = main(["eval", "--hf-checkpoint", str(tiny_workspace / "model"), "--eval-prompt-data", "held_out",
                 str(tiny_workspace / "test.jsonl"), "--custom-rm-path", "tests.support.e2e_rewards:digit_fraction",
                 "--rollout-max-response-len", "4", "--max-total-tokens", "96", "--page-size", "8",
                 "--engine-core", "on"])
    assert code == 0 and "held_out: accuracy" in capsys.readouterr().out
    (engine,) = built
    assert engine.core.scheduler.max_sequence_tokens == 96 and engine.core.blocks.block_size == 8
