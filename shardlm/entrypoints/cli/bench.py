"""`shardlm bench ...`: offline throughput and latency, a server under load, plots, random models
and the MoE layer alone."""

from __future__ import annotations

from shardlm.entrypoints.cli.engine_flags import add_engine_args, engine_args_from


def register(sub) -> None:
    p = sub.add_parser("bench", help="offline benchmarks")
    bsub = p.add_subparsers(dest="bench_kind", required=True)
    for kind, text in (("throughput", "all prompts at once: output and total tokens/s"),
                       ("latency", "one prompt: batch-1 decode tokens/s and time to first token")):
        b = bsub.add_parser(kind, help=text)
        add_engine_args(b)
        b.add_argument("--workload", default=None, help="workload JSON (shared format), or 'grounded' (prompts "
                       "whose answers are mostly in the prompt: edit, quote, rewrite code), or 'long' (4k, 8k and "
                       "16k-token prompts, or for a shorter model 2k, 4k and the longest that fits: 2,048, 4,096 and "
                       "8,000 for the default model); default: a synthetic 64-prompt chat workload")
        if kind == "throughput":
            b.add_argument("--num-prompts", type=int, default=None, help="repeat/cut the workload to this many")
            b.add_argument("--structured-outputs", default=None, help="constrain every request: a "
                           "StructuredOutputsParams as JSON, e.g. '{\"json\": SCHEMA}' or '{\"regex\": \"...\"}'")
            b.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (vLLM's "
                           "throughput benchmark samples at 1.0); default 0: greedy, as the shared workload")
            b.add_argument("--seeded", action="store_true", help="with --temperature: a seed of its own for each "
                           "request (its own random generator)")
        else:
            b.add_argument("--batch-size", type=int, default=1, help="copies of the prompt decoding together")
            b.add_argument("--images", type=int, default=0, help="a vision-language model: this many random images "
                           "before each prompt (its time to first token includes encoding them)")
            b.add_argument("--image-size", default="640x480", help="with --images: WIDTHxHEIGHT (default 640x480)")
            b.add_argument("--each-prompt", action="store_true", help="every prompt of the workload in turn "
                           "(medians over them) instead of its latency prompt")
        b.add_argument("--lora-path", nargs="+", default=None, metavar="ADAPTER",
                       help="LoRA adapters (directories or hub ids), given to the requests in turn; turns on "
                            "--enable-lora with --max-loras at least their number")
        b.add_argument("--output-len", type=int, default=None, help="new tokens per prompt (default: workload's, 128)")
        b.add_argument("--reps", type=int, default=3)
        b.add_argument("--json", action="store_true", help="print JSON")
        b.set_defaults(func=run)
    b = bsub.add_parser("embed", help="a pooling model: sentences per second at batch 1 and larger batches")
    add_engine_args(b)
    b.add_argument("--batch-sizes", default="1,64", help="sentences per call, comma-separated (default 1,64)")
    b.add_argument("--num-sentences", type=int, default=256, help="sentences per measurement (default 256)")
    b.add_argument("--compare", action="store_true", help="sentence-transformers on the same sentences, side by side")
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=run)
    b = bsub.add_parser("make-lora", help="write a random LoRA adapter (PEFT format) for a model")
    b.add_argument("model", help="the base model's directory")
    b.add_argument("out_dir")
    b.add_argument("--rank", type=int, default=16)
    b.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="projections it adapts, comma-separated (another architecture's linears by their own "
                   "names, e.g. GPT-NeoX's query_key_value,dense)")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=run)
    b = bsub.add_parser("make-draft", help="write a draft model made of a model's first layers (speculative decoding)")
    b.add_argument("model", help="the target model's directory")
    b.add_argument("out_dir")
    b.add_argument("--layers", type=int, required=True, help="layers the draft keeps")
    b.set_defaults(func=run)
    b = bsub.add_parser("make-eagle", help="write a random EAGLE head (speculative decoding) for a model")
    b.add_argument("model", help="the target model's directory")
    b.add_argument("out_dir")
    b.add_argument("--num-layers", type=int, default=1)
    b.add_argument("--eagle3", action="store_true", help="an EAGLE-3 head (reads three of the target's layers)")
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=run)
    b = bsub.add_parser("lora-layer", help="one layer's LoRA delta for several adapters, by each way of computing it")
    b.add_argument("--in-features", type=int, default=576)
    b.add_argument("--out-features", type=int, default=960)
    b.add_argument("--shards", type=int, default=3, help="projections merged in the layer (qkv: 3)")
    b.add_argument("--rank", type=int, default=16)
    b.add_argument("--adapters", type=int, default=4)
    b.add_argument("--tokens", default="4,64,512", help="tokens per step, comma-separated")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=run)
    b = bsub.add_parser("serve", help="load an OpenAI-compatible server (shardlm, vLLM, ...) with streaming requests")
    b.add_argument("--base-url", default="http://127.0.0.1:8000")
    b.add_argument("--model", default=None, help="default: the server's first model")
    b.add_argument("--api-key", default=None)
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--workload", default=None, help="workload JSON (shared format; token ids are sent as they are)")
    b.add_argument("--output-len", type=int, default=None, help="new tokens per request (default: workload's, 128)")
    b.add_argument("--duration", default=None, help="soak: clients send request after request for this long "
                   "(e.g. 30m; instead of --num-prompts), with a report per --interval")
    b.add_argument("--ramp", default="60s", help="soak: time over which the clients join (default: %(default)s)")
    b.add_argument("--interval", default="60s", help="soak: one report row per this much time (default: %(default)s)")
    b.add_argument("--server-pid", type=int, default=None,
                   help="soak: the server's process, whose tree's RSS is reported (default: the one listening on "
                        "--base-url's port, if local)")
    b.add_argument("--plot", default=None, metavar="PNG", help="soak: plot throughput, latency and RSS over time")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=run)
    b = bsub.add_parser("plot", help="W1 and batch-1 decode of shardlm and peers (vLLM, llama.cpp) per precision, "
                        "as a PNG, from `bench throughput|latency --json` files and ../shared/bench/peers.sh results")
    b.add_argument("results", nargs="+", help="JSON result files (several of one kind: their median)")
    b.add_argument("--out", default="shardlm-bench.png")
    b.add_argument("--title", default=None, help="e.g. the CPU model and flags")
    b.set_defaults(func=run)
    b = bsub.add_parser("make-model", help="write a random-weight Llama (default ~113M parameters) or, with --moe, "
                        "Mixtral (default ~132M: 8 experts, 2 per token) for benchmarks")
    b.add_argument("out_dir")
    b.add_argument("--moe", action="store_true", help="a mixture-of-experts model (Mixtral)")
    b.add_argument("--hidden-size", type=int, default=None, help="default 768 (--moe: 512)")
    b.add_argument("--num-layers", type=int, default=None, help="default 12 (--moe: 8)")
    b.add_argument("--num-heads", type=int, default=None, help="default 12 (--moe: 8)")
    b.add_argument("--num-kv-heads", type=int, default=None, help="default 4")
    b.add_argument("--intermediate-size", type=int, default=None, help="MLP size, of each expert with --moe; "
                   "default 2048 (--moe: 1024)")
    b.add_argument("--num-experts", type=int, default=8, help="--moe: routed experts per layer")
    b.add_argument("--experts-per-token", type=int, default=2, help="--moe: experts each token uses")
    b.add_argument("--max-position-embeddings", type=int, default=8192, help="the context length it declares "
                   "(e.g. 32768 for long-prompt runs)")
    b.set_defaults(func=run)
    b = bsub.add_parser("moe-layer", help="the fused MoE layer alone: its per-expert dispatch against a grouped "
                        "(padded batched matmul) one, and the bytes its collectives move")
    b.add_argument("--num-experts", type=int, default=8)
    b.add_argument("--experts-per-token", type=int, default=2)
    b.add_argument("--hidden-size", type=int, default=512)
    b.add_argument("--intermediate-size", type=int, default=1024, help="each expert's MLP size")
    b.add_argument("--tokens", default="1,8,32,64,256,2048", help="token counts per step, comma-separated")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=run)


