"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncLLM (engine core in its own
process). Every error has OpenAI's shape; nothing a client sends produces a 500."""

from __future__ import annotations

import asyncio
import hmac
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import shardlm
from shardlm.config import EngineConfig
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.async_llm import AsyncLLM
from shardlm.engine.core_client import EngineDeadError
from shardlm.entrypoints.openai.metrics import ServerMetrics
from shardlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
)
from shardlm.entrypoints.openai.serving import OpenAIServing
from shardlm.logger import init_logger

logger = init_logger(__name__)
_OPEN_ROUTES = ("/health", "/metrics", "/version")
_UNHEALTHY_GRACE_S = 2.0   # how long /health reports 503 after the engine died, before exiting


def build_app(config: EngineConfig, api_key: str | None = None, chat_template: str | None = None) -> FastAPI:
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        t0 = time.perf_counter()
        llm = AsyncLLM(config)
        names = [llm.config.model.served_model_name]
        state["llm"], state["serving"] = llm, OpenAIServing(llm, names, chat_template)
        state["metrics"] = metrics = ServerMetrics(names[0])
        llm.on_finished = metrics.observe_finished
        logger.info("Serving %s (dtype %s) after %.1f s", names[0], str(llm.config.model.dtype).replace("torch.", ""),
                    time.perf_counter() - t0)
        try:
            yield
        finally:
            llm.shutdown()

    app = FastAPI(title="shardlm", version=shardlm.__version__, lifespan=lifespan)
    app.state.shardlm = state

    def error(e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path not in _OPEN_ROUTES:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error(OpenAIError("Missing or wrong API key: send 'Authorization: Bearer <key>'.", 401,
                                         type_="AuthenticationError"))
        return await call_next(request)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(_, e: OpenAIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return error(OpenAIError(f"Invalid request: {'.'.join(loc) or 'body'}: {first.get('msg', 'malformed')}",
                                 400, ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, e: StarletteHTTPException):
        return error(OpenAIError(str(e.detail), e.status_code, type_="NotFoundError" if e.status_code == 404
                                 else "invalid_request_error"))

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_, e: EngineDeadError):
        return error(OpenAIError(str(e), 503, type_="ServiceUnavailableError"))

    @app.get("/health")
    async def health():
        llm = state.get("llm")
        if llm is None or not llm.is_running:
            return JSONResponse({"status": "unhealthy", "reason": llm.dead_reason if llm else "starting"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        llm = state["llm"]
        stats = await llm.stats() if llm.is_running else None
        return Response(state["metrics"].render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": shardlm.__version__}

    @app.get("/v1/models")
    async def models():
        serving = state["serving"]
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "shardlm",
             "max_model_len": serving.max_model_len} for n in serving.model_names]}

    async def respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        return await respond(await state["serving"].completions(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        return await respond(await state["serving"].chat(req))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving = state["serving"]
        serving.check_model(req.model)
        tok = state["llm"].tokenizer
        if req.messages is not None:
            text = tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages],
                                           tokenize=False, add_generation_prompt=True,
                                           chat_template=serving.chat_template)
            ids = tok(text, add_special_tokens=False).input_ids
        elif req.prompt is not None:
            ids = tok(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
        else:
            raise OpenAIError("Give a prompt or messages.", 400, "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        state["serving"].check_model(req.model)
        llm = state["llm"]
        bad = [t for t in req.tokens if not 0 <= t < llm.config.model.vocab_size]
        if bad:
            raise OpenAIError(f"Token ids {bad[:5]} are outside the vocabulary.", 400, "tokens")
        return {"prompt": llm.tokenizer.decode(req.tokens)}

    return app


def run_server(engine_args: EngineArgs, host: str, port: int, api_key: str | None = None,
               chat_template: str | None = None, log_level: str = "info") -> None:
    config = engine_args.create_engine_config()   # bad settings fail here, plainly, before any process starts
    app = build_app(config, api_key, chat_template)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    failed = {}

    async def watch_engine():
        """If the engine process dies: /health answers 503 for a moment (so health checkers see
        it), then the server stops and exits non-zero."""
        while not server.should_exit:
            llm = app.state.shardlm.get("llm")
            if llm is not None and not llm.is_running:
                failed["reason"] = llm.dead_reason
                await asyncio.sleep(_UNHEALTHY_GRACE_S)
                server.should_exit = True
            await asyncio.sleep(0.2)

    async def main():
        watcher = asyncio.ensure_future(watch_engine())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    asyncio.run(main())
    if failed:
        print(f"shardlm: error: {failed['reason']} The server stopped.", file=sys.stderr)
        sys.exit(1)
    if not server.started:
        sys.exit(1)
