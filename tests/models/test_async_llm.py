"""AsyncLLM: the engine core in its own process behind typed pipes, streamed to asyncio."""

import asyncio
import os
import signal

import pytest

from shardlm import LLM, SamplingParams
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.async_llm import AsyncLLM
from shardlm.engine.core_client import EngineDeadError

PROMPTS = [[5, 900, 17, 3000, 42], list(range(1000, 1040)), [77] * 3, list(range(200, 290))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _args(path, **kw):
    return EngineArgs(model=path, dtype="float32", kv_cache_memory="32MiB", max_model_len=256, **kw)


async def _collect(llm, prompt, params, rid):
    outs = [o async for o in llm.generate(prompt, params, rid)]
    return outs


@pytest.mark.slow
def test_async_outputs_equal_offline_and_stream(tiny_model_dir):
    path = tiny_model_dir("llama-gqa")
    offline = LLM(**vars(_args(path))).generate(PROMPTS, GREEDY, use_tqdm=False)

    async def main():
        llm = AsyncLLM.from_engine_args(_args(path))
        try:
            results = await asyncio.gather(*(_collect(llm, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)))
            stats = await llm.stats()
            return results, stats
        finally:
            llm.shutdown()

    results, stats = asyncio.run(main())
    for streamed, ref in zip(results, offline):
        assert streamed[-1].finished and not any(o.finished for o in streamed[:-1])
        assert len(streamed) > 1                                            # token deltas arrive step by step
        lengths = [len(o.outputs[0].token_ids) for o in streamed]
        assert lengths == sorted(lengths)
        assert streamed[-1].outputs[0].token_ids == ref.outputs[0].token_ids
        assert streamed[-1].outputs[0].text == ref.outputs[0].text
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0


@pytest.mark.slow
def test_leaving_the_stream_aborts_and_frees_blocks(tiny_model_dir):
    async def main():
        llm = AsyncLLM.from_engine_args(_args(tiny_model_dir("llama-gqa")))
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            seen = 0
            async for out in llm.generate(PROMPTS[1], params, "long"):
                seen += 1
                if seen == 3:
                    break                          # the client went away
            for _ in range(100):
                stats = await llm.stats()
                if stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            return stats
        finally:
            llm.shutdown()

    stats = asyncio.run(main())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0


def test_dead_engine_fails_requests_fast_and_leaves_no_process(tiny_model_dir):
    async def main():
        llm = AsyncLLM.from_engine_args(_args(tiny_model_dir("llama-gqa")))
        pid = llm.engine_core.process.pid
        params = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)
        outputs = 0
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in llm.generate(PROMPTS[0], params, "victim"):
                outputs += 1
                os.kill(pid, signal.SIGKILL)
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(PROMPTS[0], params, "after"):
                pass
        llm.shutdown()
        return pid, outputs

    pid, outputs = asyncio.run(main())
    assert outputs < 250          # the request failed when the engine died, not after running out
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_startup_failure_in_the_engine_process_is_reported(tiny_model_dir):
    async def main():
        AsyncLLM.from_engine_args(EngineArgs(model=tiny_model_dir("llama-gqa"), dtype="float32",
                                             kv_cache_memory=8192 * 4,
                            max_model_len=512))

    with pytest.raises(RuntimeError, match="engine core failed to start: ValueError.*max_model_len"):
        asyncio.run(main())
