"""Every environment variable shardlm reads, in one place (debugging knobs only; user-facing
settings are config fields with flags)."""

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
# How worker processes start: "fork" or "spawn". Default: fork when this process runs a single
# thread and has no CUDA context (what makes fork safe), else spawn (which re-imports the main
# script, so scripts then need an `if __name__ == "__main__":` guard).
SHARDLM_WORKER_MULTIPROC_METHOD = os.environ.get("SHARDLM_WORKER_MULTIPROC_METHOD", "")
