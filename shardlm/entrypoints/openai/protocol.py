"""OpenAI request schemas (pydantic) and the error shape every failure uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shardlm.sampling_params import INT64_MAX, MAX_LOGIT_BIAS


@dataclass
class RequestLimits:
    """What one request may ask for (server flags): beyond these it gets a 400 (413 for the body)."""
    max_n: int = 128                    # samples per prompt (n)
    max_prompts: int = 256              # prompts in one /v1/completions request
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_body_bytes: int = 16 << 20      # 413 beyond it
    max_num_waiting: int = 1024         # requests waiting to be scheduled; 429 beyond it
    max_num_queued_reqs: int | None = None      # requests in the engine (waiting or running); 503 beyond it
    # the transport (transport.py): nginx's default header buffers hold 32 KiB; a client has a
    # minute to send a request (a 16 MiB body at 2 Mbit/s)
    max_header_bytes: int = 32 << 10    # 431 beyond it
    max_header_count: int = 100         # 431 beyond it
    max_connections: int = 2048         # requests on more open connections than this get 503
    client_timeout: int = 60            # seconds for a request's headers and body to arrive; 408 after

    HELP = {"max_n": "most samples (n) per prompt in one request",
            "max_prompts": "most prompts in one /v1/completions request",
            "max_stop_strings": "most stop strings in one request",
            "max_stop_string_chars": "longest stop string, in characters",
            "max_body_bytes": "largest request body in bytes (413 beyond it)",
            "max_num_waiting": "most requests waiting to be scheduled; beyond it new ones get 429 with Retry-After",
            "max_num_queued_reqs": "most requests in the engine, waiting or running; beyond it new ones get 503 with "
                                   "Retry-After, to go to another replica, as vLLM's (None: no bound)",
            "max_header_bytes": "largest request line and headers in bytes (431 beyond it)",
            "max_header_count": "most headers in one request (431 beyond it)",
            "max_connections": "most open connections; a request on one more gets 503",
            "client_timeout": "seconds a client has to send a request's headers and body (408 after)"}

    def __post_init__(self):
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 1:
            raise ValueError(f"--max-num-queued-reqs {self.max_num_queued_reqs}: give at least 1 (leave it out for "
                             "no bound).")


class OpenAIError(Exception):
    """An error returned to the client as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type = message, status, param, type_
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def checked(default, **schema):
    """A field whose bounds SamplingParams checks (with the messages users see), published in
    /openapi.json as JSON-schema keywords so that a client or a fuzzer knows them too."""
    return Field(default, json_schema_extra=schema)


