"""Limits below the HTTP routes, so that no client can hold the server's memory or connections:
request headers (their size and count: 431), open connections (uvicorn's limit: 503) and slow
clients (a request's headers and body must arrive within --client-timeout seconds: 408).

uvicorn parses HTTP with h11, whose buffer limit bounds the memory of headers that have not
arrived whole; GuardedH11Protocol answers 431 (not uvicorn's 400) when it is exceeded, and closes
a connection whose headers take too long. Headers that arrive whole in one read (h11 takes them
then, whatever their size) and their count are checked by TransportGuard, an ASGI middleware,
which also holds the body to its deadline."""

from __future__ import annotations

import asyncio
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from shardlm.entrypoints.openai.errors import error_response
from shardlm.entrypoints.openai.protocol import OpenAIError, RequestLimits


def guarded_protocol(limits: RequestLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these limits (uvicorn.Config(http=...) takes a class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": float(limits.client_timeout)})


class GuardedH11Protocol(H11Protocol):
    header_timeout_s = 60.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._error_status: int | None = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._cycle_seen = None
        next_event = self.conn.next_event

        def next_event_noting_why():       # h11 says which status a protocol error deserves
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._error_status = e.error_status_hint
                raise
        self.conn.next_event = next_event_noting_why

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._arm_header_timer()        # bytes of a new request: its headers have a deadline
        super().data_received(data)
        if self.cycle is not self._cycle_seen:        # a request's headers came whole
            self._cycle_seen = self.cycle
            self._disarm_header_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        if self._error_status != 431:
            return super().send_400_response(msg)
        self._send_and_close(431, "Request Header Fields Too Large",
                             "The request's headers are larger than this server accepts (--max-header-bytes).")

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._send_and_close(408, "Request Timeout", f"The request's headers did not arrive within "
                                 f"{self.header_timeout_s:g} s (--client-timeout).")

    def _send_and_close(self, status: int, reason: str, text: str) -> None:
        body = text.encode()
        self.transport.write(f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        self.transport.close()


class TransportGuard:
    """ASGI middleware: the headers' size and count (431), and the body read whole before the route
    runs, within max_body_bytes (413) and client_timeout seconds of the request's start (408).
    (Read here because FastAPI turns any error while it reads a body into a 400.) After the body,
    receive() is the server's: a streaming response waits on it to learn that its client left."""

    def __init__(self, app, limits: RequestLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._check_headers(scope)
        if refusal is None:
            body, refusal = await self._read_body(scope, receive)
        if refusal is not None:
            return await error_response(refusal)(scope, receive, send)
        delivered = False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _check_headers(self, scope) -> OpenAIError | None:
        lim, headers = self.limits, scope.get("headers") or ()
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + sum(
            len(k) + len(v) + 4 for k, v in headers)
        if size > lim.max_header_bytes:
            return OpenAIError(f"The request's headers are larger than {lim.max_header_bytes} bytes "
                               "(--max-header-bytes).", 431)
        if len(headers) > lim.max_header_count:
            return OpenAIError(f"The request has more than {lim.max_header_count} headers (--max-header-count).", 431)
        length = dict(headers).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > lim.max_body_bytes:
            return self._too_large()
        return None

    async def _read_body(self, scope, receive) -> tuple[bytes, OpenAIError | None]:
        deadline, parts, size = time.monotonic() + self.limits.client_timeout, [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return b"", OpenAIError(f"The request's body did not arrive within {self.limits.client_timeout} s "
                                        "(--client-timeout).", 408)
            if message["type"] != "http.request":       # the client left
                return b"", None
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.limits.max_body_bytes:
                return b"", self._too_large()
            if not message.get("more_body", False):
                return b"".join(parts), None

    def _too_large(self) -> OpenAIError:
        return OpenAIError(f"The request body is larger than this server accepts ({self.limits.max_body_bytes} "
                           "bytes, --max-body-bytes).", 413)
