"""The engine-core client interface: the in-process client, the multiprocess one (sync) and the
asyncio one (AsyncLLM) give the same outputs for the same requests."""

import asyncio

import pytest

from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.async_llm import AsyncLLM
from shardlm.engine.core_client import AsyncMPClient, InprocClient, SyncMPClient
from shardlm.engine.llm_engine import LLMEngine
from shardlm.sampling_params import RequestOutputKind, SamplingParams

PROMPTS = [[5, 900, 17, 3000, 42], list(range(1000, 1040)), "The capital of France is", list(range(200, 290))]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=2),
          SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=16, stop=["e"], ignore_eos=True)]


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return EngineArgs(model=tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="32MiB",
                      max_model_len=256).create_engine_config()


def _summary(outputs):
    return [[(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
              None if c.logprobs is None else [sorted(p) for p in c.logprobs]) for c in o.outputs]
            for o in outputs]


def _run_sync(config, multiprocess, prompts=PROMPTS, params=PARAMS):
    engine = LLMEngine(config, multiprocess_mode=multiprocess)
    try:
        assert isinstance(engine.engine_core, SyncMPClient if multiprocess else InprocClient)
        assert engine.num_blocks > 0
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, sp.clone(output_kind=RequestOutputKind.FINAL_ONLY))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
        stats = engine.stats()
        weights = engine.collective_rpc("weight_bytes")
        return [done[str(i)] for i in range(len(prompts))], stats, weights, engine.num_blocks
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_inproc_sync_mp_and_async_clients_agree(config):
    inproc, stats_in, weights_in, blocks_in = _run_sync(config, multiprocess=False)
    mp, stats_mp, weights_mp, blocks_mp = _run_sync(config, multiprocess=True)

    async def run_async():
        llm = AsyncLLM(config)
        try:
            assert isinstance(llm.engine_core, AsyncMPClient)

            async def one(i):
                async for out in llm.generate(PROMPTS[i], PARAMS[i].clone(output_kind=RequestOutputKind.FINAL_ONLY),
                                              str(i)):
                    final = out
                return final
            outs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            return outs, await llm.stats(), await llm.collective_rpc("weight_bytes"), llm.num_blocks
        finally:
            llm.shutdown()

    asy, stats_as, weights_as, blocks_as = asyncio.run(run_async())
    assert _summary(inproc) == _summary(mp) == _summary(asy)
    assert [o.finished for o in inproc] == [True] * len(PROMPTS)
    assert len(inproc[2].outputs) == 2 and inproc[3].outputs[0].stop_reason == "e"
    assert blocks_in == blocks_mp == blocks_as
    assert weights_in == weights_mp == weights_as and weights_in[0] > 0
    for stats in (stats_in, stats_mp, stats_as):
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_delta_stream_concatenates_to_the_offline_text(config):
    """AsyncLLM with DELTA outputs, stop string included: the pieces add up to LLM's output."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    (full,), _, _, _ = _run_sync(config, False, [PROMPTS[2]], [sp])
    text = full.outputs[0].text
    stop = text[2 * len(text) // 3:][:2]          # a stop string the greedy output reaches late
    assert len(stop) == 2
    sp = sp.clone(stop=[stop])
    (ref,), _, _, _ = _run_sync(config, False, [PROMPTS[2]], [sp])
    assert ref.outputs[0].stop_reason == stop and len(ref.outputs[0].text) < len(text)

    async def run():
        llm = AsyncLLM(config)
        try:
            return [o async for o in llm.generate(PROMPTS[2], sp.clone(output_kind=RequestOutputKind.DELTA), "d")]
        finally:
            llm.shutdown()

    deltas = asyncio.run(run())
    assert deltas[-1].finished and len(deltas) > 1
    pieces = [c for d in deltas for c in d.outputs]
    assert "".join(c.text for c in pieces) == ref.outputs[0].text
    assert [t for c in pieces for t in c.token_ids] == ref.outputs[0].token_ids
    assert sum(len(c.logprobs) for c in pieces) == len(ref.outputs[0].logprobs)
    assert pieces[-1].stop_reason == ref.outputs[0].stop_reason


def test_an_engine_core_whose_client_left_before_it_was_ready_ends_quietly(config):
    """Its Ready finds no reader (the server stopped while a restart was starting it): it ends as
    when its client goes away later (exit code 0), not with a BrokenPipeError's traceback (1)."""
    from shardlm.engine.core_process import run_engine_core
    from shardlm.processes import InParentEnvironment, clean_process_context

    ctx = clean_process_context()
    req_recv, req_send = ctx.Pipe(duplex=False)
    out_recv, out_send = ctx.Pipe(duplex=False)
    out_recv.close()                     # the client is gone before the core is ready
    core = ctx.Process(target=InParentEnvironment(run_engine_core), args=(config, req_recv, out_send))
    core.start()
    req_recv.close()
    out_send.close()
    core.join(60)
    req_send.close()
    assert core.exitcode == 0
