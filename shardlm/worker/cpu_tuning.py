"""Process settings that make torch fast on CPU.

glibc returns large freed buffers to the OS (mmap threshold 128 KiB, trimmed on free), so
every step's multi-MB temporaries are page-faulted in again: on this workload that made
attention 3x slower. Keeping freed memory in the heap does what vLLM's advice to preload
tcmalloc does, without a preload.
"""

from __future__ import annotations

import ctypes

from shardlm.logger import init_logger

logger = init_logger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_freed_memory_in_heap() -> None:
    global _done
    if _done:
        return
    _done = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    except (OSError, AttributeError):
        logger.debug("not glibc: allocator left as it is")
