"""The user guide's table of engine options, made from EngineArgs (each knob's default and help
are declared there once). `python -m shardlm.engine.knob_table docs/USER_GUIDE.md` rewrites the
table between its markers; a test fails when the guide's table and the code differ."""

from __future__ import annotations

import dataclasses
import sys

from shardlm.engine.arg_utils import EngineArgs

BEGIN = "<!-- engine options: made by `python -m shardlm.engine.knob_table docs/USER_GUIDE.md` -->"
END = "<!-- end of engine options -->"


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


def with_table(text: str) -> str:
    """text with the part between BEGIN and END replaced by the table."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + knob_table() + "\n" + text[end:]


if __name__ == "__main__":
    path = sys.argv[1]
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(with_table(text))
