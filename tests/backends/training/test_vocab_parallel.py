"""The LM head split by vocabulary over a tensor-parallel group (`vocab_parallel`) gives the unsplit head's
log-probs, entropies, top-k and gradients, on real gloo process groups: uneven slices (a vocabulary that does not
divide by the ranks), ids owned by every rank, suppressed ids, several asked ids per token, chunking, the
entropy's gradient on and off, and the chunks' logits kept for the backward or recomputed there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from relax.backends.training.log_probs import token_log_probs
from relax.backends.training.vocab_parallel import vocab_parallel_token_log_probs, vocabulary_slice
from relax.distributed.process_group import free_loopback_port
from tests.support.runs import start_ranks

# (vocab, hidden, tokens, asked ids per token, chunk, top_k, entropy_grad, suppressed ids)
CASES = [(37, 8, 11, 1, 4, 0, False, None), (37, 8, 11, 3, 5, 4, True, [2, 20, 36]), (64, 16, 9, 2, 0, 5, True, None),
         (10, 4, 7, 1, 3, 3, False, [9])]


def _inputs(case, seed):
    vocab, hidden_size, tokens, asked, *_ = case
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, vocab, (tokens, asked), generator=generator)
    upstream = (torch.randn(tokens, asked, generator=generator, dtype=torch.float64),
                torch.randn(tokens, generator=generator, dtype=torch.float64))
    return hidden, weight, ids, upstream


def _run(case, hidden, weight, ids, upstream, group=None, keep_logits=False):
    vocab, _, _, _, chunk, top_k, entropy_grad, suppressed = case
    hidden = hidden.clone().requires_grad_(True)
    suppressed_ids = torch.tensor(suppressed) if suppressed else None
    if group is None:
        weight = weight.clone().requires_grad_(True)
        out = token_log_probs(hidden, weight, ids, suppressed_ids=suppressed_ids, chunk_size=chunk,
                              entropy_grad=entropy_grad, top_k=top_k, temperature=0.7)
    else:
        start, size = vocabulary_slice(vocab, group)
        weight = weight[start:start + size].clone().requires_grad_(True)
        out = vocab_parallel_token_log_probs(hidden, weight, ids, vocab, group, suppressed_ids=suppressed_ids,
                                             chunk_size=chunk, entropy_grad=entropy_grad, top_k=top_k,
                                             temperature=0.7, keep_logits=keep_logits)
    loss = (out.log_probs * upstream[0]).sum() + ((out.entropy * upstream[1]).sum() if entropy_grad else 0.0)
    loss.backward()
    return {"log_probs": out.log_probs.detach(), "entropy": out.entropy.detach(),
            "top_log_probs": out.top_log_probs, "top_ids": out.top_ids, "grad_hidden": hidden.grad,
            "grad_weight": weight.grad}


def _on_rank(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for index, case in enumerate(CASES):
        for seed in range(3):
            results[index, seed] = _run(case, *_inputs(case, seed), group=dist.group.WORLD, keep_logits=seed == 1)
    torch.save(results, Path(root) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_a_head_split_by_vocabulary_gives_the_whole_heads_outputs_and_gradients(world, tmp_path):
    start_ranks(_on_rank, (world, free_loopback_port(), str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for index, case in enumerate(CASES):
        for seed in range(3):
            expected = _run(case, *_inputs(case, seed))
            for got in (ranks[r][index, seed] for r in range(world)):  # every rank returns the whole result
                for key in ("log_probs", "entropy", "grad_hidden"):
                    torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-10, msg=key)
                if case[5]:
                    torch.testing.assert_close(got["top_log_probs"], expected["top_log_probs"], rtol=1e-10,
                                               atol=1e-10)
                    assert torch.equal(got["top_ids"], expected["top_ids"])
            # each rank's slice of the weight's gradient: together, the whole head's
            whole = torch.cat([ranks[r][index, seed]["grad_weight"] for r in range(world)])
            torch.testing.assert_close(whole, expected["grad_weight"], rtol=1e-10, atol=1e-10)


def test_vocabulary_slices_cover_the_vocabulary_in_order():
    class Group:
        def __init__(self, rank, size):
            self._rank, self._size = rank, size

        def rank(self):
            return self._rank

        def size(self):
            return self._size

    for vocab in range(1, 40):
        for size in range(1, 9):
            slices = [vocabulary_slice(vocab, Group(r, size)) for r in range(size)]
            assert [i for start, n in slices for i in range(start, start + n)] == list(range(vocab))
            chunks = torch.arange(vocab).chunk(size)  # DTensor's Shard(0)
            assert [n for _, n in slices][:len(chunks)] == [len(c) for c in chunks]
