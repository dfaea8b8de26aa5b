"""Images in prompts (multimodal/): tiny LLaVA, LLaVA-NeXT (tiles by image size) and Idefics3
(SmolVLM: tiles with text between them) give transformers' greedy tokens with 0, 1 and 2 images of
different sizes, whole and split over steps; LLaVA also at TP=2, PP=2, PCP=2 and DP=2;
offline chats read image_url and image_pil parts; the prefix cache tells images apart; LoRA on
the text model; GPTQ, AWQ and FP8 checkpoints; as an embedder (--runner pooling); bad images, counts
and models are refused with what to do."""

import base64
import io

import numpy as np
import pytest

from shardlm import LLM, SamplingParams
from tests import hf_reference

PROMPTS = ["Describe <image> please", "A <image> and <image> compared", "no image at all"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=5)


def image(seed: int, height: int = 40, width: int = 70):
    from PIL import Image
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGES = [[image(0)], [image(1, 50, 55), image(2, 60, 40)], []]
FAMILIES = ["llava", "llava-next", "idefics3"]


def transformers_greedy(path: str, prompts, images, add_special_tokens: bool = True) -> list:
    """(tokens, top-5 sets) per prompt from transformers' LLaVA, as hf_reference.greedy gives them."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoProcessor
    processor = AutoProcessor.from_pretrained(path)
    model_class = getattr(transformers, AutoConfig.from_pretrained(path).architectures[0])
    model = model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    results = []
    with torch.inference_mode():
        for text, ims in zip(prompts, images):
            inputs = processor(images=ims or None, text=text, return_tensors="pt",
                               add_special_tokens=add_special_tokens)
            out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
            results.append((out.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
                            [set(s[0].topk(5).indices.tolist()) for s in out.scores]))
    return results


def with_images(prompts, images):
    return [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in zip(prompts, images)]


@pytest.fixture(scope="module")
def llava(tiny_model_dir):
    return tiny_model_dir("llava")


@pytest.fixture(scope="module")
def reference(llava):
    return transformers_greedy(llava, PROMPTS, IMAGES)


def test_an_adapter_on_the_text_model_gives_the_merged_models_tokens(llava, reference, tmp_path):
    """A LoRA adapter of LLaVA (PEFT names its modules under model.language_model.) runs on the
    text model: image prompts give transformers' tokens on the merged weights, and a weight on
    the vision tower is refused naming it."""
    from safetensors.torch import load_file, save_file

    from shardlm import LoRARequest
    from tests.lora_adapters import merged_model, write_adapter
    adapter = write_adapter(llava, tmp_path / "adapter", rank=8, seed=4)
    ref = transformers_greedy(merged_model(llava, adapter, tmp_path / "merged"), PROMPTS, IMAGES)
    vision = write_adapter(llava, tmp_path / "vision", rank=8, seed=5)
    tensors = load_file(f"{vision}/adapter_model.safetensors")
    tensors = {k.replace("language_model.layers", "vision_tower.encoder.layers"): v for k, v in tensors.items()}
    save_file(tensors, f"{vision}/adapter_model.safetensors")
    engine = LLM(llava, dtype="float32", enable_lora=True)
    try:
        outs = engine.generate(with_images(PROMPTS, IMAGES), GREEDY, lora_request=LoRARequest("a", 1, adapter))
        with pytest.raises(ValueError, match="vision side.*vision_tower.encoder.layers.0"):
            engine.generate(with_images(PROMPTS, IMAGES), GREEDY, lora_request=LoRARequest("v", 2, vision))
    finally:
        engine.shutdown()
    assert hf_reference.assert_close(ref, outs, "llava with an adapter") == len(PROMPTS)
    assert any(r[0] != base[0] for r, base in zip(ref, reference)), "the adapter changes the tokens it is checked on"


@pytest.mark.parametrize("family", FAMILIES[1:])
@pytest.mark.parametrize("steps", [{}, {"max_num_batched_tokens": 8}], ids=["whole", "8-token-steps"])
def test_tiled_images_give_transformers_tokens(tiny_model_dir, family, steps):
    path = tiny_model_dir(family)
    engine = LLM(path, dtype="float32", **steps)
    try:
        outs = engine.generate(with_images(PROMPTS, IMAGES), GREEDY)
    finally:
        engine.shutdown()
    assert hf_reference.assert_close(transformers_greedy(path, PROMPTS, IMAGES), outs, family) == len(PROMPTS)


@pytest.fixture(scope="module")
def llm(llava):
    engine = LLM(llava, dtype="float32", enable_prefix_caching=True, limit_mm_per_prompt='{"image": 2}')
    yield engine
    engine.shutdown()


def test_images_give_transformers_tokens(llm, reference):
    outs = llm.generate(with_images(PROMPTS, IMAGES), GREEDY)
    assert hf_reference.assert_close(reference, outs, "llava") == len(PROMPTS)
    # each image's 16 placeholders are in the prompt the engine ran
    assert outs[1].prompt_token_ids.count(llm.engine.config.model.multimodal.image_token_id) == 32


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"max_num_batched_tokens": 8}, {"tensor_parallel_size": 2},
                                    {"pipeline_parallel_size": 2}, {"prefill_context_parallel_size": 2},
                                    {"data_parallel_size": 2}], ids=["8-token-steps", "tp2", "pp2", "pcp2", "dp2"])
def test_images_give_the_same_tokens_split_over_steps_and_ranks(llava, reference, layout):
    engine = LLM(llava, dtype="float32", **layout)
    try:
        outs = engine.generate(with_images(PROMPTS, IMAGES), GREEDY)
    finally:
        engine.shutdown()
    assert hf_reference.assert_close(reference, outs, str(layout)) == len(PROMPTS)


def test_a_chat_reads_image_url_and_image_pil_parts(llm, llava):
    from transformers import AutoProcessor
    picture = image(5, 50, 60)
    ask = [{"role": "user", "content": [{"type": "text", "text": "What is in "}, {"type": "image"},
                                        {"type": "text", "text": " this?"}]}]
    text = AutoProcessor.from_pretrained(llava).apply_chat_template(ask, add_generation_prompt=True)
    (ref,) = transformers_greedy(llava, [text], [[picture]], add_special_tokens=False)
    for part in ({"type": "image_url", "image_url": {"url": data_url(picture)}},
                 {"type": "image_pil", "image_pil": picture}):
        messages = [{"role": "user", "content": [ask[0]["content"][0], part, ask[0]["content"][2]]}]
        (out,) = llm.chat(messages, GREEDY)
        assert hf_reference.assert_close([ref], [out], part["type"]) == 1


def test_the_prefix_cache_tells_images_apart(llm):
    text = "Look " * 40 + "at <image> now"      # 40 tokens of text before the image
    first, other, again = (llm.generate([{"prompt": text, "multi_modal_data": {"image": im}}], GREEDY)[0]
                           for im in (image(7), image(8), image(7)))
    image_at = first.prompt_token_ids.index(llm.engine.config.model.multimodal.image_token_id)
    # another image: only the blocks before it are reused; the same image: the whole prompt's full blocks
    assert other.num_cached_tokens == image_at // 16 * 16
    assert again.num_cached_tokens == len(first.prompt_token_ids) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_bad_image_prompts_are_refused_with_what_to_do(llm, tmp_path):
    cases = [
        ({"prompt": "two <image> <image>", "multi_modal_data": {"image": [image(0)]}}, "put one '<image>'"),
        ({"prompt": "<image><image><image>", "multi_modal_data": {"image": [image(0)] * 3}}, "at most 2"),
        ({"prompt": "a <image>", "multi_modal_data": {"audio": [b""]}}, "takes images"),
        ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [image(0)]}}, "needs its text"),
        ({"prompt": "a <image>", "multi_modal_data": {"image": "data:image/png;base64,!!"}}, "does not decode"),
        ({"prompt": "a <image>", "multi_modal_data": {"image": "data:image/png;base64,aGVsbG8="}},
         "could not be decoded"),
        ({"prompt": "a <image>", "multi_modal_data": {"image": "file:///etc/passwd"}}, "--allowed-local-media-path"),
    ]
    for prompt, says in cases:
        with pytest.raises(ValueError, match=says):
            llm.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match="would cut a prompt with images"):
        llm.generate([{"prompt": "a <image>", "multi_modal_data": {"image": image(0)}}],
                     SamplingParams(max_tokens=2, truncate_prompt_tokens=4))
    # the engine goes on
    assert llm.generate(["still here"], GREEDY)[0].outputs[0].token_ids


def test_file_urls_are_read_under_the_allowed_path_only(llava, tmp_path):
    """Also: http(s) images come only from --allowed-media-domains where it is given."""
    from shardlm.entrypoints.cli import build_parser
    from shardlm.entrypoints.cli.engine_flags import engine_args_from
    given = build_parser().parse_args(["serve", llava, "--allowed-media-domains", "example.com", "Images.Example.org"])
    assert engine_args_from(given).allowed_media_domains == ["example.com", "Images.Example.org"]
    (tmp_path / "pic.png").write_bytes(base64.b64decode(data_url(image(3)).split(",")[1]))
    engine = LLM(llava, dtype="float32", allowed_local_media_path=str(tmp_path),
                 allowed_media_domains=["example.com", "Images.Example.org"])
    try:
        by_file, by_data = (engine.generate([{"prompt": "see <image>", "multi_modal_data": {"image": src}}],
                                            GREEDY)[0].outputs[0].token_ids
                            for src in (f"file://{tmp_path}/pic.png", data_url(image(3))))
        assert by_file == by_data
        with pytest.raises(ValueError, match="outside --allowed-local-media-path"):
            engine.generate([{"prompt": "see <image>", "multi_modal_data": {"image": f"file://{tmp_path}/../x.png"}}])
        with pytest.raises(ValueError, match=r"from example.com, images.example.org only \(--allowed-media-domains\), "
                                             "not 127.0.0.1"):
            engine.generate([{"prompt": "see <image>", "multi_modal_data": {"image": "http://127.0.0.1:9/x.png"}}])
    finally:
        engine.shutdown()


class _Dirs:
    """tmp_path_factory's mktemp, under one test's tmp_path."""
    def __init__(self, root):
        self.root = root

    def mktemp(self, name):
        path = self.root / name
        path.mkdir()
        return path


@pytest.mark.slow
@pytest.mark.parametrize("method,layout", [("gptq", {}), ("awq", {"tensor_parallel_size": 2}), ("fp8-block", {})],
                         ids=["gptq", "awq-tp2", "fp8-block"])
def test_a_quantized_checkpoint_runs_its_text_model_as_stored(llava, method, layout, tmp_path):
    """LLaVA with its language model's linears 4-bit packed (GPTQ, AWQ: the vision side in float,
    as their tools leave it) or in FP8 (vision attention too, dequantized as it is read): found from
    config.json without a flag, the text model's 8 linears kept as stored, images give transformers'
    tokens on the dequantized weights."""
    from tests.models.test_fp8_checkpoints import _write
    from tests.models.test_quantized import _packed_checkpoints
    if method in ("gptq", "awq"):
        dirs = _packed_checkpoints(llava, tmp_path, quantizes=lambda name: "language_model" in name)
        stored, dequantized = dirs[method], dirs["dequantized"]
    else:
        stored, dequantized = _write(llava, method, _Dirs(tmp_path))
    engine = LLM(stored, dtype="float32", **layout)
    try:
        kernels = engine.collective_rpc("quantized_kernels")
        outs = engine.generate(with_images(PROMPTS, IMAGES), GREEDY)
    finally:
        engine.shutdown()
    assert sum(sum(k.values()) for k in kernels) == 8 * (2 if "tensor_parallel_size" in layout else 1)
    ref = transformers_greedy(dequantized, PROMPTS, IMAGES)
    assert hf_reference.assert_close(ref, outs, method) == len(PROMPTS)


def test_a_vision_tower_stored_quantized_is_refused_with_what_to_do(llava, tmp_path):
    from tests.models.test_quantized import _packed_checkpoints
    dirs = _packed_checkpoints(llava, tmp_path)
    with pytest.raises(ValueError, match=r"stores its vision side quantized \(vision_tower.*Quantize the language "
                                         "model alone"):
        LLM(dirs["gptq"], dtype="float32")


@pytest.mark.slow
def test_as_an_embedder_it_embeds_images_as_transformers_does(llava):
    """--runner pooling (E5-V's way: the last token's final hidden state, normalized), with 0, 1 and
    2 images: transformers' LLaVA's last hidden state; split by tp2 x pp2 (the vision tower on the
    first stage), one rank's."""
    import torch
    import transformers
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(llava)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.stack([torch.nn.functional.normalize(model.model(**processor(
            images=ims or None, text=text, return_tensors="pt")).last_hidden_state[0, -1], dim=-1)
            for text, ims in zip(PROMPTS, IMAGES)])

    def embeddings(**layout):
        llm = LLM(llava, dtype="float32", kv_cache_memory="16MiB", runner="pooling", **layout)
        try:
            return torch.tensor([o.outputs.embedding for o in llm.embed(with_images(PROMPTS, IMAGES), use_tqdm=False)])
        finally:
            llm.shutdown()
    torch.testing.assert_close(embeddings(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(embeddings(tensor_parallel_size=2, pipeline_parallel_size=2), want, atol=1e-5, rtol=0)


def test_combinations_that_cannot_work_are_refused(llava):
    from types import SimpleNamespace

    from shardlm.engine.arg_utils import EngineArgs
    from shardlm.engine.feature_rules import UnsupportedCombination, check_combinations
    config = EngineArgs(model=llava, dtype="float32").create_engine_config()
    config.speculative = SimpleNamespace(method="eagle")        # (a tiny EAGLE head for it is not built)
    with pytest.raises(UnsupportedCombination, match="placeholder tokens as text"):
        check_combinations(config)
    with pytest.raises(ValueError, match="leave out --model-impl transformers"):
        LLM(llava, model_impl="transformers")


def test_a_text_model_refuses_images(tiny_model_dir):
    engine = LLM(tiny_model_dir("llama-gqa"), dtype="float32")
    try:
        with pytest.raises(ValueError, match="is a text model: it takes no images"):
            engine.generate([{"prompt": "a <image>", "multi_modal_data": {"image": image(0)}}])
    finally:
        engine.shutdown()


def test_processor_options_come_from_the_flag_and_the_prompt(tiny_model_dir):
    """Idefics3 without image splitting: one tile, as transformers' processor gives it with the same option."""
    path = tiny_model_dir("idefics3")
    engine = LLM(path, dtype="float32", mm_processor_kwargs='{"do_image_splitting": false}')
    try:
        whole, split = (engine.generate([{"prompt": "look <image> here", "multi_modal_data": {"image": image(0)},
                                          **extra}], GREEDY)[0]
                        for extra in ({}, {"mm_processor_kwargs": {"do_image_splitting": True}}))
    finally:
        engine.shutdown()
    token = 49152
    assert whole.prompt_token_ids.count(token) == 1 and split.prompt_token_ids.count(token) == 5
    from transformers import AutoProcessor
    text = AutoProcessor.from_pretrained(path)(text=["look <image> here"], images=[image(0)], do_image_splitting=False)
    assert whole.prompt_token_ids == text["input_ids"][0]


def test_bench_latency_puts_images_before_the_prompt(llava, capsys):
    """`shardlm bench latency --images 2`: the prompt the engine ran holds both images' placeholders."""
    from argparse import Namespace

    from shardlm.bench.offline import report, run_latency
    result = run_latency(Namespace(model=llava, dtype="float32"), None, 4, 1, images=2, image_size=(64, 48))
    report(result, as_json=False)
    assert result["images"] == 2 and result["prompt_tokens"] > 32 and result["output_tokens"] == 4
    assert "2 image(s) of 64x48" in capsys.readouterr().out


def test_a_chat_template_kept_by_the_processor_alone_is_used(llava, tmp_path):
    """llava-hf's checkpoints keep the chat template in chat_template.json, which only the
    processor reads: chats render with it (the image where its part is) as with the template
    beside the tokenizer."""
    import json
    import shutil
    legacy = tmp_path / "legacy"
    shutil.copytree(llava, legacy)
    template = (legacy / "chat_template.jinja").read_text()
    (legacy / "chat_template.jinja").unlink()
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                             {"type": "image_pil", "image_pil": image(4)}]}]
    outs = []
    for path in (llava, legacy):
        engine = LLM(str(path), dtype="float32")
        try:
            outs.append(engine.chat(messages, GREEDY)[0])
        finally:
            engine.shutdown()
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
