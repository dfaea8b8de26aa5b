"""vLLM's frontend flags (frontend_options.py): the answer's role, logprob tokens as ids, cached
prompt tokens in the usage, usage in every stream, the chat template's defaults, the content
format and tools left out with tool_choice "none"; GET /load; and processed logprobs in JSON."""

import json
import math
import threading

import httpx
import pytest

from shardlm.entrypoints.openai.frontend_options import FrontendOptions, loops_over_content
from tests.helpers import server_in_this_process

# shows what the template was given: content as a string (S:) or as parts (P:), tools, a variable
TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}S:{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}P:{{ p['text'] }}{% endfor %}{% endif %};{% endfor %}"
            "{% if tools %}TOOLS:{{ tools | length }};{% endif %}{{ greeting }}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "t.jinja"
    template.write_text(TEMPLATE)
    with server_in_this_process(
            tiny_model_dir("llama-gqa"), "--chat-template", str(template), "--enable-prefix-caching",
            "--response-role", "bot", "--return-tokens-as-token-ids", "--enable-prompt-tokens-details",
            "--enable-force-include-usage", "--default-chat-template-kwargs", '{"greeting": "G1"}',
            "--chat-template-content-format", "openai", "--exclude-tools-when-tool-choice-none",
            "--logprobs-mode", "processed_logprobs", "--enable-tokenizer-info-endpoint") as (_, url):
        yield url


def rendered(url, **body) -> str:
    ids = httpx.post(url + "/tokenize", json={"messages": HI, **body}).json()["tokens"]
    return httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def chat(url, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_template_gets_parts_and_the_default_variables_under_the_requests(server):
    assert rendered(server) == "P:hello there;G1"
    assert rendered(server, chat_template_kwargs={"greeting": "G2"}) == "P:hello there;G2"
    assert rendered(server, tools=[TOOL]) == "P:hello there;TOOLS:1;G1"


def test_tools_are_left_out_with_tool_choice_none(server):
    plain = chat(server)["usage"]["prompt_tokens"]
    assert chat(server, tools=[TOOL], tool_choice="none")["usage"]["prompt_tokens"] == plain


def test_the_answer_takes_the_response_role_unless_it_continues_the_last_message(server):
    assert chat(server)["choices"][0]["message"]["role"] == "bot"
    going_on = chat(server, messages=[*HI, {"role": "assistant", "content": "Well"}], add_generation_prompt=False)
    assert going_on["choices"][0]["message"]["role"] == "assistant"
    with httpx.stream("POST", server + "/v1/chat/completions",
                      json={"messages": HI, "max_tokens": 2, "stream": True}) as r:
        first = json.loads(next(r.iter_lines()).removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "bot"


def test_logprob_tokens_are_ids_unless_the_request_says_otherwise(server):
    content = chat(server, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    for entry in content:
        assert entry["token"].startswith("token_id:")
        text = httpx.post(server + "/detokenize", json={"tokens": [int(entry["token"].split(":")[1])]}).json()
        assert bytes(entry["bytes"]) == text["prompt"].encode()
        assert [t["token"][:9] for t in entry["top_logprobs"]] == ["token_id:"] * 2
    as_text = chat(server, logprobs=True, return_tokens_as_token_ids=False)["choices"][0]["logprobs"]["content"]
    assert [bytes(e["bytes"]).decode() for e in as_text] == [e["token"] for e in as_text]
    completion = httpx.post(server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "logprobs": 1}).json()
    assert all(t.startswith("token_id:") for t in completion["choices"][0]["logprobs"]["tokens"])


def test_processed_logprobs_of_tokens_ruled_out_are_minus_9999_in_json(server):
    """--logprobs-mode processed_logprobs: top_k 2 leaves two tokens; the other three listed are
    -inf, which JSON cannot carry: -9999.0, as vLLM's."""
    content = chat(server, temperature=1.0, top_k=2, seed=3, logprobs=True, top_logprobs=5,
                   return_tokens_as_token_ids=False)["choices"][0]["logprobs"]["content"]
    for entry in content:
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values[2:] == [-9999.0] * 3 and sum(math.exp(v) for v in values[:2]) == pytest.approx(1, abs=1e-4)


def test_the_usage_counts_cached_prompt_tokens_and_every_stream_has_one(server):
    long = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 6}]
    first, second = chat(server, messages=long)["usage"], chat(server, messages=long)["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert 16 <= second["prompt_tokens_details"]["cached_tokens"] < second["prompt_tokens"]
    salted = [chat(server, messages=long, cache_salt="tenant-a")["usage"]["prompt_tokens_details"]["cached_tokens"]
              for _ in range(2)]
    assert salted[0] == 0 and salted[1] >= 16, "a salt shares only with itself"
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 2 and "prompt_tokens_details" in usage


def test_load_counts_the_requests_being_answered(server):
    assert httpx.get(server + "/load").json() == {"server_load": 0}
    started, seen = threading.Event(), []

    def stream():
        with httpx.stream("POST", server + "/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_lines():
                if not started.is_set():
                    seen.append(httpx.get(server + "/load").json()["server_load"])
                    started.set()
    t = threading.Thread(target=stream)
    t.start()
    t.join(120)
    assert seen == [1]
    assert httpx.get(server + "/load").json() == {"server_load": 0}


@pytest.mark.parametrize("template, loops", [
    (TEMPLATE, True),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", False),
    ("{% for m in messages %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if x %}", False),     # jinja cannot parse it
])
def test_auto_reads_whether_the_template_loops_over_the_content(template, loops):
    assert loops_over_content(template) is loops
    assert FrontendOptions().content_format_for(template) == ("openai" if loops else "string")
    assert FrontendOptions(chat_template_content_format="string").content_format_for(template) == "string"


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="--chat-template-content-format 'json'"):
        FrontendOptions(chat_template_content_format="json")
    with pytest.raises(ValueError, match="--default-chat-template-kwargs is not JSON"):
        FrontendOptions(default_chat_template_kwargs="{enable_thinking: false}")
    with pytest.raises(ValueError, match="--response-role is empty"):
        FrontendOptions(response_role=" ")


def events(url, path, body) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1] if json.loads(line)["choices"]]


