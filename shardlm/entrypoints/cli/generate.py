"""`shardlm generate`: complete prompts and print them."""

from __future__ import annotations

from shardlm.entrypoints.cli.engine_flags import (
    add_engine_args,
    add_sampling_args,
    engine_args_from,
    sampling_params_from,
)


def register(sub) -> None:
    p = sub.add_parser("generate", help="complete prompts with a model and print the results")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: 'San Francisco is a'")
    p.set_defaults(func=run)


def run(ns) -> None:
    from shardlm.llm import LLM
    llm = LLM(**vars(engine_args_from(ns)))
    prompts = ns.prompt or ["San Francisco is a"]
    for out in llm.generate(prompts, sampling_params_from(ns), use_tqdm=False):
        print(f"Prompt: {out.prompt!r}\nOutput: {out.outputs[0].text!r}\n")
