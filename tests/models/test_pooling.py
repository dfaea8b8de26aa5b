"""Pooling models against their references: the real all-MiniLM-L6-v2 against
sentence-transformers; tiny random cross-encoders (BERT, XLM-RoBERTa), a decoder reranker and a
decoder embedder against transformers; tensor and data parallel against one rank; bad input
refused with what to do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardlm import LLM, PoolingParams

SENTENCES = ["The cat sits on the mat.", "A man is playing a guitar in the park.",
             "Paris is the capital of France.", "hello", "Embeddings map text to vectors that can be compared."]
QUERY = "Where does the cat sit?"


def _cosines(a, b) -> list[float]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return list((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def minilm_reference(minilm_dir):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_dir, device="cpu").encode(SENTENCES, convert_to_numpy=True)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    llm = LLM(minilm_dir)
    yield llm
    llm.shutdown()


def test_minilm_embeddings_match_sentence_transformers(minilm, minilm_reference):
    outs = minilm.embed(SENTENCES, use_tqdm=False)
    assert [len(o.outputs.embedding) for o in outs] == [384] * len(SENTENCES)
    assert min(_cosines([o.outputs.embedding for o in outs], minilm_reference)) >= 0.9999
    # normalized as its Normalize module says; normalize=False gives the raw mean
    assert np.allclose(np.linalg.norm([o.outputs.embedding for o in outs], axis=-1), 1.0, atol=1e-5)
    raw = minilm.embed(SENTENCES[:1], pooling_params=PoolingParams(normalize=False), use_tqdm=False)[0]
    assert np.linalg.norm(raw.outputs.embedding) > 1.5
    assert min(_cosines([raw.outputs.embedding], minilm_reference[:1])) >= 0.9999


def test_minilm_token_embeddings_and_score(minilm, minilm_dir, minilm_reference):
    from transformers import AutoModel, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    ids = tok(SENTENCES[1], return_tensors="pt")
    with torch.no_grad():
        ref = AutoModel.from_pretrained(minilm_dir)(**ids).last_hidden_state[0]
    out = minilm.encode(SENTENCES[1], pooling_task="token_embed", pooling_params=PoolingParams(normalize=False),
                        use_tqdm=False)[0]
    assert out.outputs.data.shape == ref.shape
    torch.testing.assert_close(out.outputs.data, ref, atol=1e-4, rtol=1e-4)
    # an embedder scores a pair by the cosine of the two embeddings
    scores = minilm.score(SENTENCES[0], SENTENCES[1:3], use_tqdm=False)
    expected = _cosines([minilm_reference[0]] * 2, minilm_reference[1:3])
    assert [s.outputs.score for s in scores] == pytest.approx(expected, abs=1e-4)


def test_minilm_refuses_bad_input_with_what_to_do(minilm):
    with pytest.raises(ValueError, match="matryoshka"):
        minilm.embed("x", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    long = " ".join(["word"] * 400)
    with pytest.raises(ValueError, match="maximum context length is 256 tokens.*truncate_prompt_tokens"):
        minilm.embed(long, use_tqdm=False)
    cut = minilm.embed(long, truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 256
    assert len(minilm.embed(long, truncate_prompt_tokens=10, use_tqdm=False)[0].prompt_token_ids) == 10
    with pytest.raises(ValueError, match="does not serve the pooling task 'classify'"):
        minilm.classify("x", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling model.*does not generate"):
        minilm.generate("x", use_tqdm=False)
    with pytest.raises(ValueError, match="one text with N, or N texts with N"):
        minilm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


def _hf_logits(path, cls, texts, pairs_with=None, **kwargs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = cls.from_pretrained(path).eval()
    out = []
    for text in texts:
        enc = tok(pairs_with, text, return_tensors="pt") if pairs_with is not None else tok(text, return_tensors="pt")
        enc = {k: v for k, v in enc.items() if k in kwargs.get("inputs", enc.keys())}
        with torch.no_grad():
            out.append(model(**enc).logits[0])
    return torch.stack(out)


def _offline_scores(path: str, **engine) -> list[float]:
    """Scores of QUERY against SENTENCES by an engine started for them."""
    llm = LLM(path, **engine)
    try:
        return [s.outputs.score for s in llm.score(QUERY, SENTENCES, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_bert_cross_encoder_scores_match_transformers(pooling_model_dir):
    bert_cross_encoder = pooling_model_dir("bert-cross-encoder")
    bert_classifier = pooling_model_dir("bert-classifier")
    from transformers import BertForSequenceClassification
    ref = torch.sigmoid(_hf_logits(bert_cross_encoder, BertForSequenceClassification, SENTENCES, QUERY))[:, 0]
    got = _offline_scores(bert_cross_encoder)
    assert got == pytest.approx(ref.tolist(), abs=1e-4)
    assert len(set(np.round(got, 3))) > 1          # the documents' segments matter: not one score for all
    ref = torch.softmax(_hf_logits(bert_classifier, BertForSequenceClassification, SENTENCES), dim=-1)
    llm = LLM(bert_classifier)
    try:
        probs = [o.outputs.probs for o in llm.classify(SENTENCES, use_tqdm=False)]
        raw = llm.classify(SENTENCES[0], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    torch.testing.assert_close(torch.tensor(probs), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(raw.outputs.probs).softmax(-1), ref[0], atol=1e-4, rtol=0)


def test_xlm_roberta_reranker_matches_transformers(pooling_model_dir):
    xlmr_reranker = pooling_model_dir("xlmr-reranker")
    from transformers import XLMRobertaForSequenceClassification
    ref = torch.sigmoid(_hf_logits(xlmr_reranker, XLMRobertaForSequenceClassification, SENTENCES, QUERY,
                                   inputs=("input_ids", "attention_mask")))[:, 0]
    got = _offline_scores(xlmr_reranker)
    assert got == pytest.approx(ref.tolist(), abs=1e-4)


def test_decoder_reranker_and_embedder_match_transformers(tiny_model_dir, pooling_model_dir):
    decoder_reranker = pooling_model_dir("qwen3-reranker")
    from transformers import AutoModel, AutoTokenizer, Qwen3ForSequenceClassification
    ref = torch.sigmoid(_hf_logits(decoder_reranker, Qwen3ForSequenceClassification, SENTENCES, QUERY))[:, 0]
    got = _offline_scores(decoder_reranker)
    assert got == pytest.approx(ref.tolist(), abs=1e-4)
    # a generative checkpoint as an embedder: its last token's final hidden state, normalized
    path = tiny_model_dir("qwen3")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        ref = torch.stack([torch.nn.functional.normalize(
            model(**tok(s, return_tensors="pt")).last_hidden_state[0, -1], dim=-1) for s in SENTENCES])
    llm = LLM(path, runner="pooling")
    try:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
        mean = llm.encode(SENTENCES[:1], pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    finally:
        llm.shutdown()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    assert mean.shape == (len(tok(SENTENCES[0]).input_ids), 64)


def test_causal_lm_as_a_reranker_from_its_yes_and_no_logits(tiny_model_dir):
    """Qwen3-Reranker's recipe (vLLM's --hf-overrides): a causal LM whose score is the softmax
    probability of "yes" against "no" as the next token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tiny_model_dir("qwen3")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    with torch.no_grad():
        logits = torch.stack([model(**tok(QUERY, d, return_tensors="pt")).logits[0, -1] for d in SENTENCES])
    ref = torch.softmax(logits[:, [no, yes]], dim=-1)[:, 1]
    got = _offline_scores(path, hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
                                              "classifier_from_token": ["no", "yes"],
                                              "is_original_qwen3_reranker": True})
    assert got == pytest.approx(ref.tolist(), abs=1e-4)


