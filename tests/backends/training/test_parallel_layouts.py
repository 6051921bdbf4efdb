"""The trainer's mesh (issue 30): a training step under tensor parallelism, alone and with FSDP2, equals the
single-process step on real gloo process groups (dense Qwen3, Qwen3-MoE, a vision-language model); checkpoints
reshard across layouts; the weights an engine is synced with are the trainer's full tensors; layouts that cannot be
built are refused naming the flag."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from hypothesis import given
from hypothesis import strategies as st

from relax.backends.training.fsdp import FSDPTrainBackend
from relax.backends.training.mesh import ParallelDims
from relax.distributed.process_group import free_loopback_port, shutdown_process_group
from tests.backends.training.test_packing import LOSS, _media_batch, _rl_batch, _settings
from tests.support.runs import start_ranks
from tests.support.tiny_assets import build_tiny_model_dir
from tests.support.tiny_families import build_text_family
from tests.support.tiny_mm_assets import build_tiny_vl

LR = 1e-4


def _backend(model_dir: str, tp: int = 1, ep: int = 1, cp: int = 1, pp: int = 1, sp: bool = False,
             replicas: int = 1) -> FSDPTrainBackend:
    torch.manual_seed(0)
    # clip_grad: the clipping runs (the norms stay below it)
    return FSDPTrainBackend(model_dir, dataclasses.replace(_settings(), lr=LR, clip_grad=10.0,
                                                           tensor_model_parallel_size=tp,
                                                           expert_model_parallel_size=ep,
                                                           context_parallel_size=cp,
                                                           pipeline_model_parallel_size=pp,
                                                           sequence_parallel=sp,
                                                           data_parallel_replicate_size=replicas))


def _grads(backend) -> dict[str, torch.Tensor]:
    """The full gradients (of every pipeline stage's weights: each rank holds its stage's)."""
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in backend.model.named_parameters() if p.grad is not None}
    if backend.pipeline is not None:
        stages: list = [None] * dist.get_world_size()
        dist.all_gather_object(stages, grads)
        grads = {name: grad for stage in stages for name, grad in stage.items()}
    return grads


def _step(backend, batch) -> dict:
    metrics = backend.train_step(batch, LOSS)
    return {"metrics": metrics, "grads": _grads(backend), "state": backend.full_state_dict()}


def _assert_same_step(got: dict, expected: dict) -> None:
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5, abs=1e-7), key
    assert got["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    # AdamW moves each weight by about lr whatever its gradient's size, so float32 sums taken in another order
    # move a near-zero gradient's weight by a small fraction of lr: compare at 2% of it
    for name, tensor in expected["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=0, atol=0.02 * LR, msg=name)


def _join(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)


# (model, layout) run on two processes: each axis alone on the dense and the MoE model (tied: the quickstart's model,
# its LM head its embedding)
TWO_PROCESS_LAYOUTS = (("qwen3", "tp"), ("qwen3", "tp_sp"), ("vl", "tp"), ("qwen3", "cp"), ("qwen3", "pp"),
                       ("tied", "pp"), ("qwen3_moe", "tp"), ("qwen3_moe", "tp_sp"), ("qwen3_moe", "ep"), ("qwen3_moe", "cp"),
                       ("qwen3_moe", "pp"))
SIZES = {"tp": dict(tp=2), "tp_sp": dict(tp=2, sp=True), "ep": dict(ep=2), "cp": dict(cp=2), "pp": dict(pp=2)}


def _two_process_on_rank(rank: int, world: int, port: int, models: dict, root: str) -> None:
    """World 2: a step per (model, layout); each Qwen3 / Qwen3-MoE checkpoint saved in that layout and loaded at
    FSDP=2, which takes a second step; the weights of a weight sync from the sharded trainer."""
    _join(rank, world, port)
    results = {}
    for name, layout in TWO_PROCESS_LAYOUTS:
        backend = _backend(models[name], **SIZES[layout])
        assert backend.dims.dp == (2 if layout == "ep" else 1)
        batch = torch.load(Path(root) / f"{name}.batch", weights_only=False)
        if layout == "pp":  # the forward without gradients through the pipeline: every stage gets the log-probs
            results[name, layout, "log_probs"] = backend.compute_log_probs(batch, top_k=3)
        results[name, layout] = _step(backend, batch)
        if name != "vl" and layout != "cp":
            results[name, layout, "synced"] = {n: t.clone() for bucket in backend.named_parameters_for_sync(
                torch.float32, 1 << 12) for n, t in bucket}
            backend.save(Path(root) / f"{name}-{layout}")
        backend.release()
        if name != "vl" and layout != "cp":
            data_parallel = _backend(models[name])
            data_parallel.load(Path(root) / f"{name}-{layout}")
            results[name, layout, "loaded_at_fsdp2"] = data_parallel.full_state_dict()
            results[name, layout, "second_step_at_fsdp2"] = _step(data_parallel, _rl_batch(seed=1))
            data_parallel.release()
    if rank == 0:
        torch.save(results, Path(root) / "results.pt")
    shutdown_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    dirs = {name: str(build_text_family(name, root / name)) for name in ("qwen3", "qwen3_moe")}
    dirs["vl"] = str(build_tiny_vl(root))
    dirs["tied"] = str(build_tiny_model_dir(root / "tied"))
    batches = {"qwen3": _rl_batch(), "qwen3_moe": _rl_batch(), "vl": _media_batch(dirs["vl"], "image", root, count=2),
               "tied": _rl_batch()}
    for name, batch in batches.items():
        torch.save(batch, root / f"{name}.batch")
    return root, dirs, batches


def test_tensor_and_expert_parallel_steps_equal_the_single_process_step_and_checkpoints_reshard(models):
    root, dirs, batches = models
    start_ranks(_two_process_on_rank, (2, free_loopback_port(), dirs, str(root)), nprocs=2)
    results = torch.load(root / "results.pt", weights_only=False)
    for name, layout in TWO_PROCESS_LAYOUTS:
        single = _backend(dirs[name])
        assert (single.dims.world_size, single.dims.tp, single.dims.ep, single.dims.cp) == (1, 1, 1, 1)
        if (name, layout, "log_probs") in results:
            for got, expected in zip(results[name, layout, "log_probs"], single.compute_log_probs(batches[name],
                                                                                                 top_k=3)):
                assert (got is None) == (expected is None)
                for row, reference in zip(got or (), expected or ()):
                    torch.testing.assert_close(row, reference, rtol=1e-5, atol=1e-6)
        _assert_same_step(results[name, layout], _step(single, batches[name]))
        if name != "vl" and layout != "cp":
            first_state = results[name, layout]["state"]
            # an engine synced from the sharded trainer holds exactly its full tensors
            synced = results[name, layout, "synced"]
            # (a head tied to the embedding is sent once, under the embedding's name)
            assert synced.keys() == first_state.keys() - ({"lm_head.weight"} if name == "tied" else set())
            for n, tensor in synced.items():
                assert torch.equal(tensor, first_state[n]), n
            # loaded at FSDP=2: the same weights, and the optimizer state came along (the second step equals the
            # single process's second step)
            for n, tensor in first_state.items():
                assert torch.equal(results[name, layout, "loaded_at_fsdp2"][n], tensor), n
            _assert_same_step(results[name, layout, "second_step_at_fsdp2"], _step(single, _rl_batch(seed=1)))
        single.release()


# per model, the (tp, ep, cp, pp, replicas) of each step on four processes, each step resuming the previous one's
# checkpoint
FOUR_PROCESS_LAYOUTS = {
    # FSDP2 x TP2 -> TP2 x CP2 -> FSDP4 -> HSDP (2 replicas x FSDP2) -> PP2 x FSDP2 -> PP2 x TP2
    "qwen3": ((2, 1, 1, 1, 1), (2, 1, 2, 1, 1), (1, 1, 1, 1, 1), (1, 1, 1, 1, 2), (1, 1, 1, 2, 1), (2, 1, 1, 2, 1)),
    # FSDP4 with EP2 -> TP2 x EP2 -> EP4 -> PP2 x FSDP2 -> PP2 x EP2 -> TP2 x CP2 -> HSDP
    "qwen3_moe": ((1, 2, 1, 1, 1), (2, 2, 1, 1, 1), (1, 4, 1, 1, 1), (1, 1, 1, 2, 1), (1, 2, 1, 2, 1),
                  (2, 1, 2, 1, 1), (1, 1, 1, 1, 2))}


def _two_dimensional_on_rank(rank: int, world: int, port: int, models: dict, root: str) -> None:
    _join(rank, world, port)
    results = {}
    for name, layouts in FOUR_PROCESS_LAYOUTS.items():
        for index, (tp, ep, cp, pp, replicas) in enumerate(layouts):
            backend = _backend(models[name], tp=tp, ep=ep, cp=cp, pp=pp, replicas=replicas)
            assert backend.dims.dp == world // (tp * cp * pp) and backend.dims.ep == ep
            if replicas > 1:  # HSDP: every weight replicated over the replicas, sharded within each
                from torch.distributed.tensor import Replicate, Shard

                assert all(p.placements == (Replicate(), Shard(0)) for p in backend.model.parameters())
            if index:
                backend.load(Path(root) / f"{name}-step{index}")
            results[name, index] = _step(backend, _rl_batch(seed=index))
            backend.save(Path(root) / f"{name}-step{index + 1}")
            backend.release()
    if rank == 0:
        torch.save(results, Path(root) / "results.pt")
    shutdown_process_group()


@pytest.mark.slow
def test_two_dimensional_layouts_equal_the_single_process_steps_and_reshard(models, tmp_path):
    _, dirs, _ = models
    start_ranks(_two_dimensional_on_rank, (4, free_loopback_port(), dirs, str(tmp_path)), nprocs=4)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    for name, layouts in FOUR_PROCESS_LAYOUTS.items():
        single = _backend(dirs[name])
        for index in range(len(layouts)):
            _assert_same_step(results[name, index], _step(single, _rl_batch(seed=index)))
        single.release()


# ---- layouts refused -----------------------------------------------------------------------------

@given(world=st.integers(1, 16), tp=st.integers(1, 8), cp=st.integers(1, 4), heads=st.integers(1, 16),
       kv_heads=st.integers(1, 8))
def test_a_layout_is_refused_exactly_when_a_size_does_not_divide_naming_the_flag(world, tp, cp, heads, kv_heads):
    config = transformers.Qwen3Config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    dims = ParallelDims(world, tp=tp, cp=cp)
    fits = (world % (tp * cp) == 0 and (tp == 1 or (heads % tp == 0 and kv_heads % tp == 0))
            and (cp == 1 or heads % (tp * cp) == 0))
    if fits:
        dims.check(config)
        assert dims.dp * tp * cp == world
    else:
        with pytest.raises(ValueError, match="--tensor-model-parallel-size|--context-parallel-size"):
            dims.check(config)


def test_a_family_without_a_plan_is_refused_naming_the_flag(models):
    from relax.backends.training.parallelize import tensor_parallel_plan

    config = transformers.CONFIG_MAPPING["glm_moe_dsa"](num_hidden_layers=1, hidden_size=32, num_attention_heads=2)
    with pytest.raises(ValueError, match="--tensor-model-parallel-size: GLM-5 .* has no tensor-parallel plan"):
        tensor_parallel_plan(config)


def test_the_flag_reaches_the_trainer_and_the_upstream_flags_left_are_refused_with_a_reason():
    from relax.cli.args import parse_config
    from relax.config import ConfigError

    cfg = parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--tensor-model-parallel-size", "2"])
    assert cfg.tensor_model_parallel_size == 2
    for extra, message in ((["--context-parallel-size", "2", "--no-sequence-packing"], "drop --no-sequence-packing"),
                           (["--expert-model-parallel-size", "2", "--no-moe-grouped-gemm"],
                            "drop --no-moe-grouped-gemm")):
        with pytest.raises(ConfigError, match=message):
            parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", *extra])
    cfg = parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--pipeline-model-parallel-size", "2",
                        "--decoder-last-pipeline-num-layers", "3"])
    assert (cfg.pipeline_model_parallel_size, cfg.decoder_last_pipeline_num_layers) == (2, 3)
    for extra, message in ((["--pipeline-model-parallel-size", "2", "--no-sequence-packing"],
                            "--pipeline-model-parallel-size runs packed micro-batches: drop --no-sequence-packing"),
                           (["--decoder-first-pipeline-num-layers", "2"],
                            "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1")):
        with pytest.raises(ConfigError, match=message):
            parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", *extra])
    cfg = parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel"])
    assert cfg.sequence_parallel
    with pytest.raises(ConfigError, match="--sequence-parallel splits the tokens over the tensor-parallel ranks: it "
                                          "needs --tensor-model-parallel-size > 1"):
        parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--sequence-parallel"])
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size: not built in Relax yet"):
        parse_config(["--hf-checkpoint", "m", "--prompt-data", "d.jsonl", "--expert-tensor-parallel-size", "2"])


def test_sequence_parallel_is_refused_for_a_block_it_is_not_built_for_naming_the_flag(models, tmp_path):
    from relax.backends.training.parallelize import _sequence_parallel_styles
    from relax.backends.training.response_model import language_model

    _, dirs, _ = models
    for name in ("qwen3", "qwen3_moe"):
        model = transformers.AutoModelForCausalLM.from_pretrained(dirs[name])
        styles = _sequence_parallel_styles(language_model(model))
        assert {key.split(".")[-1] for key in styles} == {"input_layernorm", "post_attention_layernorm", "self_attn",
                                                          "mlp"}
        assert len(styles) == 4 * model.config.num_hidden_layers
    gemma = transformers.AutoModelForCausalLM.from_pretrained(build_text_family("gemma3_text", tmp_path / "gemma"))
    with pytest.raises(ValueError, match="--sequence-parallel: Gemma3DecoderLayer .* is not a pre-norm attention"):
        _sequence_parallel_styles(language_model(gemma))


@given(layers=st.integers(1, 64), stages=st.integers(1, 16), first=st.none() | st.integers(0, 20),
       last=st.none() | st.integers(0, 20))
def test_pipeline_stages_hold_every_layer_once_in_order_or_the_split_is_refused_naming_the_flag(layers, stages, first,
                                                                                                last):
    from relax.backends.training.pipeline import stage_layers

    fits = stages <= layers
    if stages == 1:
        fits = fits and first is None and last is None
    else:
        fixed = [c for c in (first, last) if c is not None]
        free = stages - len(fixed)
        rest = layers - sum(fixed)
        fits = fits and all(c >= 1 for c in fixed) and rest >= free and (free > 0 or rest == 0)
    if not fits:
        with pytest.raises(ValueError, match="--pipeline-model-parallel-size|--decoder-(first|last)-pipeline-num-layers"):
            stage_layers(layers, stages, first, last)
        return
    ranges = stage_layers(layers, stages, first, last)
    assert len(ranges) == stages and all(len(r) >= 1 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(layers))  # contiguous, in order, each layer once
    if first is not None:
        assert len(ranges[0]) == first
    if last is not None:
        assert len(ranges[-1]) == last
    free = [len(r) for i, r in enumerate(ranges) if not ((i == 0 and first is not None)
                                                         or (i == stages - 1 and last is not None))]
    assert not free or max(free) - min(free) <= 1  # the rest as even as the count allows


def test_pipeline_beside_context_parallel_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size with --context-parallel-size is not"):
        ParallelDims(4, cp=2, pp=2).check()


# What `check_layout` refuses beyond the sizes, as docs/parallelism.md states it: (what is asked, what it is refused
# with). Each entry is a LayoutUses field, or "multimodal" for a vision-language model.
NOT_BUILT_WITH = {
    "pp": {"padded", "multimodal", "routing_replay", "moe_aux_loss", "value_head", "lora"},
    "cp": {"padded", "routing_replay", "moe_aux_loss"},
    "sp": {"padded", "multimodal", "tp1", "pp", "cp"},
}


@given(tp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), sp=st.booleans(),
       packing=st.booleans(), lora=st.booleans(), replay=st.booleans(), aux=st.booleans(), value_head=st.booleans(),
       multimodal=st.booleans())
def test_a_combination_is_refused_exactly_when_docs_say_it_is_not_built_naming_the_flag(tp, cp, pp, sp, packing, lora,
                                                                                       replay, aux, value_head,
                                                                                       multimodal):
    from relax.backends.training.layout import LayoutUses, check_layout

    config = _vl_config() if multimodal else transformers.Qwen3Config(num_attention_heads=4, num_key_value_heads=2,
                                                                        num_hidden_layers=4)
    dims = ParallelDims(tp * cp * pp, tp=tp, cp=cp, pp=pp)
    uses = LayoutUses(sequence_packing=packing, sequence_parallel=sp, lora=lora, routing_replay=replay,
                      moe_aux_loss=aux, value_head=value_head)
    has = {"padded": not packing, "multimodal": multimodal, "routing_replay": replay, "moe_aux_loss": aux,
           "value_head": value_head, "lora": lora, "tp1": tp == 1, "pp": pp > 1, "cp": cp > 1}
    asked = {"pp": pp > 1, "cp": cp > 1, "sp": sp}
    refused = (pp > 1 and cp > 1) or (lora and tp > 1) or any(
        asked[kind] and any(has[what] for what in NOT_BUILT_WITH[kind]) for kind in NOT_BUILT_WITH)
    if not refused:
        check_layout(dims, config, uses)
        return
    with pytest.raises(ValueError, match="--(pipeline-model|context|tensor-model)-parallel-size|--sequence-parallel"):
        check_layout(dims, config, uses)


def _vl_config():
    return transformers.Qwen2_5_VLConfig(text_config={"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "num_hidden_layers": 4, "hidden_size": 64})


# (WORLD_SIZE, flags, what the message names): layouts the trainer cannot build, each a different reason.
LAYOUTS_THE_TRAINER_CANNOT_BUILD = [
    ("1", ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 x --context-parallel-size 1 does "
                                                 "not divide the 1 training processes"),
    ("2", ["--data-parallel-replicate-size", "4"], "--data-parallel-replicate-size 4"),
    ("4", ["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size 4 does not divide the model's "
                                                 "num_key_value_heads (2)"),
    ("4", ["--context-parallel-size", "4", "--tensor-model-parallel-size", "1"], None),  # 4 heads: it fits
    ("2", ["--tensor-model-parallel-size", "2", "--lora-rank", "4"], "--lora-rank with --tensor-model-parallel-size"),
    ("2", ["--pipeline-model-parallel-size", "2", "--lora-rank", "4"], "--pipeline-model-parallel-size 2: not built "
                                                                        "yet with LoRA"),
    ("4", ["--pipeline-model-parallel-size", "4"], "--pipeline-model-parallel-size 4 exceeds the model's 2 decoder"),
    ("2", ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"],
     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers leave 0"),
    ("2", ["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2: Qwen3Config has no experts"),
    ("2", ["--advantage-estimator", "ppo", "--pipeline-model-parallel-size", "2"], "not built yet with a critic"),
    ("1", ["--placement", "ray", "--resource", '{"actor": [3, 0]}', "--tensor-model-parallel-size", "2"],
     "does not divide the 3 training processes (the actor of the model at"),
    ("1", ["--placement", "ray", "--resource", '{"actor": [2, 0], "critic": [3, 0]}', "--advantage-estimator", "ppo",
           "--tensor-model-parallel-size", "2"], "(the critic of the model at"),
]


@pytest.mark.parametrize(("world", "flags", "named"), LAYOUTS_THE_TRAINER_CANNOT_BUILD)
def test_a_layout_the_trainer_cannot_build_is_refused_before_the_model_loads(world, flags, named, tiny_workspace,
                                                                            tmp_path, monkeypatch, capsys):
    """`relax train` with such a layout failed inside the trainer, after the model loaded, with a traceback and exit
    status 1 (which a supervised run takes for a fault and restarts); preflight now runs the trainer's own check on
    the settings each trainer will get (under torchrun its WORLD_SIZE, under Ray its --resource replicas): exit 2
    naming the flag, no run directory, no model loaded."""
    from relax.cli.args import parse_config
    from relax.cli.main import main
    from relax.core.preflight import preflight
    from tests.support.runs import tiny_train_args

    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr("relax.backends.training.fsdp.load_model", _no_model_loads)
    args = tiny_train_args(tiny_workspace, tmp_path / "run", "--num-rollout", "1", *flags)
    if named is None:  # a layout that fits passes preflight (the run itself needs the real ranks)
        preflight(parse_config(args))
        return
    code = main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def _no_model_loads(*args, **kwargs):
    raise RuntimeError("the model loaded")


@pytest.fixture(scope="module")
def moe_workspace(tmp_path_factory):
    """The tiny workspace's data beside a tiny Qwen3-MoE with its tokenizer."""
    from tests.support.tiny_assets import write_addition_data

    root = tmp_path_factory.mktemp("moe_workspace")
    build_text_family("qwen3_moe", root / "model")
    write_addition_data(root / "train.jsonl", 64, seed=0)
    write_addition_data(root / "test.jsonl", 16, seed=1)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tensor", "expert", "pipeline"])
