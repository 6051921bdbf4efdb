"""The KV pool tensors and the forwards of one step: prefill over packed sequences, decode over block tables.

Decode runs in CUDA graphs on CUDA: one graph per batch-size bucket (`GRAPH_BATCH_SIZES` up to
``max_graph_batch``), captured once over static input buffers (token ids, positions, slots, block tables,
lengths) and the model's own parameters. A batch is padded to the next bucket: its padding rows attend to one
slot of the reserved block 0 and write their K/V there, and their logits are dropped. Weight updates copy into
the captured parameters, so the graphs stay valid across versions. Prefill, batches above the largest bucket
and every step on CPU run eagerly.
"""

from __future__ import annotations

import logging

import torch

from relax.backends.inference.core.attention import StepMetadata, decode_metadata, prefill_metadata
from relax.backends.inference.core.block_manager import RESERVED_BLOCK
from relax.backends.inference.core.decoder import TextDecoder
from relax.backends.inference.core.sequence import Sequence

logger = logging.getLogger(__name__)

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class ModelRunner:
    def __init__(self, decoder: TextDecoder, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, max_blocks_per_sequence: int, cuda_graphs: bool = True,
                 max_graph_batch: int = 256) -> None:
        self.decoder = decoder
        self.block_size = block_size
        self.device = device
        self.max_blocks_per_sequence = max_blocks_per_sequence
        self.use_triton = triton_available(device)
        shape = (decoder.num_layers, 2, num_blocks * block_size, decoder.num_kv_heads, decoder.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.key_pools = [self.kv[layer, 0] for layer in range(decoder.num_layers)]
        self.value_pools = [self.kv[layer, 1] for layer in range(decoder.num_layers)]
        self.graph_sizes = [size for size in GRAPH_BATCH_SIZES if size <= max_graph_batch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self.prefill_tokens = 0  # tokens computed by prefill steps (a shared prompt prefix is computed once)
        if cuda_graphs and self.use_triton and self.graph_sizes:
            self._capture_graphs()

    @property
    def kv_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ---- steps ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, sequences: list[Sequence]) -> torch.Tensor:
        """Compute tokens ``num_cached..len`` of every sequence that has any to compute; the logits after each
        sequence's last token, [B, V] (a sequence sharing a prompt whole, ``prefill_twin_of``, gets its twin's)."""
        computed = [s for s in sequences if s.prefill_twin_of is None]
        starts = [s.num_cached for s in computed]
        ends = [len(s) for s in computed]
        tokens = [t for s, start in zip(computed, starts) for t in s.token_ids[start:]]
        positions = [p for start, end in zip(starts, ends) for p in range(start, end)]
        metadata = prefill_metadata(self.block_size, [s.block_table for s in computed], starts, ends, self.device)
        self.prefill_tokens += len(tokens)
        hidden = self.decoder.forward(self._to_device(tokens), self._to_device(positions), self.key_pools,
                                      self.value_pools, metadata)
        last = torch.tensor(ends, dtype=torch.long).sub(torch.tensor(starts)).cumsum(0) - 1
        row_of = {id(s): row for row, s in enumerate(computed)}
        rows = [row_of[id(s.prefill_twin_of or s)] for s in sequences]
        return self.decoder.logits(hidden[last[rows].to(self.device)])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy the K/V of block ``source`` into block ``copy`` for each pair, every layer (copy-on-write)."""
        if not copies:
            return
        page = self.block_size
        source = torch.tensor([s * page + i for s, _ in copies for i in range(page)], device=self.device)
        target = torch.tensor([c * page + i for _, c in copies for i in range(page)], device=self.device)
        self.kv[:, :, target] = self.kv[:, :, source]

    @torch.inference_mode()
    def decode(self, sequences: list[Sequence]) -> torch.Tensor:
        """Compute each sequence's newest token (position ``len - 1``); the logits after it, [B, V]."""
        batch = len(sequences)
        tokens = [s.token_ids[-1] for s in sequences]
        lens = [len(s) for s in sequences]
        tables = [s.block_table for s in sequences]
        bucket = next((size for size in self.graph_sizes if size >= batch), None) if self.graphs else None
        if bucket is None:
            metadata = decode_metadata(self.block_size, tables, lens, self.device, self.use_triton)
            hidden = self.decoder.forward(self._to_device(tokens), self._to_device([n - 1 for n in lens]),
                                          self.key_pools, self.value_pools, metadata)
            return self.decoder.logits(hidden)
        self._fill_graph_inputs(tokens, lens, tables, bucket)
        self.graphs[bucket].replay()
        return self._buffers["logits"][:batch]

    # ---- CUDA graphs ---------------------------------------------------------------------
    def _fill_graph_inputs(self, tokens: list[int], lens: list[int], tables: list[list[int]], bucket: int) -> None:
        """Stage the step's inputs in one pinned buffer and copy them to the graph's buffers in one transfer.
        Table entries past a sequence's length are never read, so only the columns in use are written; padding
        rows read entry 0, the reserved block."""
        batch, buffers = len(tokens), self._buffers
        columns = max(len(table) for table in tables)
        rows = torch.tensor([table + [RESERVED_BLOCK] * (columns - len(table)) for table in tables], dtype=torch.int64)
        lens_tensor = torch.tensor(lens, dtype=torch.int64)
        last = lens_tensor - 1
        host = buffers["host"]
        host[:batch, 0] = torch.tensor(tokens, dtype=torch.int64)
        host[:batch, 1] = last
        host[:batch, 2] = rows.gather(1, (last // self.block_size)[:, None]).squeeze(1) * self.block_size \
            + last % self.block_size
        host[:batch, 3] = lens_tensor
        host[:batch, 4:4 + columns] = rows
        host[batch:bucket, :4] = torch.tensor([0, 0, RESERVED_BLOCK * self.block_size, 1])
        host[batch:bucket, 4] = RESERVED_BLOCK
        device = buffers["device"]
        device[:bucket, :4 + columns].copy_(host[:bucket, :4 + columns], non_blocking=True)
        buffers["input_ids"][:bucket].copy_(device[:bucket, 0])
        buffers["positions"][:bucket].copy_(device[:bucket, 1])
        buffers["slots"][:bucket].copy_(device[:bucket, 2])
        buffers["lens"][:bucket].copy_(device[:bucket, 3])
        buffers["tables"][:bucket, :columns].copy_(device[:bucket, 4:4 + columns])

    def _capture_graphs(self) -> None:
        largest, width = self.graph_sizes[-1], self.max_blocks_per_sequence
        device = self.device
        self._buffers = {
            "host": torch.zeros((largest, 4 + width), dtype=torch.int64).pin_memory(),
            "device": torch.zeros((largest, 4 + width), dtype=torch.int64, device=device),
            "input_ids": torch.zeros(largest, dtype=torch.long, device=device),
            "positions": torch.zeros(largest, dtype=torch.long, device=device),
            "slots": torch.full((largest,), RESERVED_BLOCK * self.block_size, dtype=torch.long, device=device),
            "lens": torch.ones(largest, dtype=torch.int32, device=device),
            "tables": torch.zeros((largest, width), dtype=torch.int32, device=device),
        }
        vocab = self.decoder.lm_head.out_features
        self._buffers["logits"] = torch.zeros((largest, vocab), dtype=torch.float32, device=device)
        pool = torch.cuda.graph_pool_handle()
        buffers = self._buffers
        with torch.inference_mode():
            for size in reversed(self.graph_sizes):  # largest first: the smaller ones reuse its memory
                metadata = StepMetadata(is_prefill=False, slot_mapping=buffers["slots"][:size],
                                        block_tables=buffers["tables"][:size], context_lens=buffers["lens"][:size],
                                        use_triton=True, block_size=self.block_size)

                def step(size=size, metadata=metadata) -> None:
                    hidden = self.decoder.forward(buffers["input_ids"][:size], buffers["positions"][:size],
                                                  self.key_pools, self.value_pools, metadata)
                    buffers["logits"][:size] = self.decoder.logits(hidden)

                step()  # compiles the kernels and settles the allocator before capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    step()
                self.graphs[size] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s)", len(self.graphs), self.graph_sizes)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
