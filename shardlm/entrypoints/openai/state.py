"""What the server's routes share: the engine, the OpenAI serving layer over it and the metrics,
made when the app starts (server.build_app's lifespan) and read by each route through the
`server_state` dependency."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from shardlm.engine.async_llm import AsyncLLM
from shardlm.entrypoints.openai.metrics import ServerMetrics
from shardlm.entrypoints.openai.serving import OpenAIServing
from shardlm.entrypoints.openai.serving_pooling import PoolingServing
from shardlm.entrypoints.openai.serving_responses import ResponsesServing


@dataclass
class ServerState:
    llm: AsyncLLM | None = None              # None until the engine has started
    serving: OpenAIServing | None = None
    pooling: PoolingServing | None = None    # the pooling routes (embeddings, classify, score, rerank)
    responses: ResponsesServing | None = None    # /v1/responses
    metrics: ServerMetrics | None = None
    draining: bool = False                   # SIGTERM came: finishing what runs, admitting nothing (drain.py)
    in_flight: int = 0                       # requests being answered (but the open routes)


def server_state(request: Request) -> ServerState:
    return request.app.state.shardlm
