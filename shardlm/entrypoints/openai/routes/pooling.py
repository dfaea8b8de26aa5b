"""The pooling routes, as vLLM serves them: /v1/embeddings (OpenAI's), /pooling, /classify,
/score and /v1/score, /rerank, /v1/rerank (Jina's shape) and /v2/rerank (Cohere's). A generative
model answers them with a 400 that says which flags make a pooling server."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from shardlm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from shardlm.entrypoints.openai.routes.openai_api import respond
from shardlm.entrypoints.openai.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.pooling.embeddings(req))


@router.post("/pooling")
async def pooling(req: PoolingRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.pooling.pooling(req))


@router.post("/classify")
async def classify(req: ClassificationRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.pooling.classify(req))


@router.post("/score")
@router.post("/v1/score")
async def score(req: ScoreRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.pooling.score(req))


@router.post("/rerank")
@router.post("/v1/rerank")
async def rerank(req: RerankRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.pooling.rerank(req, 1 if request.url.path == "/v1/rerank" else None))


@router.post("/v2/rerank")
async def rerank_v2(req: RerankRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.pooling.rerank(req, 2))
