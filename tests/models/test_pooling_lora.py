"""LoRA adapters on decoder pooling models (vLLM serves them on its embedding and classification
models too): each prompt's embedding or class score equals transformers' on the base model with
its adapter merged into the weights (W + scaling * B A), base and adapter prompts in one batch, on
every layout (one rank, tensor, pipeline, data and prefill context parallel); the
server picks the adapter by the request's model name; an adapter that can no longer be read
fails its requests alone; encoders refuse --enable-lora."""

import shutil

import pytest
import torch

from shardlm import LLM, LoRARequest, PoolingParams
from shardlm.engine.feature_rules import UnsupportedCombination
from tests.lora_adapters import merged_model, write_adapter
from tests.models.test_pooling import QUERY, SENTENCES, _hf_logits

ENGINE = dict(runner="pooling", enable_lora=True, max_loras=2, kv_cache_memory="64MiB")


def _hf_embeddings(path: str) -> torch.Tensor:
    """transformers' last-token final hidden state of each sentence, normalized."""
    from transformers import AutoModel, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([torch.nn.functional.normalize(
            model(**tok(s, return_tensors="pt")).last_hidden_state[0, -1], dim=-1) for s in SENTENCES])


@pytest.fixture(scope="module")
def embedder(tiny_model_dir, tmp_path_factory):
    """A Qwen3 checkpoint run as an embedder, two adapters (every projection at rank 8; q/v/down at
    rank 4 with rsLoRA), and transformers' embeddings on the base and on each merged model."""
    base = tiny_model_dir("qwen3")
    root = tmp_path_factory.mktemp("pooling-lora")
    one = write_adapter(base, root / "one", rank=8, seed=1)
    two = write_adapter(base, root / "two", rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"), rslora=True)
    refs = {"base": _hf_embeddings(base), "one": _hf_embeddings(merged_model(base, one, root / "m1")),
            "two": _hf_embeddings(merged_model(base, two, root / "m2"))}
    return base, {"one": LoRARequest("one", 1, one), "two": LoRARequest("two", 2, two)}, refs


@pytest.mark.parametrize("layout", [{}, pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),
                                    pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow),
                                    pytest.param({"data_parallel_size": 2}, marks=pytest.mark.slow),
                                    pytest.param({"prefill_context_parallel_size": 2}, marks=pytest.mark.slow)],
                         ids=["tp1", "tp2", "pp2", "dp2", "pcp2"])
def test_each_prompts_adapter_gives_the_merged_models_embedding(embedder, layout):
    base, loras, refs = embedder
    names = ["base", "one", "two", "one", "base"]
    llm = LLM(base, **ENGINE, **layout)
    try:
        mixed = llm.embed(SENTENCES, use_tqdm=False, lora_request=[loras.get(n) for n in names])
        alone = llm.embed(SENTENCES, use_tqdm=False, lora_request=loras["two"])
    finally:
        llm.shutdown()
    for i, (name, out) in enumerate(zip(names, mixed)):
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), refs[name][i], atol=1e-4, rtol=0,
                                   msg=lambda m, i=i, name=name: f"prompt {i} on {name}: {m}")
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in alone]), refs["two"], atol=1e-4, rtol=0)
    assert (refs["one"] - refs["base"]).abs().max() > 1e-2, "the adapter changes the embeddings it is checked on"


def test_a_reranker_adapter_gives_the_merged_models_scores(pooling_model_dir, tmp_path):
    """A decoder cross-encoder (Qwen3ForSequenceClassification): LLM.score with an adapter equals
    transformers' sigmoid of the merged model's logit for each (query, document) pair."""
    from transformers import Qwen3ForSequenceClassification
    base = pooling_model_dir("qwen3-reranker")
    adapter = write_adapter(base, tmp_path / "adapter", rank=8, seed=3)
    ref = torch.sigmoid(_hf_logits(merged_model(base, adapter, tmp_path / "merged"), Qwen3ForSequenceClassification,
                                   SENTENCES, QUERY))[:, 0]
    llm = LLM(base, **ENGINE)
    try:
        got = [o.outputs.score for o in llm.score(QUERY, SENTENCES, use_tqdm=False,
                                                  lora_request=LoRARequest("r", 1, adapter))]
        plain = [o.outputs.score for o in llm.score(QUERY, SENTENCES, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == pytest.approx(ref.tolist(), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(got, plain)) > 1e-3, "the adapter changes the scores"


@pytest.mark.slow
def test_the_server_embeds_with_the_adapter_its_model_names(embedder):
    from openai import NotFoundError, OpenAI

    from tests.helpers import server_in_this_process
    base, loras, refs = embedder
    with server_in_this_process(base, "--runner", "pooling", "--enable-lora", "--kv-cache-memory", "64MiB",
                                "--lora-modules", f"one={loras['one'].lora_path}") as (_, url):
        client = OpenAI(base_url=url + "/v1", api_key="none")
        for name in ("one", client.models.list().data[0].id):
            got = client.embeddings.create(model=name, input=SENTENCES[:2]).data
            want = refs["one" if name == "one" else "base"][:2]
            torch.testing.assert_close(torch.tensor([d.embedding for d in got]), want, atol=1e-4, rtol=0)
        with pytest.raises(NotFoundError, match="two"):
            client.embeddings.create(model="two", input="x")


def test_an_adapter_that_can_no_longer_be_read_fails_its_requests_alone(embedder, tmp_path):
    from shardlm.engine.errors import RequestFailedError
    base, loras, refs = embedder
    gone = LoRARequest("gone", 9, str(shutil.copytree(loras["one"].lora_path, tmp_path / "gone")))
    llm = LLM(base, **ENGINE)
    try:
        assert llm.add_lora(gone) and llm.remove_lora(9)     # checked, then out of memory: read again on use
        shutil.rmtree(gone.lora_path)
        engine, done = llm.engine, {}
        engine.add_request("base", SENTENCES[0], PoolingParams(task="embed"))
        engine.add_request("adapted", SENTENCES[0], PoolingParams(task="embed"), lora_request=gone)
        with pytest.raises(RequestFailedError, match="LoRA adapter 'gone' could not be read"):
            while engine.has_unfinished_requests():
                done.update((o.request_id, o) for o in engine.step() if o.finished)
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        assert list(done) == ["base"]
        torch.testing.assert_close(done["base"].outputs.data, refs["base"][0], atol=1e-4, rtol=0)
        again = llm.embed(SENTENCES[:1], use_tqdm=False, lora_request=loras["one"])[0].outputs.embedding
        torch.testing.assert_close(torch.tensor(again), refs["one"][0], atol=1e-4, rtol=0)
    finally:
        llm.shutdown()


def test_an_encoder_refuses_enable_lora_naming_what_to_use(minilm_dir):
    with pytest.raises(UnsupportedCombination, match="encoder pooling model.*decoder embedding"):
        LLM(minilm_dir, enable_lora=True)
