"""Every environment variable of shardlm's own that it reads, in one place: debugging knobs, and
the API key (a secret is better kept off the command line). User-facing settings are config
fields with flags."""

import os

# Log level of the `shardlm` loggers (DEBUG, INFO, WARNING, ...).
SHARDLM_LOG_LEVEL = os.environ.get("SHARDLM_LOG_LEVEL", "INFO")
# Where the embedded default model is converted to a Hugging Face directory.
SHARDLM_CACHE_DIR = os.environ.get(
    "SHARDLM_CACHE_DIR", os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardlm"))
# Set to 1 to use torch ops instead of shardlm's compiled CPU kernels (for comparison and debugging).
SHARDLM_DISABLE_KERNELS = os.environ.get("SHARDLM_DISABLE_KERNELS", "0") not in ("", "0")
# This node's address for rendezvous and collectives, where the default (the interface that
# routes outward) is wrong, e.g. on nodes with several networks.
SHARDLM_HOST_IP = os.environ.get("SHARDLM_HOST_IP", "")
# Ray executor: more variables to forward to the workers on every node, comma-separated
# (NCCL_*, GLOO_* and SHARDLM_* are always forwarded), e.g. "HF_TOKEN,LD_LIBRARY_PATH".
SHARDLM_FORWARD_ENV = os.environ.get("SHARDLM_FORWARD_ENV", "")
# How worker and engine-core processes start: "fork", "forkserver" or "spawn". Default: fork
# when this process runs a single thread and has no CUDA context (what makes fork safe), else
# forkserver (whose processes, as spawned ones, import the main script: scripts then need an
# `if __name__ == "__main__":` guard).
SHARDLM_WORKER_MULTIPROC_METHOD = os.environ.get("SHARDLM_WORKER_MULTIPROC_METHOD", "")
# The most a CPU kernel of shardlm's may use: portable (plain C), avx2, avx512, avx512_bf16 or
# native (the default: everything this CPU has). A cap, as oneDNN's ONEDNN_MAX_CPU_ISA: it makes
# every variant testable and measurable on a CPU that has a better one. For torch's own kernels
# set ATEN_CPU_CAPABILITY (and ONEDNN_MAX_CPU_ISA) too.
SHARDLM_CPU_ISA = os.environ.get("SHARDLM_CPU_ISA", "native")
# Set to 1 to let the server's clients load and unload LoRA adapters at run time (POST
# /v1/load_lora_adapter, /v1/unload_lora_adapter), as VLLM_ALLOW_RUNTIME_LORA_UPDATING does: off by
# default, since it lets any client make the server read a path of its choosing.
SHARDLM_ALLOW_RUNTIME_LORA_UPDATING = os.environ.get("SHARDLM_ALLOW_RUNTIME_LORA_UPDATING", "0").lower() not in (
    "", "0", "false")
# Set to 1 to make a kernel that cannot be built or loaded an error instead of a logged fallback
# to torch ops (CI sets it: a compile error must fail the run, not turn into skipped tests).
SHARDLM_REQUIRE_KERNELS = os.environ.get("SHARDLM_REQUIRE_KERNELS", "0") not in ("", "0")
# The server's API key where `shardlm serve` has no --api-key (VLLM_API_KEY is read too, as vLLM
# does): a variable keeps the key out of the process list.
SHARDLM_API_KEY = os.environ.get("SHARDLM_API_KEY") or os.environ.get("VLLM_API_KEY")
