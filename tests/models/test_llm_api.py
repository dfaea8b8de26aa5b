"""The offline API on a tiny model: request options, outputs, and clear errors for bad input."""

import json
import math
import os
import weakref

import pytest
import torch

from shardlm import LLM, SamplingParams

PROMPTS = [[5, 900, 17, 3000, 42], list(range(1000, 1040)), [77] * 3]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="64MiB", max_model_len=256)


def test_outputs_in_input_order_with_metadata(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for o in outs:
        c = o.outputs[0]
        assert o.finished and len(c.token_ids) == 5 and c.finish_reason == "length"
        assert o.metrics.first_token_time >= o.metrics.arrival_time and o.metrics.e2e_latency > 0


def test_text_prompts_and_token_prompts_agree(llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_text = llm.generate("The capital of", sp, use_tqdm=False)[0]
    by_ids = llm.generate({"prompt_token_ids": tok("The capital of").input_ids}, sp, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == "The capital of"
    assert by_text.outputs[0].text == tok.decode(by_text.outputs[0].token_ids, skip_special_tokens=True)


def test_n_samples_share_prompt_blocks_and_differ(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 4 and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # samples 1..3 reused sample 0's prompt blocks
    assert llm.stats()["prefix_cache_hits"] > 0


def test_seed_gives_same_output_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=10, seed=123, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    crowd = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [other, sp, other], use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone


def test_stop_string_is_cut_and_reported(llm):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = llm.generate(PROMPTS[1], sp, use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), "need a non-blank stop string"
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)] and stop not in out.text


def test_stop_token_ids_and_min_tokens(llm):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # the stop token's own text is not shown (vLLM's rule; include_stop_str_in_output shows it)
    assert out.text == llm.get_tokenizer().decode(ids[:first], skip_special_tokens=True)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=first + 2,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert stop_id not in out.token_ids[:first + 2]


def test_logprobs_match_hf(llm, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=3, prompt_logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama-gqa"), dtype=torch.float32)
    ids = PROMPTS[1] + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    # prompt logprobs: position i scores prompt token i given the tokens before it
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[1])
    for i in range(1, len(PROMPTS[1])):
        lp = out.prompt_logprobs[i][PROMPTS[1][i]].logprob
        assert abs(lp - float(ref[i - 1, PROMPTS[1][i]])) < 1e-3
    c = out.outputs[0]
    assert len(c.logprobs) == 3
    for j, (tok, pos) in enumerate(zip(c.token_ids, range(len(PROMPTS[1]) - 1, len(ids) - 1))):
        assert abs(c.logprobs[j][tok].logprob - float(ref[pos, tok])) < 1e-3
        assert c.logprobs[j][tok].rank == 1
        assert set(ref[pos].topk(3).indices.tolist()) <= set(c.logprobs[j])
    assert abs(c.cumulative_logprob - sum(c.logprobs[j][t].logprob for j, t in enumerate(c.token_ids))) < 1e-5


def test_chat_accepts_one_or_many_conversations(llm):
    conv = [{"role": "user", "content": "hi"}]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    one = llm.chat(conv, sp, use_tqdm=False)
    many = llm.chat([conv, conv], sp, use_tqdm=False)
    assert len(one) == 1 and len(many) == 2
    assert one[0].prompt.endswith("<|im_start|>assistant\n")
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, params, error, match", [
    (list(range(300)), SamplingParams(), ValueError, "max_model_len=256"),
    ([], SamplingParams(), ValueError, "at least one prompt"),
    ("", SamplingParams(), ValueError, "empty"),
    ([10 ** 9], SamplingParams(), ValueError, "vocabulary"),
    ("x", "not params", TypeError, "SamplingParams"),
    (["x", "y"], [SamplingParams()] * 3, ValueError, "Got 2 prompts but 3 sampling params: give one, or one per"),
])
def test_bad_input_gives_clear_errors(llm, prompt, params, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_engine_errors(tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama-gqa")
    with pytest.raises(TypeError, match="kv_cache_memory"):
        LLM(path, kv_cache_memroy="1GiB")
    with pytest.raises(ValueError, match="float16 is supported on CUDA only"):
        LLM(path, dtype="float16", device="cpu")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(path, dtype="float32", kv_cache_memory=8192 * 4, max_model_len=512)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["FancyNewForCausalLM"]
    os.makedirs(tmp_path / "m")
    json.dump(cfg, open(tmp_path / "m" / "config.json", "w"))
    with pytest.raises(ValueError, match="Supported architectures: .*LlamaForCausalLM"):
        LLM(str(tmp_path / "m"))


def test_generation_config_defaults_apply(tiny_model_dir, tmp_path):
    import shutil
    src = tiny_model_dir("llama-gqa")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    json.dump({"eos_token_id": [7, 8], "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 5},
              open(dst / "generation_config.json", "w"))
    llm = LLM(str(dst), dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    assert llm.engine.config.model.eos_token_ids == [7, 8]
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.6, 0.9, 5)
    assert len(llm.generate(PROMPTS[0], use_tqdm=False)[0].outputs[0].token_ids) <= 5


def test_generation_config_and_its_override_as_vllms_flags(tiny_model_dir, tmp_path):
    """--generation-config auto (the model's file), vllm (no defaults) or a folder, and
    --override-generation-config laid over it; the model's EOS ids hold in each case."""
    import shutil

    from shardlm.engine.arg_utils import EngineArgs
    dst, other = tmp_path / "m", tmp_path / "other"
    shutil.copytree(tiny_model_dir("llama-gqa"), dst)
    json.dump({"eos_token_id": [7, 8], "temperature": 0.6, "top_p": 0.9}, open(dst / "generation_config.json", "w"))
    other.mkdir()
    json.dump({"temperature": 0.2, "top_k": 5}, open(other / "generation_config.json", "w"))

    def defaults(**kwargs):
        model = EngineArgs(model=str(dst), dtype="float32", **kwargs).create_engine_config().model
        assert model.eos_token_ids == [7, 8]
        return model.generation_defaults

    assert defaults() == {"eos_token_id": [7, 8], "temperature": 0.6, "top_p": 0.9}
    assert defaults(generation_config="vllm") == {}
    assert defaults(generation_config=str(other)) == {"temperature": 0.2, "top_k": 5}
    assert defaults(override_generation_config='{"temperature": 0.1, "max_new_tokens": 9}') == \
        {"eos_token_id": [7, 8], "temperature": 0.1, "top_p": 0.9, "max_new_tokens": 9}
    assert defaults(generation_config="vllm", override_generation_config={"top_p": 0.5}) == {"top_p": 0.5}
    for bad, why in [(dict(generation_config="hf"), "give auto .*, vllm .* or a folder"),
                     (dict(generation_config=str(tmp_path)), "the folder has no generation_config.json"),
                     (dict(override_generation_config="temperature=0.5"), "give a JSON object"),
                     (dict(override_generation_config='{"temprature": 0.5}'), "temprature gives no sampling default")]:
        with pytest.raises(ValueError, match=why):
            defaults(**bad)


def test_load_format_dummy_runs_a_model_without_its_weights(tiny_model_dir, tmp_path):
    """config.json and the tokenizer suffice: random weights of the model's shapes, the same on each
    run, quantized at load on request; a checkpoint's own weights are not read."""
    import shutil
    dst = tmp_path / "config-only"
    shutil.copytree(tiny_model_dir("llama-gqa"), dst, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(dst), dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    runs = []
    for quantization in (None, None, "int8"):
        llm = LLM(str(dst), dtype="float32", kv_cache_memory="16MiB", max_model_len=64, load_format="dummy",
                  quantization=quantization)
        weights = dict(llm.engine.engine_core.engine_core.executor.worker.runner.model.named_parameters())
        runs.append(llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0].token_ids)
        assert all(w.abs().max() <= 1e-3 for w in weights.values() if w.is_floating_point())
        llm.shutdown()
    assert len(runs[0]) == 6 and runs[0] == runs[1], "the same random weights each run"
    with pytest.raises(ValueError, match="give auto .* or dummy"):
        LLM(str(dst), load_format="pt")
    from shardlm.engine.arg_utils import EngineArgs
    with pytest.raises(ValueError, match="dummy makes float weights, not GGUF blocks"):
        EngineArgs(load_format="dummy").create_engine_config()       # the embedded default model


def test_max_logprobs_bounds_what_a_request_may_ask(tiny_model_dir):
    """--max-logprobs, as vLLM's: 20 by default, more on request, -1 the whole vocabulary."""
    from shardlm.engine.arg_utils import EngineArgs
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64,
              max_logprobs=30)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=25, prompt_logprobs=30), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 2 and all(len(lp) in (25, 26) for lp in out.outputs[0].logprobs), \
        "the top 25, and the sampled token where it is not among them"
    assert all(len(lp) in (30, 31) for lp in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match=r"logprobs=31: this engine gives at most 30 per token \(--max-logprobs 30"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=31), use_tqdm=False)
    llm.shutdown()
    assert EngineArgs(model=tiny_model_dir("llama-gqa")).max_logprobs == 20
    with pytest.raises(ValueError, match="--max-logprobs -2: give a count >= 0, or -1"):
        EngineArgs(model=tiny_model_dir("llama-gqa"), max_logprobs=-2).create_engine_config()
    from shardlm.entrypoints.openai.server import build_app
    schema = build_app(EngineArgs(model=tiny_model_dir("llama-gqa"), max_logprobs=7).create_engine_config()).openapi()
    request = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["top_logprobs"]
    assert {"type": "integer", "maximum": 7} in request["anyOf"], "the server's schema says its bound"


