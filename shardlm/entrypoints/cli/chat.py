"""`shardlm chat`: a conversation, interactive or from --message / stdin."""

from __future__ import annotations

import sys

from shardlm.entrypoints.cli.engine_flags import (
    add_engine_args,
    add_sampling_args,
    engine_args_from,
    sampling_params_from,
)


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model (interactive, or --message / lines on stdin)")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--message", action="append", help="a user message (repeat for several turns)")
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=run)


def run(ns) -> None:
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
