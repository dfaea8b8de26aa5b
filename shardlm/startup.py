"""Facts about this process taken as shardlm is first imported, before it starts anything."""

import torch  # noqa: F401  (first: the threads it starts are the baseline fork-safety is judged against)

from shardlm.utils import os_thread_count

# Threads of this process once torch is imported (its BLAS pool); more later means another
# thread (an OpenMP pool after torch ran ops, a Python thread) that fork would leave behind.
THREADS_AT_IMPORT = os_thread_count()
