"""Expert parallel (--enable-expert-parallel): whole experts on the ranks of each stage's DP x TP
group. Outputs equal transformers' and the one-rank engine's over TP ranks, across data parallel
replicas (which run their MoE layers in lock-step, with pipeline stages too) and both; each rank
holds only its experts; an idle replica joins the others' steps and all go quiet together; a
dead replica fails the whole engine; the expert load reaches the stats."""

import os
import signal
import threading
import time

import httpx
import psutil
import pytest
import torch

from shardlm import LLM, SamplingParams, kernels
from shardlm.engine.core_client import EngineDeadError
from shardlm.layers.cpu_matmul import goes_into_panels
from shardlm.layers.moe import local_experts
from tests.distributed.test_parallel_server import assert_server_answers_like_llm
from tests.helpers import server_in_this_process, start_server, stop_server
from tests.models.test_tiny_models_vs_hf import PARAMS, _prompts

ENGINE = dict(dtype="float32", kv_cache_memory="64MiB", max_model_len=512)


def _token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def one_rank_outputs(tiny_model_dir):
    cache = {}

    def get(name):
        if name not in cache:
            llm = LLM(tiny_model_dir(name), **ENGINE)
            try:
                cache[name] = _token_ids(llm.generate(_prompts(), PARAMS, use_tqdm=False))
            finally:
                llm.shutdown()
        return cache[name]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name,dp,tp,pp,pcp", [
    ("mixtral", 1, 2, 1, 1), ("qwen2-moe", 1, 2, 1, 1), ("mixtral", 2, 1, 1, 1), ("qwen3-moe", 2, 2, 1, 1),
    ("gpt-oss", 1, 2, 1, 1), ("deepseek-v3", 1, 2, 1, 1), ("deepseek-v3", 2, 1, 2, 1), ("qwen3-moe", 1, 2, 1, 2),
    ("gpt-oss", 2, 1, 1, 2)],
    ids=["mixtral-tp2-ep", "qwen2moe-tp2-ep", "mixtral-dp2-ep", "qwen3moe-dp2-tp2-ep", "gptoss-tp2-ep",
         "deepseekv3-tp2-ep", "deepseekv3-dp2-pp2-ep", "qwen3moe-tp2-pcp2-ep", "gptoss-dp2-pcp2-ep"])
def test_expert_parallel_equals_one_rank_and_hf(name, dp, tp, pp, pcp, tiny_model_dir, references, hf,
                                                one_rank_outputs):
    """Under -pcp each prefill context parallel group runs its own tokens through its own
    expert parallel group (DP x TP of that group); under -pp each stage through its own."""
    llm = LLM(tiny_model_dir(name), **ENGINE, data_parallel_size=dp, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, prefill_context_parallel_size=pcp, enable_expert_parallel=True)
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert _token_ids(outs) == one_rank_outputs(name)
    assert hf.assert_close(references(name), outs, f"{name} dp={dp} tp={tp} EP") >= 4
    # every routed token counted once, on the replica that served it (top-2 of each MoE layer's
    # tokens); a Llama-family model's last layer routes the sampled rows alone (one per output
    # token), except under DP + EP lock-step (GPT-OSS's window groups and DeepSeek's latent
    # attention finish every row too: model_runner._last_layer_rows)
    processed = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outs)
    sampled = sum(len(o.outputs[0].token_ids) for o in outs)
    last = str(max(int(layer) for layer in stats["expert_load"]))
    finishes_sampled_rows = name in ("mixtral", "qwen2-moe") and dp == 1
    for layer, counts in stats["expert_load"].items():
        routed = sampled if layer == last and finishes_sampled_rows else processed
        assert sum(counts) == 2 * routed, (layer, counts)


