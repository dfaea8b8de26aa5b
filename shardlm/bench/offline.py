"""`shardlm bench throughput` and `shardlm bench latency`: the offline engine on a workload.

Throughput: every prompt submitted at once, exactly output_len new tokens each (greedy, or
sampled at --temperature, each request seeded with --seeded; EOS ignored), repeated after a
warm-up with the prefix cache cleared between runs; medians.
Latency: one prompt alone (or --batch-size copies of it, all decoding together); in each run
the time to the first token and to the last, decode step time = (T(last) - T(first)) / (n - 1)
(median over runs), decode tok/s = batch size / step time. With
--each-prompt, every prompt of the workload in turn, and the median over them. A workload that
keeps EOS (grounded) ends each request at its answer's end: n is the tokens it made.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass

from shardlm.bench.workload import load_workload
from shardlm.sampling_params import RequestOutputKind, SamplingParams


def _peak_rss_bytes(llm) -> int:
    """This process's peak, plus each worker process's peak when the ranks run in their own."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if llm.engine.config.parallel.distributed_executor_backend != "uni":   # ranks in processes of their own
        own += sum(llm.collective_rpc("peak_rss_bytes"))
    return own


def _engine_facts(llm) -> dict:
    model = llm.engine.config.model
    return {"engine": "shardlm", "dtype": str(model.dtype).replace("torch.", ""),
            "quantization": model.quantization.method if model.quantization else None}


