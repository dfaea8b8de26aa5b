"""Small helpers used across the package."""

import contextlib
import ctypes
import os
import signal
import threading


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return flags_in_cpuinfo(f.read())
    except OSError:
        return set()


def flags_in_cpuinfo(text: str) -> set[str]:
    """The first processor's `flags` (x86) or `Features` (ARM) in /proc/cpuinfo's text."""
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def median_seconds(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() over reps calls, after warmup calls."""
    import statistics
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_seconds_side_by_side(a, b, reps: int = 7) -> tuple[float, float]:
    """Median wall times of a() and b(), their calls interleaved (after one warm-up call each) so
    that a slow spell of a noisy machine falls on both alike."""
    import statistics
    import time
    a(), b()
    times: tuple[list, list] = ([], [])
    for _ in range(reps):
        for fn, out in ((a, times[0]), (b, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def os_thread_count() -> int:
    """Threads of this process as the OS sees them (C++, BLAS and OpenMP threads included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def die_with_parent() -> None:
    """Ask Linux to kill this process when the process (strictly: the thread) that started it
    dies, however it dies, so nothing outlives its parent. Exits now if the parent is already gone."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def leave_stop_signals_to_the_parent() -> None:
    """Ignore SIGINT and SIGTERM in this process (an engine core, a worker, the fork server they
    come from). Ctrl-C, and a SIGTERM sent to the whole process group (systemd's stop, `kill --
    -PGID`), reach every process at once; the server decides what they mean (a drain needs its
    engine alive), and a parent that must end one of these processes kills it."""
    if threading.current_thread() is threading.main_thread():     # (a Ray actor may run elsewhere)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def set_process_name(name: str) -> None:
    """Name this process as ps, top and psutil show it (Linux keeps 15 characters); a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15], 0, 0, 0)     # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def cut_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of text that begins marker (a marker cut between streamed
    pieces, held back until it is whole or ruled out); 0 where none."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class StepValue:
    """A value set around one step's forward pass, which the layers inside read (LoRA's segments,
    a step's given embeddings); None outside. Plain module state: a step runs on one thread."""

    def __init__(self):
        self.value = None

    @contextlib.contextmanager
    def running(self, value):
        previous, self.value = self.value, value
        try:
            yield
        finally:
            self.value = previous