def test_shutdown_releases_weights_and_kv_cache(tiny_model_dir):
    """A process may start a second engine after the first (CUDA: its memory profile must not
    count the first one's weights and KV cache, which stayed allocated before this)."""
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="64MiB")
    runner = llm.engine.engine_core.engine_core.executor.worker.runner
    model, k_cache = weakref.ref(runner.model), weakref.ref(runner.attention_layers()[0].k_cache)
    del runner
    llm.shutdown()
    assert model() is None and k_cache() is None


def test_one_max_tokens_rule_offline_as_in_the_server(tiny_model_dir):
    """prompt + max_tokens must fit in max_model_len (the server answers 400 with the same words);
    max_tokens=None runs to the end of the context."""
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    prompt = list(range(100, 150))
    with pytest.raises(ValueError, match=r"max_tokens=20 is too large: .* 64 tokens and the prompt has 50, which "
                                         r"leaves room for 14 new tokens"):
        llm.generate(prompt, SamplingParams(max_tokens=20), use_tqdm=False)
    fits = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    rest = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(fits[0].outputs[0].token_ids) == len(rest[0].outputs[0].token_ids) == 14
    assert rest[0].outputs[0].finish_reason == "length"


def test_the_kv_cache_sized_by_blocks_or_by_vllms_byte_knob(tiny_model_dir):
    """--num-gpu-blocks-override sets the block count whatever the memory gives (a small cache
    preempts and still finishes every request); LLM(kv_cache_memory_bytes=...) is vLLM's name."""
    # llama-gqa float32: 2 layers x 2 kv heads x 16 dims x 4 bytes x 2 (K, V) x 16 tokens = 8 KiB a block
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", max_model_len=64, num_gpu_blocks_override=9)
    assert llm.stats()["kv_cache_tokens"] == 8 * 16
    outs = llm.generate([[100 + i] * 20 for i in range(4)], SamplingParams(max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [40] * 4 and llm.stats()["num_preemptions"] > 0
    llm.shutdown()
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", max_model_len=64, kv_cache_memory_bytes=8192 * 13)
    assert llm.stats()["kv_cache_tokens"] == 12 * 16
    llm.shutdown()
    with pytest.raises(TypeError, match="two names of one setting"):
        LLM(tiny_model_dir("llama-gqa"), kv_cache_memory="1GiB", kv_cache_memory_bytes=1 << 30)


def test_logprobs_modes_offline(tiny_model_dir):
    """--logprobs-mode raw_logits: each position's listed values are the logprobs plus one constant
    (the log-sum-exp); processed_logprobs with top_k 3: three tokens share all the probability."""
    prompts, greedy = [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, logprobs=4, prompt_logprobs=2)
    runs = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs"):
        llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64,
                  logprobs_mode=mode)
        runs[mode] = llm.generate(prompts, greedy, use_tqdm=False)[0]
        if mode == "processed_logprobs":
            sampled = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.8, top_k=3, seed=1,
                                                           logprobs=5), use_tqdm=False)[0].outputs[0]
        llm.shutdown()
    raw, logits = runs["raw_logprobs"], runs["raw_logits"]
    assert raw.outputs[0].token_ids == logits.outputs[0].token_ids
    positions = list(zip(raw.outputs[0].logprobs, logits.outputs[0].logprobs)) + \
        list(zip(raw.prompt_logprobs[1:], logits.prompt_logprobs[1:]))
    for lp, lg in positions:
        assert list(lp) == list(lg), "the same tokens, in the same order"
        shift = [lg[t].logprob - lp[t].logprob for t in lp]
        assert max(shift) - min(shift) < 1e-3 and shift[0] > 0
    assert [{t: v.logprob for t, v in p.items()} for p in runs["processed_logprobs"].outputs[0].logprobs] == \
        [{t: v.logprob for t, v in p.items()} for p in raw.outputs[0].logprobs], "greedy: nothing processes them"
    for position in sampled.logprobs:
        finite = [v.logprob for v in position.values() if v.logprob != float("-inf")]
        assert len(finite) == 3 and sum(math.exp(v) for v in finite) == pytest.approx(1, abs=1e-4)


