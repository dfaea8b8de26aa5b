"""GPT-OSS's harmony output in the chat API: the analysis channel is reasoning_content, final (and
a preamble to no one) the content, a message to functions.NAME a tool call; whole and fed in
pieces as a stream (the deltas reassemble into the whole), with either header order of a call; a
GPT-OSS server detokenizes chats with their special tokens and answers through harmony."""

import json

import openai
import pytest

from shardlm.entrypoints.openai.tool_parsers import get_parser
from shardlm.entrypoints.openai.tools import HarmonyChoiceStream
from shardlm.entrypoints.openai.tools import harmony_message as chat_message
from tests.helpers import server_in_this_process
from tests.server.test_tool_calling import reassemble

ANSWER = ("<|channel|>analysis<|message|>The user asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final"
          "<|message|>2 + 2 = 4.<|return|>")
CALLS = ('<|channel|>analysis<|message|>Need the weather, then the time.<|end|><|start|>assistant<|channel|>'
         'commentary<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
         '<|constrain|>json<|message|>{"city": "Oslo", "days": 2}<|call|><|start|>assistant to=functions.get_time'
         '<|channel|>commentary json<|message|>{"zone": "CET"}<|call|>')


def _streamed(text: str, size: int, tools_on: bool = True) -> tuple[str, str, list]:
    stream = HarmonyChoiceStream(tools_on)
    pieces = [text[k:k + size] for k in range(0, len(text), size)]
    deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, final=i == len(pieces) - 1)]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content, calls = reassemble(deltas)
    return reasoning, content, calls


def test_reasoning_and_answer_are_read_whole_and_in_pieces():
    message = chat_message(ANSWER, tools_on=False)
    assert (message["reasoning_content"], message["content"]) == ("The user asks 2+2. Easy.", "2 + 2 = 4.")
    assert "tool_calls" not in message
    for size in (1, 3, 7, 1000):
        assert _streamed(ANSWER, size) == ("The user asks 2+2. Easy.", "2 + 2 = 4.", []), size


def test_tool_calls_in_either_header_order_with_a_preamble():
    message = chat_message(CALLS, tools_on=True)
    assert message["content"] == "Checking both."
    assert message["reasoning_content"] == "Need the weather, then the time."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "CET"})]
    for size in (1, 4, 9):
        assert _streamed(CALLS, size) == ("Need the weather, then the time.", "Checking both.", calls), size
    assert get_parser("openai").extract(CALLS)[1][1].name == "get_time"      # --tool-call-parser openai


def test_without_tools_a_calls_arguments_stay_content_and_a_cut_answer_keeps_what_came():
    assert chat_message(CALLS, tools_on=False)["content"] == 'Checking both.{"city": "Oslo", "days": 2}{"zone": "CET"}'
    cut = "<|channel|>analysis<|message|>Let me think about <|"      # max_tokens ended it mid-marker
    assert chat_message(cut, tools_on=False) == {"role": "assistant", "content": None,
                                                 "reasoning_content": "Let me think about <|"}
    assert _streamed(cut, 2) == ("Let me think about <|", "", [])
    plain = "No harmony here."                       # text outside any message is content
    assert chat_message(plain, tools_on=True)["content"] == plain


@pytest.mark.slow
def test_a_gpt_oss_server_answers_chats_through_harmony(tiny_model_dir):
    """The tiny random GPT-OSS writes no harmony of its own: its text, read with special tokens
    kept, comes back whole as content, with a reasoning_content field, streamed and not."""
    with server_in_this_process(tiny_model_dir("gpt-oss"), "--enable-auto-tool-choice", "--tool-call-parser",
                                "openai") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        ask = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0)
        whole = client.chat.completions.create(**ask).choices[0].message
        assert hasattr(whole, "reasoning_content") and isinstance(whole.content, str) and whole.content
        chunks = list(client.chat.completions.create(**ask, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.content
        completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=12, temperature=0)
        assert completion.choices[0].text                 # completions stay plain text
