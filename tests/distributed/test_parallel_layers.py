"""Weight slicing of the tensor parallel layers: each rank loads exactly its part of the
checkpoint tensor (read lazily from safetensors), and the parts recombine to the full layer."""

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from shardlm.distributed import parallel_state as ps
from shardlm.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from shardlm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from tests.distributed.ranks import run_ranks

torch.manual_seed(0)
HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER, VOCAB = 16, 4, 4, 2, 24, 10
FULL = {
    "q": torch.randn(HEADS * HEAD_DIM, HIDDEN), "k": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN),
    "v": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN), "gate": torch.randn(INTER, HIDDEN),
    "up": torch.randn(INTER, HIDDEN), "down": torch.randn(HIDDEN, INTER), "down_bias": torch.randn(HIDDEN),
    "embed": torch.randn(VOCAB, HIDDEN),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "w.safetensors"
    save_file(FULL, str(path))
    f = safe_open(str(path), framework="pt")
    return {name: f.get_slice(name) for name in FULL}     # lazy: loaders read only their part


def _as_rank(monkeypatch, tp, rank):
    monkeypatch.setitem(ps._groups, "tp", ps.GroupCoordinator("tp", list(range(tp)), rank))


def _build(monkeypatch, tp, rank, ckpt):
    _as_rank(monkeypatch, tp, rank)
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=False)
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER])
    down = RowParallelLinear(INTER, HIDDEN, bias=True)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN)
    for layer, param, name, shard in ((qkv, qkv.weight, "q", "q"), (qkv, qkv.weight, "k", "k"),
                                      (qkv, qkv.weight, "v", "v"), (gate_up, gate_up.weight, "gate", 0),
                                      (gate_up, gate_up.weight, "up", 1), (down, down.weight, "down", None),
                                      (down, down.bias, "down_bias", None), (embed, embed.weight, "embed", None)):
        param.weight_loader(param, ckpt[name], shard)
    return qkv, gate_up, down, embed


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_slice(monkeypatch, checkpoint, tp):
    rows_per_rank = -(-VOCAB // tp)
    for rank in range(tp):
        qkv, gate_up, down, embed = _build(monkeypatch, tp, rank, checkpoint)
        q_rows = HEADS * HEAD_DIM // tp
        kv_head = rank // max(1, tp // KV_HEADS)     # tp=4 > 2 KV heads: each replicated on 2 ranks
        kv_rows = max(1, KV_HEADS // tp) * HEAD_DIM
        kv_start = kv_head * kv_rows
        expected_qkv = torch.cat([FULL["q"][rank * q_rows:(rank + 1) * q_rows],
                                  FULL["k"][kv_start:kv_start + kv_rows], FULL["v"][kv_start:kv_start + kv_rows]])
        assert torch.equal(qkv.weight, expected_qkv)
        i = INTER // tp
        assert torch.equal(gate_up.weight, torch.cat([FULL["gate"][rank * i:(rank + 1) * i],
                                                      FULL["up"][rank * i:(rank + 1) * i]]))
        assert torch.equal(down.weight, FULL["down"][:, rank * i:(rank + 1) * i])
        assert torch.equal(down.bias, FULL["down_bias"])
        real = FULL["embed"][rank * rows_per_rank:(rank + 1) * rows_per_rank]
        assert torch.equal(embed.weight[:len(real)], real)
        assert not embed.weight[len(real):].any(), "padding rows past the vocabulary are zero"


def test_parts_recombine_to_the_full_layers(monkeypatch, checkpoint):
    tp, x = 2, torch.randn(3, HIDDEN)
    gate_up_out, down_partial, embed_parts = [], [], []
    h = torch.randn(3, INTER)
    ids = torch.tensor([0, 4, 5, 9])
    for rank in range(tp):
        _, gate_up, down, embed = _build(monkeypatch, tp, rank, checkpoint)
        gate_up_out.append(gate_up(x).split(INTER // tp, dim=-1))
        i = INTER // tp
        down_partial.append(F.linear(h[:, rank * i:(rank + 1) * i], down.weight))
        local = (ids >= embed.start) & (ids < embed.end)
        embed_parts.append(F.embedding((ids - embed.start) * local, embed.weight) * local.unsqueeze(-1))
    gate = torch.cat([g for g, _ in gate_up_out], dim=-1)
    up = torch.cat([u for _, u in gate_up_out], dim=-1)
    torch.testing.assert_close(gate, x @ FULL["gate"].T)
    torch.testing.assert_close(up, x @ FULL["up"].T)
    torch.testing.assert_close(sum(down_partial) + FULL["down_bias"], F.linear(h, FULL["down"], FULL["down_bias"]))
    torch.testing.assert_close(sum(embed_parts), FULL["embed"][ids])


def test_a_mismatched_checkpoint_is_a_clear_error(monkeypatch):
    _as_rank(monkeypatch, 2, 1)
    layer = ColumnParallelLinear(HIDDEN, 8)
    with pytest.raises(ValueError, match="does not match the weights"):
        layer.weight.weight_loader(layer.weight, torch.randn(6, HIDDEN))


def _lm_head_rank(rank, tp, port, weight, hidden, results):
    from shardlm.layers.vocab_parallel_embedding import ParallelLMHead
    ps.init_distributed_environment(tp, rank, "127.0.0.1", port, "gloo", 60)
    ps.initialize_model_parallel(tp, rank=rank, backend="gloo")
    head = ParallelLMHead(*weight.shape)
    head.weight.weight_loader(head.weight, weight)
    results.put((rank, (head.greedy(hidden), head(hidden))))
    ps.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_greedy_on_vocab_shards_equals_argmax_of_the_full_logits(tp):
    """Each rank sends (max, index) of its shard; ties across ranks go to the lowest id, as argmax does.
    tp=3 pads the 10-row vocabulary to 12: the padding rows never win."""
    weight = torch.randn(VOCAB, HIDDEN)
    weight[7] = weight[2]                  # rows on different ranks: equal logits for every input
    hidden = torch.randn(6, HIDDEN)
    hidden[0] = weight[2] * 10             # row 0: the tie between ids 2 and 7 is the maximum
    hidden[1] = -weight.sum(0)             # row 1: all logits negative (padding rows are 0: must not win)
    got = run_ranks(_lm_head_rank, tp, weight, hidden)
    tokens, logits = got[0]
    expected = (hidden @ weight.t()).argmax(dim=-1).tolist()
    assert tokens == expected == logits.argmax(dim=-1).tolist()
    assert tokens[0] == 2
    assert all(got[r] == (None, None) for r in range(1, tp))
