"""Pooling models on one GPU: all-MiniLM-L6-v2 (an encoder, no KV cache) against
sentence-transformers on CPU, and a decoder embedder (paged KV cache, CUDA attention, its
memory profile) against transformers."""

import numpy as np
import torch

from shardlm import LLM

SENTENCES = ["The cat sits on the mat.", "A man is playing a guitar.", "Paris is the capital of France."]


def test_encoder_embeddings_on_cuda_match_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer
    ref = SentenceTransformer(minilm_dir, device="cpu").encode(SENTENCES)
    llm = LLM(minilm_dir, device="cuda", dtype="float32")
    try:
        got = np.array([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
    finally:
        llm.shutdown()
    assert ((got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)).min() >= 0.9999


def test_decoder_embedder_on_cuda_matches_transformers(tiny_model_dir):
    from transformers import AutoModel, AutoTokenizer
    path = tiny_model_dir("qwen3")
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        ref = torch.stack([torch.nn.functional.normalize(model(**tok(s, return_tensors="pt")).last_hidden_state[0, -1],
                                                         dim=-1) for s in SENTENCES])
    llm = LLM(path, runner="pooling", device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    try:
        got = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES, use_tqdm=False)])
    finally:
        llm.shutdown()
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