def _speculation(llm) -> dict:
    """Speculative decoding over the run: tokens proposed and accepted; {} without it."""
    if llm.engine.config.speculative is None:
        return {}
    s = llm.engine.engine_core.call_utility("stats")
    drafts, drafted, accepted = s["spec_num_drafts"], s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"]
    return {"spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0}


def _expert_load(llm) -> dict:
    """MoE models: tokens routed to each expert per layer over the run, and each layer's
    imbalance (the busiest expert's tokens over the mean: 1.0 is even); {} for dense models."""
    if not llm.engine.config.model.num_experts:
        return {}
    load = llm.engine.engine_core.call_utility("stats")["expert_load"]
    imbalance = {layer: max(c) * len(c) / max(1, sum(c)) for layer, c in load.items()}
    return {"expert_load": load, "expert_imbalance": imbalance,
            "expert_imbalance_max": max(imbalance.values(), default=1.0)}


def _start(engine_args):
    from shardlm.llm import LLM
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    return llm, time.perf_counter() - t0


@dataclass(frozen=True)
class Sampling:
    """How the throughput benchmark's requests sample: greedy (temperature 0), or at a temperature,
    each request with a seed of its own or none."""
    temperature: float = 0.0
    seeded: bool = False

    def params(self, count: int, **kwargs) -> SamplingParams | list[SamplingParams]:
        if not self.seeded:
            return SamplingParams(temperature=self.temperature, **kwargs)
        return [SamplingParams(temperature=self.temperature, seed=i, **kwargs) for i in range(count)]


def _timed(llm, prompts, n, structured_outputs=None, loras=None, ignore_eos=True,
           sampling: Sampling = Sampling()) -> tuple[float, int]:
    """(seconds, output tokens) to generate n tokens for each prompt; a constrained output may
    end sooner, when its constraint is complete, and without ignore_eos at EOS. loras: LoRA
    adapters the prompts take in turn."""
    llm.reset_prefix_cache()
    params = sampling.params(len(prompts), max_tokens=n, ignore_eos=ignore_eos, structured_outputs=structured_outputs)
    lora_requests = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    elapsed = time.perf_counter() - t0
    assert structured_outputs is not None or not ignore_eos or all(len(o.outputs[0].token_ids) == n for o in outs)
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def _timed_first_and_last(llm, prompts, n, loras=None, ignore_eos=True) -> tuple[float, float, int]:
    """One run of n tokens per prompt: (seconds to the first token, seconds to the last, tokens
    per request). Both times from one run, so a long prompt's prefill, which varies by more than
    a whole decode, is not subtracted across runs."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos,
                            output_kind=RequestOutputKind.CUMULATIVE)
    engine, first, tokens = llm.engine, None, 0
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}-{t0}", prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt},
                           params,
                           lora_request=loras[i % len(loras)] if loras else None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - t0
            tokens = max(tokens, len(out.outputs[0].token_ids))
    return first, time.perf_counter() - t0, tokens


def run_throughput(engine_args, workload_path, num_prompts, output_len, reps, structured_outputs=None,
                   loras=None, sampling: Sampling = Sampling()) -> dict:
    """structured_outputs: a StructuredOutputsParams every request is constrained by, or None;
    loras: LoRARequests the requests take in turn, or None."""
    llm, startup_s = _start(engine_args)
    w = load_workload(workload_path, llm.get_tokenizer(), num_prompts, output_len,
                      llm.engine.config.model.max_model_len)
    _timed(llm, w.prompts[:4], 8, structured_outputs, loras)   # warm-up
    runs = [_timed(llm, w.prompts, w.output_len, structured_outputs, loras, w.ignore_eos, sampling)
            for _ in range(reps)]
    times = [t for t, _ in runs]
    rates = [tokens / t for t, tokens in runs]
    out_tokens = statistics.median(tokens for _, tokens in runs)
    med = statistics.median(times)
    return {"benchmark": "throughput", "workload": w.source, "num_prompts": len(w.prompts),
            "prompt_tokens": w.num_prompt_tokens, "output_tokens": out_tokens, "reps": reps,
            "elapsed_s": times, "output_tok_s": statistics.median(rates),
            "total_tok_s": (out_tokens + w.num_prompt_tokens) / med,
            "output_tok_s_all": rates, "startup_s": startup_s,
            "structured_outputs": None if structured_outputs is None else structured_outputs.kinds()[0],
            "temperature": sampling.temperature, "seeded": sampling.seeded,
            "lora_adapters": len(loras or []),
            "peak_rss_bytes": _peak_rss_bytes(llm), **_engine_facts(llm), **_expert_load(llm), **_speculation(llm)}


def _with_images(llm, ids: list[int], images: int, size: tuple[int, int]) -> dict:
    """A prompt of `images` random images of size (width, height) before the text of `ids`."""
    import numpy as np
    from PIL import Image
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    placeholder = llm.engine.processor.given_embeddings.images.placeholder
    return {"prompt": placeholder * images + llm.get_tokenizer().decode(ids),
            "multi_modal_data": {"image": [picture] * images}}


def run_latency(engine_args, workload_path, output_len, reps, batch_size: int = 1, loras=None,
                each_prompt: bool = False, images: int = 0, image_size: tuple[int, int] = (640, 480)) -> dict:
    """images: that many random images of image_size (width, height) before each prompt (a
    vision-language model): its time to first token includes encoding them."""
    t0 = time.perf_counter()
    llm, startup_s = _start(engine_args)
    w = load_workload(workload_path, llm.get_tokenizer(), None, output_len, llm.engine.config.model.max_model_len)
    if images:
        w.prompts = [_with_images(llm, ids, images, image_size) for ids in w.prompts]
    indices = range(len(w.prompts)) if each_prompt else [w.latency_prompt_index]
    first_prompt = [w.prompts[indices[0]]] * batch_size
    first = _timed(llm, first_prompt, 1, loras=loras)[0]
    startup_to_first_token = time.perf_counter() - t0
    _timed(llm, first_prompt, 8, loras=loras)   # warm-up
    per_prompt = []
    for i in indices:
        prompt = [w.prompts[i]] * batch_size
        runs = [_timed_first_and_last(llm, prompt, w.output_len, loras, w.ignore_eos) for _ in range(reps)]
        t1, tn, n = [r[0] for r in runs], [r[1] for r in runs], runs[0][2]   # greedy: every run the same tokens
        step_s = statistics.median((last - first) / max(1, n - 1) for first, last, _ in runs)
        per_prompt.append({"prompt_tokens": _prompt_tokens(llm, prompt[0]), "output_tokens": n, "t_1tok_s": t1,
                           "t_ntok_s": tn,
                           "time_to_first_token_s": statistics.median(t1), "decode_step_ms": step_s * 1000,
                           "decode_tok_s": batch_size / step_s})
    median = {key: statistics.median(p[key] for p in per_prompt)
              for key in ("prompt_tokens", "output_tokens", "time_to_first_token_s", "decode_step_ms", "decode_tok_s")}
    return {"benchmark": "latency", "workload": w.source, **per_prompt[0], **median,
            "batch_size": batch_size, "reps": reps, "lora_adapters": len(loras or []),
            **({"images": images, "image_size": "x".join(map(str, image_size))} if images else {}),
            **({"per_prompt": per_prompt} if each_prompt else {}),
            "startup_s": startup_s, "startup_to_first_token_s": startup_to_first_token,
            "cold_first_request_s": first, "peak_rss_bytes": _peak_rss_bytes(llm), **_engine_facts(llm),
            **_expert_load(llm), **_speculation(llm)}


def _prompt_tokens(llm, prompt) -> int:
    """The tokens the engine runs for a prompt (with images: their placeholders too)."""
    if not isinstance(prompt, dict):
        return len(prompt)
    return len(llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids)


def report(result: dict, as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return
    gib = result["peak_rss_bytes"] / (1 << 30)
    if result["benchmark"] == "throughput":
        sampled = (f", sampled at temperature {result['temperature']:g}{', seeded' if result.get('seeded') else ''}"
                   if result.get("temperature") else "")
        print(f"Throughput ({result['workload']}, {result['num_prompts']} prompts, {result['prompt_tokens']} prompt "
              f"tokens, {result['output_tokens']} output tokens, dtype {result['dtype']}{sampled}, "
              f"median of {result['reps']}):\n"
              f"  output tokens/s: {result['output_tok_s']:.1f}\n  total tokens/s:  {result['total_tok_s']:.1f}\n"
              f"  start-up: {result['startup_s']:.1f} s, peak memory (RSS): {gib:.2f} GiB")
    else:
        images = f", {result['images']} image(s) of {result['image_size']}" if result.get("images") else ""
        print(f"Latency (batch {result['batch_size']}, {result['prompt_tokens']} prompt tokens{images}, "
              f"{result['output_tokens']} new tokens, dtype {result['dtype']}, median of {result['reps']}):\n"
              f"  decode step: {result['decode_step_ms']:.2f} ms\n"
              f"  decode tokens/s: {result['decode_tok_s']:.1f}\n"
              f"  time to first token: {result['time_to_first_token_s'] * 1000:.0f} ms\n"
              f"  start-up to first token: {result['startup_to_first_token_s']:.1f} s "
              f"(engine start-up {result['startup_s']:.1f} s)\n  peak memory (RSS): {gib:.2f} GiB")
        for p in result.get("per_prompt", []):       # --each-prompt: the medians above are over these
            print(f"  {p['prompt_tokens']} prompt tokens: time to first token "
                  f"{p['time_to_first_token_s'] * 1000:.0f} ms, decode step {p['decode_step_ms']:.2f} ms")
    if "expert_imbalance_max" in result:
        print(f"  expert load: busiest expert / mean, worst layer: {result['expert_imbalance_max']:.2f} "
              "(per-layer counts in --json)")
