"""The pooling routes of a real server, through the official openai client and plain HTTP:
/v1/embeddings (float and base64) equal to the offline engine, /pooling, /classify, /score,
/rerank (vLLM/Jina and Cohere shapes); bad input answered 400 with what to do; a generative
server's pooling routes and a pooling server's generation routes refused by name."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from shardlm import LLM
from tests.helpers import server_in_this_process

SENTENCES = ["The cat sits on the mat.", "A man is playing a guitar.", "Paris is the capital of France."]
QUERY = "Where does the cat sit?"


@pytest.fixture(scope="module")
def embedder(minilm_dir):
    with server_in_this_process(minilm_dir) as (_, url):
        yield url


@pytest.fixture(scope="module")
def offline(minilm_dir):
    llm = LLM(minilm_dir)
    try:
        yield [o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_openai_client_embeddings_equal_offline(embedder, offline):
    client = openai.OpenAI(base_url=embedder + "/v1", api_key="x", max_retries=0)
    resp = client.embeddings.create(model=client.models.list().data[0].id, input=SENTENCES)
    assert [d.index for d in resp.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in resp.data], offline, atol=1e-6)     # base64: the client's default
    floats = client.embeddings.create(model=resp.model, input=SENTENCES[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, offline[0], atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    ids = client.embeddings.create(model=resp.model, input=[[101, 7592, 102]], encoding_format="float")
    assert len(ids.data[0].embedding) == 384
    models = httpx.get(embedder + "/v1/models").json()["data"]
    assert models[0]["tasks"] == ["embed", "token_embed", "score"]


def test_pooling_score_and_rerank_routes(embedder, offline):
    pooled = httpx.post(embedder + "/pooling", json={"input": SENTENCES[0], "task": "token_embed"}).json()
    assert np.asarray(pooled["data"][0]["data"]).shape[1] == 384
    score = httpx.post(embedder + "/score", json={"text_1": SENTENCES[0], "text_2": SENTENCES[1:]}).json()
    expected = [float(np.dot(offline[0], v)) for v in offline[1:]]
    assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = httpx.post(embedder + path, json={"query": SENTENCES[0], "documents": SENTENCES[1:], "top_n": 1}).json()
        best = int(np.argmax(expected))
        assert [r["index"] for r in body["results"]] == [best]
        assert body["results"][0]["relevance_score"] == pytest.approx(expected[best], abs=1e-5)
        assert body["results"][0]["document"] == {"text": SENTENCES[1:][best]}
        assert ("meta" in body) == (path != "/rerank")
    bare = httpx.post(embedder + "/rerank", json={"query": "q", "documents": [{"text": "a"}, "b"],
                                                  "return_documents": False}).json()
    assert sorted(r["index"] for r in bare["results"]) == [0, 1] and "document" not in bare["results"][0]


@pytest.mark.parametrize("route, body, status, words", [
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/embeddings", {"input": ["a", 1]}, 400, "input"),
    ("/v1/embeddings", {"input": " ".join(["word"] * 400)}, 400, "maximum context length is 256"),
    ("/v1/embeddings", {"input": ["x"] * 300}, 400, "--max-prompts"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "matryoshka"),
    ("/v1/embeddings", {"input": "x", "colour": "red"}, 400, "colour"),
    ("/v1/embeddings", {"input": "x", "model": "other"}, 404, "does not exist"),
    ("/v1/embeddings", {"input": [[10 ** 9]]}, 400, "outside the vocabulary"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "N texts with N"),
    ("/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/classify", {"input": "x"}, 400, "does not serve the pooling task 'classify'"),
    ("/v1/completions", {"prompt": "x"}, 400, "pooling model"),
])
def test_bad_input_gets_400_with_what_to_do(embedder, route, body, status, words):
    r = httpx.post(embedder + route, json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"] + str(r.json()["error"]["param"])


def test_truncate_prompt_tokens(embedder):
    long = " ".join(["word"] * 400)
    r = httpx.post(embedder + "/v1/embeddings", json={"input": long, "truncate_prompt_tokens": 16})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16


@pytest.mark.slow
def test_cross_encoder_server_reranks_as_offline(pooling_model_dir, tiny_model_dir):
    path = pooling_model_dir("bert-cross-encoder")
    llm = LLM(path)
    try:
        expected = [s.outputs.score for s in llm.score(QUERY, SENTENCES, use_tqdm=False)]
        probs = llm.classify(SENTENCES[0], use_tqdm=False)[0].outputs.probs
    finally:
        llm.shutdown()
    with server_in_this_process(path) as (_, url):
        body = httpx.post(url + "/v2/rerank", json={"query": QUERY, "documents": SENTENCES}).json()
        assert [r["index"] for r in body["results"]] == list(np.argsort(expected)[::-1])
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx(sorted(expected, reverse=True),
                                                                                abs=1e-6)
        score = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": SENTENCES}).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-6)
        cls = httpx.post(url + "/classify", json={"input": [SENTENCES[0]]}).json()["data"][0]
        assert cls["probs"] == pytest.approx(probs, abs=1e-6) and cls["label"] == "LABEL_0"
    # a generative server names the flags that make a pooling one
    with server_in_this_process(tiny_model_dir("llama-gqa")) as (_, url):
        r = httpx.post(url + "/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