def test_return_token_ids_gives_the_prompts_and_the_answers_ids(server):
    """vLLM's return_token_ids: whole, the prompt's and the answer's ids; streamed, the prompt's in
    the first chunk and each chunk's new ids, which add up to the whole answer's."""
    body = {"prompt": "The capital of", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(server + "/v1/completions", json=body).json()["choices"][0]
    assert whole["prompt_token_ids"] == httpx.post(server + "/tokenize", json={"prompt": "The capital of"}).json()[
        "tokens"]
    assert httpx.post(server + "/detokenize", json={"tokens": whole["token_ids"]}).json()["prompt"] == whole["text"]
    chunks = [e["choices"][0] for e in events(server, "/v1/completions", body)]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert sum((c["token_ids"] for c in chunks), []) == whole["token_ids"]

    answer = chat(server, return_token_ids=True, max_tokens=6)
    assert answer["prompt_token_ids"] == httpx.post(server + "/tokenize", json={"messages": HI}).json()["tokens"]
    ids = answer["choices"][0]["token_ids"]
    assert httpx.post(server + "/detokenize", json={"tokens": ids}).json()["prompt"] == \
        answer["choices"][0]["message"]["content"]
    streamed = events(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 6, "temperature": 0,
                                                        "return_token_ids": True})
    assert streamed[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert sum((e["choices"][0].get("token_ids", []) for e in streamed), []) == ids
    assert "token_ids" not in chat(server)["choices"][0], "only when asked"


def test_a_server_without_a_tokenizer_answers_token_ids_and_refuses_text(tiny_model_dir):
    """--skip-tokenizer-init: token-id prompts are answered (return_token_ids gives the tokens;
    logprobs name them token_id:N); chat, text prompts and /tokenize get a 400 that says why."""
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--skip-tokenizer-init") as (_, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                                                      "logprobs": 1, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 3
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        for path, body in (("/v1/completions", {"prompt": "Hello"}), ("/v1/chat/completions", {"messages": HI}),
                           ("/tokenize", {"prompt": "Hello"})):
            refused = httpx.post(url + path, json=body)
            assert refused.status_code == 400 and "--skip-tokenizer-init" in refused.json()["error"]["message"], path


def test_vllms_request_extras(server):
    """prompt_logprobs (not streamed), truncate_prompt_tokens, request_id, and a chat answer that
    goes on in the last message (continue_final_message) with that message echoed before it."""
    prompt = "The capital of France is"
    ids = httpx.post(server + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "request_id": "mine-1"}
    answer = httpx.post(server + "/v1/completions", json=body).json()
    assert answer["id"] == "cmpl-mine-1"
    positions = answer["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(ids)
    for position, token in zip(positions[1:], ids[1:]):
        assert str(token) in position and 2 <= len(position) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in position.values())
    streamed = httpx.post(server + "/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    first = answer["choices"][0]["text"].split()[0]
    banned = httpx.post(server + "/v1/completions", json={**body, "prompt_logprobs": None, "bad_words": [first]})
    assert banned.status_code == 200 and not banned.json()["choices"][0]["text"].split()[0] == first
    cut = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 3})
    assert cut.json()["usage"]["prompt_tokens"] == 3
    assert httpx.post(server + "/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 0}).status_code \
        == 400

    going_on = [*HI, {"role": "assistant", "content": "Well"}]
    new_turn = chat(server, messages=going_on, add_generation_prompt=False)
    continued = chat(server, messages=going_on, add_generation_prompt=False, continue_final_message=True, echo=True,
                     prompt_logprobs=1, request_id="mine-2")
    assert continued["id"] == "chatcmpl-mine-2" and len(continued["prompt_logprobs"]) == \
        continued["usage"]["prompt_tokens"]
    message = continued["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("Well")
    # the rendered prompt stops right after "Well": the template's ";G1" after the message is cut
    assert continued["usage"]["prompt_tokens"] < new_turn["usage"]["prompt_tokens"]
    both = httpx.post(server + "/v1/chat/completions", json={"messages": going_on, "continue_final_message": True})
    assert both.status_code == 400 and "set add_generation_prompt to false" in both.json()["error"]["message"]


def test_sagemakers_ping_and_invocations(server):
    """GET/POST /ping is /health; /invocations answers what its body is (vLLM's SageMaker routes)."""
    assert httpx.get(server + "/ping").json() == {"status": "ok"} and httpx.post(server + "/ping").status_code == 200
    chat_answer = httpx.post(server + "/invocations", json={"messages": HI, "max_tokens": 2}).json()
    assert chat_answer["object"] == "chat.completion" and chat_answer["choices"][0]["message"]["role"] == "bot"
    completion = httpx.post(server + "/invocations", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert completion["object"] == "text_completion"
    streamed = httpx.post(server + "/invocations", json={"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream") and "[DONE]" in streamed.text
    for body, why in (({"input": "Hi"}, "generative model"), ({"hello": 1}, "/invocations takes a chat request"),
                      ({"messages": 5}, "Invalid request: messages")):
        refused = httpx.post(server + "/invocations", json=body)
        assert refused.status_code == 400 and why in refused.json()["error"]["message"], refused.text


def test_tokenizer_info(server):
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["tokenizer_class"].endswith("Tokenizer") or "Tokenizer" in info["tokenizer_class"]
    assert info["chat_template"] == TEMPLATE and "vocab_file" not in info
    json.dumps(info)            # all of it JSON
