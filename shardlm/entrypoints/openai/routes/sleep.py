"""Sleep mode's routes (vLLM's, mounted with --enable-sleep-mode): POST /sleep?level=1|2 gives back
the KV cache's memory (and at level 2 the weights'), POST /wake_up takes it again, GET /is_sleeping
says which. Requests meanwhile get 503."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from shardlm.entrypoints.openai.protocol import OpenAIError
from shardlm.entrypoints.openai.state import ServerState, server_state

router = APIRouter()


@router.post("/sleep")
async def sleep(level: int = 1, state: ServerState = Depends(server_state)):
    try:
        await state.llm.sleep(level)
    except (ValueError, RuntimeError) as e:     # running requests, a bad level
        raise OpenAIError(str(e).removeprefix("ValueError: "), 400, "level") from None
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(state: ServerState = Depends(server_state)):
    await state.llm.wake_up()
    return Response(status_code=200)


@router.get("/is_sleeping")
async def is_sleeping(state: ServerState = Depends(server_state)):
    return {"is_sleeping": state.llm.sleeping}
