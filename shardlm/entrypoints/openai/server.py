"""The OpenAI-compatible HTTP server: FastAPI over AsyncLLM (the engine core in its own process).
build_app starts the engine with the app and assembles the routers (routes/: OpenAI, tokenizer,
LoRA admin, health and metrics), the middleware and the error handlers; run_server serves it
and stops when the engine dies."""

from __future__ import annotations

import asyncio
import gc
import ssl
import sys
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

import shardlm
from shardlm import envs
from shardlm.config import EngineConfig
from shardlm.engine.arg_utils import EngineArgs
from shardlm.engine.async_llm import AsyncLLM
from shardlm.engine.restarts import RestartPolicy
from shardlm.entrypoints.openai.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, DrainGate, DrainingServer
from shardlm.entrypoints.openai.errors import add_error_handlers
from shardlm.entrypoints.openai.frontend_options import FrontendOptions
from shardlm.entrypoints.openai.http_options import HttpOptions
from shardlm.entrypoints.openai.listen import bind_sockets
from shardlm.entrypoints.openai.metrics import ServerMetrics
from shardlm.entrypoints.openai.middleware import ApiKeyCheck
from shardlm.entrypoints.openai.protocol import RequestLimits, publish_vocabulary
from shardlm.entrypoints.openai.routes import (
    health,
    lora_admin,
    openai_api,
    pooling,
    responses,
    sagemaker,
    sleep,
    tokenizer,
)
from shardlm.entrypoints.openai.serving import OpenAIServing
from shardlm.entrypoints.openai.serving_pooling import PoolingServing
from shardlm.entrypoints.openai.serving_responses import ResponsesServing
from shardlm.entrypoints.openai.state import ServerState
from shardlm.entrypoints.openai.tracing import RequestTracer, TraceHeaders
from shardlm.entrypoints.openai.transport import TransportGuard, guarded_protocol
from shardlm.logger import init_logger
from shardlm.lora.peft import front_end_check
from shardlm.lora.request import LoRARequest
from shardlm.processes import start_fork_server_early

logger = init_logger(__name__)
_UNHEALTHY_GRACE_S = 2.0   # how long /health reports 503 after the engine died, before exiting


def build_app(config: EngineConfig, api_key: str | None = None, chat_template: str | None = None,
              limits: RequestLimits | None = None, metrics_require_key: bool = False,
              tool_parser: str | None = None, lora_modules: list[LoRARequest] | None = None,
              restarts: RestartPolicy | None = None, otlp_traces_endpoint: str | None = None,
              http: HttpOptions | None = None, frontend: FrontendOptions | None = None) -> FastAPI:
    """lora_modules: --lora-modules, as LoRARequests (their ids are given out here); restarts: when
    to start a dead engine again (None: never; the server then exits); otlp_traces_endpoint: where
    each request's span goes (None: no tracing); http: CORS and the docs pages (http_options.py);
    frontend: how answers are written (frontend_options.py)."""
    limits, http = limits or RequestLimits(), http or HttpOptions()
    state = ServerState()
    tracer = RequestTracer(otlp_traces_endpoint, config.model.served_model_name) if otlp_traces_endpoint else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        t0 = time.perf_counter()
        llm = AsyncLLM(config, restarts=restarts)
        names = llm.config.model.served_model_names
        state.llm, state.serving = llm, OpenAIServing(llm, names, chat_template, limits, tool_parser, frontend)
        state.pooling = PoolingServing(state.serving)
        state.responses = ResponsesServing(state.serving)
        for module in lora_modules or []:       # each checked and read now: a bad one stops the start
            lora = state.serving.loras.new(module.lora_name, module.lora_path, module.base_model_name)
            await llm.add_lora(lora)
            state.serving.loras.add(lora)
        cache = llm.config.cache
        state.metrics = ServerMetrics(names[0], llm.config.model.max_model_len, {
            "block_size": str(cache.block_size), "cache_dtype": cache.kv_cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization), "num_gpu_blocks": str(llm.num_blocks)})
        llm.on_finished = state.metrics.observe_finished
        if tracer is not None:
            state.serving.tracer = tracer
            llm.on_finished = lambda out: (state.metrics.observe_finished(out), tracer.finish(out))
        llm.output_processor.on_tokens = state.metrics.observe_tokens
        logger.info("Serving %s (dtype %s) after %.1f s", names[0], str(llm.config.model.dtype).replace("torch.", ""),
                    time.perf_counter() - t0)
        try:
            yield
        finally:
            llm.shutdown()
            if tracer is not None:
                tracer.shutdown()

    app = FastAPI(title="shardlm", version=shardlm.__version__, lifespan=lifespan, **http.fastapi_kwargs())
    app.state.shardlm = state
    default_openapi = app.openapi

    def openapi() -> dict:        # the schema says this model's bound on token ids
        if app.openapi_schema is None:
            app.openapi_schema = publish_vocabulary(default_openapi(), config.model.vocab_size,
                                                  config.model.logprobs_limit)
        return app.openapi_schema
    app.openapi = openapi
    for router in (health.router, openai_api.router, responses.router, pooling.router, tokenizer.router,
                   sagemaker.router):
        app.include_router(router)
    if envs.SHARDLM_ALLOW_RUNTIME_LORA_UPDATING:
        app.include_router(lora_admin.router)
    if config.model.enable_sleep_mode:
        app.include_router(sleep.router)
    add_error_handlers(app)
    app.add_middleware(TransportGuard, limits=limits)
    if tracer is not None:
        app.add_middleware(TraceHeaders)
    app.add_middleware(DrainGate, state=state, open_routes=health.OPEN_ROUTES)
    if api_key:       # added last, so it runs first
        open_routes = tuple(r for r in health.OPEN_ROUTES if not (metrics_require_key and r == "/metrics"))
        app.add_middleware(ApiKeyCheck, api_key=api_key, open_routes=open_routes)
    http.add_outer_middleware(app)
    return app


