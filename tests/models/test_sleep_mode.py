"""Sleep mode (--enable-sleep-mode, as vLLM's): sleep gives back the KV cache's memory (level 1)
and the weights' (level 2), wake_up takes them again, and the engine then gives the same tokens;
requests meanwhile are refused, and an engine with requests to finish does not sleep."""

import httpx
import pytest

from shardlm import LLM, SamplingParams
from tests.helpers import server_in_this_process

PROMPTS = [[5, 6, 7, 8], list(range(100, 140))]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def kv_bytes(llm) -> int:
    return sum(llm.collective_rpc("kv_cache_bytes"))


@pytest.mark.parametrize("layout", [{}, pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow)])
def test_sleep_gives_the_memory_back_and_wake_up_the_same_tokens(tiny_model_dir, layout):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="64MiB", max_model_len=128,
              enable_sleep_mode=True, **layout)
    try:
        before, held = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)], kv_bytes(llm)
        assert held >= 60 << 20
        for levels in ([1], [1, 2]):       # asleep already, it sleeps deeper
            for level in levels:
                llm.sleep(level)
            assert llm.is_sleeping() and kv_bytes(llm) == 0
            with pytest.raises(ValueError, match="The engine sleeps"):
                llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            llm.wake_up()
            assert not llm.is_sleeping() and kv_bytes(llm) == held
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == before, levels
        llm.engine.add_request("running", [5, 6, 7], GREEDY)
        with pytest.raises((ValueError, RuntimeError), match="requests to finish"):
            llm.sleep()
        llm.engine.abort_request("running")
    finally:
        llm.shutdown()


def test_sleep_needs_sleep_mode(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        llm.sleep()
    llm.shutdown()


def test_the_servers_sleep_routes(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--enable-sleep-mode") as (_, url):
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        first = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
        assert httpx.get(url + "/tokenizer_info").status_code == 404, "off without its flag"
        assert httpx.post(url + "/sleep", params={"level": 2}).status_code == 200
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
        refused = httpx.post(url + "/v1/completions", json=body)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert httpx.post(url + "/sleep", params={"level": 3}).status_code == 400
        assert httpx.post(url + "/wake_up").status_code == 200
        assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
        assert httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"] == first
