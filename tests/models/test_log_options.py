"""vLLM's log switches: the periodic stats line (--disable-log-stats turns it off, the counters
stay), one line per request with --enable-log-requests (--max-log-len shortens its prompt) and
one per finished output with --enable-log-outputs; and --stream-interval."""

import asyncio
import contextlib
import logging

import pytest

from shardlm import LLM, SamplingParams
from shardlm.core.stat_logger import StatLogger
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.async_llm import AsyncLLM
from shardlm.sampling_params import RequestOutputKind


@contextlib.contextmanager
def shardlm_log():
    """The messages shardlm logs meanwhile (its logger does not propagate to pytest's)."""
    lines, handler = [], logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("shardlm").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("shardlm").removeHandler(handler)


def test_the_stats_line_and_disable_log_stats(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(StatLogger, "INTERVAL_S", 0.0)        # a line after every step
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for disabled in (False, True):
        llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64,
                  disable_log_stats=disabled)
        with shardlm_log() as lines:
            llm.generate([[5, 6, 7]], sp, use_tqdm=False)
        counted = llm.engine.engine_core.engine_core.stat_logger.generation_tokens_total
        llm.shutdown()
        logged = [line for line in lines if line.startswith("Avg prompt throughput")]
        assert (logged == []) == disabled, lines
        assert counted == 4, "the counters behind /metrics count either way"


def test_enable_log_requests_logs_each_request_shortened_to_max_log_len(tiny_model_dir):
    config = EngineArgs(model=tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB",
                        max_model_len=64, enable_log_requests=True, max_log_len=3).create_engine_config()

    async def run():
        llm = AsyncLLM(config)
        try:
            with shardlm_log() as lines:
                async for _ in llm.generate("Hello there", SamplingParams(max_tokens=2), "req-1"):
                    pass
            return lines, llm.tokenizer("Hello there")["input_ids"]
        finally:
            llm.shutdown()

    lines, ids = asyncio.run(run())
    received = [line for line in lines if line.startswith("Received request req-1: ")]
    assert len(received) == 1, lines
    assert "prompt: 'Hel', params: SamplingParams(" in received[0]
    assert f"prompt_token_ids: {ids[:3]} ({len(ids)}), lora_request: None." in received[0]


def test_log_outputs_and_the_stream_interval(tiny_model_dir):
    """--enable-log-outputs logs each finished request's outputs; --stream-interval 4 sends the
    first token at once, then 4 at a time, and the rest at the end."""
    config = EngineArgs(model=tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB",
                        max_model_len=64, enable_log_requests=True, enable_log_outputs=True,
                        stream_interval=4).create_engine_config()
    sp = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run():
        llm = AsyncLLM(config)
        try:
            with shardlm_log() as lines:
                sizes = [len(out.outputs[0].token_ids) async for out in llm.generate("Hello", sp, "req-2")]
            return lines, sizes
        finally:
            llm.shutdown()

    lines, sizes = asyncio.run(run())
    assert sizes == [1, 4, 4, 2], sizes
    generated = [line for line in lines if line.startswith("Generated response req-2: output: ")]
    assert len(generated) == 1 and "(11), finish_reason: length" in generated[0], lines
    with pytest.raises(ValueError, match="add --enable-log-requests"):
        EngineArgs(model=tiny_model_dir("llama-gqa"), enable_log_outputs=True).create_engine_config()