def test_disable_sliding_window_caps_sequences_at_the_window(tiny_model_dir):
    """As vLLM's: max_model_len becomes the model's window (8 keys here), within which the outputs
    are the windowed model's; a longer max_model_len is refused; a model without windows is as it was."""
    from shardlm.engine.arg_utils import EngineArgs
    assert EngineArgs(model=tiny_model_dir("mistral-window"),
                      disable_sliding_window=True).create_engine_config().model.max_model_len == 8
    assert EngineArgs(model=tiny_model_dir("llama-gqa"),
                      disable_sliding_window=True).create_engine_config().model.max_model_len == 512
    with pytest.raises(ValueError, match="longer than the model's attention window \\(8\\)"):
        EngineArgs(model=tiny_model_dir("mistral-window"), max_model_len=64,
                   disable_sliding_window=True).create_engine_config()
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outputs = []
    for disabled in (True, False):
        llm = LLM(tiny_model_dir("mistral-window"), dtype="float32", kv_cache_memory="16MiB",
                  disable_sliding_window=disabled)
        outputs.append(llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].outputs[0].token_ids)
        llm.shutdown()
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4


def test_skip_tokenizer_init_takes_and_gives_token_ids(tiny_model_dir):
    """As vLLM's: no tokenizer; token-id prompts give the same tokens as with one (their text
    empty, logprobs without text); whatever needs text is refused, saying so."""
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    outputs = []
    for skip in (False, True):
        llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64,
                  skip_tokenizer_init=skip)
        outputs.append(llm.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].outputs[0])
        if skip:
            assert llm.get_tokenizer() is None
            for call, what in ((lambda: llm.generate("Hello", sp, use_tqdm=False), "A text prompt"),
                               (lambda: llm.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False),
                                r"\(stop strings\)"),
                               (lambda: llm.chat([{"role": "user", "content": "hi"}]), "LLM.chat")):
                with pytest.raises(ValueError, match=f"{what} needs the tokenizer.*--skip-tokenizer-init"):
                    call()
        llm.shutdown()
    with_text, ids_only = outputs
    assert ids_only.token_ids == with_text.token_ids and with_text.text and ids_only.text == ""
    assert [{t: v.logprob for t, v in p.items()} for p in ids_only.logprobs] == \
        [{t: v.logprob for t, v in p.items()} for p in with_text.logprobs]
    assert all(v.decoded_token is None for p in ids_only.logprobs for v in p.values())


