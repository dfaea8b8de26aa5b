"""Parser plugins (--tool-parser-plugin, --reasoning-parser-plugin, as vLLM's): a file registers
parsers by name; serve takes the names, a reasoning parser reaches the engine core's process too
(structured outputs wait for the end of the thinking); a bad plugin or name stops serve with why."""

import textwrap

import httpx
import pytest

from shardlm.entrypoints.openai.tool_parsers import ToolParser, get_parser
from shardlm.reasoning import get_reasoning_parser
from tests.helpers import start_server

TOOL_PLUGIN = '''
import json
from shardlm.entrypoints.openai.tool_parsers import ToolCall, ToolParser, register_tool_parser


@register_tool_parser("angle", "angle_v2")
class AngleParser(ToolParser):
    """<<name|{json arguments}>>, repeated."""
    marker = "<<"

    def calls(self, section):
        calls = []
        for piece in section.split("<<")[1:]:
            name, _, rest = piece.partition("|")
            calls.append(ToolCall(name, json.dumps(json.loads(rest.split(">>")[0]))))
        return calls
'''

REASONING_PLUGIN = '''
from shardlm.reasoning import ReasoningParser, register_reasoning_parser

register_reasoning_parser(ReasoningParser("thought", unclosed_is_reasoning=True, start="<thought>", end="</thought>"))
'''


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plugins")
    (folder / "tools.py").write_text(textwrap.dedent(TOOL_PLUGIN))
    (folder / "reasoning.py").write_text(textwrap.dedent(REASONING_PLUGIN))
    (folder / "broken.py").write_text("raise RuntimeError('plugin says no')\n")
    return folder


def test_a_tool_parser_plugin_registers_its_names(plugins):
    parser = get_parser("angle_v2", str(plugins / "tools.py"))
    assert isinstance(parser, ToolParser)
    content, calls = parser.extract('Sure. <<get_weather|{"city": "Oslo"}>><<now|{}>>')
    assert content == "Sure. " and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}'),
                                                                            ("now", "{}")]
    with pytest.raises(ValueError, match="failed to import: RuntimeError: plugin says no"):
        get_parser("angle", str(plugins / "broken.py"))
    with pytest.raises(ValueError, match="no such file"):
        get_parser("angle", str(plugins / "missing.py"))


def test_a_reasoning_parser_plugin_splits_the_thinking(plugins):
    parser = get_reasoning_parser("thought", str(plugins / "reasoning.py"))
    assert parser.split("<thought>hmm</thought>42") == ("hmm", "42")


def test_serve_takes_plugin_names_and_stops_on_a_bad_one(tiny_model_dir, plugins, capsys):
    from shardlm.entrypoints.cli import build_parser
    from shardlm.entrypoints.cli.serve import server_options
    base = ["serve", tiny_model_dir("llama-gqa"), "--enable-auto-tool-choice"]
    options = server_options(build_parser().parse_args(
        base + ["--tool-call-parser", "angle", "--tool-parser-plugin", str(plugins / "tools.py")]))
    assert options["tool_parser"] == "angle"
    for extra, says in ((["--tool-call-parser", "nope", "--tool-parser-plugin", str(plugins / "tools.py")],
                         "'nope' is not one of"),
                        (["--tool-call-parser", "square"], "a --tool-parser-plugin file may register more"),
                        (["--tool-call-parser", "angle", "--tool-parser-plugin", str(plugins / "broken.py")],
                         "plugin says no")):
        with pytest.raises(SystemExit) as stop:
            server_options(build_parser().parse_args(base + extra))
        assert says in str(stop.value)


def test_the_engine_core_process_loads_the_reasoning_plugin(tiny_model_dir, plugins):
    """A real `shardlm serve`, whose engine core comes from a fork server started before the plugin
    was read: a constrained request makes the engine core read the parser itself; the thinking is
    all reasoning_content (a random model never closes it)."""
    proc, url = start_server(tiny_model_dir("llama-gqa"), "--reasoning-parser", "thought",
                             "--reasoning-parser-plugin", str(plugins / "reasoning.py"))
    try:
        r = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["reasoning_content"] and message["content"] is None
    finally:
        proc.terminate()
        proc.wait(60)
    from shardlm import LLM
    with pytest.raises(ValueError, match="'thought2' is not one of"):
        LLM(tiny_model_dir("llama-gqa"), reasoning_parser="thought2",
            reasoning_parser_plugin=str(plugins / "reasoning.py"))


def test_constraints_that_cannot_be_set_up_in_the_engine_core_fail_that_request_alone(tiny_model_dir, monkeypatch):
    """Before, such a request was ended by the core without a token and its caller waited forever."""
    from shardlm import LLM, SamplingParams
    from shardlm.core import engine_core
    from shardlm.engine.errors import RequestFailedError
    from shardlm.sampling_params import StructuredOutputsParams

    def refuse(*args, **kwargs):
        raise ValueError("no grammar here")
    monkeypatch.setattr(engine_core, "StructuredOutputManager", refuse)
    llm = LLM(tiny_model_dir("llama-gqa"))
    try:
        with pytest.raises(RequestFailedError, match="could not be set up here: no grammar here"):
            llm.generate(["a"], SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(choice=["x"])))
        assert llm.generate(["b"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
    finally:
        llm.shutdown()
