"""shardlm: serve large language models split across processes, devices and machines.

The public names load on first use (PEP 562): importing a submodule costs no torch import, so
`shardlm serve` starts its fork server before this process imports torch and both import at once.
`startup` loads first, as it counts the threads that importing torch starts."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from shardlm.version import __version__

if TYPE_CHECKING:
    from shardlm.llm import LLM
    from shardlm.lora.request import LoRARequest
    from shardlm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
    from shardlm.pooling.params import PoolingParams
    from shardlm.sampling_params import RequestOutputKind, SamplingParams

_HOMES = {"LLM": "shardlm.llm", "SamplingParams": "shardlm.sampling_params", "PoolingParams": "shardlm.pooling.params",
          "PoolingRequestOutput": "shardlm.outputs", "LoRARequest": "shardlm.lora.request",
          "RequestOutputKind": "shardlm.sampling_params", "RequestOutput": "shardlm.outputs",
          "CompletionOutput": "shardlm.outputs"}
__all__ = ["LLM", "SamplingParams", "PoolingParams", "PoolingRequestOutput", "LoRARequest", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'shardlm' has no attribute {name!r}")
    importlib.import_module("shardlm.startup")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
