"""`shardlm run-batch -i FILE|URL -o FILE [engine flags]`: OpenAI batch files through the server's
routes, offline (entrypoints/batch.py)."""

from __future__ import annotations

import asyncio
import os
import sys

from shardlm.entrypoints.cli.engine_flags import add_engine_args, engine_args_from


def register(sub) -> None:
    p = sub.add_parser("run-batch", help="OpenAI batch file (JSONL of requests) -> a JSONL of responses, in order")
    p.add_argument("-i", "--input-file", required=True, help="the requests: a JSONL file or an http(s) URL; each "
                   "line {\"custom_id\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", \"body\": {...}}")
    p.add_argument("-o", "--output-file", required=True, help="where the responses go, one line per input line; "
                   "run again with the same file, lines already answered are not run again")
    p.add_argument("--max-concurrency", type=int, default=256, help="lines in flight at once (default: %(default)s)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(p)
    from shardlm.entrypoints.cli.serve import add_frontend_args
    add_frontend_args(p.add_argument_group("answers (vLLM's frontend flags)"))
    p.set_defaults(func=run)


def run(ns) -> None:
    from shardlm.entrypoints.batch import read_input, run_batch
    from shardlm.entrypoints.cli.serve import frontend_options
    from shardlm.entrypoints.openai.protocol import RequestLimits
    from shardlm.entrypoints.openai.server import build_app
    if ns.max_concurrency < 1:
        sys.exit(f"shardlm: error: --max-concurrency {ns.max_concurrency}: give at least 1.")
    lines = read_input(ns.input_file)
    config = engine_args_from(ns).create_engine_config()
    chat_template = ns.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    limits = RequestLimits(max_num_waiting=max(RequestLimits.max_num_waiting, ns.max_concurrency + 1))
    app = build_app(config, chat_template=chat_template, limits=limits, frontend=frontend_options(ns))
    counts = asyncio.run(run_batch(app, lines, ns.output_file, ns.max_concurrency, not ns.no_progress))
    print(f"{counts['lines']} lines: {counts['ok']} answered 200, {counts['failed']} failed"
          + (f", {counts['skipped']} answered by an earlier run" if counts["skipped"] else "")
          + f" -> {ns.output_file}")
