"""Every error the server answers has OpenAI's shape: the exception handlers that turn what a
route raises (or what FastAPI and Starlette refuse) into it; nothing a client sends produces a
plain 500."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardlm.engine.errors import EngineDeadError, RequestFailedError
from shardlm.entrypoints.openai.protocol import OpenAIError
from shardlm.logger import init_logger

logger = init_logger(__name__)


def error_response(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def on_openai_error(_, e: OpenAIError):
    return error_response(e)


async def on_validation_error(_, e: RequestValidationError):
    first = e.errors()[0] if e.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    return error_response(OpenAIError(f"Invalid request: {'.'.join(loc) or 'body'}: {first.get('msg', 'malformed')}",
                                      400, ".".join(loc) or None))


async def on_http_error(_, e: StarletteHTTPException):
    return error_response(OpenAIError(str(e.detail), e.status_code, type_="NotFoundError" if e.status_code == 404
                                      else "invalid_request_error"))


def engine_error(e: Exception) -> OpenAIError | None:
    """What the client gets for a request the engine could not finish (None: not such an error)."""
    if isinstance(e, EngineDeadError):
        # retriable: the engine is starting again, or another server behind the same balancer can answer
        return OpenAIError(str(e), 503, type_="ServiceUnavailableError", headers={"Retry-After": "5"})
    if isinstance(e, RequestFailedError):       # this request's own fault; the engine goes on
        return OpenAIError(f"The request failed: {e}", 500, type_="InternalServerError")
    return None


async def on_engine_error(_, e: Exception):
    return error_response(engine_error(e))


async def on_unexpected(request: Request, e: Exception):
    """Anything else: logged with its traceback, answered in OpenAI's shape (never a plain 500)."""
    logger.error("Unexpected error in %s %s", request.method, request.url.path, exc_info=e)
    return error_response(OpenAIError(f"Internal error: {type(e).__name__}: {e}", 500, type_="InternalServerError"))


def add_error_handlers(app: FastAPI) -> None:
    for exc, handler in ((OpenAIError, on_openai_error), (RequestValidationError, on_validation_error),
                         (StarletteHTTPException, on_http_error), (EngineDeadError, on_engine_error),
                         (RequestFailedError, on_engine_error),
                         (Exception, on_unexpected)):
        app.add_exception_handler(exc, handler)
