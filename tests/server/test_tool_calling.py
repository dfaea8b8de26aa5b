"""Tool calling: each --tool-call-parser reads its model family's tool-call text, whole and fed
in pieces as a stream (the deltas reassemble into the whole); through the server with the
official client, tool_choice "required" and a named function give calls whose arguments parse
and match their schema even from a random-weight model, streamed as OpenAI streams them (id and
name first, then the arguments in pieces), and a conversation with earlier calls and tool
answers renders; what cannot work is a 400."""

import json

import openai
import pytest

from shardlm.entrypoints.openai.tool_parsers import get_parser
from shardlm.entrypoints.openai.tools import ToolCallStream
from tests.helpers import server_in_this_process

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]

OUTPUTS = {   # each family's own tool-call text, with the calls it holds
    "hermes": ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
               "I will look.\n"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None),
    "pythonic": ('[get_weather(city="Oslo", days=2), get_time(zone="CET")]', None),
    "deepseek_v3": ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
                    '<｜tool▁sep｜>get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "Let me check."),
    "deepseek_v31": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo", "days": 2}'
                     '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜>'
                     "<｜tool▁calls▁end｜>", None),
    "kimi_k2": ('Checking. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Oslo", "days": 2}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{"zone": "CET"}<|tool_call_end|>'
                "<|tool_calls_section_end|>", "Checking. "),
    "granite": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None),
    "phi4_mini_json": ('functools[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
                       '{"name": "get_time", "arguments": {"zone": "CET"}}]', None),
    "qwen3_coder": ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>", "I will look.\n"),
    "glm45": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n"
              "<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n<arg_key>zone</arg_key>\n"
              "<arg_value>CET</arg_value>\n</tool_call>", None),
}
CALLS = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]


def reassemble(deltas: list[dict]) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"name": None, "arguments": "", "id": None})
            if "id" in c:
                assert call["id"] is None and c["function"]["name"], "id and name come first, once"
                call["id"], call["name"] = c["id"], c["function"]["name"]
            call["arguments"] += c["function"].get("arguments", "")
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_each_parser_reads_its_format_whole_and_in_pieces(name):
    text, content = OUTPUTS[name]
    parser = get_parser(name).with_tools(TOOLS)       # the request's tools (typed argument values)
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for size in (1, 3, 7):
        stream = ToolCallStream("auto", None, parser)
        deltas = [d for k in range(0, len(text), size) for d in stream.feed(text[k:k + size])] + stream.finish()
        assert reassemble(deltas) == (content or "", CALLS), (name, size)
    plain = "No tools needed: the answer is 4."
    assert parser.extract(plain) == (plain, [])
    stream = ToolCallStream("auto", None, parser)
    deltas = [d for ch in plain for d in stream.feed(ch)] + stream.finish()
    assert reassemble(deltas) == (plain, []) and not stream.called


def test_text_that_looks_like_a_call_but_does_not_parse_stays_content():
    for name, text in [("hermes", "<tool_call>{not json</tool_call>"), ("pythonic", "[1, 2, 3]"),
                       ("llama3_json", '{"no_name": 1}'), ("mistral", "[TOOL_CALLS] oops"),
                       ("deepseek_v3", "<｜tool▁calls▁begin｜>no call"), ("granite", "[1, 2]"),
                       ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops"),
                       ("kimi_k2", "<|tool_calls_section_begin|>"), ("phi4_mini_json", "functools[oops]"),
                       ("qwen3_coder", "<tool_call>\n<oops>"), ("glm45", "<tool_call></tool_call>")]:
        assert get_parser(name).extract(text) == (text, []), name


def test_text_valued_arguments_take_the_types_the_tool_schema_gives():
    """qwen3_coder and glm45 write every value as text: a string parameter keeps it ("007"
    stays text), the others are read as JSON; parameters the schema does not name stay text."""
    schema = {"type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"},
                                               "ok": {"type": "boolean"}, "tags": {"type": "array"},
                                               "level": {"enum": [1, 2]}, "note": {"type": ["string", "null"]}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n007\n</parameter>\n<parameter=n>\n12\n</parameter>\n"
            "<parameter=ok>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=level>\n"
            "2\n</parameter>\n<parameter=note>\nline one\nline two\n</parameter>\n<parameter=extra>\n5\n</parameter>\n"
            "</function>\n</tool_call>")
    _, (call,) = get_parser("qwen3_coder").with_tools(tools).extract(text)
    assert json.loads(call.arguments) == {"code": "007", "n": 12, "ok": True, "tags": ["a", "b"], "level": 2,
                                          "note": "line one\nline two", "extra": "5"}
    _, (call,) = get_parser("qwen3_coder").extract(text)      # no tools given: every value is text
    assert json.loads(call.arguments)["n"] == "12"
    glm = "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
    assert json.loads(get_parser("glm45").with_tools(tools).extract(glm)[1][0].arguments) == {"n": 3}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--enable-auto-tool-choice", "--tool-call-parser",
                                "hermes") as (_, url):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(**{
        "model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS,
        "max_tokens": 120, "temperature": 1.0, "seed": 5, **kw})


