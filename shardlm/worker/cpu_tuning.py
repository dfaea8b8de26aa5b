"""Process and memory settings that make torch fast on CPU.

glibc returns large freed buffers to the OS (mmap threshold 128 KiB, trimmed on free), so
every step's multi-MB temporaries are page-faulted in again: on this workload that made
attention 3x slower. Keeping freed memory in the heap does what vLLM's advice to preload
tcmalloc does, without a preload.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

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


_MADV_NOHUGEPAGE = 15


def zeroed_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor backed by anonymous memory that the OS faults in on first touch, so a
    large KV cache costs neither start-up time nor resident memory until used. Huge pages are
    declined: faulting 2 MiB pages (with compaction) cost 4x more per byte here than 4 KiB pages,
    and gathers from the cache run as fast either way."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        libc = ctypes.CDLL("libc.so.6")
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), _MADV_NOHUGEPAGE)
    except (OSError, AttributeError, TypeError):
        pass
    # the tensor keeps `buf` alive; the memory returns to the OS when the tensor is freed
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
