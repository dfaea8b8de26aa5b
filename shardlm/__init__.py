"""shardlm: serve large language models split across processes, devices and machines."""

from shardlm.llm import LLM
from shardlm.outputs import CompletionOutput, RequestOutput
from shardlm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
