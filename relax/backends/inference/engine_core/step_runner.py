"""What both of the core's runners share: a step's output and its copy to the host, sampling, and the input token
of each decoding sequence (the host's, or the previous step's on the device).

A runner turns a step the scheduler picked into sampled tokens: `paged_runner.PagedRunner` over the core's own
decoder and paged KV pool (CUDA graphs on CUDA), `cache_runner.CacheRunner` over the model's own Hugging Face
forward and cache (every family). The core's loop (`core.EngineCore`) drives either through the same four calls:
``prefill``, ``decode``, ``copy_blocks``, ``release``/``restore``.

Sampling is the same on both: every row samples with noise keyed by its sequence's seed and the index of the
token it samples (`relax.backends.inference.sampling.CounterNoise`), so a seeded request gets the same tokens on
either runner's logits and whatever shares its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax.backends.inference.engine_core.sequence import Sequence
from relax.backends.inference.sampling import BatchSampling, CounterNoise, sample_next_tokens


def triton_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class StepOutput:
    """The tokens a step sampled for ``sequences`` (device tensors), and their copy to the host once ready."""

    sequences: list[Sequence]
    tokens: torch.Tensor  # [B] int64, on the device
    log_probs: torch.Tensor  # [B] float32
    version: int  # the weight version the step ran with
    host_tokens: torch.Tensor | None = None  # pinned copies, filled behind the step (CUDA)
    host_log_probs: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None

    def result(self) -> tuple[list[int], list[float]]:
        """Wait for the step and read its tokens and log-probs (the host synchronization of the step)."""
        if self.ready is None:
            return self.tokens.tolist(), self.log_probs.tolist()
        self.ready.synchronize()
        count = len(self.sequences)
        return self.host_tokens[:count].tolist(), self.host_log_probs[:count].tolist()


class StepRunner:
    """The base of the core's runners: ``rows`` bounds the sequences of one step (pinned output buffers on CUDA)."""

    records_routing = False  # whether `prefill`/`decode` record each fed token's routed experts

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device = device
        self.use_triton = triton_available(device)
        self._outputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # two pinned output buffers, used in turn
        self._turn = 0
        if device.type == "cuda":
            self._outputs = [(torch.zeros(rows, dtype=torch.int64).pin_memory(),
                              torch.zeros(rows, dtype=torch.float32).pin_memory()) for _ in range(2)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared KV blocks before a decode step (a paged runner's; nothing to do otherwise)."""

    # ---- sampling ------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of ``logits``; the noise of a row is keyed by its sequence's seed and the position of
        the token it samples (``num_tokens``)."""
        params = [s.params for s in sequences]
        # One host-to-device copy of the seeds and counters, from pinned memory: a copy from pageable memory would
        # wait for the device to finish the step's forward.
        keys = self._to_device([s.seed for s in sequences] + [s.num_tokens for s in sequences]).view(2, -1)
        seeds, counters = keys[0], keys[1]
        filtering = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
        if self.use_triton and not filtering:
            from relax.backends.inference.triton_sampling import sample_tokens

            temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32).pin_memory()
            tokens = torch.empty(len(params), dtype=torch.int64, device=self.device)
            log_probs = torch.empty(len(params), dtype=torch.float32, device=self.device)
            sample_tokens(logits, temperature.to(self.device, non_blocking=True), seeds, counters, tokens, log_probs)
            return tokens, log_probs
        sampling = BatchSampling.from_params(params, self.device)
        return sample_next_tokens(logits, sampling, CounterNoise(seeds, counters))

    def _finish(self, sequences: list[Sequence], tokens: torch.Tensor, log_probs: torch.Tensor,
                version: int) -> StepOutput:
        output = StepOutput(sequences, tokens, log_probs, version)
        if self.device.type == "cuda":
            host_tokens, host_log_probs = self._outputs[self._next_turn()]
            host_tokens[:len(sequences)].copy_(tokens, non_blocking=True)
            host_log_probs[:len(sequences)].copy_(log_probs, non_blocking=True)
            output.host_tokens, output.host_log_probs = host_tokens, host_log_probs
            output.ready = torch.cuda.Event()
            output.ready.record()
        return output

    def _next_turn(self) -> int:
        self._turn ^= 1
        return self._turn

    # ---- decode inputs -------------------------------------------------------------------
    def _decode_inputs(self, sequences: list[Sequence], previous: StepOutput | None) -> torch.Tensor:
        """The input token of each sequence: the host's last token, or (``pending``) ``previous``'s output."""
        host_tokens, sources = self._token_sources(sequences, previous)
        host = self._to_device(host_tokens)
        if previous is None or all(source < 0 for source in sources):
            return host
        sources_tensor = self._to_device(sources)
        return torch.where(sources_tensor >= 0, previous.tokens[sources_tensor.clamp(min=0)], host)

    @staticmethod
    def _token_sources(sequences: list[Sequence], previous: StepOutput | None) -> tuple[list[int], list[int]]:
        row_of = {id(s): row for row, s in enumerate(previous.sequences)} if previous is not None else {}
        host_tokens, sources = [], []
        for sequence in sequences:
            if sequence.pending:
                host_tokens.append(0)
                sources.append(row_of[id(sequence)])
            else:
                host_tokens.append(sequence.token_ids[-1])
                sources.append(-1)
        return host_tokens, sources

    def _to_device(self, values: list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