def valid(name: str, arguments: dict) -> bool:
    if name == "get_weather":
        return set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Oslo", "Lima") \
            and type(arguments["days"]) is int and 1 <= arguments["days"] <= 7
    return name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.mark.slow
def test_required_and_named_tool_choice_give_calls_that_match_their_schema(client):
    for choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        out = ask(client, tool_choice=choice, n=3)
        for c in out.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            assert c.message.tool_calls and all(t.id.startswith("chatcmpl-tool-") for t in c.message.tool_calls)
            for t in c.message.tool_calls:
                assert valid(t.function.name, json.loads(t.function.arguments)), t
                assert choice == "required" or t.function.name == "get_time"
    single = ask(client, tool_choice="required", parallel_tool_calls=False, n=3)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


@pytest.mark.slow
def test_streamed_tool_calls_reassemble_into_the_non_streamed_ones(client):
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        whole = ask(client, tool_choice=choice).choices[0]
        chunks = list(ask(client, tool_choice=choice, stream=True))
        deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
        content, calls = reassemble([{**d, "tool_calls": [{**t, "function": {"arguments": "", **t["function"]}}
                                                          for t in d.get("tool_calls", [])]} for d in deltas])
        assert calls == [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_a_conversation_with_calls_and_tool_answers_goes_on(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 1})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 12 C"}]
    out = ask(client, messages=messages, tool_choice="none", max_tokens=10)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"
    auto = ask(client, messages=messages, max_tokens=10)       # auto: hermes reads the random text as content
    assert auto.choices[0].message.content and auto.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_what_cannot_work_is_a_400(client, tiny_model_dir):
    bad = [dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
           dict(tool_choice="required", tools=None),
           dict(tool_choice="required", response_format={"type": "json_object"}),
           dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
               {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])]
    for kw in bad:
        with pytest.raises(openai.BadRequestError):
            ask(client, **kw)
    with server_in_this_process(tiny_model_dir("llama-gqa")) as (_, url):      # auto tool choice not enabled
        plain = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            ask(plain, tool_choice="auto")
        assert ask(plain, max_tokens=5).choices[0].message.tool_calls is None    # tools, no choice: none


# Mistral's tokenizers write [TOOL_CALLS] and [ARGS] as special tokens: a scripted model writes them
MISTRAL_MARKERS = ["[TOOL_CALLS]", "[ARGS]"]


@pytest.fixture(scope="module")
def scripted_mistral(tmp_path_factory):
    from tests.scripted_model import scripted_model
    return scripted_model(tmp_path_factory.mktemp("scripted-mistral"), "[TOOL_CALLS]get_time[ARGS]{}",
                          MISTRAL_MARKERS)


def test_a_parser_knows_when_its_tokenizer_writes_its_markers_as_special_tokens(scripted_mistral,
                                                                              default_model_dir):
    from transformers import AutoTokenizer
    special = AutoTokenizer.from_pretrained(scripted_mistral)
    assert get_parser("mistral").needs_special_tokens(special)
    assert not get_parser("hermes").needs_special_tokens(special)        # <tool_call> is plain text there
    assert not get_parser("mistral").needs_special_tokens(AutoTokenizer.from_pretrained(default_model_dir))


@pytest.mark.slow
def test_tool_calls_written_in_special_tokens_are_read(scripted_mistral):
    """Before, the detokenizer dropped [TOOL_CALLS] (a special token) and the call came back as
    content "get_time{}"; now an answer that may hold calls keeps special tokens, as vLLM does,
    and no request shows the EOS that ended it."""
    with server_in_this_process(scripted_mistral, "--enable-auto-tool-choice", "--tool-call-parser",
                                "mistral") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for kw in ({}, {"temperature": 0.8, "seed": 3}):
            out = ask(client, max_tokens=30, **kw).choices[0]
            assert out.finish_reason == "tool_calls" and out.message.content is None, out
            assert [(t.function.name, json.loads(t.function.arguments)) for t in out.message.tool_calls] == \
                [("get_time", {})]
        chunks = list(ask(client, max_tokens=30, stream=True))
        deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
        assert reassemble(deltas) == ("", [("get_time", {})])
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = ask(client, max_tokens=30, tools=None).choices[0]     # no tools: special tokens skipped
        assert plain.message.content == "get_time{}" and plain.finish_reason == "stop"
        prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        kept = client.completions.create(model="tiny", prompt=prompt, max_tokens=30,
                                         extra_body={"skip_special_tokens": False}).choices[0]
        assert kept.text == "[TOOL_CALLS]get_time[ARGS]{}" and kept.finish_reason == "stop"
        shown = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, extra_body={
            "skip_special_tokens": False, "include_stop_str_in_output": True}).choices[0]
        assert shown.text == "[TOOL_CALLS]get_time[ARGS]{}<|im_end|>"
