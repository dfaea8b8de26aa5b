"""Reasoning output: --reasoning-parser splits a reasoning model's thinking into reasoning_content,
whole and streamed (the stream's pieces, cut anywhere, reassemble into the whole); and in the
engine core a structured-output constraint waits for the end of the thinking, then applies to
the answer."""

import openai
import pytest

from shardlm.core.request import Request
from shardlm.core.scheduler import Scheduler
from shardlm.model_loader.default_model import default_model_dir
from shardlm.reasoning import ReasoningStream, get_reasoning_parser
from shardlm.sampling_params import SamplingParams, StructuredOutputsParams
from shardlm.structured_output.manager import StructuredOutputManager, thinking_closed
from tests.helpers import server_in_this_process

SPLITS = [("deepseek_r1", "Two and two.\nSo four.</think>\n\nIt is 4.", ("Two and two.\nSo four.", "\n\nIt is 4.")),
          ("deepseek_r1", " Still thinking", (" Still thinking", None)),
          ("qwen3", "<think>\nsum</think>\n\nFour.", ("\nsum", "\n\nFour.")),
          ("qwen3", "Four.", (None, "Four.")),
          ("qwen3", "<think>never closed", ("never closed", None))]


@pytest.mark.parametrize("name, text, want", SPLITS)
def test_thinking_and_answer_split_whole_and_streamed(name, text, want):
    parser = get_reasoning_parser(name)
    assert parser.split(text) == want
    for size in (1, 2, 4, 9):
        stream, parts = ReasoningStream(parser), []
        pieces = [text[k:k + size] for k in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            parts += stream.feed(piece, final=i == len(pieces) - 1)
        got = tuple("".join(p for kind, p in parts if kind == k) or None for k in ("reasoning", "content"))
        assert got == want, (name, size)


def test_a_prompt_that_closes_the_thinking_lets_the_constraint_apply_at_once():
    start, end = [7, 8], [9]
    assert thinking_closed([1, 7, 8, 2, 9, 3], start, end)          # <think> ... </think> in the prompt
    assert not thinking_closed([1, 7, 8, 2], start, end)             # opened: the output thinks first
    assert thinking_closed([1, 2, 9], start, end)                    # ends by closing it (DeepSeek-V3.1, off)
    assert not thinking_closed([9, 1, 7, 8], start, end)             # an earlier turn's end does not count
    assert not thinking_closed([1, 2], start, end)                   # no thinking in the prompt


@pytest.mark.parametrize("name", ["deepseek_r1", "deepseek_v3", "qwen3"])
def test_a_prompt_that_closes_the_thinking_is_answered_with_content_alone(name):
    """DeepSeek-V3.1's template with thinking off ends the prompt with </think>: its answer holds no
    </think>, which deepseek_r1's rule would read as all thinking; the server reads it as content."""
    import dataclasses
    parser = get_reasoning_parser(name)
    assert parser.closed_by("<｜User｜>Hi<｜Assistant｜></think>") and not parser.closed_by("<｜Assistant｜><think>")
    assert parser.closed_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")          # Qwen3, thinking off
    answer_only = dataclasses.replace(parser, thinking=False)
    assert answer_only.split("It is 4.") == (None, "It is 4.")
    stream = ReasoningStream(answer_only)
    assert stream.feed("It is", False) + stream.feed(" 4.", True) == [("content", "It is"), ("content", " 4.")]
    assert get_reasoning_parser("deepseek_v3").split("Sum.</think>It is 4.") == ("Sum.", "It is 4.")


def test_the_constraint_starts_after_the_end_of_the_thinking():
    """The core's matcher ignores the thinking and follows the answer from the end marker on."""
    manager = StructuredOutputManager(default_model_dir(), 49152, "deepseek_r1")
    tok = manager.compiler.hf_tokenizer()
    # pieces encoded apart, as a reasoning model's single <think> and </think> tokens would be
    encode = lambda *texts: sum((tok.encode(t, add_special_tokens=False) for t in texts), [])     # noqa: E731
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), max_tokens=100)
    request = Request("r", encode("Question?", "<think>", "\n"), params, [2], 512, 16)
    request.grammar = manager.compile(request)
    request.grammar.result()
    assert request.thinking_end_ids == encode("</think>")
    for token in encode("Hmm, let me see. Maybe no.", "</think>", "yes"):
        request.append_output_token(token)
        Scheduler._advance_grammar(request, token)
        done = request.grammar_done
    assert request.thinking_end_ids is None and done, "the answer 'yes' completed the constraint"
    closed = Request("c", encode("Q?", "<think>", "\n\n", "</think>", "\n\n"), params, [2], 512, 16)
    closed.grammar = manager.compile(closed)
    closed.grammar.result()
    assert closed.thinking_end_ids is None, "thinking off in the prompt: constrained from the first token"
    manager.shutdown()


@pytest.mark.slow
def test_the_server_returns_reasoning_content_streamed_and_not(tiny_model_dir):
    """A random model never closes its thinking: with deepseek_r1 it is all reasoning_content."""
    with server_in_this_process(tiny_model_dir("llama-gqa"), "--reasoning-parser", "deepseek_r1") as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Think."}], max_tokens=20, seed=1)
        whole = client.chat.completions.create(**kw).choices[0].message
        assert whole.content is None and whole.reasoning_content
        chunks = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == whole.reasoning_content
        assert not any(d.content for d in chunks)
        # a prompt that ends by closing the thinking (here the answer goes on after "</think>") is
        # answered with content alone, streamed and not
        closed = dict(kw, messages=kw["messages"] + [{"role": "assistant", "content": "</think>"}],
                      extra_body={"continue_final_message": True, "add_generation_prompt": False})
        answer = client.chat.completions.create(**closed).choices[0].message
        assert answer.reasoning_content is None and answer.content
        chunks = [c.choices[0].delta for c in client.chat.completions.create(**closed, stream=True) if c.choices]
        assert "".join(d.content or "" for d in chunks) == answer.content
        assert not any(getattr(d, "reasoning_content", None) for d in chunks)
        # the Responses API: the thinking as a reasoning item, whole and streamed
        response = client.responses.create(model="tiny", input="Think.", max_output_tokens=20, temperature=0)
        (item,) = response.output
        assert item.type == "reasoning" and item.content[0].text
        with client.responses.stream(model="tiny", input="Think.", max_output_tokens=20, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
            final = stream.get_final_response()
        assert "".join(deltas) == item.content[0].text == final.output[0].content[0].text