def test_matryoshka_dimensions_and_step_pooling(tiny_model_dir, minilm, minilm_dir, tmp_path):
    import json
    import shutil
    path = shutil.copytree(tiny_model_dir("qwen3"), tmp_path / "matryoshka")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    llm = LLM(str(path), runner="pooling")
    try:
        full = llm.embed(SENTENCES[:1], pooling_params=PoolingParams(normalize=False), use_tqdm=False)[0]
        cut = llm.embed(SENTENCES[:1], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0]
        with pytest.raises(ValueError, match="more than the model's 64"):
            llm.embed("x", pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
    finally:
        llm.shutdown()
    first = torch.tensor(full.outputs.embedding[:16])      # the first 16 dims, then normalized
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), first / first.norm(), atol=1e-5, rtol=0)
    # STEP: the token vectors at the step tag's positions ("." here), as ALL gives them
    tok = minilm.get_tokenizer()
    tag = tok.convert_tokens_to_ids(".")
    text = "One step. Two steps. Three."
    every = minilm.encode(text, pooling_task="token_embed", use_tqdm=False)[0]
    llm = LLM(minilm_dir, pooler_config={"pooling_type": "STEP", "step_tag_id": tag})
    try:
        steps = llm.encode(text, use_tqdm=False)[0].outputs.data
    finally:
        llm.shutdown()
    at_tag = torch.tensor(every.prompt_token_ids) == tag
    assert steps.shape == (3, 384)
    torch.testing.assert_close(steps, every.outputs.data[at_tag], atol=1e-5, rtol=0)


