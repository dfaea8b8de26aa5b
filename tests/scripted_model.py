"""A tiny Llama that writes a given text: its layers are silenced (attention and MLP outputs zero),
so each position's logits depend on its own token alone, and its embeddings and LM head chain the
text's tokens (token i's embedding is the unit vector i; the LM head row of token i + 1 reads
it). Greedy decoding after the prompt's last token then writes exactly the script and its EOS,
which a random model never does: tool-call markers, special tokens, a stop token.

The script's tokens must be distinct (each has one successor) and fewer than the hidden size."""

from __future__ import annotations

import os

import torch

HIDDEN = 64


def scripted_model(path, script: str, special_tokens: list[str] = (), eos: str = "<|im_end|>",
                   after: str = "\n") -> str:
    """A model directory at path that answers any prompt ending in `after` with `script`, then
    `eos`; special_tokens: added to the tokenizer (the default model's) as special tokens first."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tests.conftest import _tokenizer_dir
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir())
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    chain = [tokenizer.encode(after, add_special_tokens=False)[-1], *tokenizer.encode(script, add_special_tokens=False),
             tokenizer.convert_tokens_to_ids(eos)]
    if len(set(chain)) != len(chain) or len(chain) > HIDDEN:
        raise ValueError(f"a script of {len(chain)} tokens with repeats cannot be chained: {chain}")
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=chain[-1], tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, i] = 1.0
            model.lm_head.weight[successor, i] = 4.0      # logit 32 after the final norm, the rest 0
    model.generation_config.eos_token_id = chain[-1]
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    template = os.path.join(_tokenizer_dir(), "chat_template.jinja")
    if os.path.exists(template) and not os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(template) as src, open(os.path.join(path, "chat_template.jinja"), "w") as dst:
            dst.write(src.read())
    return str(path)
