"""`shardlm bench make-model DIR`: a random-weight Llama for benchmarks of the parallel layouts.

The default shape has about 113M parameters (hidden 768, 12 layers, 12 heads, 4 KV heads, MLP
2048, tied 49152-token embeddings) so tensor parallel sizes 1, 2 and 4 all split it; it carries
the default model's tokenizer, so the shared workload's prompts apply.
"""

from __future__ import annotations

import os
import shutil


def make_random_llama(out_dir: str, hidden: int = 768, layers: int = 12, heads: int = 12, kv_heads: int = 4,
                      intermediate: int = 2048, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardlm.model_loader.default_model import default_model_dir

    tokenizer_dir = default_model_dir()
    config = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=8192, tie_word_embeddings=True, torch_dtype="bfloat16",
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"Wrote a random-weight Llama with {params / 1e6:.0f}M parameters to {out_dir}")
    return out_dir
