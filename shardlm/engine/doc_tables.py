"""The tables the docs print from the code: the user guide's engine options (from EngineArgs,
where each knob's default and help are declared) and the README's feature combinations (from
engine/feature_rules.py). `python -m shardlm.engine.doc_tables` (from the repository root)
rewrites each between its markers; a test fails when a doc and the code differ."""

from __future__ import annotations

import dataclasses
import os
import sys

from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.feature_rules import combinations_table


def _default(f) -> str:
    value = f.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:       # resolved at start-up: the help says how, or there is none
        return "see meaning" if "default:" in f.metadata["help"] else "none"
    if "str" in f.type and isinstance(value, int) and value % (1 << 30) == 0:      # a size in bytes
        return f"`{value >> 30}GiB`"
    return f"`{value}`"


def knob_table() -> str:
    """Every EngineArgs knob but the model: its keyword, flags, default and help, in markdown."""
    rows = ["| option | flag | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = f"--{'[no-]' if isinstance(f.default, bool) else ''}{f.name.replace('_', '-')}"
        flags = ", ".join(f"`{x}`" for x in ([f.metadata["short"]] if f.metadata["short"] else []) + [flag])
        meaning = f.metadata["help"].replace("|", "\\|")
        rows.append(f"| {f.name} | {flags} | {_default(f)} | {meaning} |")
    return "\n".join(rows)


# (file, the table's name in its markers, what makes it)
TABLES = (("docs/USER_GUIDE.md", "engine options", knob_table),
          ("README.md", "feature combinations", combinations_table))


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: made by `python -m shardlm.engine.doc_tables` -->", f"<!-- end of {name} -->"


def with_table(text: str, name: str, table) -> str:
    """text with the part between the table's markers replaced by the table."""
    begin, end = markers(name)
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + table() + "\n" + text[stop:]


def rewrite(root: str) -> None:
    for path, name, table in TABLES:
        path = os.path.join(root, path)
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(with_table(text, name, table))


if __name__ == "__main__":
    rewrite(sys.argv[1] if len(sys.argv) > 1 else ".")
