"""A decode step's inputs as the paged runner stages them for its CUDA graphs (block tables kept as rows from step
to step, token sources, slots, positions), checked on the CPU against the same values built from the sequences'
lists, over random batches that grow, copy blocks on write, get preempted, join and leave; and the engine core's
host loop end to end with the device work taken out (`benchmarks.engine_host_cpu`)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.engine_host_cpu import HostOnlyRunner
from benchmarks.engine_host_cpu import run as run_host_only
from relax.backends.inference.base import GenerationRequest, PauseHolds, SamplingParams
from relax.backends.inference.engine_core.block_manager import RESERVED_BLOCK, BlockManager
from relax.backends.inference.engine_core.core import EngineCore
from relax.backends.inference.engine_core.scheduler import Scheduler
from relax.backends.inference.engine_core.sequence import Sequence
from relax.backends.inference.engine_core.step_runner import StepOutput
from relax.backends.inference.engine_core.table_rows import BlockTableRows
from tests.backends.inference.test_embedded_engine import make_model

PAGE, WIDTH = 4, 12


def _sequence(index: int, prompt_len: int) -> Sequence:
    request = GenerationRequest(f"r{index}", list(range(2, 2 + prompt_len)),
                                SamplingParams(max_new_tokens=40, temperature=0.5 + index % 3, seed=index))
    return Sequence(request, seed=1000 + index, stop_token_ids=frozenset(), stop_window_tokens=0, arrival=index)


class _World:
    """Sequences whose block tables change the ways the scheduler changes them, with fresh block ids."""

    def __init__(self, rng: random.Random, count: int) -> None:
        self.rng, self.next_block = rng, 1
        self.sequences = [_sequence(i, rng.randint(1, 10)) for i in range(count)]
        for sequence in self.sequences:
            sequence.block_table = [self._block() for _ in range(-(-sequence.num_tokens // PAGE))]

    def _block(self) -> int:
        self.next_block += 1
        return self.next_block

    def step(self, members: list[Sequence]) -> None:
        for sequence in members:
            change = self.rng.random()
            if change < 0.3 and len(sequence.token_ids) < PAGE * WIDTH - 1:  # grow a token, maybe opening a block
                sequence.token_ids.append(self.rng.randint(2, 50))
            elif change < 0.4:  # copy-on-write: the last block replaced in place
                sequence.block_table[-1] = self._block()
            elif change < 0.45:  # preempted and admitted again: a new list
                sequence.block_table = [self._block() for _ in sequence.block_table]
        for sequence in members:  # room for the newest token (a pending one included), as `append_slot` makes
            while len(sequence.block_table) < -(-sequence.num_tokens // PAGE):
                sequence.block_table.append(self._block())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), steps=st.integers(1, 25))
def test_the_kept_rows_always_hold_each_sequences_current_table(seed, steps):
    rng = random.Random(seed)
    world = _World(rng, 10)
    rows = BlockTableRows(capacity=2 * 10, width=WIDTH)
    for _ in range(steps):
        members = sorted(rng.sample(world.sequences, rng.randint(1, 10)), key=lambda s: s.arrival)
        world.step(members)
        indices = rows.rows(members)
        assert len(set(indices.tolist())) == len(members)  # no two sequences share a row
        for sequence, row in zip(members, indices):
            table = sequence.block_table
            assert rows.array[row, :len(table)].tolist() == table
            assert (rows.array[row, len(table):] == RESERVED_BLOCK).all()
        assert rows.longest(indices) == max(len(s.block_table) for s in members)


def _reference_inputs(sequences: list[Sequence], previous: StepOutput | None) -> dict[str, list]:
    """The step's inputs from the sequences' lists, as the runner staged them before it kept rows."""
    row_of = {id(s): row for row, s in enumerate(previous.sequences)} if previous is not None else {}
    inputs, slots, tables = [], [], []
    for sequence in sequences:
        inputs.append(int(previous.tokens[row_of[id(sequence)]]) if sequence.pending else sequence.token_ids[-1])
        last = sequence.num_tokens - 1
        slots.append(sequence.block_table[last // PAGE] * PAGE + last % PAGE)
        tables.append(sequence.block_table)
    return {"input_ids": inputs, "slots": slots, "tables": tables,
            "positions": [s.num_tokens - 1 for s in sequences], "lens": [s.num_tokens for s in sequences],
            "seeds": [s.seed for s in sequences], "temperature": [s.params.temperature for s in sequences]}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_the_staged_graph_inputs_equal_the_ones_built_from_the_sequences(seed):
    rng = random.Random(seed)
    world = _World(rng, 12)
    runner = HostOnlyRunner(batch=16, num_blocks=4096, block_size=PAGE, max_blocks_per_sequence=WIDTH)
    previous = None
    for _ in range(12):
        if previous is not None and rng.random() < 0.7:  # the steady state: the same batch, every token pending
            members = previous.sequences
            for sequence in members:
                sequence.pending = 1
        else:
            members = sorted(rng.sample(world.sequences, rng.randint(1, 12)), key=lambda s: s.arrival)
            for sequence in members:  # some wait for the previous step's token, the others have theirs
                in_previous = previous is not None and any(s is sequence for s in previous.sequences)
                sequence.pending = int(in_previous and rng.random() < 0.5)
        world.step(members)
        bucket = next(size for size in runner.graph_sizes if size >= len(members))
        expected = _reference_inputs(members, previous)
        runner._fill_graph_inputs(members, previous, bucket)
        buffers, batch = runner._buffers, len(members)
        for name in ("input_ids", "slots", "positions", "lens", "seeds"):
            assert buffers[name][:batch].tolist() == expected[name], name
        assert buffers["counters"][:batch].tolist() == expected["lens"]
        assert buffers["temperature"][:batch].tolist() == expected["temperature"]
        for row, table in enumerate(expected["tables"]):
            assert buffers["tables"][row, :len(table)].tolist() == table
        # padding rows: one token at the reserved block's first slot
        assert (buffers["lens"][batch:bucket] == 1).all() and (buffers["tables"][batch:bucket, 0] == RESERVED_BLOCK).all()
        assert (buffers["slots"][batch:bucket] == RESERVED_BLOCK * PAGE).all()
        tokens = torch.tensor([rng.randint(2, 99) for _ in members])
        previous = runner._finish(members, tokens, torch.zeros(batch), version=0)  # turns the staging buffers


def test_the_host_loop_decodes_every_token_of_every_sequence_and_times_its_phases():
    result = run_host_only(batch=32, prompt_len=20, new_tokens=24)
    assert result["new_tokens_produced"] == 32 * 24
    assert result["decode_steps"] == 23  # the prefill samples the first token, a decode step each of the others
    assert set(result["phases_ms_per_decode_step"]) >= {"schedule", "launch", "process"}
    assert np.isfinite(result["host_ms_per_decode_step"])


# ---- merged projections ------------------------------------------------------------------------------------------
def _linears(bias: bool) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(8, width, bias=bias) for width in (6, 4, 4)]


def test_merged_projections_compute_each_linear_and_hold_no_second_copy():
    from relax.backends.inference.engine_core.merged_projections import MergedLinears

    for bias in (False, True):
        linears = _linears(bias)
        x = torch.randn(5, 8)
        expected = [linear(x) for linear in linears]
        group = MergedLinears(linears)
        for out, want in zip(group(x), expected):
            torch.testing.assert_close(out, want)
        storage = group.weight.untyped_storage().data_ptr()
        assert all(linear.weight.untyped_storage().data_ptr() == storage for linear in linears)
        with torch.no_grad():  # a weight update through a parameter (an in-place copy) reaches the product
            linears[1].weight.copy_(torch.randn(4, 8))
        torch.testing.assert_close(group(x)[1], linears[1](x))


def test_merged_projections_stack_again_after_the_weights_were_released_and_loaded():
    from relax.backends.inference.engine_core.merged_projections import MergedLinears

    linears = _linears(bias=True)
    group = MergedLinears(linears)
    loaded = [(linear.weight.detach().clone() * 2, linear.bias.detach().clone() - 1) for linear in linears]
    group.release()  # as `release_memory_occupation` does: the parameters' storage replaced, then zeros back
    for linear in linears:
        for parameter in (linear.weight, linear.bias):
            shape = parameter.shape
            parameter.data = parameter.data.new_empty(0)
            parameter.data = parameter.data.new_zeros(shape)
    group.merge()
    with torch.no_grad():
        for linear, (weight, bias) in zip(linears, loaded):
            linear.weight.copy_(weight)
            linear.bias.copy_(bias)
    x = torch.randn(3, 8)
    for out, (weight, bias) in zip(group(x), loaded):
        torch.testing.assert_close(out, x @ weight.T + bias)


@pytest.mark.parametrize("widths", [(6, 4, 4), (5,)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_group_laid_out_column_major_computes_the_same_and_weight_updates_reach_it(widths, bias):
    """Any group (three stacked linears, or one alone as o and down are) re-laid column-major and back: the same
    products, no second copy, each parameter a view of the layout, in-place weight updates reaching the product,
    and the layout kept across a release and reload (`release_memory_occupation`)."""
    from relax.backends.inference.engine_core.merged_projections import MergedLinears

    torch.manual_seed(len(widths))
    linears = [torch.nn.Linear(8, width, bias=bias) for width in widths]
    x = torch.randn(5, 8)
    expected = [linear(x).detach() for linear in linears]
    group = MergedLinears(linears)
    for column_major in (True, False, True):
        group.lay_out(column_major)
        assert group.weight.t().is_contiguous() == column_major and group.weight.is_contiguous() != column_major
        storage = group.weight.untyped_storage().data_ptr()
        assert all(linear.weight.untyped_storage().data_ptr() == storage for linear in linears)
        for out, want, linear in zip(group(x), expected, linears):
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(linear(x), want)  # the linear's own forward over the strided view
    with torch.no_grad():
        new = torch.randn(widths[-1], 8)
        linears[-1].weight.copy_(new)
        expected[-1] = x @ new.T + (linears[-1].bias if bias else 0)
    torch.testing.assert_close(group(x)[-1], expected[-1])
    group.release()
    loaded = [linear.weight.detach().clone() for linear in linears]
    for linear in linears:
        linear.weight.data = linear.weight.data.new_empty(0)
        linear.weight.data = linear.weight.data.new_zeros(linear.out_features, 8)
    group.merge()
    assert group.column_major and group.weight.t().is_contiguous()
    with torch.no_grad():
        for linear, weight in zip(linears, loaded):
            linear.weight.copy_(weight)
    for out, want in zip(group(x), expected):
        torch.testing.assert_close(out, want)


def test_a_lone_linear_as_the_model_stores_it_is_not_copied():
    from relax.backends.inference.engine_core.merged_projections import MergedLinears

    linear = torch.nn.Linear(8, 5)
    pointer = linear.weight.data_ptr()
    group = MergedLinears([linear])
    assert group.merged and group.weight.data_ptr() == pointer == linear.weight.data_ptr()


def test_the_decoder_groups_every_product_of_a_layer():
    from relax.backends.inference.engine_core.merged_projections import layer_groups

    layer = make_model(seed=0).model.layers[0]
    groups = layer_groups(layer)
    assert [group.linears for group in groups] == [
        [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], [layer.self_attn.o_proj],
        [layer.mlp.gate_proj, layer.mlp.up_proj], [layer.mlp.down_proj]]


def test_a_linear_with_its_own_forward_keeps_it():
    from relax.backends.inference.engine_core.merged_projections import MergedLinears

    linears = _linears(bias=False)
    group = MergedLinears(linears)
    linears[0].forward = lambda x: torch.zeros(x.shape[0], 6)  # as FP8 rollout patches a projection
    x = torch.randn(2, 8)
    assert not group.merged
    outs = group(x)
    assert (outs[0] == 0).all()
    torch.testing.assert_close(outs[2], linears[2](x))


def test_linears_that_are_not_plain_are_never_stacked():
    from relax.backends.inference.engine_core.merged_projections import MergedLinears

    class Adapted(torch.nn.Linear):  # as a LoRA layer adds to its base weight's product
        def forward(self, x):
            return super().forward(x) + 1

    torch.manual_seed(0)
    linears = [Adapted(8, 6), torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)]
    storages = [linear.weight.untyped_storage().data_ptr() for linear in linears]
    group = MergedLinears(linears)
    x = torch.randn(2, 8)
    assert not group.merged and [l.weight.untyped_storage().data_ptr() for l in linears] == storages
    for out, linear in zip(group(x), linears):
        torch.testing.assert_close(out, linear(x))
    mixed = MergedLinears([torch.nn.Linear(8, 4), torch.nn.Linear(8, 4, bias=False)])  # a bias on one only
    assert not mixed.merged


class _ChainGraph:
    """A decode graph whose replay samples ``(input * 31 + position) % 1000`` for every row: each token a sequence
    gets says which input token the step fed it, wherever that input came from (the host, the previous decode's
    output, or a prefill's output on the device)."""

    def __init__(self, buffers: dict[str, torch.Tensor]) -> None:
        self.buffers = buffers

    def replay(self) -> None:
        buffers = self.buffers
        buffers["tokens"].copy_((buffers["input_ids"] * 31 + buffers["positions"]) % 1000)


class _CopiedBehindTheStep:
    def synchronize(self) -> None:
        pass


class _ChainRunner(HostOnlyRunner):
    """The host-only runner with `_ChainGraph` as every decode graph."""

    def __init__(self, **sizes) -> None:
        super().__init__(**sizes)
        self.graphs = {size: _ChainGraph(self._buffers) for size in self.graph_sizes}

    def _finish(self, sequences, tokens, log_probs, version):
        output = super()._finish(sequences, tokens, log_probs, version)
        # as on CUDA: the host reads a copy taken behind the step, not the graph's buffer the next replay rewrites
        output.host_tokens, output.host_log_probs = tokens.clone(), log_probs.clone()
        output.ready = _CopiedBehindTheStep()
        return output


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=10),
       st.integers(8, 40))
