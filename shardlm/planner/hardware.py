"""The devices of this machine, for plans made without hardware flags and for the start-up check."""

from __future__ import annotations

import psutil
import torch

from shardlm.planner.plan import Hardware


def detect_hardware(utilization: float = 0.9) -> Hardware:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        memory = torch.cuda.get_device_properties(0).total_memory
        return Hardware("gpu", count, 1, memory, utilization)
    return Hardware("cpu", 1, 1, psutil.virtual_memory().total, utilization)


def described_hardware(utilization: float, gpus_per_node: int | None, nodes: int | None,
                       gpu_memory: int | None, interconnect: str) -> Hardware:
    """This machine, or GPUs described by `shardlm plan`'s flags (what is not given is this
    machine's where it has GPUs, else one 80 GiB GPU per node on one node)."""
    hw = detect_hardware(utilization)
    if gpus_per_node or nodes or gpu_memory:
        on_gpu = hw.kind == "gpu"
        hw.kind = "gpu"
        hw.devices_per_node = gpus_per_node or (hw.devices_per_node if on_gpu else 1)
        hw.nodes = nodes or 1
        hw.device_memory = gpu_memory or (hw.device_memory if on_gpu else 80 << 30)
    hw.interconnect = interconnect
    return hw
