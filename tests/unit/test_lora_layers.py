"""The grouped LoRA product against its definition, token by token: every batch layout (one
adapter for the whole step, equal segments as views, unequal ones gathered, base tokens between,
a subset of the slots), merged layers' shards, and the PEFT reader's scaling rules."""

import math

import pytest
import torch

from shardlm.lora import batch as lora_batch
from shardlm.lora.batch import LoRABatch
from shardlm.lora.layers import LoRASlots
from shardlm.lora.peft import _pattern_value


class _Merged:
    """A stand-in for a merged column-parallel layer of three shards (q, k, v) at tp=1."""
    in_features, outputs = 12, [(0, 8), (8, 4), (12, 4)]

    def lora_dims(self):
        return self.in_features, 16

    def lora_num_shards(self):
        return 3

    def lora_slice(self, shard, a, b):
        return a, b, self.outputs[shard][0]


def _adapter(seed: int, rank: int, shards=(0, 1, 2)):
    g = torch.Generator().manual_seed(seed)
    return {s: (torch.randn(rank, 12, generator=g), torch.randn(_Merged.outputs[s][1], rank, generator=g))
            for s in shards}


def _delta(parts, x):
    """The adapter's delta for rows x, from its definition: per shard B (A x)."""
    out = torch.zeros(x.shape[0], 16, dtype=torch.float64)
    for s, (a, b) in parts.items():
        first, rows = _Merged.outputs[s]
        out[:, first:first + rows] = x.double() @ a.double().t() @ b.double().t()
    return out


@pytest.mark.parametrize("chunks", [
    [(0, 5)],                                  # one adapter: the whole step
    [(0, 3), (1, 3), (2, 3)],                  # equal segments covering the step: views
    [(0, 2), (0, 3), (1, 1), (2, 6)],          # unequal (two chunks of one adapter merge)
    [(-1, 4), (1, 2), (-1, 1), (2, 5)],        # base tokens between, a subset of the slots
])
def test_grouped_product_equals_each_tokens_own_adapter(chunks):
    adapters = [_adapter(1, 4), _adapter(2, 2, shards=(0, 2)), _adapter(3, 3)]
    slots = LoRASlots(_Merged(), num_slots=3, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    for i, parts in enumerate(adapters):
        slots.set(i, parts)
    tokens = sum(n for _, n in chunks)
    x = torch.randn(tokens, 12)
    base = torch.randn(tokens, 16)
    batch = LoRABatch.of_chunks([s for s, _ in chunks], [n for _, n in chunks], 3, torch.device("cpu"))
    with lora_batch.running(batch):
        out = slots.add_to(x, base.clone())
    expected, row = base.double().clone(), 0
    for slot, n in chunks:
        if slot >= 0:
            expected[row:row + n] += _delta(adapters[slot], x[row:row + n])
        row += n
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-5)


def test_a_step_without_adapters_adds_nothing():
    assert LoRABatch.of_chunks([-1, -1], [3, 1], 2, torch.device("cpu")) is None
    slots = LoRASlots(_Merged(), 2, 4, torch.float32, torch.device("cpu"))
    out = torch.randn(4, 16)
    assert torch.equal(slots.add_to(torch.randn(4, 12), out.clone()), out)     # no batch running


def test_batch_layouts():
    whole = LoRABatch.of_chunks([1, 1], [2, 3], 4, torch.device("cpu"))
    assert whole.whole == 1 and whole.rows is None
    views = LoRABatch.of_chunks([0, 1], [3, 3], 2, torch.device("cpu"))
    assert views.rows is None and views.slot_ids is None and views.segments == [(0, 0, 3), (1, 3, 6)]
    gathered = LoRABatch.of_chunks([-1, 2, 0], [1, 3, 1], 3, torch.device("cpu"))
    assert gathered.slot_ids.tolist() == [2, 0] and gathered.rows.tolist() == [[1, 2, 3], [4, 4, 4]]
    with pytest.raises(ValueError, match="must be adjacent"):
        LoRABatch.of_chunks([0, 1, 0], [1, 1, 1], 2, torch.device("cpu"))


def test_peft_patterns_match_the_end_of_a_module_name():
    patterns = {"q_proj": 8, r"layers\.1\.mlp\.down_proj": 2}
    assert _pattern_value(patterns, "model.layers.0.self_attn.q_proj", 4) == 8
    assert _pattern_value(patterns, "model.layers.1.mlp.down_proj", 4) == 2
    assert _pattern_value(patterns, "model.layers.11.mlp.down_proj", 4) == 4
    assert _pattern_value(patterns, "model.layers.0.self_attn.k_proj", 4) == 4


@pytest.mark.parametrize("rslora", [False, True])
def test_the_reader_scales_b_by_alpha_over_rank_per_module(rslora, tmp_path, tiny_model_dir):
    """B comes out multiplied by lora_alpha / r (rsLoRA: / sqrt(r)), with rank_pattern and
    alpha_pattern overriding r and alpha per module; q/k/v land in qkv_proj's shards 0/1/2."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoConfig

    from shardlm.bench.random_lora import make_random_lora
    from shardlm.lora.peft import read_adapter
    base = tiny_model_dir("llama-gqa")
    path = make_random_lora(base, tmp_path / "a", rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                            rslora=rslora)
    config_file = tmp_path / "a" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["alpha_pattern"] = {"down_proj": 2}
    config_file.write_text(json.dumps(config))
    adapter = read_adapter("a", path, AutoConfig.from_pretrained(base), max_lora_rank=16)
    raw = load_file(tmp_path / "a" / "adapter_model.safetensors")
    scale = (lambda alpha: alpha / math.sqrt(4)) if rslora else (lambda alpha: alpha / 4)
    key = "base_model.model.model.layers.1.{}.lora_B.weight"
    parts = adapter.weights["model.layers.1.self_attn.qkv_proj"]
    assert set(parts) == {0, 2} and adapter.rank == 4
    torch.testing.assert_close(parts[2][1], raw[key.format("self_attn.v_proj")] * scale(8))
    torch.testing.assert_close(adapter.weights["model.layers.1.mlp.down_proj"][0][1],
                               raw[key.format("mlp.down_proj")] * scale(2))
