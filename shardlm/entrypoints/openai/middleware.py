"""What every request passes before its route: the API key check and the body size limit."""

from __future__ import annotations

import hmac

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
            return await self._refuse(scope, receive, send)
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
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send):
        await error_response(OpenAIError(f"The request body is larger than this server accepts ({self.max_bytes} "
                                         "bytes, --max-body-bytes).", 413))(scope, receive, send)
