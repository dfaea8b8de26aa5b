"""--trust-remote-code: a model whose config class is its repository's own Python (config.json's
auto_map) is refused with the flag to pass, and runs with it: offline, and with the engine core
in its own process, which unpickles that class (as a server's does)."""

import asyncio
import json
import shutil

import pytest

from shardlm import LLM, SamplingParams
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.async_llm import AsyncLLM

CONFIG_CODE = '''from transformers import LlamaConfig


class CustomLlamaConfig(LlamaConfig):
    model_type = "shardlm_custom_llama"
'''
ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
SP = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def custom_code_model(tiny_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("remote-code") / "custom-llama"
    shutil.copytree(tiny_model_dir("llama-gqa"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="shardlm_custom_llama", auto_map={"AutoConfig": "configuration_custom.CustomLlamaConfig"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_custom.py").write_text(CONFIG_CODE)
    return str(path)


def test_refused_without_the_flag_and_the_same_as_the_plain_model_with_it(custom_code_model, tiny_model_dir):
    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        EngineArgs(model=custom_code_model, **ENGINE).create_engine_config()
    llm = LLM(custom_code_model, trust_remote_code=True, **ENGINE)
    assert type(llm.engine.config.model.hf_config).__name__ == "CustomLlamaConfig"
    custom = llm.generate([[5, 6, 7]], SP, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
    llm = LLM(tiny_model_dir("llama-gqa"), **ENGINE)
    assert custom == llm.generate([[5, 6, 7]], SP, use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()


def test_an_engine_core_process_takes_the_custom_config_class(custom_code_model):
    config = EngineArgs(model=custom_code_model, trust_remote_code=True, **ENGINE).create_engine_config()

    async def run():
        llm = AsyncLLM(config)
        try:
            async for out in llm.generate({"prompt_token_ids": [5, 6, 7]}, SP, "r"):
                pass
            return out.outputs[0].token_ids
        finally:
            llm.shutdown()

    assert len(asyncio.run(run())) == 5
