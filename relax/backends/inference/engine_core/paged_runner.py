"""The KV pool tensors and one step's work: prefill over packed sequences or decode over block tables, then
sampling on the device.

Decode runs in CUDA graphs on CUDA: one graph per batch-size bucket (`GRAPH_BATCH_SIZES` up to
``max_graph_batch``), captured once over static input buffers (token ids, positions, slots, block tables,
lengths, temperatures, seeds) and the model's own parameters; a graph runs the forward and the sampling
(`triton_sampling.sample_tokens`) and leaves tokens and log-probs on the device. A batch is padded to the next
bucket: its padding rows attend to one slot of the reserved block 0, write their K/V there, and their outputs are
dropped. Weight updates copy into the captured parameters, so the graphs stay valid across versions. Prefill,
batches above the largest bucket and every step on CPU run eagerly; rows with top-k/top-p sample with
`relax.backends.inference.sampling.sample_next_tokens` from the step's logits.

Steps are asynchronous on CUDA: `decode` takes a sequence's input token from the previous step's device output
when the host has not read it yet, and returns a `StepOutput` whose tokens are copied to pinned host memory
behind the step; `StepOutput.result` waits for them. So the host can launch step t+1 before it reads step t.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from relax.backends.inference.engine_core.attention import StepMetadata, decode_metadata, prefill_metadata, upload
from relax.backends.inference.engine_core.block_manager import RESERVED_BLOCK
from relax.backends.inference.engine_core.decoder import TextDecoder
from relax.backends.inference.engine_core.kv_cache import KVPool, kv_bytes_per_token
from relax.backends.inference.engine_core.media import merge_media
from relax.backends.inference.engine_core.sequence import Sequence
from relax.backends.inference.engine_core.step_runner import StepKeys, StepOutput, StepRunner
from relax.backends.inference.engine_core.table_rows import BlockTableRows
from relax.backends.models import flash_varlen

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class PagedRunner(StepRunner):
    """Steps over the core's own decoder (`decoder.TextDecoder`) and a paged KV pool of ``num_blocks`` blocks."""

    pipelines_prefill = True

    def __init__(self, decoder: TextDecoder, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, max_blocks_per_sequence: int, cuda_graphs: bool = True,
                 max_graph_batch: int = 256, max_batch: int = 1024, kv_cache_dtype: str = "auto") -> None:
        graph_sizes = [size for size in GRAPH_BATCH_SIZES if size <= max_graph_batch]
        rows = max(max_batch, graph_sizes[-1] if graph_sizes else 1)
        super().__init__(device, rows)
        self.decoder = decoder
        self.block_size = block_size
        self.max_blocks_per_sequence = max_blocks_per_sequence
        # Prefill attention on FlashAttention's varlen kernel where it runs (CUDA, half precision).
        self.varlen_prefill = self.use_triton and dtype in (torch.float16, torch.bfloat16) and flash_varlen.available()
        self._pool_shape = (decoder.num_layers, num_blocks * block_size, decoder.num_kv_heads, decoder.head_dim)
        self._kv_dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self._cuda_graphs = cuda_graphs
        self.graph_sizes = graph_sizes
        if self._graphs_wanted:  # at the fullest batch the graphs run; before the pool (the timing's copies go)
            decoder.choose_weight_layouts(min(max_batch, graph_sizes[-1]))
        self._allocate_pool()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_tokens = 0  # tokens computed by prefill steps (a shared prompt prefix is computed once)
        self._buffers: dict[str, torch.Tensor] = {}
        self._staging: list[torch.Tensor] = []  # two pinned input buffers, used in turn (a copy may still read one)
        if device.type == "cuda":
            self._staging = [torch.zeros((rows, 6 + max_blocks_per_sequence), dtype=torch.int64).pin_memory()
                             for _ in range(2)]
        self._staging_arrays = [buffer.numpy() for buffer in self._staging]  # the same memory, written by numpy
        self._table_rows = BlockTableRows(2 * rows, max_blocks_per_sequence)
        if self._graphs_wanted:
            self._capture_graphs()

    @property
    def _graphs_wanted(self) -> bool:
        return self._cuda_graphs and self.use_triton and bool(self.graph_sizes)

    def _allocate_pool(self) -> None:
        self.pool: KVPool | None = KVPool(*self._pool_shape, self._kv_dtype, self.kv_cache_dtype, self.device)
        self.caches = self.pool.layers

    @property
    def kv_bytes(self) -> int:
        layers, slots, heads, dim = self._pool_shape
        return slots * kv_bytes_per_token(layers, heads, dim, self._kv_dtype, self.kv_cache_dtype)

    @property
    def released(self) -> bool:
        return self.pool is None

    def release(self) -> None:
        """Free the KV pool and the CUDA graphs (which point into it and into the weights). The runner cannot
        step until `restore`."""
        self.graphs.clear()
        self._buffers = {}
        self._table_rows.clear()
        self.decoder.release_projections()
        self.pool = None
        self.caches = []

    def restore(self) -> None:
        """Allocate the KV pool again and re-capture the CUDA graphs on the model's current weight tensors (a
        later in-place weight update keeps them valid)."""
        if not self.released:
            return
        self.decoder.merge_projections()  # the weights may have storage of their own again (released and resumed)
        self._allocate_pool()
        if self._graphs_wanted:
            self._capture_graphs()

    # ---- steps ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, sequences: list[Sequence], version: int) -> StepOutput:
        """Compute tokens ``num_cached..`` of every sequence that has any to compute and sample each sequence's
        next token (a sequence sharing a prompt whole, ``prefill_twin_of``, samples from its twin's logits)."""
        computed = [s for s in sequences if s.prefill_twin_of is None]
        starts = [s.num_cached for s in computed]
        ends = [s.num_tokens for s in computed]
        tokens = [t for s, start in zip(computed, starts) for t in s.token_ids[start:]]
        positions = [p + s.rope_delta for s, start, end in zip(computed, starts, ends) for p in range(start, end)]
        metadata = prefill_metadata(self.block_size, [s.block_table for s in computed], starts, ends, self.device,
                                    varlen=self.varlen_prefill)
        self.prefill_tokens += len(tokens)
        input_ids, positions = self._to_device(tokens), self._to_device(positions)
        hidden = self.decoder.forward(input_ids, positions, self.caches, metadata,
                                      *self._media_inputs(input_ids, positions, computed, starts, ends))
        last = torch.tensor(ends, dtype=torch.long).sub(torch.tensor(starts)).cumsum(0) - 1
        row_of = {id(s): row for row, s in enumerate(computed)}
        rows = [row_of[id(s.prefill_twin_of or s)] for s in sequences]
        logits = self.decoder.logits(hidden[upload(last[rows], self.device)])
        return self._finish(sequences, *self._sample(logits, sequences, self._step_keys(sequences)), version)

    def _media_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor, computed: list[Sequence],
                      starts: list[int], ends: list[int]) -> tuple[torch.Tensor | None, tuple | None]:
        """The packed embeddings and rope tables of a prefill with multimodal prompt tokens, else (None, None)."""
        spans, offset = [], 0
        for sequence, start, end in zip(computed, starts, ends):
            if sequence.media is not None and start < sequence.media.length:
                spans.append((offset, start, end, sequence.media))
            offset += end - start
        if not spans:
            return None, None
        decoder = self.decoder
        embeds, cos, sin = decoder.embed_tokens(input_ids), decoder.cos[positions], decoder.sin[positions]
        merge_media(embeds, cos, sin, spans)
        return embeds, (cos, sin)

    @torch.inference_mode()
    def decode(self, sequences: list[Sequence], previous: StepOutput | None, version: int) -> StepOutput:
        """Compute each sequence's newest token (position ``num_tokens - 1``) and sample the next. A sequence
        whose newest token the host has not read yet (``pending``) takes it from ``previous``."""
        batch = len(sequences)
        bucket = next((size for size in self.graph_sizes if size >= batch), None) if self.graphs else None
        filtering = any(s.filters for s in sequences)
        if bucket is None:
            keys = self._step_keys(sequences, previous, decode=True)
            lens = [s.num_tokens for s in sequences]
            metadata = decode_metadata(self.block_size, [s.block_table for s in sequences], lens, self.device,
                                       self.use_triton)
            positions = [n - 1 + s.rope_delta for n, s in zip(lens, sequences)]
            hidden = self.decoder.forward(keys.inputs, self._to_device(positions), self.caches,
                                          metadata)
            return self._finish(sequences, *self._sample(self.decoder.logits(hidden), sequences, keys), version)
        self._fill_graph_inputs(sequences, previous, bucket)
        self.graphs[bucket].replay()
        buffers = self._buffers
        if filtering:  # the graph sampled without top-k/top-p: sample those batches again from its logits
            keys = StepKeys(buffers["seeds"][:batch], buffers["counters"][:batch], buffers["temperature"][:batch])
            logits = buffers["logits"][:batch].float()
            return self._finish(sequences, *self._sample(logits, sequences, keys), version)
        return self._finish(sequences, buffers["tokens"][:batch], buffers["log_probs"][:batch], version)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the K/V of block ``source`` into block ``copy`` for each pair, every layer (copy-on-write)."""
        if not copies:
            return
        page = self.block_size
        source = upload(torch.tensor([s * page + i for s, _ in copies for i in range(page)]), self.device)
        target = upload(torch.tensor([c * page + i for _, c in copies for i in range(page)]), self.device)
        self.pool.copy_slots(source, target)

    # ---- decode inputs -------------------------------------------------------------------
    def _fill_graph_inputs(self, sequences: list[Sequence], previous: StepOutput | None, bucket: int) -> None:
        """Stage the step's inputs in a pinned buffer and copy them to the graph's buffers in one transfer. The
        block tables come from `table_rows` (rewritten only where a table changed); entries past a sequence's
        length are never read, so only the columns in use are written; padding rows read entry 0, the reserved
        block."""
        batch, buffers, page = len(sequences), self._buffers, self.block_size
        host_tokens, sources, steady = self._token_sources(sequences, previous)
        rows = self._table_rows.rows(sequences)
        columns = self._table_rows.longest(rows)
        tables = self._table_rows.array[rows, :columns]
        lens = np.fromiter((s.num_tokens for s in sequences), dtype=np.int64, count=batch)
        last = lens - 1
        staging = self._staging_arrays[self._turn]  # the other buffer's copy may still be in flight
        staging[:batch, 0] = host_tokens
        staging[:batch, 1] = last
        if any(s.media is not None for s in sequences):
            staging[:batch, 1] += np.fromiter((s.rope_delta for s in sequences), dtype=np.int64, count=batch)
        staging[:batch, 2] = tables[np.arange(batch), last // page] * page + last % page
        staging[:batch, 3] = lens
        staging[:batch, 4] = sources
        staging[:batch, 5] = np.fromiter((s.seed for s in sequences), dtype=np.int64, count=batch)
        staging[:batch, 6:6 + columns] = tables
        staging[batch:bucket, :6] = (0, 0, RESERVED_BLOCK * page, 1, -1, 0)
        staging[batch:bucket, 6] = RESERVED_BLOCK
        device = buffers["staging"]
        device[:bucket, :6 + columns].copy_(self._staging[self._turn][:bucket, :6 + columns], non_blocking=True)
        _, temperature = self._stage([], [s.params.temperature for s in sequences])
        buffers["temperature"][:batch].copy_(temperature, non_blocking=True)
        if steady:  # padding rows keep the tokens they had: any token id is a valid input
            buffers["input_ids"][:batch].copy_(previous.tokens)
        elif previous is not None and any(source >= 0 for source in sources):
            source = device[:bucket, 4]
            gathered = previous.tokens[source.clamp(min=0, max=previous.tokens.shape[0] - 1)]
            buffers["input_ids"][:bucket].copy_(torch.where(source >= 0, gathered, device[:bucket, 0]))
        else:
            buffers["input_ids"][:bucket].copy_(device[:bucket, 0])
        buffers["positions"][:bucket].copy_(device[:bucket, 1])
        buffers["slots"][:bucket].copy_(device[:bucket, 2])
        buffers["lens"][:bucket].copy_(device[:bucket, 3])
        buffers["counters"][:bucket].copy_(device[:bucket, 3])
        buffers["seeds"][:bucket].copy_(device[:bucket, 5])
        buffers["tables"][:bucket, :columns].copy_(device[:bucket, 6:6 + columns])

    # ---- CUDA graphs ---------------------------------------------------------------------
    def _graph_buffers(self, rows: int, width: int, vocab: int,
                       logits_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The static tensors the decode graphs read and write, for up to ``rows`` sequences of ``width`` blocks
        (the logits in the LM head's dtype: `TextDecoder.logits_into`)."""
        device = self.device
        return {
            "staging": torch.zeros((rows, 6 + width), dtype=torch.int64, device=device),
            "input_ids": torch.zeros(rows, dtype=torch.long, device=device),
            "positions": torch.zeros(rows, dtype=torch.long, device=device),
            "slots": torch.full((rows,), RESERVED_BLOCK * self.block_size, dtype=torch.long, device=device),
            "lens": torch.ones(rows, dtype=torch.int32, device=device),
            "tables": torch.zeros((rows, width), dtype=torch.int32, device=device),
            "temperature": torch.ones(rows, dtype=torch.float32, device=device),
            "seeds": torch.zeros(rows, dtype=torch.int64, device=device),
            "counters": torch.ones(rows, dtype=torch.int64, device=device),
            "logits": torch.zeros((rows, vocab), dtype=logits_dtype, device=device),
            "tokens": torch.zeros(rows, dtype=torch.int64, device=device),
            "log_probs": torch.zeros(rows, dtype=torch.float32, device=device),
        }

    def _capture_graphs(self) -> None:
        from relax.backends.inference.triton_sampling import sample_tokens

        largest, width, device = self.graph_sizes[-1], self.max_blocks_per_sequence, self.device
        head = self.decoder.lm_head
        self._buffers = buffers = self._graph_buffers(largest, width, head.out_features, head.weight.dtype)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.graph_sizes):  # largest first: the smaller ones reuse its memory
                metadata = StepMetadata(is_prefill=False, slot_mapping=buffers["slots"][:size],
                                        block_tables=buffers["tables"][:size], context_lens=buffers["lens"][:size],
                                        use_triton=True, block_size=self.block_size)

                def step(size=size, metadata=metadata) -> None:
                    hidden = self.decoder.forward(buffers["input_ids"][:size], buffers["positions"][:size],
                                                  self.caches, metadata)
                    self.decoder.logits_into(hidden, buffers["logits"][:size])
                    # The key of a token's noise is its index, the sequence's length (as on the eager path);
                    # "positions" are rope positions, shifted for multimodal prompts.
                    sample_tokens(buffers["logits"][:size], buffers["temperature"][:size], buffers["seeds"][:size],
                                  buffers["counters"][:size], buffers["tokens"][:size], buffers["log_probs"][:size])

                step()  # compiles the kernels and settles the allocator before capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    step()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.graph_sizes)
