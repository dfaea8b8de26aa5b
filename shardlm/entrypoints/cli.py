"""The `shardlm` command: serve, generate, chat, bench, plan, env check and cluster; engine flags are generated
from EngineArgs, one per field, with vLLM's names."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from shardlm.engine.arg_utils import EngineArgs
from shardlm.executor.selection import BACKENDS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, named as vLLM names them."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            parser.add_argument("model", nargs="?", default=None, help=f.metadata["help"])
            continue
        flags = [f"--{f.name.replace('_', '-')}"] + ([f.metadata["short"]] if f.metadata["short"] else [])
        kwargs = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:   # from the annotation: "int | str" takes a string (e.g. 4GiB), "float", else int
            kwargs["type"] = str if "str" in f.type else float if "float" in f.type else int
        if f.name == "distributed_executor_backend":
            kwargs["choices"] = list(BACKENDS)
        if kwargs["help"] and f.default is not None and not isinstance(f.default, bool):
            kwargs["help"] += " (default: %(default)s)"
        group.add_argument(*flags, **kwargs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)


def sampling_params_from(ns):
    from shardlm.sampling_params import SamplingParams
    return SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens)


def cmd_generate(ns) -> None:
    from shardlm.llm import LLM
    llm = LLM(**vars(engine_args_from(ns)))
    prompts = ns.prompt or ["San Francisco is a"]
    for out in llm.generate(prompts, sampling_params_from(ns), use_tqdm=False):
        print(f"Prompt: {out.prompt!r}\nOutput: {out.outputs[0].text!r}\n")


def cmd_chat(ns) -> None:
    from shardlm.llm import LLM
    llm = LLM(**vars(engine_args_from(ns)))
    params = sampling_params_from(ns)
    history = [{"role": "system", "content": ns.system}] if ns.system else []
    messages = ns.message or []
    interactive = not messages
    if interactive and not sys.stdin.isatty():
        messages = [line.strip() for line in sys.stdin if line.strip()]
        interactive = False
    while True:
        if interactive:
            try:
                text = input("> ")
            except EOFError:
                break
            if not text.strip():
                continue
        elif messages:
            text = messages.pop(0)
            print(f"> {text}")
        else:
            break
        history.append({"role": "user", "content": text})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(reply)


def cmd_bench(ns) -> None:
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
    if ns.bench_kind == "plot":
        from shardlm.bench.plot import plot
        for metric, values in plot(ns.results, ns.out, ns.title).items():
            print(f"{metric}: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(values.items())))
        print(f"wrote {ns.out}")
        return
    if ns.bench_kind == "serve":
        from shardlm.bench.serve import report as report_serve
        from shardlm.bench.serve import run_serve_bench
        report_serve(run_serve_bench(ns.base_url, ns.model, ns.api_key, ns.concurrency, ns.num_prompts, ns.workload,
                                     ns.output_len), ns.json)
        return
    from shardlm.bench.offline import report, run_latency, run_throughput
    args = engine_args_from(ns)
    if ns.bench_kind == "throughput":
        result = run_throughput(args, ns.workload, ns.num_prompts, ns.output_len, ns.reps)
    else:
        result = run_latency(args, ns.workload, ns.output_len, ns.reps, ns.batch_size)
    report(result, ns.json)


def cmd_serve(ns) -> None:
    if ns.headless:
        from shardlm.engine.dp_remote import run_headless
        config = engine_args_from(ns).create_engine_config()
        par = config.parallel
        if par.data_parallel_size_local == par.data_parallel_size or par.data_parallel_start_rank == 0:
            raise ValueError("--headless runs replicas that join a head on another node: give "
                             "--data-parallel-start-rank (its first replica, above the head's) and "
                             "--data-parallel-size-local, with --data-parallel-address/--data-parallel-rpc-port.")
        sys.exit(run_headless(config))
    from shardlm.entrypoints.openai.server import run_server
    chat_template = ns.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    from shardlm.entrypoints.openai.protocol import RequestLimits
    limits = RequestLimits(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RequestLimits)})
    api_key = ns.api_key if ns.api_key is not None else (os.environ.get("SHARDLM_API_KEY")
                                                         or os.environ.get("VLLM_API_KEY"))
    if api_key is not None and not api_key.strip():
        sys.exit("shardlm: error: the API key is empty: give a key, or leave --api-key out to serve without one.")
    run_server(engine_args_from(ns), ns.host, ns.port, api_key, chat_template, ns.uvicorn_log_level, limits,
               ns.metrics_require_key)


def cmd_env_check(ns) -> None:
    import json

    from shardlm.entrypoints.preflight import communication_check, node_facts, problems, render
    if ns.address:
        from shardlm.entrypoints.cluster_check import cluster_check, render_cluster
        report = cluster_check(ns.address)
        print(json.dumps(report, indent=1) if ns.json else render_cluster(report))
        sys.exit(1 if report["problems"] else 0)
    if ns.ranks < 2:
        raise ValueError("env check --ranks must be at least 2 (it measures communication between ranks).")
    facts = node_facts()
    device = "cuda" if len(facts["gpus"]) >= ns.ranks else "cpu"
    comm = communication_check(ns.ranks, device)
    found = problems(facts, comm)
    if ns.json:
        print(json.dumps({"node": facts, "communication": comm, "problems": found}, indent=1))
    else:
        print(render(facts, comm, found))
    if found:
        sys.exit(1)


def cmd_cluster(ns) -> None:
    import json

    from shardlm import cluster
    if ns.cluster_kind == "head":
        address, token_file = cluster.start_head(ns.port, ns.model, ns.num_cpus, ns.num_gpus)
        auth = (f"Ray's token authentication is on: copy {token_file} to the same path on every other node "
                "(or set RAY_AUTH_TOKEN there) first.\n" if token_file else "")
        print(f"Ray head started at {address} (this node: {cluster.host_ip()}).\n{auth}"
              f"On every other node: shardlm cluster worker --address {address}\n"
              "Then, on this node: shardlm serve MODEL --distributed-executor-backend ray "
              "-tp <GPUs per node> -pp <nodes>\n"
              "Check the nodes with: shardlm cluster status; shardlm env check --address " + address)
    elif ns.cluster_kind == "worker":
        record = cluster.start_worker(ns.address, ns.model, ns.num_cpus, ns.num_gpus)
        print(f"Joined the cluster at {ns.address} as {cluster.host_ip()}; versions match the head "
              f"({record.get('node', 'no shardlm record on the head')}).")
    elif ns.cluster_kind == "status":
        report = cluster.status(ns.address)
        print(json.dumps(report, indent=1) if ns.json else cluster.render_status(report))
    else:
        cluster.stop()
        print("Stopped the Ray processes of this node.")


def cmd_plan(ns) -> None:
    from shardlm.config import parse_size
    from shardlm.model_loader.gptq_awq import checkpoint_method
    from shardlm.planner import ModelShape, Workload, load_config, recommend
    from shardlm.planner.hardware import detect_hardware
    from shardlm.planner.report import render, to_json
    name, cfg = load_config(ns.model)
    shape = ModelShape.from_config(name, cfg)
    hw = detect_hardware(ns.gpu_memory_utilization)
    if ns.gpus_per_node or ns.nodes or ns.gpu_memory:
        on_gpu = hw.kind == "gpu"
        hw.kind = "gpu"
        hw.devices_per_node = ns.gpus_per_node or (hw.devices_per_node if on_gpu else 1)
        hw.nodes = ns.nodes or 1
        hw.device_memory = parse_size(ns.gpu_memory) if ns.gpu_memory else (hw.device_memory if on_gpu else 80 << 30)
    hw.interconnect = ns.interconnect
    dtype = ns.dtype or {"float32": "float32", "float16": "float16"}.get(cfg.get("torch_dtype") or cfg.get("dtype"),
                                                                      "bfloat16")
    max_len = ns.max_model_len or min(shape.max_position, 8192)
    bits = ns.quantization_bits
    stored = checkpoint_method(cfg.get("quantization_config"))     # a GPTQ/AWQ checkpoint
    if ns.quantization or (stored and bits is None):
        # what the engine loads: the integers plus a float32 scale and min per group
        from shardlm.engine.arg_utils import resolve_quantization
        bits = resolve_quantization(ns.quantization, ns.quantization_group_size,
                                    checkpoint=stored).effective_bits(shape.hidden)
    workload = Workload(dtype=dtype, quantization_bits=bits, max_model_len=max_len,
                        concurrency=ns.concurrency)
    rec = recommend(shape, hw, workload, ns.model)
    print(to_json(rec) if ns.json else render(rec))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlm", description="Serve large language models split across "
                                     "processes, devices and machines.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible server (the engine core runs in its own process)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all routes but "
                   "/health, /metrics, /version); default: $SHARDLM_API_KEY or $VLLM_API_KEY (which keep it out "
                   "of `ps`)")
    p.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    p.add_argument("--headless", action="store_true",
                   help="data parallel across nodes: run this node's replicas (--data-parallel-size-local from "
                        "--data-parallel-start-rank) and no API server; they join the head at "
                        "--data-parallel-address:--data-parallel-rpc-port")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    from shardlm.entrypoints.openai.protocol import RequestLimits
    limits = p.add_argument_group("request limits")
    for f in dataclasses.fields(RequestLimits):
        limits.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default,
                            help=RequestLimits.HELP[f.name] + " (default: %(default)s)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="complete prompts with a model and print the results")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: 'San Francisco is a'")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="chat with a model (interactive, or --message / lines on stdin)")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--message", action="append", help="a user message (repeat for several turns)")
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("plan", help="will a model fit, and how to split it: from config.json, nothing loaded")
    p.add_argument("model", help="model directory, config.json, or a preset: Llama-3.1-8B, Llama-3.1-70B, "
                   "Llama-3.1-405B, Mixtral-8x7B, Qwen2.5-7B, Qwen2.5-72B, DeepSeek-V3")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the GPUs of this machine")
    p.add_argument("--nodes", type=int, default=None, help="default: 1")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB (default: this machine's)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: the checkpoint's (bfloat16 unless it says float32/float16)")
    p.add_argument("--quantization-bits", type=int, choices=[2, 3, 4, 8], default=None,
                   help="weight quantization width for linear layers")
    p.add_argument("--quantization", choices=["int8", "int4", "gptq", "awq"], default=None,
                   help="as `serve --quantization`: the bits the engine loads, scales included")
    p.add_argument("--quantization-group-size", type=int, default=None, help="as `serve`")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's maximum, at most 8192")
    p.add_argument("--concurrency", type=int, default=None, help="requests of max_model_len to serve at once")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--interconnect", choices=["nvlink", "pcie"], default="nvlink")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("cluster", help="start, inspect and stop a Ray cluster for multi-node serving")
    csub = p.add_subparsers(dest="cluster_kind", required=True)
    c = csub.add_parser("head", help="start the Ray head on this node")
    c.add_argument("--port", type=int, default=6379, help="the port workers join on")
    c2 = csub.add_parser("worker", help="join this node to the cluster at --address, checking versions and model")
    c2.add_argument("--address", required=True, help="HEAD_IP:PORT, the head's address (not this node's)")
    for c in (c, c2):
        c.add_argument("--model", default=None, help="model path that every node must have")
        c.add_argument("--num-cpus", type=int, default=None, help="CPUs this node offers (default: all)")
        c.add_argument("--num-gpus", type=int, default=None, help="GPUs this node offers (default: all)")
    c = csub.add_parser("status", help="the nodes: addresses, CPUs, GPUs, memory")
    c.add_argument("--address", default=None, help="HEAD:PORT (default: RAY_ADDRESS or the cluster of this node)")
    c.add_argument("--json", action="store_true", help="print JSON")
    csub.add_parser("stop", help="stop the Ray processes of this node")
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("env", help="check this node for distributed serving")
    esub = p.add_subparsers(dest="env_kind", required=True)
    e = esub.add_parser("check", help="addresses, versions, memory, devices, /dev/shm, and a measured "
                        "all-reduce and send/recv between local ranks, in seconds")
    e.add_argument("--ranks", type=int, default=2, help="local processes in the communication check")
    e.add_argument("--address", default=None, help="HEAD:PORT of a Ray cluster ('auto': the cluster of this node): "
                   "check every node and the communication across them")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(func=cmd_env_check)

    p = sub.add_parser("bench", help="offline benchmarks")
    bsub = p.add_subparsers(dest="bench_kind", required=True)
    for kind, text in (("throughput", "all prompts at once: output and total tokens/s"),
                       ("latency", "one prompt: batch-1 decode tokens/s and time to first token")):
        b = bsub.add_parser(kind, help=text)
        add_engine_args(b)
        b.add_argument("--workload", default=None, help="workload JSON (shared format); default: a synthetic "
                       "64-prompt chat workload")
        if kind == "throughput":
            b.add_argument("--num-prompts", type=int, default=None, help="repeat/cut the workload to this many")
        else:
            b.add_argument("--batch-size", type=int, default=1, help="copies of the prompt decoding together")
        b.add_argument("--output-len", type=int, default=None, help="new tokens per prompt (default: workload's, 128)")
        b.add_argument("--reps", type=int, default=3)
        b.add_argument("--json", action="store_true", help="print JSON")
        b.set_defaults(func=cmd_bench)
    b = bsub.add_parser("serve", help="load an OpenAI-compatible server (shardlm, vLLM, ...) with streaming requests")
    b.add_argument("--base-url", default="http://127.0.0.1:8000")
    b.add_argument("--model", default=None, help="default: the server's first model")
    b.add_argument("--api-key", default=None)
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--workload", default=None, help="workload JSON (shared format; token ids are sent as they are)")
    b.add_argument("--output-len", type=int, default=None, help="new tokens per request (default: workload's, 128)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(func=cmd_bench)
    b = bsub.add_parser("plot", help="W1 and batch-1 decode of shardlm and peers (vLLM, llama.cpp) per precision, "
                        "as a PNG, from `bench throughput|latency --json` files and ../shared/bench/peers.sh results")
    b.add_argument("results", nargs="+", help="JSON result files (several of one kind: their median)")
    b.add_argument("--out", default="shardlm-bench.png")
    b.add_argument("--title", default=None, help="e.g. the CPU model and flags")
    b.set_defaults(func=cmd_bench)
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
    b.set_defaults(func=cmd_bench)
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
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    try:
        ns.func(ns)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        print(f"shardlm: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