def test_a_model_parallel_relax_train_run_gives_the_single_process_runs_metrics(layout, tiny_workspace,
                                                                                moe_workspace, tmp_path):
    """`relax train --tensor-model-parallel-size 2` on two ranks (dense),
    `--expert-model-parallel-size 2` (MoE) or `--pipeline-model-parallel-size 2` (the quickstart's model, whose head
    is its embedding): each rank generates half of the groups, seeded per sample, so the same samples as one
    engine; three steps give the one-process run's metrics, and `relax export` of the sharded run's checkpoint
    gives the one-process run's Hugging Face folder."""
    from tests.support.runs import assert_ranks_take_the_one_process_steps, run_relax, tiny_train_args

    workspace = moe_workspace if layout == "expert" else tiny_workspace
    args = ("--num-rollout", "3", "--clip-grad", "1.0", "--save-interval", "3")
    assert_ranks_take_the_one_process_steps(lambda out, *extra: ["train", *tiny_train_args(workspace, out, *args,
                                                                                                 *extra)],
                                                tmp_path, 3, f"--{layout}-model-parallel-size", "2")
    from safetensors.torch import load_file

    exported = {}
    for name in ("one", "two"):
        result = run_relax("export", str(tmp_path / name), str(tmp_path / f"{name}_hf"))
        assert result.returncode == 0, result.stderr[-3000:]
        exported[name] = {k: v for f in sorted((tmp_path / f"{name}_hf").glob("*.safetensors"))
                          for k, v in load_file(f).items()}
    assert exported["two"].keys() == exported["one"].keys()
    # (AdamW moves a weight by about lr whatever its gradient's size: sums in another order move a near-zero
    # gradient's weight by a fraction of lr = 1e-3; measured 2e-6 at most)
    for key, tensor in exported["one"].items():
        torch.testing.assert_close(exported["two"][key], tensor, rtol=0, atol=1e-5, msg=key)


