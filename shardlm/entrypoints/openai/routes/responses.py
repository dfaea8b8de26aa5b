"""OpenAI's Responses API: create (whole, streamed, or in the background), retrieve, cancel."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from shardlm.entrypoints.openai.responses_protocol import ResponsesRequest
from shardlm.entrypoints.openai.routes.openai_api import respond
from shardlm.entrypoints.openai.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.responses.create(req))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, state: ServerState = Depends(server_state)):
    return state.responses.retrieve(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, state: ServerState = Depends(server_state)):
    return await state.responses.cancel(response_id)
