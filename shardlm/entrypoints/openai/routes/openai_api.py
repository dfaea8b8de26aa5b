"""The OpenAI API: models, completions and chat completions, whole or streamed. A request whose
client goes away is aborted in the engine, whether it was answered whole or streamed."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from shardlm.entrypoints.openai.errors import engine_error
from shardlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from shardlm.entrypoints.openai.serving import EventStream, sse
from shardlm.entrypoints.openai.state import ServerState, server_state
from shardlm.logger import init_logger

logger = init_logger(__name__)
router = APIRouter()


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)):
    return {"object": "list", "data": _cards(state)}


@router.get("/v1/models/{model:path}")
async def model(model: str, state: ServerState = Depends(server_state)):
    """OpenAI's retrieve: one model's card (a served name or an adapter; names may hold slashes)."""
    card = next((c for c in _cards(state) if c["id"] == model), None)
    if card is None:
        state.serving.check_model(model)        # the 404 that lists what is served
    return card


def _cards(state: ServerState) -> list[dict]:
    serving = state.serving
    return [*({"id": n, "object": "model", "created": 0, "owned_by": "shardlm", "root": n, "parent": None,
               "max_model_len": serving.max_model_len, "tasks": _tasks(state)} for n in serving.model_names),
            *serving.loras.cards(serving.max_model_len)]


def _tasks(state: ServerState) -> list[str]:
    """What the model serves: generate, or its pooling tasks (embed, classify, score, ...)."""
    pooler = state.llm.config.model.pooler
    return list(pooler.tasks) if pooler is not None else ["generate"]


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.serving.completions(req))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    return await respond(request, state.serving.chat(req))


async def respond(request: Request, handler):
    """A whole response, cancelled (its request aborted) if the client goes away first; or a
    stream, which Starlette ends when the client goes (its requests then aborted)."""
    result = await until_disconnected(request, handler)
    if result is None:
        return Response(status_code=499)      # nobody is listening
    if isinstance(result, dict):
        return JSONResponse(result)
    return event_stream_response(result)


async def until_disconnected(request: Request, handler):
    """Run `handler` (a coroutine) unless the client disconnects first: then cancel it (which
    aborts its requests in the engine) and return None."""
    task = asyncio.ensure_future(handler)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def event_stream_response(stream: EventStream) -> StreamingResponse:
    """Server-sent events; however the response ends (a client may leave before the first event,
    when the events' generator has not even started), its requests are aborted afterwards."""
    return StreamingResponse(sse_errors(stream.events), media_type="text/event-stream",
                             background=BackgroundTask(stream.close))


async def sse_errors(stream):
    """The events as server-sent events (a dict: its JSON; a string: an event as written); a failure
    after a stream has started: an SSE error event, then [DONE] (never a cut stream)."""
    try:
        async for chunk in stream:
            yield chunk if isinstance(chunk, str) else sse(chunk)
    except Exception as e:   # noqa: BLE001 - reported to the client, logged here
        if isinstance(e, OpenAIError):
            err = e
        elif (known := engine_error(e)) is not None:
            err = known
        else:
            logger.error("Stream failed", exc_info=e)
            err = OpenAIError(f"{type(e).__name__}: {e}", 500, type_="InternalServerError")
        yield sse(err.body())
        yield sse("[DONE]")
