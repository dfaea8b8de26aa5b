"""`--config FILE`: a command's flags in a YAML file, as vLLM's (e.g. from a Kubernetes ConfigMap):

    model: /models/llama
    tensor-parallel-size: 2        # or tensor_parallel_size
    enable-prefix-caching: false   # --no-enable-prefix-caching
    lora-modules: [a=/loras/a, b=/loras/b]
    speculative-config: {method: ngram, num_speculative_tokens: 3}

The file's flags go before those of the command line, which therefore win."""

from __future__ import annotations

import argparse
import json

import yaml


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with the flags of its --config file (if any) put in after the command and its model."""
    path = _config_path(argv)
    command, depth = parser, 0         # the (sub)command's parser: `serve`, `bench latency`
    while depth < len(argv) and argv[depth] in (choices := _subparsers(command)):
        command, depth = choices[argv[depth]], depth + 1
    if path is None or depth == 0:
        return argv
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read it as YAML ({e}).") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: give a mapping of flags to values, e.g. 'tensor-parallel-size: 2'.")
    actions = command._option_string_actions
    takes_model = any(a.dest == "model" and not a.option_strings for a in command._actions)
    model_given = len(argv) > depth and not argv[depth].startswith("-")
    head, rest, flags = argv[:depth], argv[depth:], []
    where = " ".join(argv[:depth])
    for key, value in values.items():
        name = str(key).replace("_", "-")
        if name == "model" and takes_model:
            if not model_given:
                head.append(str(value))
            continue
        action = actions.get(f"--{name}")
        if action is None or name == "config":
            raise ValueError(f"--config {path}: {key} is no option of `shardlm {where}` (see its --help).")
        flags += _as_flags(name, value, action, actions)
    return head + (rest[:1] if model_given else []) + flags + (rest[1:] if model_given else rest)


def _as_flags(name: str, value, action: argparse.Action, actions: dict) -> list[str]:
    if isinstance(value, bool):
        if value:
            return [f"--{name}"]
        return [f"--no-{name}"] if f"--no-{name}" in actions else []     # a store_true flag: off by default
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [f"--{name}", *(str(v) for v in value)]
    if isinstance(value, (list, dict)):
        return [f"--{name}", json.dumps(value)]       # a JSON flag (--speculative-config, --allowed-origins)
    return [f"--{name}", str(value)]


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}
