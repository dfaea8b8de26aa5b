"""Beam search (LLM.beam_search and the server's use_beam_search, as vLLM's): the search above
the engine finds transformers' beams, and the server answers n beams."""

import httpx
import pytest
import torch

from shardlm import LLM
from shardlm.beam_search import BeamSearchParams
from tests.helpers import server_in_this_process

PROMPTS = [[5, 6, 7, 8], list(range(100, 120))]


def test_the_beams_are_transformers_beams(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    path = tiny_model_dir("llama-gqa")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                              BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, output in zip(PROMPTS, outputs):
        with torch.inference_mode():
            beams = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, max_new_tokens=8,
                                do_sample=False, early_stopping=False, eos_token_id=None, pad_token_id=0)
        assert [b.tokens[len(prompt):] for b in output.sequences] == [b[len(prompt):].tolist() for b in beams]
        scores = [b.cum_logprob for b in output.sequences]
        assert scores == sorted(scores, reverse=True) and all(b.finish_reason == "length" for b in output.sequences)
        assert all(b.text for b in output.sequences)
    with pytest.raises(ValueError, match="beam_width=0"):
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_the_server_answers_n_beams(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa")) as (_, url):
        body = {"prompt": "Hello", "max_tokens": 6, "n": 3, "use_beam_search": True, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body).json()
        texts = [c["text"] for c in answer["choices"]]
        assert len(texts) == len(set(texts)) == 3 and answer["usage"]["completion_tokens"] == 18
        chat = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "use_beam_search": True}).json()
        assert [c["message"]["role"] for c in chat["choices"]] == ["assistant", "assistant"]
        wide = httpx.post(url + "/v1/completions", json={**body, "n": 11})
        assert wide.status_code == 400 and "give n <= 10" in wide.json()["error"]["message"]
        streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
