"""The request of POST /v1/responses (OpenAI's Responses API), as far as shardlm serves it.
Fields it does not serve are refused by name with a 400 (except those sent as null)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardlm.entrypoints.openai.protocol import checked
from shardlm.sampling_params import INT64_MAX


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(json_schema_extra={"minLength": 1, "minItems": 1})
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = checked(None, minimum=1, maximum=INT64_MAX)
    temperature: float | None = checked(None, minimum=0)
    top_p: float | None = checked(None, exclusiveMinimum=0, maximum=1)
    text: dict[str, Any] | None = None           # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    tools: list[dict[str, Any]] | None = None    # function tools: {"type": "function", "name", "parameters", ...}
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None      # accepted; the model's reasoning parser decides what is thinking
    store: bool = True
    stream: bool = False
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    seed: int | None = checked(None, minimum=0, maximum=INT64_MAX)
    priority: int = checked(0, minimum=-INT64_MAX - 1, maximum=INT64_MAX)
