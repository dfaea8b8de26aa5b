"""Worker processes start with fork when that is safe, so a script written for vLLM (no
`if __name__ == "__main__":` guard) runs pipeline parallel as it is; from a fork server otherwise,
in the environment of the process that started them."""

import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from shardlm import LLM, SamplingParams
from shardlm.processes import InParentEnvironment, start_method

SCRIPT = textwrap.dedent("""
    import json, os
    from shardlm import LLM, SamplingParams
    llm = LLM(os.environ["MODEL"], dtype="float32", kv_cache_memory="32MiB", max_model_len=256,
              pipeline_parallel_size=2)
    outs = llm.generate(["The capital of", "One two three"],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    executor = llm.engine.engine_core.engine_core.executor
    print("RESULT", json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                                "method": executor.start_method,
                                "workers": [p.pid for p in executor.procs]}))
""")


def _run_script(tmp_path, model, env=None):
    path = tmp_path / "no_main_guard.py"
    path.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "MODEL": model, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), proc.stderr


@pytest.mark.slow
def test_script_without_main_guard_runs_pp2_with_fork(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama-gqa")
    result, _ = _run_script(tmp_path, model)
    assert result["method"] == "fork"
    ref = LLM(model, dtype="float32", kv_cache_memory="32MiB", max_model_len=256).generate(
        ["The capital of", "One two three"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False)
    assert result["tokens"] == [r.outputs[0].token_ids for r in ref]
    assert not [p for p in result["workers"] if psutil.pid_exists(p)], "workers outlived the script"


@pytest.mark.slow
def test_spawn_without_main_guard_names_the_guard(tmp_path, tiny_model_dir):
    path = tmp_path / "no_main_guard.py"
    path.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={**os.environ, "MODEL": tiny_model_dir("llama-gqa"),
                               "SHARDLM_WORKER_MULTIPROC_METHOD": "spawn"})
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr


def test_start_method_choice(monkeypatch):
    import threading

    from shardlm import startup
    from shardlm.utils import os_thread_count

    monkeypatch.setattr(startup, "THREADS_AT_IMPORT", os_thread_count() - 1)    # one thread more than torch's
    assert start_method() == ("forkserver", "this process runs 1 more thread(s) than after importing torch")
    monkeypatch.setattr(startup, "THREADS_AT_IMPORT", os_thread_count())
    if threading.active_count() == 1:
        assert start_method()[0] == "fork"
        assert start_method(allow_fork=False)[0] == "forkserver"
    monkeypatch.setattr("shardlm.envs.SHARDLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert start_method() == ("spawn", "SHARDLM_WORKER_MULTIPROC_METHOD")
    monkeypatch.setattr("shardlm.envs.SHARDLM_WORKER_MULTIPROC_METHOD", "vfork")
    with pytest.raises(ValueError, match="fork, forkserver or spawn"):
        start_method()


def _environment_seen_by_a_child() -> dict:
    from shardlm import envs, kernels
    return {"var": os.environ.get("SHARDLM_TEST_VARIABLE"), "log_level": envs.SHARDLM_LOG_LEVEL,
            "isa_cap": kernels.isa_cap()}


def _report(queue):
    queue.put(_environment_seen_by_a_child())


def test_a_fork_server_child_sees_the_environment_of_the_process_that_started_it(monkeypatch):
    """The fork server started with one environment; a process started after the environment changed
    sees the new one, shardlm's settings read at import included."""
    from shardlm.processes import process_context
    ctx = process_context("forkserver")
    queue = ctx.Queue()

    def run():
        proc = ctx.Process(target=InParentEnvironment(_report), args=(queue,))
        proc.start()
        seen = queue.get(timeout=120)
        proc.join(30)
        assert proc.exitcode == 0
        return seen

    before = run()        # starts the fork server (if no test did) in this environment
    monkeypatch.setenv("SHARDLM_TEST_VARIABLE", "changed")
    monkeypatch.setenv("SHARDLM_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("SHARDLM_CPU_ISA", "portable")
    assert before["var"] is None
    assert run() == {"var": "changed", "log_level": "DEBUG", "isa_cap": "portable"}