def make_server(engine_args: EngineArgs, host: str, port: int, api_key: str | None = None,
                chat_template: str | None = None, log_level: str = "info", limits: RequestLimits | None = None,
                metrics_require_key: bool = False, tool_parser: str | None = None,
                lora_modules: list[LoRARequest] | None = None,
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                restarts: RestartPolicy | None = None, otlp_traces_endpoint: str | None = None,
                http: HttpOptions | None = None, frontend: FrontendOptions | None = None) -> DrainingServer:
    """The server `shardlm serve` runs, checked and ready to serve (the engine starts with it)."""
    http = http or HttpOptions()
    sockets = bind_sockets(host, port, http.uds)      # a port in use fails now, not after the model loaded
    try:
        start_fork_server_early()     # the engine core comes from it: its imports overlap ours
        config = engine_args.create_engine_config()   # bad settings fail here, plainly, before the engine starts
        if lora_modules and config.lora is None:
            raise ValueError("--lora-modules needs --enable-lora.")
        for module in lora_modules or []:      # a bad adapter fails here too, before any process starts
            front_end_check(module, config.model, config.lora.max_lora_rank)
        app = build_app(config, api_key, chat_template, limits, metrics_require_key, tool_parser, lora_modules,
                        restarts, otlp_traces_endpoint, http, frontend)
        limits = limits or RequestLimits()
        # uvicorn answers 503 once a request finds limit_concurrency connections open, itself counted
        try:        # uvicorn applies --log-config-file here
            server_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5, http=guarded_protocol(limits),
                                           h11_max_incomplete_event_size=limits.max_header_bytes,
                                           limit_concurrency=limits.max_connections + 1, **http.uvicorn_kwargs())
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"--log-config-file {http.log_config_file}: not a logging configuration ({e}).") \
                from None
        http.quiet_access_log()
        try:
            server_config.load()        # the TLS files are read here, before the engine starts
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--ssl-keyfile/--ssl-certfile/--ssl-ca-certs/--ssl-ciphers: cannot use them: {e}.") \
                from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return DrainingServer(server_config, app.state.shardlm, shutdown_timeout, sockets)


def run_server(*args, **kwargs) -> None:
    """make_server's server, until SIGTERM (drained), SIGINT or the engine's death past its
    restarts (exit 1)."""
    server = make_server(*args, **kwargs)
    failed = {}

    async def watch_engine():
        """If the engine is dead for good (past --max-engine-restarts): /health answers 503 for a
        moment (so health checkers see it), then the server stops and exits non-zero."""
        while not server.should_exit:
            llm = server.state.llm
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

    try:
        asyncio.run(main())
    finally:
        # the server is down: what is left is freed with the process, so the interpreter's exit
        # need not scan it for cycles first (more than a second of a stop's two)
        gc.freeze()
    if server.interrupted:      # Ctrl-C, also where SIGINT was inherited ignored (uvicorn's re-raise is then lost)
        raise KeyboardInterrupt
    if failed:
        print(f"shardlm: error: {failed['reason']} The server stopped.", file=sys.stderr)
        sys.exit(1)
    if not server.started:
        sys.exit(1)
