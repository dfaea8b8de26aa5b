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
