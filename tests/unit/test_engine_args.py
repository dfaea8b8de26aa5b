"""Each engine knob is declared once (a config's `knob`, or EngineArgs' own for the knobs it
resolves): the CLI flags, the LLM keywords and the configs are made from that one declaration."""

import argparse
import dataclasses

from shardlm.config import CacheConfig, LoRAConfig, ParallelConfig, SchedulerConfig
from shardlm.engine.arg_utils import EngineArgs
from shardlm.entrypoints.cli.engine_flags import add_engine_args, engine_args_from

CONFIGS = {"parallel": ParallelConfig, "cache": CacheConfig, "lora": LoRAConfig, "scheduler": SchedulerConfig}
RESOLVED_BY_ENGINE_ARGS = {"max_num_batched_tokens"}      # None in EngineArgs: resolved from max_num_seqs


def test_every_knob_is_declared_whole_and_lands_in_a_config_field():
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata["help"], f.name
        target = CONFIGS.get(f.metadata["lands_in"])
        if target is not None:
            assert f.name in {g.name for g in dataclasses.fields(target)}, f"{f.name} is no field of {target}"
        else:
            assert f.metadata["lands_in"] in ("model", "engine"), f.name


def test_a_config_knob_has_its_default_and_help_from_the_config_alone():
    for f in dataclasses.fields(EngineArgs):
        target = CONFIGS.get(f.metadata["lands_in"])
        if target is None:
            continue
        declared = next(g for g in dataclasses.fields(target) if g.name == f.name)
        assert f.metadata["help"] is declared.metadata["help"], f"{f.name}: help written again in EngineArgs"
        if f.name not in RESOLVED_BY_ENGINE_ARGS:
            assert f.default == declared.default, f"{f.name}: EngineArgs' default differs from {target.__name__}'s"


def test_the_cli_has_one_flag_per_knob_with_its_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    defaults = engine_args_from(parser.parse_args([]))
    assert defaults == EngineArgs()
    given = engine_args_from(parser.parse_args(["m", "-tp", "2", "--no-enable-prefix-caching", "--kv-cache-memory",
                                                "1GiB", "--execute-model-timeout", "7.5"]))
    assert (given.model, given.tensor_parallel_size, given.enable_prefix_caching, given.kv_cache_memory,
            given.execute_model_timeout) == ("m", 2, False, "1GiB", 7.5)
    assert given.landing_in("cache") == {"block_size": 16, "kv_cache_memory": "1GiB", "gpu_memory_utilization": 0.9,
                                         "enable_prefix_caching": False, "disable_hybrid_kv_cache_manager": False,
                                         "kv_cache_dtype": "auto", "num_gpu_blocks_override": None}
    # vLLM's other names: --kv-cache-memory-bytes and LLM(kv_cache_memory_bytes=...)
    assert engine_args_from(parser.parse_args(["--kv-cache-memory-bytes", "123456"])).kv_cache_memory == "123456"
    assert engine_args_from(parser.parse_args(["--distributed-timeout-seconds", "60"])).distributed_init_timeout == 60.0
    # vLLM's --model, which the positional model wins over
    assert engine_args_from(parser.parse_args(["--model", "org/name", "-tp", "2"])).model == "org/name"
    assert engine_args_from(parser.parse_args(["pos", "--model", "org/name"])).model == "pos"


def test_external_and_hybrid_load_balancing_run_this_servers_replicas(tiny_model_dir):
    """--data-parallel-rank (vLLM's external load balancing) and --data-parallel-hybrid-lb: a server
    of its own replicas. A dense model's run on their own; expert parallel ones keep their place
    in the deployment (they step with the other servers': engine/dp_front_ends.py)."""
    import pytest
    dense, moe = tiny_model_dir("llama-gqa"), tiny_model_dir("mixtral")
    par = EngineArgs(model=dense, data_parallel_size=4, data_parallel_rank=2,
                     data_parallel_external_lb=True).create_engine_config().parallel
    assert (par.data_parallel_size, par.data_parallel_size_local, par.data_parallel_hybrid_lb) == (1, 1, False)
    par = EngineArgs(model=dense, data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
                     data_parallel_hybrid_lb=True).create_engine_config().parallel
    assert (par.data_parallel_size, par.data_parallel_size_local, par.data_parallel_start_rank) == (2, 2, 0)
    par = EngineArgs(model=moe, data_parallel_size=2, data_parallel_rank=1,
                     enable_expert_parallel=True).create_engine_config().parallel
    assert (par.data_parallel_size, par.data_parallel_size_local, par.data_parallel_start_rank) == (2, 1, 1)
    assert par.data_parallel_hybrid_lb and (par.data_parallel_address, par.data_parallel_rpc_port) == (
        "127.0.0.1", 29550)       # vLLM's defaults, for servers on one node
    with pytest.raises(ValueError, match=r"give a replica in \[0, 4\)"):
        EngineArgs(model=dense, data_parallel_size=4, data_parallel_rank=4).create_engine_config()
    for ray in (dict(data_parallel_backend="ray"), dict(distributed_executor_backend="ray")):
        with pytest.raises(ValueError, match="the mp backend and executor on each node"):
            EngineArgs(model=moe, data_parallel_size=2, data_parallel_rank=1, enable_expert_parallel=True,
                       **ray).create_engine_config()
    with pytest.raises(ValueError, match="--data-parallel-size-local 1 or more"):
        EngineArgs(model=dense, data_parallel_size=2, data_parallel_size_local=0,
                   data_parallel_hybrid_lb=True).create_engine_config()


def test_hf_config_path_reads_the_config_from_elsewhere(tiny_model_dir, tmp_path):
    """--hf-config-path, as vLLM's: the architecture and sizes come from that config.json (a
    directory or the file), the weights from the model; a path without one is named."""
    import json

    import pytest

    from shardlm import LLM, SamplingParams
    model = tiny_model_dir("llama-gqa")
    with open(f"{model}/config.json") as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 48}))
    for given in (str(tmp_path), str(tmp_path / "config.json")):
        engine = EngineArgs(model=model, hf_config_path=given).create_engine_config()
        assert engine.model.max_model_len == 48 and engine.model.hf_config.max_position_embeddings == 48
    assert EngineArgs(model=model).create_engine_config().model.max_model_len != 48
    llm = LLM(model, hf_config_path=str(tmp_path), kv_cache_memory="64MiB")
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    with pytest.raises(ValueError, match="has no config.json"):
        EngineArgs(model=model, hf_config_path=str(tmp_path / "elsewhere")).create_engine_config()
