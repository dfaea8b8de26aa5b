"""--logits-processors in the OpenAI server: a request opts in with vLLM's vllm_xargs (the official
client's extra_body), on completions and chat; parameters the processor refuses are a 400."""

import openai
import pytest

from tests.helpers import server_in_this_process


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--logits-processors",
                                "tests.custom_logits_processors:TargetTokenProcessor",
                                "tests.custom_logits_processors:CountingAdapter") as (_, url):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _ids(client, xargs, **kw):
    out = client.completions.create(model="tiny", prompt="Go:", max_tokens=5, temperature=1.0, seed=1,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                **({"vllm_xargs": xargs} if xargs else {})}, **kw)
    return out.choices[0].token_ids


@pytest.mark.slow
def test_vllm_xargs_reach_the_processors(client):
    assert _ids(client, {"target_token": 42}) == [42] * 5
    assert _ids(client, {"count": True}) == [100, 101, 102, 103, 104]
    plain = _ids(client, None)
    assert plain != [42] * 5 and plain == _ids(client, None)      # others sample as before (seeded)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          extra_body={"vllm_xargs": {"target_token": 42}, "ignore_eos": True,
                                                      "return_token_ids": True})
    assert chat.choices[0].token_ids == [42] * 4


@pytest.mark.slow
def test_parameters_a_processor_refuses_are_a_400(client):
    with pytest.raises(openai.BadRequestError, match="target_token=-3"):
        _ids(client, {"target_token": -3})
    with pytest.raises(openai.BadRequestError, match="vllm_xargs"):
        _ids(client, {"target_token": {"nested": 1}})
