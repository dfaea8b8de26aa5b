"""--scheduling-policy priority on a real engine: a high-priority request admitted ahead of the
queue, low-priority requests preempted first when the KV cache runs out, outputs unchanged;
priority refused where the policy is fcfs."""

import pytest

from shardlm import LLM, SamplingParams

PROMPTS = ["The capital of France is", "One, two, three,", "A list of fruits:", "def fibonacci(n):"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32")
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_priority_orders_admission_and_keeps_outputs(tiny_model_dir, reference):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", scheduling_policy="priority", max_num_seqs=1)
    try:
        outs = llm.generate(PROMPTS, PARAMS, priority=[5, 9, -3, 0], use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference
    started = sorted(range(len(PROMPTS)), key=lambda i: outs[i].metrics.first_token_time)
    assert started == [2, 3, 0, 1]          # by priority, lower first


def test_priority_preempts_low_priority_first_and_keeps_outputs(tiny_model_dir, reference):
    # room for about two of the four requests: preemptions must happen, always of the low ones
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", scheduling_policy="priority", block_size=4,
              kv_cache_memory=24 * 4 * 2 * 2 * 16 * 4 * 2, max_model_len=64)
    try:
        outs = llm.generate(PROMPTS, PARAMS, priority=[0, 0, 9, 9], use_tqdm=False)
        preemptions = llm.stats()["num_preemptions"]
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert preemptions > 0
    finished = sorted(range(len(PROMPTS)), key=lambda i: outs[i].metrics.finished_time)
    assert set(finished[:2]) == {0, 1}       # the high-priority pair never gave way


def test_priority_needs_the_priority_policy(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32")
    try:
        with pytest.raises(ValueError, match="--scheduling-policy priority"):
            llm.generate(PROMPTS[:1], PARAMS, priority=[1], use_tqdm=False)
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate(PROMPTS[:2], PARAMS, priority=[1], use_tqdm=False)
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        LLM(tiny_model_dir("llama-gqa"), scheduling_policy="lifo")


def test_server_takes_priority_on_completions_and_chat(tiny_model_dir, reference):
    import httpx

    from tests.helpers import server_in_this_process
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--scheduling-policy", "priority") as (_, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True, "priority": -5}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 4, "priority": 3}, timeout=60)
        assert chat.status_code == 200, chat.text
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "priority": 2 ** 70}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
