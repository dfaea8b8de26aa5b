"""Prompts as embeddings (--enable-prompt-embeds, as vLLM's): transformers' generate from the same
inputs_embeds gives the same tokens, on TP=2 and PP=2 too; the server's /v1/completions takes them
as base64 of torch.save; the prefix cache reuses equal embeddings only; bad ones are refused."""

import base64
import io

import openai
import pytest
import torch

from shardlm import LLM, SamplingParams
from tests.helpers import server_in_this_process

IDS = [[5, 60, 700, 8000, 31, 12, 99], [40, 41, 42]]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def embeddings_of(path: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each prompt's token embeddings (the model's own table) and transformers' greedy tokens from them."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.inference_mode():
        embeds = [hf.get_input_embeddings()(torch.tensor(ids)).clone() for ids in IDS]
        tokens = [hf.generate(inputs_embeds=e[None], max_new_tokens=8, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0].tolist() for e in embeds]
    return embeds, tokens


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def reference(llama):
    return embeddings_of(llama)


@pytest.fixture(scope="module")
def llm(llama):
    engine = LLM(llama, dtype="float32", enable_prompt_embeds=True, enable_prefix_caching=True)
    yield engine
    engine.shutdown()


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_embeddings_give_transformers_tokens_and_the_tokens_own(llm, reference):
    embeds, expected = reference
    assert tokens(llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY)) == expected
    assert tokens(llm.generate([{"prompt_token_ids": i} for i in IDS], GREEDY)) == expected
    # a batch dim of one is taken too, and a prompt beside token prompts
    mixed = llm.generate([{"prompt_embeds": embeds[0][None]}, {"prompt_token_ids": IDS[1]}], GREEDY)
    assert tokens(mixed) == expected


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                    {"max_num_batched_tokens": 8, "max_num_seqs": 8}],
                         ids=["tp2", "pp2", "8-token-steps"])
def test_embeddings_on_parallel_layouts(llama, reference, layout):
    embeds, expected = reference
    engine = LLM(llama, dtype="float32", enable_prompt_embeds=True, **layout)
    try:
        assert tokens(engine.generate([{"prompt_embeds": e} for e in embeds], GREEDY)) == expected
        long = torch.cat([embeds[0]] * 3)       # 21 rows: over three steps of 8
        assert tokens(engine.generate([{"prompt_embeds": long}], GREEDY)) == tokens(
            engine.generate([{"prompt_token_ids": IDS[0] * 3}], GREEDY))
    finally:
        engine.shutdown()


def test_the_prefix_cache_reuses_equal_embeddings_only(llm):
    torch.manual_seed(0)
    long = torch.randn(40, 64) * 0.5
    first = llm.generate([{"prompt_embeds": long}], GREEDY)[0]
    again = llm.generate([{"prompt_embeds": long.clone()}], GREEDY)[0]
    other = llm.generate([{"prompt_embeds": long + 0.01}], GREEDY)[0]
    assert again.num_cached_tokens == 32 and other.num_cached_tokens == 0
    assert tokens([again]) == tokens([first])


def test_bad_embeddings_are_refused_with_what_to_do(llm, llama):
    cases = [({"prompt_embeds": torch.zeros(3, 65)}, "give \\[tokens, 64\\]"),
             ({"prompt_embeds": torch.zeros(0, 64)}, "at least one token"),
             ({"prompt_embeds": torch.full((2, 64), float("nan"))}, "finite"),
             ({"prompt_embeds": [[0.0] * 64]}, "torch tensor"),
             ({"prompt_embeds": torch.zeros(2, 64), "prompt": "x"}, "takes no"),]
    for prompt, says in cases:
        with pytest.raises(ValueError, match=says):
            llm.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([{"prompt_embeds": torch.zeros(2, 64)}], SamplingParams(max_tokens=2, prompt_logprobs=1))
    engine = LLM(llama, dtype="float32")
    try:
        with pytest.raises(ValueError, match="--enable-prompt-embeds"):
            engine.generate([{"prompt_embeds": torch.zeros(2, 64)}])
    finally:
        engine.shutdown()


def test_a_model_that_cannot_take_them_refuses_the_flag(tiny_model_dir):
    with pytest.raises(ValueError, match="does not take embeddings"):
        LLM(tiny_model_dir("gemma2"), enable_prompt_embeds=True)


def encoded(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_the_server_takes_base64_prompt_embeds(llama, reference):
    embeds, expected = reference
    with server_in_this_process(llama, "--dtype", "float32", "--enable-prompt-embeds") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        answer = client.completions.create(model="tiny", prompt="", max_tokens=8, temperature=0,
                                           extra_body={"prompt_embeds": [encoded(e) for e in embeds],
                                                       "return_token_ids": True})
        assert [c.token_ids for c in sorted(answer.choices, key=lambda c: c.index)] == expected
        assert answer.usage.prompt_tokens == sum(len(i) for i in IDS)
        for body, says in (({"prompt_embeds": "!!"}, "not base64"),
                           ({"prompt_embeds": encoded(torch.zeros(2, 3))}, "give [tokens, 64]"),
                           ({"prompt_embeds": encoded(embeds[0]), "echo": True}, "echo"),
                           ({"prompt_embeds": base64.b64encode(b"not a tensor").decode()}, "torch.save")):
            with pytest.raises(openai.BadRequestError, match=None) as err:
                client.completions.create(model="tiny", prompt="", max_tokens=2, extra_body=body)
            assert says in str(err.value)
