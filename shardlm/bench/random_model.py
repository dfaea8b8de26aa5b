"""`shardlm bench make-model DIR`: a random-weight model for benchmarks of the parallel layouts.

The default shape is a Llama of about 113M parameters (hidden 768, 12 layers, 12 heads, 4 KV
heads, MLP 2048, tied 49152-token embeddings) so tensor parallel sizes 1, 2 and 4 all split it.
`--moe` writes a Mixtral instead: about 132M parameters (hidden 512, 8 layers, 8 heads, 4 KV
heads, 8 experts of 1024 each, 2 per token), so expert parallel over 2, 4 or 8 ranks places
whole experts. Both carry the default model's tokenizer, so the shared workload's prompts apply.
"""

from __future__ import annotations

import os
import shutil

DENSE_DEFAULTS = dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048)
MOE_DEFAULTS = dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1024)


def make_random_model(out_dir: str, hidden: int = 768, layers: int = 12, heads: int = 12, kv_heads: int = 4,
                      intermediate: int = 2048, num_experts: int = 0, experts_per_token: int = 2,
                      seed: int = 0, max_position_embeddings: int = 8192) -> str:
    """A Llama, or with num_experts > 0 a Mixtral whose experts have `intermediate` each."""
    import torch
    import transformers

    from shardlm.model_loader.default_model import default_model_dir

    tokenizer_dir = default_model_dir()
    common = dict(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=True, torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2)
    if num_experts:
        config = transformers.MixtralConfig(**common, num_local_experts=num_experts,
                                            num_experts_per_tok=experts_per_token, sliding_window=None)
        model_cls = transformers.MixtralForCausalLM
        kind = f"Mixtral ({num_experts} experts, {experts_per_token} per token)"
    else:
        config, model_cls, kind = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM, "Llama"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16)
    if num_experts:
        # Trained MoE models route evenly (their training balances the load). At random init the
        # layers' outputs share a common direction that sends most tokens to the same experts;
        # larger embeddings keep each token's own direction dominant, and the routing near even.
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0, 1.0)
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, hidden ** -0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    if not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        raise RuntimeError(f"The default model's tokenizer was not found in {tokenizer_dir}; delete that "
                           "directory (it is converted again on next use) and run make-model again.")
    params = sum(p.numel() for p in model.parameters())
    print(f"Wrote a random-weight {kind} with {params / 1e6:.0f}M parameters to {out_dir}")
    return out_dir
