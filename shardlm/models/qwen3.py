"""Qwen3, dense (the MoE ones: qwen_moe.py)."""

from __future__ import annotations

from shardlm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (0.6B to 32B): Llama with an RMSNorm on each q and k head and an explicit head_dim
    (e.g. 128 with hidden 1024 and 16 heads in Qwen3-0.6B); no q/k/v biases."""
    qk_norm = True
