"""What every request passes before its route: the API key check, and the X-Request-Id header
of --enable-request-id-headers (the limits on headers and body: transport.py)."""

from __future__ import annotations

import hmac
import uuid

from shardlm.entrypoints.openai.errors import error_response
from shardlm.entrypoints.openai.protocol import OpenAIError


class ApiKeyCheck:
    """ASGI middleware: every route but the open ones (health, metrics, version) needs
    'Authorization: Bearer <key>'."""

    def __init__(self, app, api_key: str, open_routes: tuple[str, ...]):
        self.app, self.expected, self.open_routes = app, f"Bearer {api_key}".encode(), open_routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_routes:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(OpenAIError("Missing or wrong API key: send 'Authorization: Bearer <key>'.",
                                                  401, type_="AuthenticationError"))
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestIdHeader:
    """ASGI middleware: every answer carries X-Request-Id, the one the request came with or a new one."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", given)]
            await send(message)
        return await self.app(scope, receive, send_with_id)
