"""shardlm: serve large language models split across processes, devices and machines."""

from shardlm import startup  # noqa: F401  (first: it counts the process's threads before anything starts more)
from shardlm.llm import LLM
from shardlm.lora.request import LoRARequest
from shardlm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from shardlm.pooling.params import PoolingParams
from shardlm.sampling_params import RequestOutputKind, SamplingParams
from shardlm.version import __version__

__all__ = ["LLM", "SamplingParams", "PoolingParams", "PoolingRequestOutput", "LoRARequest", "RequestOutputKind",
           "RequestOutput", "CompletionOutput", "__version__"]