def test_runner_and_pooler_flags_are_checked(minilm_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="is a pooling model.*--runner pooling"):
        LLM(minilm_dir, runner="generate")
    with pytest.raises(ValueError, match="unknown key.*pooling_kind"):
        LLM(minilm_dir, pooler_config={"pooling_kind": "MEAN"})
    with pytest.raises(ValueError, match="--pooler-config applies to pooling models"):
        LLM(tiny_model_dir("llama-gqa"), pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="CLS pooling reads the first token"):
        LLM(tiny_model_dir("llama-gqa"), runner="pooling", pooler_config={"pooling_type": "CLS"})
    llm = LLM(tiny_model_dir("llama-gqa"))
    try:
        with pytest.raises(ValueError, match="generative model.*--runner pooling"):
            llm.embed("x", use_tqdm=False)
    finally:
        llm.shutdown()


def _decoder_pooling(path: str, reranker: str, **layout):
    """A Qwen3 embedder's embeddings and one prompt's per-token states, and a reranker's scores."""
    llm = LLM(path, runner="pooling", **layout)
    try:
        embedded = (torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)]),
                    llm.encode(SENTENCES[:1], pooling_task="token_embed", use_tqdm=False)[0].outputs.data)
    finally:
        llm.shutdown()
    return embedded, _offline_scores(reranker, **layout)


@pytest.fixture(scope="module")
def decoder_pooling_one_rank(tiny_model_dir, pooling_model_dir):
    return _decoder_pooling(tiny_model_dir("qwen3"), pooling_model_dir("qwen3-reranker"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                    {"prefill_context_parallel_size": 2},
                                    {"tensor_parallel_size": 4, "decode_context_parallel_size": 2}],
                         ids=["tp2", "pp2", "pcp2", "tp4-dcp2"])
def test_decoder_embedder_and_reranker_split_equal_one_rank(tiny_model_dir, pooling_model_dir, layout,
                                                            decoder_pooling_one_rank):
    """A decoder's embeddings (and its per-token states) and a decoder reranker's scores, split by
    tensor, pipeline or context parallel (each prompt's positions over two groups, or its KV over
    two ranks), equal one rank's."""
    (embeddings, states), scores = _decoder_pooling(tiny_model_dir("qwen3"), pooling_model_dir("qwen3-reranker"),
                                                    **layout)
    (want_embeddings, want_states), want_scores = decoder_pooling_one_rank
    torch.testing.assert_close(embeddings, want_embeddings, atol=1e-5, rtol=0)
    torch.testing.assert_close(states, want_states, atol=1e-5, rtol=0)
    assert scores == pytest.approx(want_scores, abs=1e-5)


@pytest.mark.slow
def test_a_mixture_of_experts_embedder_with_expert_parallel_equals_one_rank(tiny_model_dir):
    """Qwen3-MoE as an embedder (--convert embed): its experts placed whole over tp2's ranks, and
    over dp2's replicas in lock-step, give one rank's embeddings."""
    path, got = tiny_model_dir("qwen3-moe"), {}
    for name, layout in (("one rank", {}), ("tp2", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
                         ("dp2", dict(data_parallel_size=2, enable_expert_parallel=True))):
        llm = LLM(path, runner="pooling", convert="embed", **layout)
        try:
            got[name] = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
            if name != "one rank":
                load = llm.stats()
                load = load["engines"][0] if "engines" in load else load
                assert load["expert_load"], "the experts ran"
        finally:
            llm.shutdown()
    for name in ("tp2", "dp2"):
        torch.testing.assert_close(got[name], got["one rank"], atol=1e-5, rtol=0)


def test_an_encoder_refuses_pipeline_and_context_parallel_naming_what_to_use(minilm_dir):
    from shardlm.engine.feature_rules import UnsupportedCombination
    with pytest.raises(UnsupportedCombination, match="encoder pooling model.*-pp.*-tp or -dp"):
        LLM(minilm_dir, pipeline_parallel_size=2)
    with pytest.raises(UnsupportedCombination, match="encoder pooling model.*-pcp.*no KV cache.*-tp or -dp"):
        LLM(minilm_dir, prefill_context_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}])
def test_parallel_layouts_equal_one_rank(minilm_dir, minilm_reference, layout, pooling_model_dir):
    bert_cross_encoder = pooling_model_dir("bert-cross-encoder")
    llm = LLM(minilm_dir, **layout)
    try:
        outs = llm.embed(SENTENCES, use_tqdm=False)
    finally:
        llm.shutdown()
    assert min(_cosines([o.outputs.embedding for o in outs], minilm_reference)) >= 0.9999
    expected = _offline_scores(bert_cross_encoder)
    got = _offline_scores(bert_cross_encoder, **layout)
    assert got == pytest.approx(expected, abs=1e-5)
