"""The OpenAI-compatible HTTP server: FastAPI routes over AsyncLLM (engine core in its own
process). Every error has OpenAI's shape; nothing a client sends produces a 500."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import shardlm
from shardlm import envs
from shardlm.config import EngineConfig
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.async_llm import AsyncLLM
from shardlm.engine.core_client import EngineDeadError
from shardlm.entrypoints.openai.metrics import ServerMetrics
from shardlm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    OpenAIError,
    RequestLimits,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from shardlm.entrypoints.openai.serving import EventStream, OpenAIServing, check_encodable, sse
from shardlm.logger import init_logger
from shardlm.lora.peft import read_lora_request
from shardlm.lora.request import LoRARequest

logger = init_logger(__name__)
_OPEN_ROUTES = ("/health", "/metrics", "/version")
_UNHEALTHY_GRACE_S = 2.0   # how long /health reports 503 after the engine died, before exiting


def build_app(config: EngineConfig, api_key: str | None = None, chat_template: str | None = None,
              limits: RequestLimits | None = None, metrics_require_key: bool = False,
              tool_parser: str | None = None, lora_modules: list[LoRARequest] | None = None) -> FastAPI:
    """lora_modules: --lora-modules, as LoRARequests (their ids are given out here)."""
    limits = limits or RequestLimits()
    open_routes = tuple(r for r in _OPEN_ROUTES if not (metrics_require_key and r == "/metrics"))
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        t0 = time.perf_counter()
        llm = AsyncLLM(config)
        names = [llm.config.model.served_model_name]
        state["llm"], state["serving"] = llm, OpenAIServing(llm, names, chat_template, limits, tool_parser)
        for module in lora_modules or []:       # each checked and read now: a bad one stops the start
            lora = state["serving"].loras.new(module.lora_name, module.lora_path, module.base_model_name)
            await llm.add_lora(lora)
            state["serving"].loras.add(lora)
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
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)

    def error(e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path not in open_routes:
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

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception):
        """Anything else: logged with its traceback, answered in OpenAI's shape (never a plain 500)."""
        logger.error("Unexpected error in %s %s", request.method, request.url.path, exc_info=e)
        return error(OpenAIError(f"Internal error: {type(e).__name__}: {e}", 500, type_="InternalServerError"))

    @app.get("/health")
    async def health():
        llm = state.get("llm")
        if llm is None or not llm.is_running:
            return JSONResponse({"status": "unhealthy", "reason": llm.dead_reason if llm else "starting"}, 503)
        if llm.dead_replicas:          # data parallel: the others still serve
            return JSONResponse({"status": "degraded", "dead_replicas": llm.dead_replicas})
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
            *({"id": n, "object": "model", "created": 0, "owned_by": "shardlm", "root": n, "parent": None,
               "max_model_len": serving.max_model_len} for n in serving.model_names),
            *serving.loras.cards(serving.max_model_len)]}

    if envs.SHARDLM_ALLOW_RUNTIME_LORA_UPDATING:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest):
            if state["llm"].config.lora is None:
                raise OpenAIError("LoRA is off: start the server with --enable-lora.", 400, "lora_name")
            loras = state["serving"].loras
            try:
                lora = loras.new(req.lora_name, req.lora_path, req.base_model_name)
                await state["llm"].add_lora(lora)
                loras.add(lora)
            except ValueError as e:
                raise OpenAIError(str(e), 400, "lora_path") from e
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
            lora = state["serving"].loras.remove(req.lora_name)
            if lora is None:
                raise OpenAIError(f"The LoRA adapter '{req.lora_name}' is not loaded.", 404, "lora_name",
                                  "NotFoundError")
            await state["llm"].remove_lora(lora.lora_int_id)
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def respond(request: Request, handler):
        """A whole response, cancelled (its request aborted) if the client goes away first; or a
        stream, which Starlette ends when the client goes (its requests then aborted)."""
        result = await until_disconnected(request, handler)
        if result is None:
            return Response(status_code=499)      # nobody is listening
        if isinstance(result, dict):
            return JSONResponse(result)
        return event_stream_response(result)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await respond(request, state["serving"].completions(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await respond(request, state["serving"].chat(req))

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
            check_encodable(req.prompt, "prompt")
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
    """A failure after a stream has started: an SSE error event, then [DONE] (never a cut stream)."""
    try:
        async for chunk in stream:
            yield chunk
    except Exception as e:   # noqa: BLE001 - reported to the client, logged here
        if isinstance(e, OpenAIError):
            err = e
        elif isinstance(e, EngineDeadError):
            err = OpenAIError(str(e), 503, type_="ServiceUnavailableError")
        else:
            logger.error("Stream failed", exc_info=e)
            err = OpenAIError(f"{type(e).__name__}: {e}", 500, type_="InternalServerError")
        yield sse(err.body())
        yield sse("[DONE]")


class _BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """ASGI middleware: a request body over max_bytes gets 413, whether it says its length or not."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps(OpenAIError(f"The request body is larger than this server accepts ({self.max_bytes} "
                                      "bytes, --max-body-bytes).", 413).body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def run_server(engine_args: EngineArgs, host: str, port: int, api_key: str | None = None,
               chat_template: str | None = None, log_level: str = "info", limits: RequestLimits | None = None,
               metrics_require_key: bool = False, tool_parser: str | None = None,
               lora_modules: list[LoRARequest] | None = None) -> None:
    config = engine_args.create_engine_config()   # bad settings fail here, plainly, before any process starts
    if lora_modules and config.lora is None:
        raise ValueError("--lora-modules needs --enable-lora.")
    for module in lora_modules or []:      # a bad adapter fails here too, before any process starts
        read_lora_request(module, config.model.hf_config, config.lora.max_lora_rank, config.model.download_dir)
    app = build_app(config, api_key, chat_template, limits, metrics_require_key, tool_parser, lora_modules)
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
