"""The `shardlm` command: generate, chat, bench."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from shardlm.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, named as vLLM names them."""
    parser.add_argument("model", nargs="?", default=None, help=EngineArgs.HELP["model"])
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flags = [f"--{f.name.replace('_', '-')}"]
        if f.name in EngineArgs.SHORT_FLAGS:
            flags.append(EngineArgs.SHORT_FLAGS[f.name])
        kwargs = {"dest": f.name, "default": f.default, "help": EngineArgs.HELP.get(f.name, "")}
        if isinstance(f.default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "kv_cache_memory":
            kwargs["type"] = str
        elif f.name in ("dtype", "device", "tokenizer", "served_model_name", "download_dir",
                        "distributed_executor_backend"):
            kwargs["type"] = str
        elif f.name == "gpu_memory_utilization":
            kwargs["type"] = float
        else:
            kwargs["type"] = int
        if f.name == "distributed_executor_backend":
            kwargs["choices"] = ["uni", "mp", "ray"]
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
    from shardlm.bench.offline import report, run_latency, run_throughput
    args = engine_args_from(ns)
    if ns.bench_kind == "throughput":
        result = run_throughput(args, ns.workload, ns.num_prompts, ns.output_len, ns.reps)
    else:
        result = run_latency(args, ns.workload, ns.output_len, ns.reps)
    report(result, ns.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlm", description="Serve large language models split across "
                                     "processes, devices and machines.")
    sub = parser.add_subparsers(dest="command", required=True)

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
        b.add_argument("--output-len", type=int, default=None, help="new tokens per prompt (default: workload's, 128)")
        b.add_argument("--reps", type=int, default=3)
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
