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

from relax.backends.inference.engine_core.attention import upload
from relax.backends.inference.engine_core.sequence import Sequence
from relax.backends.inference.sampling import BatchSampling, CounterNoise, sample_next_tokens

# Columns of a step's staged integers: seeds, token indices, host tokens, rows of the previous step's tokens.
STAGED_INT_COLUMNS = 4


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


@dataclass
class StepKeys:
    """A step's per-row values on the device: its sampling noise's keys (the sequence's seed and the index of the
    token it samples), temperatures, and on a decode step each row's input token."""

    seeds: torch.Tensor  # [B] int64
    counters: torch.Tensor  # [B] int64
    temperature: torch.Tensor  # [B] float32
    inputs: torch.Tensor | None = None  # [B] int64


class StepRunner:
    """The base of the core's runners: ``rows`` bounds the sequences of one step (pinned buffers on CUDA)."""

    records_routing = False  # whether `prefill`/`decode` record each fed token's routed experts
    # Whether a prefill may be launched with the previous step still unread and left unread itself while the next
    # step launches (`EngineCore._run`): its output rows feed a following decode as a decode step's do.
    pipelines_prefill = False

    def __init__(self, device: torch.device, rows: int) -> None:
        self.device = device
        self.use_triton = triton_available(device)
        # Pinned buffers used in turn by consecutive steps (`_turn`): the step's outputs copied to the host, and the
        # step's host values staged for their copy to the device. With one step in flight, a buffer is written
        # again two steps later, once the host has read the step that last used it.
        self._outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._turn = 0
        if device.type == "cuda":
            self._outputs = [(torch.zeros(rows, dtype=torch.int64).pin_memory(),
                              torch.zeros(rows, dtype=torch.float32).pin_memory()) for _ in range(2)]
            self._inputs = [(torch.zeros(STAGED_INT_COLUMNS * rows, dtype=torch.int64).pin_memory(),
                             torch.zeros(rows, dtype=torch.float32).pin_memory()) for _ in range(2)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write of shared KV blocks before a decode step (a paged runner's; nothing to do otherwise)."""

    # ---- a step's host values ------------------------------------------------------------
    def _stage(self, columns: list[list[int]], floats: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """``columns`` (at most `STAGED_INT_COLUMNS` lists of B ints) as ``[k, B]`` int64 and ``floats`` as ``[B]``
        float32, on the host: in this step's pinned buffers on CUDA, so that their copies to the device neither
        allocate pinned memory nor wait for the device. At most one call per step (the buffers alternate by step)."""
        ints = torch.tensor(columns, dtype=torch.int64).view(len(columns), len(floats))
        values = torch.tensor(floats, dtype=torch.float32)
        if not self._inputs:
            return ints, values
        int_buffer, float_buffer = self._inputs[self._turn]
        staged = int_buffer[:ints.numel()].view(ints.shape)
        staged.copy_(ints)
        float_buffer[:len(floats)].copy_(values)
        return staged, float_buffer[:len(floats)]

    def _step_keys(self, sequences: list[Sequence], previous: StepOutput | None = None,
                   decode: bool = False) -> StepKeys:
        """This step's `StepKeys` in one copy to the device; ``decode``: with each sequence's input token, the
        host's last token or (``pending``) ``previous``'s output."""
        columns = [[s.seed for s in sequences], [s.num_tokens for s in sequences]]
        if decode:
            host_tokens, sources, steady = self._token_sources(sequences, previous)
            columns += [host_tokens, sources]
        ints, temperature = self._stage(columns, [s.params.temperature for s in sequences])
        ints = ints.to(self.device, non_blocking=True)
        keys = StepKeys(ints[0], ints[1], temperature.to(self.device, non_blocking=True))
        if decode:
            keys.inputs = self._input_tokens(ints[2], ints[3], sources, steady, previous)
        return keys

    @staticmethod
    def _input_tokens(host: torch.Tensor, source: torch.Tensor, sources: list[int], steady: bool,
                      previous: StepOutput | None) -> torch.Tensor:
        if steady:
            return previous.tokens  # the previous step's sequences, in its order, all pending
        if previous is None or all(row < 0 for row in sources):
            return host
        return torch.where(source >= 0, previous.tokens[source.clamp(min=0)], host)

    @staticmethod
    def _follows(sequences: list[Sequence], previous: StepOutput | None) -> bool:
        """Whether this step's sequences are ``previous``'s, in its order, each waiting for its token from it (a
        decode's steady state: every input token is the previous step's output row of the same index)."""
        return (previous is not None and len(previous.sequences) == len(sequences)
                and all(a is b and a.pending for a, b in zip(sequences, previous.sequences)))

    @classmethod
    def _token_sources(cls, sequences: list[Sequence],
                       previous: StepOutput | None) -> tuple[list[int], list[int], bool]:
        """Each sequence's last token as the host knows it (0 when pending), its row in ``previous`` (-1 when the
        host has its token), and whether the step is steady (`_follows`: every input is ``previous``'s row of the
        same index)."""
        if cls._follows(sequences, previous):
            return [0] * len(sequences), list(range(len(sequences))), True
        row_of = {id(s): row for row, s in enumerate(previous.sequences)} if previous is not None else {}
        host_tokens, sources = [], []
        for sequence in sequences:
            if sequence.pending:
                host_tokens.append(0)
                sources.append(row_of[id(sequence)])
            else:
                host_tokens.append(sequence.token_ids[-1])
                sources.append(-1)
        return host_tokens, sources, False

    def _to_device(self, values: list[int]) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=torch.long), self.device)

    # ---- sampling ------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, sequences: list[Sequence],
                keys: StepKeys) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of ``logits``; the noise of a row is keyed by ``keys`` (its sequence's seed and the
        index of the token it samples)."""
        params = [s.params for s in sequences]
        filtering = any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params)
        if self.use_triton and not filtering:
            from relax.backends.inference.triton_sampling import sample_tokens

            tokens = torch.empty(len(params), dtype=torch.int64, device=self.device)
            log_probs = torch.empty(len(params), dtype=torch.float32, device=self.device)
            sample_tokens(logits, keys.temperature, keys.seeds, keys.counters, tokens, log_probs)
            return tokens, log_probs
        sampling = BatchSampling.from_params(params, self.device)
        return sample_next_tokens(logits, sampling, CounterNoise(keys.seeds, keys.counters))

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
