"""--served-model-name a b, as vLLM's: the server answers to each name, lists each in /v1/models
and repeats the name a request gave; another name is a 404 listing them."""

import httpx
import pytest

from shardlm import LLM
from tests.helpers import server_in_this_process

BODY = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}


@pytest.mark.slow
def test_each_served_name_answers_and_is_repeated(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--served-model-name", "llama", "tiny-chat") as (_, url):
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["llama", "tiny-chat"]
        texts = set()
        for name in ("llama", "tiny-chat"):
            r = httpx.post(url + "/v1/completions", json={**BODY, "model": name})
            assert r.status_code == 200 and r.json()["model"] == name
            texts.add(r.json()["choices"][0]["text"])
        assert len(texts) == 1, "one model under two names"
        other = httpx.post(url + "/v1/completions", json={**BODY, "model": "gpt-4"})
        assert other.status_code == 404 and "Served: llama, tiny-chat" in other.json()["error"]["message"]
        assert httpx.get(url + "/v1/models/tiny-chat").json()["id"] == "tiny-chat", "OpenAI's retrieve"
        missing = httpx.get(url + "/v1/models/gpt-4")
        assert missing.status_code == 404 and "Served: llama, tiny-chat" in missing.json()["error"]["message"]


def test_offline_the_first_name_is_the_models(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", kv_cache_memory="16MiB", max_model_len=64,
              served_model_name=["a", "b"])
    assert (llm.engine.config.model.served_model_name, llm.engine.config.model.served_model_names) == ("a", ["a", "b"])
    llm.shutdown()
    with pytest.raises(ValueError, match="give one or more non-empty names"):
        LLM(tiny_model_dir("llama-gqa"), served_model_name=[" "])
