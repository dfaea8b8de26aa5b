"""/v1/responses through the official openai client: create, stream, retrieve, a
previous_response_id chain, instructions, a function-call round trip, text.format JSON schema and
background responses, against the offline engine's chat outputs; bad input in the error shape."""

import json
import time

import httpx
import openai
import pytest

from shardlm import LLM, SamplingParams
from tests.helpers import server_in_this_process

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa")) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-gqa"), dtype="float32", max_model_len=256)

    def chat(messages, max_tokens=8):
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        return out.outputs[0].text
    yield chat
    llm.shutdown()


def test_create_retrieve_and_chain_equal_offline_chat(client, offline):
    first = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0)
    assert first.status in ("completed", "incomplete") and first.object == "response"
    assert first.output_text == offline([{"role": "user", "content": "Hello there"}])
    assert first.usage.output_tokens == 8 and first.usage.input_tokens > 0
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                     instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert second.output_text == offline([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hello there"},
                                          {"role": "assistant", "content": first.output_text},
                                          {"role": "user", "content": "And then?"}])


def test_stream_gives_the_typed_events_and_the_same_text(client):
    whole = client.responses.create(model="tiny", input="Count with me", max_output_tokens=10, temperature=0)
    with client.responses.stream(model="tiny", input="Count with me", max_output_tokens=10, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert final.output_text == whole.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text     # streamed ones are kept too


def test_function_call_round_trip(client):
    called = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    answer = client.responses.create(model="tiny", previous_response_id=called.id, max_output_tokens=6, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": json.dumps({"temperature": 21})}])
    assert answer.output and answer.output[-1].type == "message"


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    out = client.responses.create(model="tiny", input="JSON please", temperature=1.0, max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    value = json.loads(out.output_text)
    assert set(value) == {"n", "ok"} and out.status == "completed"


def test_background_response_is_polled(client):
    queued = client.responses.create(model="tiny", input="Slowly", max_output_tokens=8, background=True)
    assert queued.status in ("queued", "in_progress")
    deadline = time.time() + 60
    while (got := client.responses.retrieve(queued.id)).status in ("queued", "in_progress") and time.time() < deadline:
        time.sleep(0.1)
    assert got.status in ("completed", "incomplete") and got.output_text


@pytest.mark.parametrize("body, status, words", [
    ({"input": "x", "colour": "red"}, 400, "colour"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "not found"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "text model"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, 400, "input_file"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "only function tools"),
    ({"input": "x", "stream": True, "background": True}, 400, "background"),
    ({"input": []}, 400, "input"),
])
def test_bad_input_gets_the_error_shape(server, body, status, words):
    r = httpx.post(server + "/v1/responses", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert httpx.get(server + "/v1/responses/resp_nope").status_code == 404