def run(ns) -> None:
    if ns.bench_kind == "make-model":
        from shardlm.bench.random_model import DENSE_DEFAULTS, MOE_DEFAULTS, make_random_model
        given = dict(hidden=ns.hidden_size, layers=ns.num_layers, heads=ns.num_heads, kv_heads=ns.num_kv_heads,
                     intermediate=ns.intermediate_size)
        defaults = MOE_DEFAULTS if ns.moe else DENSE_DEFAULTS
        make_random_model(ns.out_dir, **{k: defaults[k] if v is None else v for k, v in given.items()},
                          num_experts=ns.num_experts if ns.moe else 0, experts_per_token=ns.experts_per_token,
                          max_position_embeddings=ns.max_position_embeddings)
        return
    if ns.bench_kind == "moe-layer":
        from shardlm.bench.moe_layer import report as report_moe
        from shardlm.bench.moe_layer import run_moe_layer_bench
        result = run_moe_layer_bench(ns.num_experts, ns.experts_per_token, ns.hidden_size, ns.intermediate_size,
                                     [int(t) for t in ns.tokens.split(",")], ns.dtype, ns.threads)
        if ns.json:
            import json
            print(json.dumps(result, indent=1))
        else:
            report_moe(result)
        return
    if ns.bench_kind == "make-lora":
        from shardlm.bench.random_lora import make_random_lora
        print(f"Wrote a rank-{ns.rank} LoRA adapter to "
              f"{make_random_lora(ns.model, ns.out_dir, ns.rank, seed=ns.seed, targets=ns.targets.split(','))}")
        return
    if ns.bench_kind == "lora-layer":
        from shardlm.bench.lora_layer import report as report_lora
        from shardlm.bench.lora_layer import run_lora_layer_bench
        result = run_lora_layer_bench(ns.in_features, ns.out_features, ns.shards, ns.rank, ns.adapters,
                                      [int(t) for t in ns.tokens.split(",")], ns.dtype)
        if ns.json:
            import json
            print(json.dumps(result, indent=1))
        else:
            report_lora(result)
        return
    if ns.bench_kind == "make-draft":
        from shardlm.bench.truncated_draft import make_truncated_draft
        out = make_truncated_draft(ns.model, ns.out_dir, ns.layers)
        print(f"wrote a {ns.layers}-layer draft of {ns.model} to {out}")
        return
    if ns.bench_kind == "make-eagle":
        from shardlm.bench.random_eagle import make_random_eagle
        print(f"wrote a random EAGLE head for {ns.model} to "
              f"{make_random_eagle(ns.model, ns.out_dir, ns.seed, ns.num_layers, eagle3=ns.eagle3)}")
        return
    if ns.bench_kind == "plot":
        from shardlm.bench.plot import plot
        for metric, values in plot(ns.results, ns.out, ns.title).items():
            print(f"{metric}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(values.items())))
        print(f"wrote {ns.out}")
        return
    if ns.bench_kind == "serve" and ns.duration is not None:
        from shardlm.bench import soak
        result = soak.run_soak(ns.base_url, ns.model, ns.api_key, ns.concurrency, ns.duration, ns.ramp, ns.interval,
                               ns.workload, ns.output_len, ns.server_pid)
        soak.report(result, ns.json)
        if ns.plot:
            soak.plot(result, ns.plot)
        return
    if ns.bench_kind == "serve":
        from shardlm.bench.serve import report as report_serve
        from shardlm.bench.serve import run_serve_bench
        report_serve(run_serve_bench(ns.base_url, ns.model, ns.api_key, ns.concurrency, ns.num_prompts, ns.workload,
                                     ns.output_len), ns.json)
        return
    if ns.bench_kind == "embed":
        from shardlm.bench.embed import report as report_embed
        from shardlm.bench.embed import run_embed_bench
        args = engine_args_from(ns)
        if args.runner == "auto":
            args.runner = "pooling"
        report_embed(run_embed_bench(args, [int(b) for b in ns.batch_sizes.split(",")], ns.num_sentences, ns.reps,
                                     ns.compare), ns.json)
        return
    from shardlm.bench.offline import Sampling, report, run_latency, run_throughput
    args = engine_args_from(ns)
    loras = None
    if ns.lora_path:
        from shardlm.lora.request import LoRARequest
        args.enable_lora, args.max_loras = True, max(args.max_loras, len(ns.lora_path))
        loras = [LoRARequest(f"lora{i}", i, path) for i, path in enumerate(ns.lora_path, 1)]
    if ns.bench_kind == "throughput":
        import json

        from shardlm.sampling_params import StructuredOutputsParams
        constraint = ns.structured_outputs and StructuredOutputsParams(**json.loads(ns.structured_outputs))
        result = run_throughput(args, ns.workload, ns.num_prompts, ns.output_len, ns.reps, constraint or None, loras,
                                Sampling(ns.temperature, ns.seeded))
    else:
        width, _, height = ns.image_size.partition("x")
        result = run_latency(args, ns.workload, ns.output_len, ns.reps, ns.batch_size, loras, ns.each_prompt,
                             ns.images, (int(width), int(height)))
    report(result, ns.json)