@pytest.mark.slow
def test_each_rank_holds_only_its_experts(tiny_model_dir):
    """Qwen3-MoE, 6 experts on 4 ranks (2, 2, 1, 1): the weights per rank differ from tensor
    parallel's (a quarter of every expert) by exactly the experts it holds beyond those quarters
    (counted as stored: in the blocked kernel's panels where float experts go there)."""
    path = tiny_model_dir("qwen3-moe")
    sliced = LLM(path, **ENGINE, tensor_parallel_size=4)
    try:
        tp_bytes = sliced.collective_rpc("weight_bytes")
        config = sliced.engine.config.model.hf_config
    finally:
        sliced.shutdown()
    whole = LLM(path, **ENGINE, tensor_parallel_size=4, enable_expert_parallel=True)
    try:
        ep_bytes = whole.collective_rpc("weight_bytes")
    finally:
        whole.shutdown()
    H, inter = config.hidden_size, config.moe_intermediate_size
    expert_bytes, quarter_bytes = _stored_expert_bytes(H, inter), _stored_expert_bytes(H, inter // 4)
    moe_layers = config.num_hidden_layers - len(config.mlp_only_layers)
    for rank in range(4):
        held = local_experts(6, 4, rank)[1]
        assert ep_bytes[rank] - tp_bytes[rank] == (held * expert_bytes - 6 * quarter_bytes) * moe_layers


def _stored_expert_bytes(hidden: int, inter: int) -> int:
    """A float32 expert's w13 [2 inter, hidden] and w2 [hidden, inter] as the CPU stores them."""
    if not goes_into_panels(torch.empty(1, 1)):
        return 3 * hidden * inter * 4
    size = kernels.blocked_pack()[0]
    return (size(2 * inter, hidden, 0) + size(hidden, inter, 0)) * 4


def _busy_seconds(procs) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_an_idle_replica_steps_with_the_busy_one_and_all_go_quiet(pp, tiny_model_dir, one_rank_outputs):
    """One long request and a few short ones: the replica whose requests finish early runs dummy
    steps for the other's many decode steps; outputs still equal one rank's, and once everything
    has finished neither replica uses the CPU (they sleep together). With -pp 2 the busy replica
    has two batches in flight while the idle one runs a dummy step at a time, and each stage's
    forwards still meet the other replica's."""
    path = tiny_model_dir("mixtral")
    prompts = ["Once upon a time", "Hi", "The capital of France is", "1 2 3"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (120, 2, 3, 2)]
    ref = LLM(path, **ENGINE)
    try:
        expected = _token_ids(ref.generate(prompts, params, use_tqdm=False))
    finally:
        ref.shutdown()
    llm = LLM(path, **ENGINE, data_parallel_size=2, pipeline_parallel_size=pp, enable_expert_parallel=True)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [e["num_routed"] for e in llm.stats()["engines"]] == [2, 2]
        assert _token_ids(outs) == expected
        cores = [psutil.Process(c.process.pid) for c in llm.engine.engine_core.cores]
        cores += [worker for core in cores for worker in core.children()]
        time.sleep(0.5)
        before = _busy_seconds(cores)
        time.sleep(2.0)
        assert _busy_seconds(cores) - before < 0.1, "an idle server's replicas must sleep, not spin"
        again = llm.generate(prompts[:1], params[:1], use_tqdm=False)     # and wake up for the next wave
        assert _token_ids(again) == expected[:1]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_dead_replica_fails_the_whole_engine(tiny_model_dir):
    llm = LLM(tiny_model_dir("mixtral"), **ENGINE, data_parallel_size=2, enable_expert_parallel=True)
    try:
        cores = llm.engine.engine_core.cores
        other = cores[0].process
        long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
        threading.Timer(1.0, os.kill, (cores[1].process.pid, signal.SIGKILL)).start()
        with pytest.raises(EngineDeadError, match=r"replica 1 .* died.*Expert parallel replicas run every step"):
            for _ in range(100):        # far longer than 1 s unless the kill stops it
                llm.generate(["one", "two", "three", "four"], long, use_tqdm=False)
        deadline = time.monotonic() + 15        # (the client's stopper thread reaps it: no join here)
        while other.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert other.exitcode is not None, "the surviving replica is stopped too (it cannot step alone)"
        with pytest.raises(EngineDeadError):
            llm.generate(["Hello"], long, use_tqdm=False)
    finally:
        llm.shutdown()


def test_expert_parallel_layouts_this_version_refuses(tiny_model_dir):
    path = tiny_model_dir("mixtral")
    with pytest.raises(ValueError, match="needs at least as many experts; this model has 4"):
        LLM(path, **ENGINE, data_parallel_size=2, tensor_parallel_size=4, enable_expert_parallel=True)


@pytest.mark.slow
def test_dp2_ep_server_answers_like_the_offline_engine_and_shows_the_expert_load(tiny_model_dir):
    path = tiny_model_dir("mixtral")
    with server_in_this_process(path, "-dp", "2", "--enable-expert-parallel") as (_, url):
        assert_server_answers_like_llm(url, path)
        metrics = httpx.get(url + "/metrics").text
    series = [line for line in metrics.splitlines() if line.startswith("shardlm:moe_expert_tokens{")]
    # 2 MoE layers x 4 experts, for each replica and their total
    assert len(series) == 2 * 4 * 3
    totals = [float(line.rsplit(" ", 1)[1]) for line in series if 'engine="all"' in line]
    assert sum(totals) > 0


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp,pp,pcp,redundant", [(1, 2, 1, 1, 0), (1, 2, 1, 1, 2), (2, 1, 1, 1, 0),
                                                    (2, 1, 2, 1, 0), (1, 2, 1, 2, 0)],
                         ids=["tp2-ep", "tp2-ep-2-copies", "dp2-ep", "dp2-pp2-ep", "tp2-pcp2-ep"])
