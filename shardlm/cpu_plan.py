"""The CPU plan: every choice the CPU path makes, in one value per process.

Some choices are read off the machine (the kernel variant, where the kernel library came from),
some are measured at load (whether bfloat16 products use the CPU's dot product, how many rows
each weight's fast kernel serves, `--dtype auto`), one follows from the model (whether decode
steps run as one C call, and why not). Each is made once, here, and the worker logs the whole
plan as one block after load, so a run can say afterwards which path it took.

Measured choices go through `choose(kind, key, measure)`. With `--cpu-plan FILE` naming a plan
written before, its answers are taken without timing anything: a run repeats another exactly, or
a CI machine is pinned to one path. Where FILE does not exist yet, the first worker writes the
plan it made there.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from shardlm.logger import init_logger

logger = init_logger(__name__)

# the measured choices, by kind: what a key names and what its value means
KINDS = {
    "bf16_dot": "bfloat16 products use the CPU's bfloat16 dot product (else widened to float32)",
    "skinny_rows": "a plain weight [N, K]: the most rows its product runs on the skinny kernel (else oneDNN)",
    "quantized_rows": "a packed 4-/8-bit weight: the most rows torch's packed kernel serves (else dequantized)",
    "dtype_auto": "--dtype auto for a bfloat16 checkpoint: the dtype chosen",
    "amx_rows": "per kind of weight: the fewest rows from which products run on AMX tiles (0: never; "
                "batch-invariant: 1 or 0)",
}


@dataclass
class CpuPlan:
    isa: str | None = None                   # the kernel variant in use (kernels.active_isa)
    kernel_library: str | None = None        # where the kernel library came from, or none
    dtype: str | None = None                 # the model's (--dtype; auto: the dtype_auto choice)
    decode_path: str | None = None           # "one C call per step" or "layer by layer (why)"
    batch_invariant: bool = True             # --[no-]batch-invariant: products sum a row alike at any row count
    choices: dict[str, dict[str, Any]] = field(default_factory=dict)     # kind -> key -> value
    evidence: dict[str, dict[str, str]] = field(default_factory=dict)    # kind -> key -> how it was decided

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CpuPlan:
        data = json.loads(text)
        unknown = set(data) - {f for f in cls.__dataclass_fields__}
        if unknown or set(data.get("choices", {})) - set(KINDS):
            raise ValueError(f"Not a shardlm CPU plan: unknown entries {sorted(unknown or set(data['choices']))}.")
        return cls(**data)

    def describe(self) -> str:
        """The plan as the log shows it: one line per choice."""
        lines = [f"CPU plan: kernels {self.isa or 'none'} ({self.kernel_library or 'no library'}); dtype "
                 f"{self.dtype or 'chosen when a model loads'}; decode steps "
                 f"{self.decode_path or 'chosen when a model loads'}"
                 f"{'' if self.batch_invariant else '; --no-batch-invariant'}"]
        for kind in KINDS:
            for key, value in sorted(self.choices.get(kind, {}).items()):
                lines.append(f"  {kind} {key}: {value} ({self.evidence.get(kind, {}).get(key, '')})")
        return "\n".join(lines)


_made = CpuPlan()                  # this process's plan, as its choices are made
_given: list = [None, None]        # [the plan read from --cpu-plan, its path]


def current() -> CpuPlan:
    return _made


def follow(path: str | None) -> None:
    """--cpu-plan: take the choices of the plan at `path` from now on; where no file is there, the
    worker writes this run's plan to it (write_if_asked)."""
    if path is None or _given[1] == path:
        return
    plan = None
    if os.path.exists(path):
        try:
            with open(path) as f:
                plan = CpuPlan.from_json(f.read())
        except (OSError, ValueError) as e:
            raise ValueError(f"--cpu-plan {path} cannot be read ({e}): give a plan that shardlm wrote, or a path "
                             "where none exists yet (this run then writes its plan there).") from None
    _given[0], _given[1] = plan, path


def choose(kind: str, key: str, measure: Callable[[], tuple[Any, str]]) -> Any:
    """The value of a measured choice: the given plan's, else measure() -> (value, what was measured);
    recorded in this process's plan either way. Made once per (kind, key) in a process."""
    made = _made.choices.setdefault(kind, {})
    if key not in made:
        given = _given[0].choices.get(kind, {}) if _given[0] is not None else {}
        if key in given:
            value, how = given[key], f"from {_given[1]}"
        else:
            if _given[0] is not None:
                logger.warning("The CPU plan %s has no %s choice for %s: measured instead.", _given[1], kind, key)
            value, how = measure()
        made[key] = value
        _made.evidence.setdefault(kind, {})[key] = how
    return made[key]


def record(**facts) -> None:
    """Choices that are not measured: isa, kernel_library, dtype, decode_path, batch_invariant."""
    for name, value in facts.items():
        setattr(_made, name, value)


def write_if_asked() -> str | None:
    """Writes this process's plan to the --cpu-plan path where no plan was there; -> the path written."""
    plan, path = _given
    if path is None or plan is not None:
        return None
    with open(path, "w") as f:
        f.write(_made.to_json())
    _given[0] = CpuPlan.from_json(_made.to_json())       # written once, by the first worker
    return path


def forget() -> None:
    """A fresh plan (tests; a process that loads a second engine keeps its measured choices)."""
    global _made
    _made = CpuPlan()
    _given[0] = _given[1] = None
