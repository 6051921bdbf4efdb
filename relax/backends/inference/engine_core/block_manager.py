"""The KV pool as fixed-size blocks: block tables, prompt blocks shared by content, refcounts.

The pool holds ``num_blocks`` blocks of ``block_size`` token slots; block 0 is never handed out (padding rows
of a CUDA-graph batch write their K/V there). A sequence's block table lists its blocks in order; slot ``i`` of
the sequence is ``block_table[i // block_size] * block_size + i % block_size``.

Sharing. A *full* block of prompt tokens is keyed by a hash of its tokens chained with the hash of the block
before it (so equal keys mean equal prefixes). A sequence whose prompt starts with blocks already in the pool
takes them (refcount + 1) and skips their prefill: the samples of a GRPO group, or the turns of an episode,
compute their shared prompt once. Blocks keyed this step are shared by the other sequences of the same prefill
batch too: K/V is written layer by layer before attention reads it, so a block written by one row of the batch
is complete before another row's attention at that layer reads it. A freed block keeps its key (and content)
until the block is handed out again, least recently freed first, so a prompt seen again soon is found again.
Keyed sharing covers full prompt blocks before the block of a prompt's last token, which no one writes into.
Sequences with the very same prompt in one prefill step share all its blocks instead (`fork`: the prompt is
computed once and its logits serve every sample); the first write into a shared block copies it.
`reset_prefix_cache` forgets every key (new weights make the cached K/V stale) and starts a new `generation`.

Answers too. When a sequence finishes, the full blocks of its tokens whose K/V it wrote (prompt and answer) are keyed
the same way (`key_prefix`), if that K/V is of the current generation: an agent's next turn, whose prompt is the
last turn's tokens plus the new messages, takes them and prefills only what is new. Keys are of content only, so a
block is shared only with a sequence whose tokens up to it are the same.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

RESERVED_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks for the request."""


def block_key(previous: int | None, tokens: Sequence[int]) -> int:
    return hash((previous, tuple(tokens)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a pool needs >= 2 blocks of >= 1 slot, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        # Free blocks, least recently freed first; a freed block keeps its key until it is handed out again.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._key_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self.generation = 0  # + 1 at each reset: K/V written in an older generation is never keyed

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: Sequence[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def cached_prefix_blocks(self, tokens: Sequence[int]) -> int:
        """How many leading blocks of ``tokens`` `allocate` would take from the pool."""
        count, key = 0, None
        for start in range(0, (len(tokens) - 1) // self.block_size * self.block_size, self.block_size):
            key = block_key(key, tokens[start:start + self.block_size])
            if key not in self._block_of:
                break
            count += 1
        return count

    def can_allocate(self, tokens: Sequence[int], extra_tokens: int = 0, share: bool = True) -> bool:
        """Whether `allocate` of ``tokens`` (+ room for ``extra_tokens`` more) would succeed."""
        needed = self.blocks_for(len(tokens) + extra_tokens)
        cached = self.cached_prefix_blocks(tokens) if share else 0
        revived = sum(1 for b in self._cached_blocks(tokens, cached) if self.refcount[b] == 0)
        return needed - cached + revived <= self.num_free

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, tokens: Sequence[int], share: bool = True) -> tuple[list[int], int]:
        """Blocks for a sequence whose tokens are ``tokens``: its block table and how many of its tokens are
        already in the pool (their prefill is skipped). With ``share`` its full blocks are keyed for others (a
        prompt); without, nothing is shared (a preempted sequence recomputed with its outputs).

        The block holding the last token is never taken from the pool: that token is computed again (its logits
        give the next token), and its K/V must land in a block this sequence alone writes."""
        if not self.can_allocate(tokens, share=share):
            raise OutOfBlocks(f"{self.blocks_for(len(tokens))} blocks needed, {self.num_free} free")
        table: list[int] = []
        key = None
        cached_tokens = 0
        full_blocks = len(tokens) // self.block_size
        shareable = (len(tokens) - 1) // self.block_size  # the blocks before the last token's
        for index in range(self.blocks_for(len(tokens))):
            if share and index < full_blocks:
                key = block_key(key, tokens[index * self.block_size:(index + 1) * self.block_size])
                block = self._block_of.get(key)
                if block is not None and index < shareable and cached_tokens == index * self.block_size:
                    self._take(block)
                    table.append(block)
                    cached_tokens += self.block_size
                    continue
                block = self._new_block()
                self._key_block(block, key)
            else:
                block = self._new_block()
            table.append(block)
        return table, cached_tokens

    def fork(self, block_table: Sequence[int]) -> list[int]:
        """The same blocks for a second sequence with the same tokens (a GRPO sample of a prompt prefilled this
        step); the partial last block is copied when either writes into it (`append_slot`)."""
        for block in block_table:
            self._take(block)
        return list(block_table)

    def append_slot(self, block_table: list[int], num_tokens: int) -> tuple[int, int] | None:
        """Make room for token ``num_tokens - 1`` (a sequence now ``num_tokens`` long). When that slot falls in a
        block another sequence holds too, the block is replaced by a private one: returns ``(source, copy)``,
        whose K/V the caller copies before writing (copy-on-write); else None."""
        index = (num_tokens - 1) // self.block_size
        if index >= len(block_table):
            block_table.append(self._new_block())
            return None
        shared = block_table[index]
        if self.refcount[shared] == 1:
            return None
        copy = self._new_block()
        self.refcount[shared] -= 1
        block_table[index] = copy
        return shared, copy

    def free(self, block_table: Sequence[int]) -> None:
        for block in reversed(block_table):
            if self.refcount[block] <= 0:
                raise RuntimeError(f"block {block} freed twice")
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free[block] = None

    def reset_prefix_cache(self) -> None:
        self._key_of.clear()
        self._block_of.clear()
        self.generation += 1

    def key_prefix(self, block_table: Sequence[int], tokens: Sequence[int], num_cached: int) -> int:
        """Key the full blocks of ``block_table`` holding the first ``num_cached`` of ``tokens`` (K/V written), so
        that a later sequence starting with those tokens takes them; returns how many blocks got a new key. A
        block already keyed, or whose content another block holds already, is left as it is."""
        added, key = 0, None
        for index in range(min(num_cached // self.block_size, len(block_table))):
            key = block_key(key, tokens[index * self.block_size:(index + 1) * self.block_size])
            block = block_table[index]
            if block in self._key_of or key in self._block_of:
                continue
            self._key_block(block, key)
            added += 1
        return added

    # ---- internals -----------------------------------------------------------------------
    def _cached_blocks(self, tokens: Sequence[int], count: int) -> list[int]:
        blocks, key = [], None
        for index in range(count):
            key = block_key(key, tokens[index * self.block_size:(index + 1) * self.block_size])
            blocks.append(self._block_of[key])
        return blocks

    def _new_block(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free KV block")
        block, _ = self._free.popitem(last=False)
        stale = self._key_of.pop(block, None)
        if stale is not None and self._block_of.get(stale) == block:
            del self._block_of[stale]
        self.refcount[block] = 1
        return block

    def _take(self, block: int) -> None:
        if self.refcount[block] == 0:
            del self._free[block]
        self.refcount[block] += 1

    def _key_block(self, block: int, key: int) -> None:
        if key not in self._block_of:
            self._block_of[key] = block
            self._key_of[block] = key
