"""Request schemas of the pooling routes (vLLM's): /v1/embeddings (OpenAI's), /pooling, /classify,
/score and /rerank (Jina's and Cohere's shapes). Unknown fields are refused with a 400."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardlm.entrypoints.openai.protocol import ChatMessage, checked
from shardlm.sampling_params import INT64_MAX

# one input, or a batch: texts or token ids
PoolingInput = str | list[str] | list[int] | list[list[int]]


def _input(*default):
    return Field(*default, json_schema_extra={"minLength": 1, "minItems": 1})


class _PoolingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = checked(None, minimum=-1, maximum=INT64_MAX)
    priority: int = checked(0, minimum=-INT64_MAX - 1, maximum=INT64_MAX)   # --scheduling-policy priority


class EmbeddingRequest(_PoolingFields):
    """OpenAI's input, or (vLLM's) a chat's messages, rendered by the chat template as one prompt
    (with image_url parts for a vision-language model)."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "anyOf": [{"required": ["input"]}, {"required": ["messages"]}]})
    input: PoolingInput | None = _input(None)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = checked(None, minimum=1, maximum=INT64_MAX)
    normalize: bool | None = None
    # messages render with these (vLLM's defaults for embeddings: no generation prompt)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    use_activation: bool | None = None


class ClassificationRequest(_PoolingFields):
    input: str | list[str] | list[int] | list[list[int]] = _input()
    use_activation: bool | None = None


class ScoreRequest(_PoolingFields):
    """text_1 scored against each of text_2 (1 -> N), or the two lists pairwise (N -> N)."""
    text_1: str | list[str] = _input()
    text_2: str | list[str] = _input()


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class RerankRequest(_PoolingFields):
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = checked(None, minimum=1, maximum=INT64_MAX)
    return_documents: bool = True
