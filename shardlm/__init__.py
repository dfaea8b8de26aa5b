"""shardlm: serve large language models split across processes, devices and machines."""

import torch  # noqa: F401  (first: the threads it starts are the baseline fork-safety is judged against)

from shardlm.utils import os_thread_count

# Threads of this process once torch is imported (its BLAS pool); more later means another
# thread (an OpenMP pool after torch ran ops, a Python thread) that fork would leave behind.
THREADS_AT_IMPORT = os_thread_count()

from shardlm.llm import LLM  # noqa: E402
from shardlm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from shardlm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "__version__"]
