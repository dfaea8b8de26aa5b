"""The `shardlm` command: one module per subcommand (serve, generate, chat, bench, plan, env,
cluster, run-batch), each with register(subparsers) and run(namespace)."""

from __future__ import annotations

import argparse
import sys

from shardlm.entrypoints.cli import bench, chat, cluster, env, generate, plan, run_batch, serve
from shardlm.entrypoints.cli.engine_flags import add_engine_args, engine_args_from

__all__ = ["main", "build_parser", "add_engine_args", "engine_args_from"]
SUBCOMMANDS = (serve, run_batch, generate, chat, plan, cluster, env, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardlm", description="Serve large language models split across "
                                     "processes, devices and machines.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    try:
        ns.func(ns)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        print(f"shardlm: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:       # Ctrl-C: whatever ran has stopped (a server, its engine with it)
        sys.exit(130)


if __name__ == "__main__":
    main()
