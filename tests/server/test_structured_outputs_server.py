"""Structured outputs through the OpenAI server with the official client: response_format
(json_object, json_schema), vLLM's structured_outputs field and the older guided_* fields, on
completions and chat, streamed and not; the random-weight model's outputs always satisfy them."""

import json
import re

import openai
import pytest

from shardlm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from shardlm.entrypoints.openai.serving import structured_outputs_params
from tests.helpers import server_in_this_process
from tests.models.test_structured_outputs import SCHEMA, valid_json


def test_each_request_field_becomes_one_constraint_and_two_are_refused():
    """The server's reading of a request, without a server: response_format, structured_outputs
    (with options for another field's constraint) and guided_* each give one constraint."""
    def params(**kw):
        return structured_outputs_params(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **kw))
    assert params() is None
    assert params(response_format={"type": "json_object"}).json_object is True
    got = params(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
                 structured_outputs={"disable_any_whitespace": True})
    assert got.json == SCHEMA and got.disable_any_whitespace
    assert params(guided_choice=["yes", "no"]).choice == ["yes", "no"]
    assert params(structured_outputs={"regex": "[0-9]+"}).regex == "[0-9]+"
    with pytest.raises(OpenAIError, match="one structured-output constraint"):
        params(guided_regex="a+", response_format={"type": "json_object"})
    with pytest.raises(OpenAIError, match="not available"):
        params(guided_regex="a+", guided_decoding_backend="xgrammar")


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa")) as (_, url):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": "tiny", "messages": [{"role": "user", "content": "Data please."}],
                                             "max_tokens": 80, "temperature": 1.0, "seed": 3, **kw})


@pytest.mark.slow
def test_response_format_json_schema_on_chat_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    compact = {"structured_outputs": {"disable_any_whitespace": True}}   # a random model would pad with spaces
    whole = chat(client, response_format=fmt, n=2, extra_body=compact)
    assert all(valid_json(c.message.content) and c.finish_reason == "stop" for c in whole.choices), whole.choices
    pieces = [c.choices[0].delta.content or "" for c in chat(client, response_format=fmt, stream=True,
                                                              extra_body=compact) if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == whole.choices[0].message.content


@pytest.mark.slow
def test_structured_outputs_and_guided_fields_on_completions(client):
    cases = [({"structured_outputs": {"regex": "[0-9]{4}-[a-z]{3}"}}, lambda t: re.fullmatch("[0-9]{4}-[a-z]{3}", t)),
             ({"guided_regex": "[0-9]{4}-[a-z]{3}"}, lambda t: re.fullmatch("[0-9]{4}-[a-z]{3}", t)),
             ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
             ({"guided_json": SCHEMA, "guided_whitespace_pattern": ""}, valid_json),
             # bounded, so that a random model cannot write digits until max_tokens
             ({"guided_grammar": 'root ::= "x" d d? d? "y"\nd ::= [0-9]'}, lambda t: re.fullmatch("x[0-9]{1,3}y", t)),
             ({"structured_outputs": {"choice": ["up", "down"], "backend": "auto"}}, lambda t: t in ("up", "down"))]
    for body, ok in cases:
        out = client.completions.create(model="tiny", prompt="Go:", max_tokens=60, temperature=1.0, extra_body=body)
        assert ok(out.choices[0].text), (body, out.choices[0].text)


@pytest.mark.slow
def test_json_object_parses_or_is_cut_by_max_tokens(client):
    out = chat(client, response_format={"type": "json_object"}, max_tokens=200)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_a_bad_schema_is_a_400_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError, match="structured_outputs.json is invalid"):
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "zzz"}}})
    assert chat(client, extra_body={"guided_choice": ["a", "b"]}).choices[0].message.content in ("a", "b")