_TOKEN_IDS = {"items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}}


class _SamplingFields(BaseModel):
    # fields this server does not implement are refused by name (OpenAIServing.check_fields),
    # except those a client sends as null; the schema lists only the fields it takes
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: str | None = None
    n: int = checked(1, minimum=1, maximum=INT64_MAX)
    temperature: float | None = checked(None, minimum=0)
    top_p: float | None = checked(None, exclusiveMinimum=0, maximum=1)
    top_k: int | None = checked(None, minimum=-1, maximum=INT64_MAX)
    min_p: float | None = checked(None, minimum=0, maximum=1)
    seed: int | None = checked(None, minimum=0, maximum=INT64_MAX)
    presence_penalty: float = checked(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = checked(0.0, minimum=-2, maximum=2)
    repetition_penalty: float | None = checked(None, exclusiveMinimum=0)
    stop: str | list[str] | None = checked(None, minLength=1, items={"minLength": 1})
    stop_token_ids: list[int] | None = checked(None, **_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = checked(0, minimum=0, maximum=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = checked(None, propertyNames={"pattern": "^[0-9]+$"},
                                                  additionalProperties={"minimum": -MAX_LOGIT_BIAS,
                                                                        "maximum": MAX_LOGIT_BIAS})
    allowed_token_ids: list[int] | None = checked(None, minItems=1, **_TOKEN_IDS)
    bad_words: list[str] | None = None          # vLLM's: words never generated
    use_beam_search: bool = False               # vLLM's: n beams searched (beam_search.py), not streamed
    length_penalty: float = checked(1.0, minimum=-100, maximum=100)     # beam scores: logprob / length ** this
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = checked(None, minItems=1)
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    priority: int = checked(0, minimum=-INT64_MAX - 1, maximum=INT64_MAX)   # --scheduling-policy priority
    return_tokens_as_token_ids: bool | None = None     # logprobs' tokens as token_id:N (default: the server's)
    return_token_ids: bool | None = None       # the answer's token ids beside its text, and the prompt's
    # vLLM's: logprobs of the prompt's tokens (not streamed); keep the prompt's last k tokens (-1: as many as fit)
    prompt_logprobs: int | None = checked(None, minimum=0)
    truncate_prompt_tokens: int | None = checked(None, minimum=-1)
    request_id: str | None = None              # the response's id (after its cmpl- / chatcmpl- prefix)
    cache_salt: str | None = Field(None, min_length=1)     # prefix-cache blocks shared only with the same salt
    # vLLM's: SamplingParams.extra_args, what custom logits processors (--logits-processors) read
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = Field(
        None, json_schema_extra={"minLength": 1, "minItems": 1})
    # vLLM's (--enable-prompt-embeds): base64 of torch.save([tokens, hidden] tensor), one or a list
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = checked(16, minimum=1, maximum=INT64_MAX)
    logprobs: int | None = checked(None, minimum=0)          # at most --max-logprobs (the engine checks)
    echo: bool = False
    add_special_tokens: bool = True            # the tokenizer's BOS (and others) around a text prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    """An image for a vision-language model: a data:, http(s): or file: URL (multimodal/media.py)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str        # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[MessageToolCall] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None                     # a tool's answer: to which call
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_and_image_parts_only(cls, content):
        """An audio or video part gets a message that says why, not a schema error."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url"):
                    raise ValueError(f"content parts of type {kind!r} are not supported: shardlm reads text parts, "
                                     "and image_url parts for vision-language models.")
        return content

    def parts(self) -> list[str]:
        """The content's text parts (a string is one; none is none)."""
        if isinstance(self.content, list):
            return [p.text for p in self.content if isinstance(p, TextPart)]
        return [self.content] if self.content else []

    def image_urls(self) -> list[str]:
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) \
            else []

    def template_parts(self) -> list[dict]:
        """The content in order as OpenAI-format chat templates take it: text parts, and
        {"type": "image"} where an image goes."""
        if not isinstance(self.content, list):
            return [{"type": "text", "text": t} for t in self.parts()]
        return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in self.content]

    def text(self) -> str:
        return "".join(self.parts())


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema of the arguments
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = checked(None, minimum=1, maximum=INT64_MAX)
    max_completion_tokens: int | None = checked(None, minimum=1, maximum=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = checked(None, minimum=0)      # at most --max-logprobs (the engine checks)

    # top_logprobs needs logprobs: true (OpenAI's rule), said in the schema too
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "additionalProperties": False,
        "dependentSchemas": {"top_logprobs": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}})
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the answer goes on in the last message (no new turn); special tokens added to the
    # rendered prompt (the template has its own); the last message's text before the answer where
    # the answer continues it
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False
    documents: list[dict[str, Any]] | None = None     # for templates that take documents (RAG)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "anyOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    # messages render as a chat completion's would, with these
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra=_TOKEN_IDS)


def publish_vocabulary(schema: dict, vocab_size: int, most_logprobs: int) -> dict:
    """/openapi.json with this model's bound on every token id (prompt ids, stop_token_ids,
    allowed_token_ids, detokenize's tokens): the server refuses ids at or past its vocabulary; and
    with its bound on logprobs and top_logprobs (--max-logprobs). Also gives back the integer
    bounds FastAPI's schema model wrote as floats (2^63 - 1 became 2^63, past what the server takes)."""
    def bound(node):
        if isinstance(node, dict):
            for name in ("logprobs", "top_logprobs"):
                for branch in node.get("properties", {}).get(name, {}).get("anyOf", []):
                    if branch.get("type") == "integer":
                        branch["maximum"] = most_logprobs
            for key in ("minimum", "maximum", "exclusiveMinimum"):
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = min(int(node[key]), INT64_MAX)
            if node.get("type") == "array" and node.get("items", {}).get("type") == "integer":
                node["items"].update(minimum=0, maximum=vocab_size - 1)
            for value in node.values():
                bound(value)
        elif isinstance(node, list):
            for value in node:
                bound(value)
    bound(schema["components"]["schemas"])
    return schema


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
