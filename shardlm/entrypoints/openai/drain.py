"""Graceful drain: on SIGTERM (how Kubernetes, Docker and systemd stop a service) the server stops
admitting work, lets the requests in flight finish for up to --shutdown-timeout seconds, then
exits 0. New requests meanwhile get 503 with Retry-After, and /health 503, so a load balancer
sends them elsewhere. Requests still running at the deadline end with a 503 error (an error
event in a stream). SIGINT (Ctrl-C), or a second signal, stops at once as before."""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType

import uvicorn

from shardlm.entrypoints.openai.errors import error_response
from shardlm.entrypoints.openai.protocol import OpenAIError
from shardlm.entrypoints.openai.state import ServerState
from shardlm.logger import init_logger

logger = init_logger(__name__)

# Kubernetes gives a pod 30 s between SIGTERM and SIGKILL by default: drain for nearly all of it.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0


class DrainGate:
    """ASGI middleware: counts the requests in flight and, while the server drains, refuses new
    ones (but the open routes: /health says so itself, /metrics and /version still answer)."""

    def __init__(self, app, state: ServerState, open_routes: tuple[str, ...]):
        self.app, self.state, self.open_routes = app, state, open_routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_routes:
            return await self.app(scope, receive, send)
        if self.state.draining:
            response = error_response(OpenAIError("The server is shutting down: send the request to another "
                                                  "replica, or retry.", 503, type_="ServiceUnavailableError",
                                                  headers={"Retry-After": "5"}))
            return await response(scope, receive, send)
        self.state.in_flight += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM turned into a drain of up to `shutdown_timeout` seconds
    (0: stop at once, as vLLM's default)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float,
                 sockets: list[socket.socket] | None = None):
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self.sockets = sockets          # bound already (listen.py); None: uvicorn binds config's host and port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None      # held: the loop keeps only a weak reference to a task
        self.interrupted = False        # stopped by SIGINT (Ctrl-C), whatever this process inherited for it

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets or self.sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets is not None:       # uvicorn says where it listens only on sockets it bound itself
            self._log_started_message(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.state.draining and not self.should_exit
        self.interrupted |= first and sig == signal.SIGINT
        if sig == signal.SIGTERM and first and self.shutdown_timeout > 0 and self._loop is not None:
            self.state.draining = True     # a drained stop is a clean exit: uvicorn does not re-raise it
            self._loop.call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        self._drain = self._loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        logger.info("SIGTERM: draining %d request(s) in flight for up to %g s (--shutdown-timeout); new requests "
                    "get 503", self.state.in_flight, self.shutdown_timeout)
        deadline = self._loop.time() + self.shutdown_timeout
        while self.state.in_flight and self._loop.time() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
        if self.state.in_flight and self.state.llm is not None:
            logger.warning("%d request(s) still running after %g s: ending them", self.state.in_flight,
                           self.shutdown_timeout)
            self.state.llm.fail_all(OpenAIError(
                f"The server shut down before this request finished (--shutdown-timeout {self.shutdown_timeout:g} s).",
                503, type_="ServiceUnavailableError", headers={"Retry-After": "5"}))
        self.should_exit = True
