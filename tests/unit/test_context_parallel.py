"""Decode context parallel in one process: which rank holds which position, the exact merge of
partial outputs, and partial attention over N simulated ranks' caches merged back to the whole."""

import random

import pytest
import torch

from shardlm import kernels
from shardlm.attention.context_parallel import ContextShard, merge, merge_partials
from shardlm.attention.cpu_kernel import CpuKernelAttention
from shardlm.attention.torch_paged import TorchPagedAttention
from shardlm.layers.attention import Attention

pytestmark = pytest.mark.usefixtures("one_rank")   # they build layers outside an engine

H, HKV, D, BS, NB = 8, 1, 64, 16, 48


@pytest.mark.parametrize("size,interleave", [(2, 1), (2, 4), (3, 1), (4, 16), (2, 16)])
def test_every_position_has_one_owner_and_a_slot_of_its_own(size, interleave):
    shards = [ContextShard(size, r, interleave, BS) for r in range(size)]
    table = [5, 9, 2, 7, 11, 3, 8]          # one table, its block ids on every rank
    seen = [set() for _ in shards]
    for n in range(0, len(table) * BS * size):
        owners = [s for s in shards if s.owns(n)]
        assert len(owners) == 1
        s = owners[0]
        i = s.local_index(n)
        assert i == s.local_len(n)                     # positions are stored in order, densely
        assert int(s.positions(i + 1)[-1]) == n        # and the local index maps back
        slot = s.slot(table, n, sink=-1)
        assert slot not in seen[s.rank] and slot // BS in table
        seen[s.rank].add(slot)
        assert all(t.slot(table, n, sink=-1) == -1 for t in shards if t is not s)
    assert sum(s.local_len(len(table) * BS * size) for s in shards) == len(table) * BS * size


def test_merge_equals_a_float64_softmax_over_the_whole_context():
    torch.manual_seed(0)
    T, Hq, n = 5, 3, 40
    scores = torch.randn(T, Hq, n, dtype=torch.float64) * 4
    values = torch.randn(n, Hq, 16, dtype=torch.float64)
    owner = torch.tensor([random.Random(1).randrange(3) for _ in range(n)])
    owner[owner == 2] = 1                     # rank 2 holds nothing: zeros and -inf
    outs, lses = [], []
    for r in range(3):
        s = scores.masked_fill(owner != r, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0).unsqueeze(-1))
        outs.append(torch.einsum("thn,nhd->thd", p, values).float())
        lses.append(lse.float())
    want = torch.einsum("thn,nhd->thd", torch.softmax(scores, dim=-1), values)
    got = merge(torch.stack(outs), torch.stack(lses))
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < 1e-5


def _layer(backend, shard: ContextShard | None, dtype):
    backend.shard, backend.sink_slot = shard, NB * BS
    attn = Attention(H, HKV, D, D ** -0.5)
    attn.backend = backend
    attn.k_cache = torch.zeros(HKV, NB + 1, BS, D, dtype=dtype, device=backend.device)   # + the sink block
    attn.v_cache = torch.zeros(HKV, NB + 1, BS, D, dtype=dtype, device=backend.device)
    return attn


def partial_attention_error(make_backend, size: int, interleave: int, dtype: torch.dtype) -> float:
    """Two steps, as an engine runs them: prompt chunks (one with earlier context), then decodes
    (one of a sequence whose first position only rank 0 holds, so the others return -inf); on
    `size` simulated ranks, each with a backend from make_backend(). -> the largest difference of
    the merged partials from the whole attention. Checks each position is stored once."""
    torch.manual_seed(0)
    whole = _layer(make_backend(), None, dtype)
    device = whole.k_cache.device
    ranks = [_layer(make_backend(), ContextShard(size, r, interleave, BS), dtype) for r in range(size)]
    tables = [[3, 7, 1, 12, 20, 5], [9, 2, 30], [40]]
    steps = [([37, 20, 1], [0, 0, 0]), ([1, 1, 1], [37, 20, 1]), ([5, 1, 1], [38, 21, 2])]
    error = 0.0
    for q_lens, starts in steps:
        T = sum(q_lens)
        q = torch.randn(T, H, D, dtype=dtype, device=device)
        k, v = (torch.randn(T, HKV, D, dtype=dtype, device=device) for _ in range(2))
        want = whole(q, k, v, whole.backend.build_metadata(q_lens, starts, tables)).view(T, H, D)
        outs, lses = zip(*(r.backend.forward_partial(r, q, k, v, r.backend.build_metadata(q_lens, starts, tables))
                           for r in ranks))
        got = merge(torch.stack(outs), torch.stack(lses))
        error = max(error, float((got - want.float()).abs().max()))
    held = sum(int(r.k_cache[:, :NB].abs().sum(-1).gt(0).sum()) for r in ranks)
    assert held == int(whole.k_cache.abs().sum(-1).gt(0).sum())
    return error


@pytest.mark.parametrize("size,interleave", [(2, 1), (2, 8), (4, 1)])
@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_partial_attention_on_each_rank_merges_to_whole_attention(size, interleave, use_kernel, dtype, tol, cpu_isa):
    cpu = torch.device("cpu")
    if use_kernel:
        make = lambda: CpuKernelAttention(BS, cpu, kernels.paged_decode_attention())   # noqa: E731
    else:
        make = lambda: TorchPagedAttention(BS, cpu)   # noqa: E731
    assert partial_attention_error(make, size, interleave, dtype) < tol


class _Gathered:
    """A stand-in for a cp group whose every rank's packed partials are known in advance."""

    def __init__(self, packed: list[torch.Tensor], rank: int):
        self.packed, self.rank_in_group, self.world_size = packed, rank, len(packed)

    def all_gather(self, x, dim):
        assert torch.equal(x[0], self.packed[self.rank_in_group])
        return torch.stack(self.packed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_merge_equals_the_torch_merge_for_own_rows_and_heads(dtype, cpu_isa):
    torch.manual_seed(0)
    N, T, heads, D, H = 4, 6, 8, 16, 2          # 4 ranks, 8 gathered heads, 2 of them each rank's
    outs, lses = torch.randn(N, T, heads, D), torch.randn(N, T, heads) * 3
    lses[2, :3] = float("-inf")                 # a rank without context for some queries
    packed = [torch.cat([outs[r].reshape(T, -1), lses[r]], dim=1) for r in range(N)]
    rows = slice(1, 5)
    for r in range(N):
        first = (r % 4) * H
        got = merge_partials(outs[r], lses[r], _Gathered(packed, r), H, first, dtype, rows)
        want = merge(outs[:, rows, first:first + H], lses[:, rows, first:first + H]).to(dtype).view(4, -1)
        assert kernels.merge_attention_partials() is not None
        assert (got.float() - want.float()).abs().max() <= (1e-6 if dtype == torch.float32 else 1e-2)
