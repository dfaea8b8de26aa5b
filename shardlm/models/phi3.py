"""Phi-3 and Phi-4-mini."""

from __future__ import annotations

from shardlm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 and Phi-4-mini: Llama with q/k/v and gate/up fused in the checkpoint (split here, so
    that tensor parallel slices them as it slices Llama's), a partial rotary embedding (Phi-4-mini:
    0.75 of each head) and LongRoPE (its long or short factors chosen once from max_model_len)."""

    def checkpoint_tensors(self, weights):
        c = self.config
        q, kv = c.num_attention_heads * self.head_dim, c.num_key_value_heads * self.head_dim
        return super().checkpoint_tensors(self._split(weights, q, kv))

    @staticmethod
    def _split(weights, q: int, kv: int):
        """Each fused tensor read whole (every rank reads it) and split into Llama's."""
        for name, tensor in weights:
            if name.endswith("self_attn.qkv_proj.weight"):
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor[:].split([q, kv, kv])):
                    yield name.replace("qkv_proj", part), piece
            elif name.endswith("mlp.gate_up_proj.weight"):
                for part, piece in zip(("gate_proj", "up_proj"), tensor[:].chunk(2)):
                    yield name.replace("gate_up_proj", part), piece
            else:
                yield name, tensor