def test_cache_salt_shares_cached_prompts_only_within_one_salt(tiny_model_dir):
    """vLLM's cache_salt: a prompt's cached blocks are reused by the same prompt with the same
    salt, never by one with another salt or none (tenants that must not see each other's cache)."""
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    prompt, sp = list(range(100, 150)), SamplingParams(max_tokens=1)

    def cached(**salt) -> int:
        return llm.generate([{"prompt_token_ids": prompt, **salt}], sp, use_tqdm=False)[0].num_cached_tokens
    assert [cached(cache_salt="a"), cached(cache_salt="a"), cached(cache_salt="b"), cached(), cached()] == \
        [0, 48, 0, 0, 48]
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        cached(cache_salt="")
    llm.shutdown()


def test_bad_words_are_never_generated(tiny_model_dir):
    """vLLM's bad_words (text, with and without a leading space) and bad_words_token_ids: a word's
    last token is banned where the output ends with the rest of it."""
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    greedy = dict(max_tokens=8, temperature=0, ignore_eos=True)

    def run(**extra) -> list[int]:
        return llm.generate([[5, 6, 7]], SamplingParams(**greedy, **extra), use_tqdm=False)[0].outputs[0].token_ids
    plain = run()
    two = plain[2:4]                       # a two-token word the plain output has
    avoided = run(bad_words_token_ids=[two])
    assert avoided[:3] == plain[:3] and avoided[3] != plain[3]
    assert all(avoided[i:i + 2] != two for i in range(len(avoided) - 1))
    word = llm.get_tokenizer().decode(plain[:1]).strip()
    assert run(bad_words=[word])[0] != plain[0]
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[" "])
    llm.shutdown()


