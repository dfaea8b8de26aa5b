"""Amazon SageMaker's container contract, as vLLM serves it: GET/POST /ping is /health, and POST
/invocations takes any request the server answers, sent where its body says (messages: chat,
prompt: completions, input: embeddings, query and documents: rerank, text_1 and text_2: score)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from shardlm.entrypoints.openai.pooling_protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from shardlm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from shardlm.entrypoints.openai.routes.health import health
from shardlm.entrypoints.openai.routes.openai_api import respond
from shardlm.entrypoints.openai.state import ServerState, server_state

router = APIRouter()

# the body's keys -> its request type and the serving call that answers it
INVOCATIONS = (
    (("messages",), ChatCompletionRequest, lambda state, req: state.serving.chat(req)),
    (("prompt",), CompletionRequest, lambda state, req: state.serving.completions(req)),
    (("input",), EmbeddingRequest, lambda state, req: state.pooling.embeddings(req)),
    (("query", "documents"), RerankRequest, lambda state, req: state.pooling.rerank(req, None)),
    (("text_1", "text_2"), ScoreRequest, lambda state, req: state.pooling.score(req)),
)


@router.get("/ping")
@router.post("/ping")
async def ping(state: ServerState = Depends(server_state)):
    return await health(state)


@router.post("/invocations")
async def invocations(request: Request, state: ServerState = Depends(server_state)):
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(f"The body is not JSON: {e}.", 400) from None
    keys = body.keys() if isinstance(body, dict) else ()
    for needed, kind, answer in INVOCATIONS:
        if all(k in keys for k in needed):
            try:
                req = kind.model_validate(body)
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from None
            return await respond(request, answer(state, req))
    raise OpenAIError("/invocations takes a chat request (messages), a completion (prompt), embeddings (input), a "
                      "rerank (query and documents) or a score (text_1 and text_2).", 400)
