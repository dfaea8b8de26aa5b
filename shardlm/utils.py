"""Small helpers used across the package."""

import os


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def os_thread_count() -> int:
    """Threads of this process as the OS sees them (C++, BLAS and OpenMP threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1
