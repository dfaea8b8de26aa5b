"""Which CPU cores each rank's threads use.

`cpu_threads_bind` (flag --cpu-threads-bind):
- "auto" (default): the cores this process may use are shared evenly; each rank runs that many
  threads, and the OS places them. One rank gets them all.
- "0-3|4-7": one core list per rank, separated by "|"; each rank is pinned to its cores and
  runs one thread per core (the form of vLLM's CPU thread binding).
- "nobind": torch's default thread count, no pinning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class CpuBinding:
    num_threads: int | None      # None: leave torch's default
    cores: list[int] | None      # None: no pinning


def parse_core_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]"""
    cores = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def validate_binding(spec: str, ranks: int | None) -> None:
    """Raise a helpful error for a spec that cannot work; called before any process starts.
    ranks: how many ranks share this machine (None: not known yet, only the core lists are checked)."""
    if spec in ("auto", "nobind"):
        return
    groups = spec.split("|")
    if ranks is not None and len(groups) != ranks:
        raise ValueError(f"cpu_threads_bind={spec!r} lists {len(groups)} core group(s) but there are {ranks} "
                         "ranks: give one group per rank, separated by '|' (e.g. '0-3|4-7'), or 'auto'.")
    allowed = os.sched_getaffinity(0)
    for group in groups:
        try:
            cores = parse_core_list(group)
        except ValueError:
            raise ValueError(f"cpu_threads_bind={spec!r}: cannot read the core list {group!r}; write e.g. "
                             "'0-3|4-7' or '0,2|1,3'.") from None
        if not set(cores) <= allowed:
            raise ValueError(f"cpu_threads_bind={spec!r}: core(s) {sorted(set(cores) - allowed)} are not "
                             f"available to this process (available: {_ranges(sorted(allowed))}).")


def binding_for_rank(spec: str, local_world_size: int, local_rank: int) -> CpuBinding:
    """local_*: among the ranks on this machine (all of them with the mp executor)."""
    if spec == "nobind":
        return CpuBinding(None, None)
    if spec == "auto":
        return CpuBinding(max(1, len(os.sched_getaffinity(0)) // local_world_size), None)
    validate_binding(spec, local_world_size)
    cores = parse_core_list(spec.split("|")[local_rank])
    return CpuBinding(len(cores), cores)


def apply_binding(binding: CpuBinding) -> None:
    import torch

    if binding.cores is not None:
        os.sched_setaffinity(0, binding.cores)
    if binding.num_threads is not None:
        torch.set_num_threads(binding.num_threads)


def _ranges(cores: list[int]) -> str:
    out, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(out)