def test_eplb_evens_a_skewed_routing_and_keeps_the_tokens(dp, tp, pp, pcp, redundant, tiny_model_dir,
                                                         one_rank_outputs):
    """GPT-OSS with its router biased towards experts 0 and 1, which start on one rank (without
    copies): placed anew every 4 forward passes from the last 4, with copies of the hot experts or
    without, the replicas of dp2 balancing together (under -pp each stage's ranks, under -pcp each
    group's, by their own tokens), the ranks' loads even out (2 copies of 4 experts start even already) and the tokens
    do not change."""
    llm = LLM(tiny_model_dir("gpt-oss-skewed"), **ENGINE, data_parallel_size=dp, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, prefill_context_parallel_size=pcp, enable_expert_parallel=True,
              enable_eplb=True,
              eplb_config={"step_interval": 4, "window_size": 4, "num_redundant_experts": redundant})
    try:
        outs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    eplb = stats["engines"][0]["eplb"] if "engines" in stats else stats["eplb"]
    assert eplb["rebalances"] > 0
    assert eplb["balancedness_after"] > 0.9, eplb
    if not redundant:
        assert eplb["balancedness_at_start"] < 0.75, eplb
    assert _token_ids(outs) == one_rank_outputs("gpt-oss-skewed")


@pytest.mark.slow
def test_eplb_moves_quantized_experts_and_keeps_their_tokens(tiny_model_dir):
    """int4 experts (one uint8 stack of panels per matrix) move between ranks as floats do: with
    EPLB placing them anew, the tokens equal the same quantized model's without moves."""
    path, engine = tiny_model_dir("gpt-oss-skewed"), dict(ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
                                                         quantization="int4", quantization_group_size=32)
    outs = {}
    for eplb in (False, True):
        llm = LLM(path, **engine, enable_eplb=eplb, **({"eplb_config": {"step_interval": 4, "window_size": 4}}
                                                        if eplb else {}))
        try:
            outs[eplb] = _token_ids(llm.generate(_prompts(), PARAMS, use_tqdm=False))
            assert set(k for rank in llm.collective_rpc("quantized_experts") for k in rank) == {"blocked4"}
            if eplb:
                assert llm.stats()["eplb"]["rebalances"] > 0
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]


def test_eplb_needs_expert_parallel(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-eplb without --enable-expert-parallel"):
        LLM(tiny_model_dir("gpt-oss"), **ENGINE, tensor_parallel_size=2, enable_eplb=True)
    with pytest.raises(ValueError, match="num_redundant_experts=-1"):
        LLM(tiny_model_dir("gpt-oss"), **ENGINE, tensor_parallel_size=2, enable_expert_parallel=True,
            enable_eplb=True, eplb_config={"num_redundant_experts": -1})


@pytest.mark.slow
def test_a_server_keeps_answering_while_eplb_moves_experts(tiny_model_dir):
    """Experts placed anew every 2 forward passes under 8 concurrent requests: every request is
    answered, the answers are the offline engine's, and the log shows the moves."""
    import openai
    path = tiny_model_dir("gpt-oss-skewed")
    proc, url = start_server(path, "-tp", "2", "--enable-expert-parallel", "--enable-eplb",
                             "--eplb-config", '{"step_interval": 2, "window_size": 2}')
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        results = [None] * 8

        def ask(i):
            results[i] = client.completions.create(model="tiny", prompt=f"Request {i} says", max_tokens=16,
                                                   temperature=0, extra_body={"ignore_eos": True})
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert all(r is not None and len(r.choices[0].text) > 0 for r in results)
        assert_server_answers_like_llm(url, path)
    finally:
        stop_server(proc)
    assert "EPLB: experts of" in proc.stderr.read()
