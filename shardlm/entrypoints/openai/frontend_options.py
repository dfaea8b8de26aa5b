"""How the OpenAI routes write their answers, under vLLM's frontend flags of the same names: the
role a chat answer takes, logprob tokens as ids, cached prompt tokens in the usage, usage in
every stream, the chat template's defaults and the shape message content takes in it."""

from __future__ import annotations

from dataclasses import dataclass

from jinja2 import Environment, nodes

from shardlm.config import json_object_flag
from shardlm.logger import init_logger

logger = init_logger(__name__)

CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass
class FrontendOptions:
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    default_chat_template_kwargs: dict | str | None = None
    chat_template_content_format: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    HELP = {
        "response_role": "the role of chat answers to a conversation that asks for one (add_generation_prompt)",
        "return_tokens_as_token_ids": "logprobs name their tokens as token_id:N, so that tokens which are not "
                                      "whole UTF-8 text can be told apart (a request may say otherwise)",
        "enable_prompt_tokens_details": "the usage says how many prompt tokens came from the prefix cache "
                                        "(prompt_tokens_details.cached_tokens)",
        "enable_force_include_usage": "every stream ends with a usage chunk, whether stream_options asks or not",
        "default_chat_template_kwargs": "the chat template's variables for requests that leave them out, a JSON "
                                        "object, e.g. '{\"enable_thinking\": false}' (a request's "
                                        "chat_template_kwargs win)",
        "chat_template_content_format": "how a message's content reaches the chat template: string, or openai (a "
                                        "list of {\"type\": \"text\", \"text\": ...} parts); auto: openai for a "
                                        "template that loops over the content, else string",
        "exclude_tools_when_tool_choice_none": "with tool_choice \"none\", leave the tools out of the prompt",
        "enable_server_load_tracking": "accepted for vLLM's command lines: GET /load always answers "
                                       "{\"server_load\": requests being answered} here",
        "enable_tokenizer_info_endpoint": "GET /tokenizer_info answers the tokenizer's configuration and chat "
                                          "template (off by default: it shows the template)",
    }

    def __post_init__(self):
        if not self.response_role.strip():
            raise ValueError("--response-role is empty: give a role, e.g. assistant.")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"--chat-template-content-format {self.chat_template_content_format!r}: give "
                             f"{', '.join(CONTENT_FORMATS)}.")
        self.default_chat_template_kwargs = json_object_flag(
            self.default_chat_template_kwargs, "--default-chat-template-kwargs", '{"enable_thinking": false}')

    def content_format_for(self, template: str | None) -> str:
        """string or openai: the flag's choice, or for auto the one `template` reads."""
        if self.chat_template_content_format != "auto":
            return self.chat_template_content_format
        found = "openai" if template and loops_over_content(template) else "string"
        logger.info("Chat template content format: %s (--chat-template-content-format auto)", found)
        return found


def loops_over_content(template: str) -> bool:
    """Whether a Jinja chat template iterates over a message's content (`for part in
    message['content']`, or `.content`): then it expects OpenAI's list of parts."""
    try:
        tree = Environment().parse(template)
    except Exception:      # noqa: BLE001 - a template jinja cannot parse renders as before
        return False
    for loop in tree.find_all(nodes.For):
        node = loop.iter
        while isinstance(node, nodes.Filter) and node.node is not None:    # content | list ...
            node = node.node
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content":
            return True
        if isinstance(node, nodes.Getattr) and node.attr == "content":
            return True
    return False


def as_content_format(parts: list[dict], content_format: str, image_placeholder: str | None = None) -> str | list[dict]:
    """A message's parts (text, and {"type": "image"}) as the template takes them: OpenAI's list
    of parts, or one string, in which each image is its placeholder on a line of its own before
    the text, as vLLM writes them."""
    if content_format != "string":
        return parts
    images = sum(1 for p in parts if p["type"] == "image")
    text = "".join(p["text"] for p in parts if p["type"] == "text")
    return "".join(f"{image_placeholder}\n" for _ in range(images)) + text
