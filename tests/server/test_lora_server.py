"""LoRA adapters in the server: --lora-modules (both forms), a request's model picks the adapter,
/v1/models lists them under their base, runtime load and unload behind the opt-in, the errors,
and lora_requests_info in /metrics."""

import json

import httpx
import openai
import pytest

from shardlm import LLM, LoRARequest, SamplingParams
from tests.helpers import ServerThread, server_in_this_process
from tests.lora_adapters import write_adapter

PROMPTS = ["The capital of", "One two three"]


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("llama-gqa")
    root = tmp_path_factory.mktemp("server-lora")
    one = write_adapter(base, root / "one", rank=8, seed=1)
    two = write_adapter(base, root / "two", rank=4, seed=2, targets=("q_proj", "v_proj"))
    with server_in_this_process(base, "--enable-lora", "--max-loras", "2", "--lora-modules", f"one={one}",
                                json.dumps({"name": "two", "path": two}),
                                env={"SHARDLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as (_, url):
        yield base, url, {"one": one, "two": two}


def _offline(base, lora: LoRARequest | None) -> list[str]:
    llm = LLM(base, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, enable_lora=True,
              distributed_executor_backend="uni")
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False,
                            lora_request=lora)
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def _complete(client, model: str) -> list[str]:
    resp = client.completions.create(model=model, prompt=PROMPTS, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]


def test_a_request_model_picks_its_adapter(lora_server):
    base, url, paths = lora_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "one", "two"}
    assert cards["one"].parent == "tiny" and cards["two"].root == paths["two"] and cards["tiny"].parent is None
    texts = {name: _complete(client, name) for name in ("tiny", "one", "two")}
    assert texts["one"] == _offline(base, LoRARequest("one", 1, paths["one"]))
    assert texts["tiny"] == _offline(base, None)
    assert texts["one"] != texts["tiny"] and texts["two"] != texts["tiny"]
    chat = client.chat.completions.create(model="two", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert chat.model == "two"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="three", prompt="Hi", max_tokens=2)
    metrics = httpx.get(url + "/metrics").text
    assert 'shardlm:lora_requests_info{max_lora="2"' in metrics and 'vllm:lora_requests_info{max_lora="2"' in metrics


def test_adapters_load_and_unload_at_run_time(lora_server, tmp_path):
    base, url, paths = lora_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "three", "lora_path": paths["one"]})
    assert r.status_code == 200 and "added" in r.text
    assert _complete(client, "three") == _complete(client, "one")
    assert httpx.post(url + "/v1/load_lora_adapter",
                      json={"lora_name": "three", "lora_path": paths["two"]}).status_code == 400   # name taken
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
    assert r.status_code == 400 and "corrupt" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "three"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="three", prompt="Hi", max_tokens=2)
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "three"}).status_code == 404
    assert {m.id for m in client.models.list().data} == {"tiny", "one", "two"}
    assert _complete(client, "one") == _offline(base, LoRARequest("one", 1, paths["one"]))   # still serving


@pytest.mark.slow
def test_runtime_updates_need_the_opt_in_and_modules_need_enable_lora(lora_server):
    base, _, paths = lora_server
    with server_in_this_process(base, "--enable-lora", "--lora-modules", f"one={paths['one']}") as (_, url):
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["two"]})
        assert r.status_code == 404
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        ServerThread(base, "--lora-modules", f"one={paths['one']}")          # refused before it serves