def test_chat_goes_on_in_the_last_message_and_passes_tools_and_template_variables(tiny_model_dir, tmp_path):
    """vLLM's LLM.chat arguments: continue_final_message, tools, chat_template_kwargs."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                "{% if tools %}[{{ tools | length }} tools]{% endif %}{{ suffix }}")
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well"}]
    sp = SamplingParams(max_tokens=1)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    whole = llm.chat(conversation, sp, use_tqdm=False, chat_template=template, add_generation_prompt=False,
                     tools=[tool], chat_template_kwargs={"suffix": "!"})[0]
    assert whole.prompt == "<user>hi</user><assistant>Well</assistant>[1 tools]!"
    going_on = llm.chat(conversation, sp, use_tqdm=False, chat_template=template, add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert going_on.prompt == "<user>hi</user><assistant>Well"
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(conversation, continue_final_message=True)
    llm.shutdown()


def test_detokenize_false_and_truncate_prompt_tokens(tiny_model_dir):
    """vLLM's SamplingParams.detokenize (token ids alone) and truncate_prompt_tokens (the prompt's
    last k tokens)."""
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    greedy = dict(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    text, ids_only = llm.generate(["Hello there", "Hello there"], [SamplingParams(**greedy),
                                  SamplingParams(**greedy, detokenize=False)], use_tqdm=False)
    assert ids_only.outputs[0].token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert ids_only.outputs[0].text == "" and all(v.decoded_token is None
                                                   for p in ids_only.outputs[0].logprobs for v in p.values())
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(stop=["x"], detokenize=False)
    cut = llm.generate([list(range(100, 120))], SamplingParams(**greedy, truncate_prompt_tokens=3), use_tqdm=False)[0]
    alone = llm.generate([[117, 118, 119]], SamplingParams(**greedy), use_tqdm=False)[0]
    assert cut.prompt_token_ids == [117, 118, 119] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    llm.shutdown()
