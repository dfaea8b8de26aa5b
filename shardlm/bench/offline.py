"""`shardlm bench throughput` and `shardlm bench latency`: the offline engine on a workload.

Throughput: every prompt submitted at once, exactly output_len new tokens each (greedy, EOS
ignored), repeated after a warm-up with the prefix cache cleared between runs; medians.
Latency: one prompt alone (or --batch-size copies of it, all decoding together); decode step
time = (T(n tokens) - T(1 token)) / (n - 1), decode tok/s = batch size / step time.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time

from shardlm.bench.workload import load_workload
from shardlm.sampling_params import SamplingParams


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


def _timed(llm, prompts, n, structured_outputs=None, loras=None) -> tuple[float, int]:
    """(seconds, output tokens) to generate n tokens for each prompt; a constrained output may
    end sooner, when its constraint is complete. loras: LoRA adapters the prompts take in turn."""
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, structured_outputs=structured_outputs)
    lora_requests = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    elapsed = time.perf_counter() - t0
    assert structured_outputs is not None or all(len(o.outputs[0].token_ids) == n for o in outs)
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def run_throughput(engine_args, workload_path, num_prompts, output_len, reps, structured_outputs=None,
                   loras=None) -> dict:
    """structured_outputs: a StructuredOutputsParams every request is constrained by, or None;
    loras: LoRARequests the requests take in turn, or None."""
    llm, startup_s = _start(engine_args)
    w = load_workload(workload_path, llm.get_tokenizer(), num_prompts, output_len)
    _timed(llm, w.prompts[:4], 8, structured_outputs, loras)   # warm-up
    runs = [_timed(llm, w.prompts, w.output_len, structured_outputs, loras) for _ in range(reps)]
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
            "lora_adapters": len(loras or []),
            "peak_rss_bytes": _peak_rss_bytes(llm), **_engine_facts(llm), **_expert_load(llm)}


def run_latency(engine_args, workload_path, output_len, reps, batch_size: int = 1, loras=None) -> dict:
    t0 = time.perf_counter()
    llm, startup_s = _start(engine_args)
    w = load_workload(workload_path, llm.get_tokenizer(), None, output_len)
    prompt = [w.prompts[w.latency_prompt_index]] * batch_size
    first = _timed(llm, prompt, 1, loras=loras)[0]
    startup_to_first_token = time.perf_counter() - t0
    _timed(llm, prompt, 8, loras=loras)   # warm-up
    t1 = [_timed(llm, prompt, 1, loras=loras)[0] for _ in range(reps)]
    tn = [_timed(llm, prompt, w.output_len, loras=loras)[0] for _ in range(reps)]
    n = w.output_len
    step_s = (statistics.median(tn) - statistics.median(t1)) / (n - 1)
    return {"benchmark": "latency", "workload": w.source, "prompt_tokens": len(prompt[0]), "output_tokens": n,
            "batch_size": batch_size, "reps": reps, "t_1tok_s": t1, "t_ntok_s": tn, "lora_adapters": len(loras or []),
            "time_to_first_token_s": statistics.median(t1),
            "decode_step_ms": step_s * 1000, "decode_tok_s": batch_size / step_s,
            "startup_s": startup_s, "startup_to_first_token_s": startup_to_first_token,
            "cold_first_request_s": first, "peak_rss_bytes": _peak_rss_bytes(llm), **_engine_facts(llm),
            **_expert_load(llm)}


def report(result: dict, as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=1)
        print()
        return
    gib = result["peak_rss_bytes"] / (1 << 30)
    if result["benchmark"] == "throughput":
        print(f"Throughput ({result['workload']}, {result['num_prompts']} prompts, {result['prompt_tokens']} prompt "
              f"tokens, {result['output_tokens']} output tokens, dtype {result['dtype']}, "
              f"median of {result['reps']}):\n"
              f"  output tokens/s: {result['output_tok_s']:.1f}\n  total tokens/s:  {result['total_tok_s']:.1f}\n"
              f"  start-up: {result['startup_s']:.1f} s, peak memory (RSS): {gib:.2f} GiB")
    else:
        print(f"Latency (batch {result['batch_size']}, {result['prompt_tokens']} prompt tokens, "
              f"{result['output_tokens']} new tokens, dtype {result['dtype']}, median of {result['reps']}):\n"
              f"  decode step: {result['decode_step_ms']:.2f} ms\n"
              f"  decode tokens/s: {result['decode_tok_s']:.1f}\n"
              f"  time to first token: {result['time_to_first_token_s'] * 1000:.0f} ms\n"
              f"  start-up to first token: {result['startup_to_first_token_s']:.1f} s "
              f"(engine start-up {result['startup_s']:.1f} s)\n  peak memory (RSS): {gib:.2f} GiB")
    if "expert_imbalance_max" in result:
        print(f"  expert load: busiest expert / mean, worst layer: {result['expert_imbalance_max']:.2f} "
              "(per-layer counts in --json)")
