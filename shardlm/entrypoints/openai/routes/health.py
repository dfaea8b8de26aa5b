"""Health, Prometheus metrics, version and load: open to everyone, without an API key (OPEN_ROUTES)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import shardlm
from shardlm.entrypoints.openai.state import ServerState, server_state

OPEN_ROUTES = ("/health", "/metrics", "/version", "/load", "/ping")
router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    llm = state.llm
    if state.draining:
        return JSONResponse({"status": "draining", "in_flight": state.in_flight}, 503)
    if llm is None or not llm.is_running:
        return JSONResponse({"status": "unhealthy", "reason": llm.dead_reason if llm else "starting"}, 503)
    if llm.unavailable:            # starting again after a fault: send requests elsewhere meanwhile
        return JSONResponse({"status": "restarting", "reason": llm.unavailable}, 503, headers={"Retry-After": "5"})
    if llm.dead_replicas:          # data parallel: the others still serve
        return JSONResponse({"status": "degraded", "dead_replicas": llm.dead_replicas})
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)):
    stats = await state.llm.stats() if state.llm.unavailable is None else None
    return Response(state.metrics.render(stats, state.llm.restarts), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    return {"version": shardlm.__version__}


@router.get("/load")
async def load(state: ServerState = Depends(server_state)):
    """vLLM's server load: the requests being answered now (this route and the other open ones aside)."""
    return {"server_load": state.in_flight}
