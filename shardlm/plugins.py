"""Parser plugins, as vLLM's --tool-parser-plugin and --reasoning-parser-plugin: a Python file
imported once per process, which registers its parsers by name (register_tool_parser in
entrypoints/openai/tool_parsers.py, register_reasoning_parser in reasoning.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

_loaded: set[str] = set()


def load_plugin(path: str, flag: str) -> None:
    """Import the file at `path` (once per process); a ValueError naming `flag` where it cannot be."""
    path = os.path.abspath(path)
    if path in _loaded:
        return
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file (give the plugin's .py file).")
    name = "shardlm_plugin_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:      # noqa: BLE001 - whatever the plugin raises, the user must see it named
        del sys.modules[name]
        raise ValueError(f"{flag} {path} failed to import: {type(e).__name__}: {e}") from e
    _loaded.add(path)
