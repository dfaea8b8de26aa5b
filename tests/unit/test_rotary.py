"""Rotary embeddings: every kind builds on the device the model is built on (load_model builds
under `with torch.device(...)`; transformers' rope functions answer on the CPU), and a partial
rotary embedding on full-width tables, after permute_partial_rotary, gives transformers' q . k."""

import pytest
import torch

from shardlm.layers.rotary import ApplyRotary, RotaryEmbedding, permute_partial_rotary, rotary_dim

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 128},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                 "long_factor": [2.0] * 8, "original_max_position_embeddings": 128},
}


def _config(rope: dict, partial: float = 1.0):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                       rope_parameters={**rope, "partial_rotary_factor": partial})


@pytest.mark.parametrize("kind", list(ROPES))
def test_every_rope_kind_builds_on_the_models_device(kind):
    with torch.device("meta"):
        rope = RotaryEmbedding(_config(ROPES[kind]), 16, 512, torch.float32)
    assert rope.cos.device.type == "meta" and rope.cos.shape == (512, 16)


def test_a_partial_rotary_embedding_on_full_width_tables_gives_transformers_scores():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    config = _config(ROPES["default"], partial=0.75)
    D, R = 16, rotary_dim(config, 16)
    assert R == 12
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 3, D, generator=g).unbind(0)                   # [T, heads, D]
    positions = torch.tensor([0, 3, 7, 100, 511])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, R, 2).float() / R))
    freqs = torch.outer(positions.float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    theirs = torch.einsum("htd,hsd->hts", hq, hk)
    rope = RotaryEmbedding(config, D, 512, torch.float32)

    def laid_out(x):      # [T, heads, D] with each head's dims in the order load gives a projection's rows
        rows = permute_partial_rotary(x.permute(1, 2, 0).reshape(-1, x.shape[0]), D, R)     # [heads * D, T]
        return rows.reshape(x.shape[1], D, -1).permute(2, 0, 1)

    ours_q, ours_k = (ApplyRotary().forward_native(laid_out(x), rope.lookup(positions)) for x in (q, k))
    ours = torch.einsum("thd,shd->hts", ours_q, ours_k)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