# ---- plans at real shapes, simulated (benchmarks/parallel_plan.py) -------------------------------------------------

SIMULATED = [("Qwen3-4B", 8, 2, 1), ("Qwen3-Omni-30B-A3B thinker", 16, 2, 8)]


def test_real_shapes_lay_out_on_a_simulated_world():
    """The real Qwen3-4B and Qwen3-Omni thinker on the meta device under a fake group of 8 / 16 ranks: the trainer's
    plans apply (the omni thinker lists its audio encoder beside the encoder's layers as FSDP units: inner units are
    wrapped first), and one rank holds the share the layout implies. (In a process of its own: the fake group is
    the default group, and this process may hold a real one.)"""
    import json
    import subprocess
    import sys

    from tests.support.runs import ROOT

    script = ("import json, sys; from benchmarks.parallel_plan import plan; "
              f"print(json.dumps([plan(*layout, tokens=4096) for layout in {SIMULATED!r}]))")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    for row, (_, world, tp, ep) in zip(rows, SIMULATED):
        assert (row["world"], row["tp"], row["ep"], row["dp"]) == (world, tp, ep, world // tp)
        # each rank holds at least its 1/world share and at most 1/dp of the whole
        assert row["parameters_total_b"] / world <= row["parameters_per_gpu_b"] * 1.001
        assert row["parameters_per_gpu_b"] <= row["parameters_total_b"] / row["dp"] * 1.001
