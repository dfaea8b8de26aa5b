"""The `shardlm` command: one module per subcommand (serve, generate, chat, bench, plan, env,
cluster, run-batch), each with register(subparsers) and run(namespace). They load in
build_parser, after `serve` or `run-batch` has started its fork server: until then this
process imports no torch."""

from __future__ import annotations

import argparse
import sys

from shardlm.version import __version__

__all__ = ["main", "build_parser"]
# the commands whose engine core runs in a process of its own, which comes from the fork server
ENGINE_PROCESS_COMMANDS = ("serve", "run-batch")


def build_parser() -> argparse.ArgumentParser:
    from shardlm import startup  # noqa: F401  (first: it counts the threads importing torch starts)
    from shardlm.entrypoints.cli import bench, chat, cluster, env, generate, plan, run_batch, serve

    parser = argparse.ArgumentParser(prog="shardlm", description="Serve large language models split across "
                                     "processes, devices and machines.")
    parser.add_argument("--version", action="version", version=f"shardlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (serve, run_batch, generate, chat, plan, cluster, env, bench):
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in ENGINE_PROCESS_COMMANDS and not {"-h", "--help"} & set(argv):
        from shardlm.processes import start_fork_server_early
        start_fork_server_early()     # the engine core comes from it: its imports overlap this process's
    parser = build_parser()
    from shardlm.entrypoints.cli.config_file import expand_config_file
    try:
        argv = expand_config_file(parser, argv)
    except ValueError as e:
        parser.error(str(e))
    ns = parser.parse_args(argv)
    try:
        ns.func(ns)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        print(f"shardlm: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:       # Ctrl-C: whatever ran has stopped (a server, its engine with it)
        sys.exit(130)


if __name__ == "__main__":
    main()