def test_the_graph_path_feeds_each_decode_the_token_before_it_with_prefills_in_flight(jobs, prefill_budget):
    """The paged runner's graph inputs (the CUDA path's staging, run on the CPU) under the engine core's loop, with
    requests joining at random steps and a small prefill budget, so prefills are launched behind decodes and
    behind each other, unread: every decode step feeds each sequence the token sampled just before it, the first
    one straight from its prefill's output."""
    runner = _ChainRunner(batch=16, num_blocks=512, block_size=PAGE, max_blocks_per_sequence=WIDTH)
    scheduler = Scheduler(BlockManager(512, PAGE), max_running=16, max_prefill_tokens=prefill_budget)
    core = EngineCore(runner, scheduler.blocks, scheduler, tokenizer=None, eos_token_ids=frozenset(),
                      pauses=PauseHolds(), weight_version=lambda: 0)
    core._output = lambda sequence: (len(sequence.token_ids) - sequence.num_outputs, list(sequence.output_ids))

    async def caller(index, prompt_len, new_tokens, delay):
        for _ in range(delay):
            await asyncio.sleep(0)
        request = GenerationRequest(f"c{index}", [2 + (index + j) % 40 for j in range(prompt_len)],
                                    SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True,
                                                   seed=index))
        return (await core.generate([request]))[0]

    async def run_all():
        return await asyncio.gather(*(caller(i, *job) for i, job in enumerate(jobs)))

    for (prompt_len, outputs), (_, new_tokens, _) in zip(asyncio.run(run_all()), jobs):
        assert len(outputs) == new_tokens
        for k in range(1, len(outputs)):
            assert outputs[k] == (outputs[k - 1] * 31 + prompt_len + k - 1) % 1000, (k, outputs)
