"""Shared check: a rank SIGKILLed during generation fails the engine fast, naming it."""

import os
import signal
import threading
import time

import psutil
import pytest

from shardlm import LLM, SamplingParams
from shardlm.executor.base import WorkerDiedError
from tests.helpers import wait_gone
from tests.models.test_tiny_models_vs_hf import _prompts


def kill_during_generation(llm: LLM, pid: int, match: str, sig: int = signal.SIGKILL) -> str:
    """Send `sig` (SIGKILL: a dead rank; SIGSTOP: a hung one) to `pid` one second into a long
    generation; the WorkerDiedError (matching `match`: the death or the hang named, not some later
    failure) must end it. Returns its message."""
    killed_at = []

    def kill():
        time.sleep(1.0)
        killed_at.append(pid)
        os.kill(pid, sig)

    threading.Thread(target=kill, daemon=True).start()
    long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)     # to the end of the context
    with pytest.raises(WorkerDiedError, match=match) as err:
        for _ in range(100):      # far longer than 1 s unless the kill stops it
            llm.generate(_prompts(), long, use_tqdm=False)
    assert killed_at, str(err.value)
    return str(err.value)


def assert_killed_rank_fails_fast(model_dir: str, rank: int, **parallel) -> None:
    llm = LLM(model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=512, **parallel)
    workers = [psutil.Process(p.pid) for p in llm.engine.engine_core.engine_core.executor.procs]
    kill_during_generation(llm, workers[rank].pid, rf"rank {rank} .* died")
    llm.shutdown()
    alive = wait_gone(workers, 5)
    assert not alive, f"worker processes left: {[p.pid for p in alive]}"
