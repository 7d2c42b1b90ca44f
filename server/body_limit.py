"""`--max-request-bytes`: a request body past the limit gets 413 with
OpenAI's error body, before it is parsed (or, for a chunked body without a
Content-Length, as soon as the bytes read pass the limit).

A plain ASGI middleware, like the API-key check, so streaming responses pass
through untouched.
"""

from __future__ import annotations

from fastapi import HTTPException

from stepserve.server.errors import SafeJSONResponse, error_body


def _message(limit: int) -> str:
    return f"The request body is larger than the server's limit of {limit} bytes"


class _TooLarge(HTTPException):
    """Raised from `receive` while the route reads its body: FastAPI passes an
    HTTPException through, and the app's handler renders it (with this code)."""

    code = "request_too_large"

    def __init__(self, limit: int):
        super().__init__(413, _message(limit))


def _too_large(limit: int) -> SafeJSONResponse:
    return SafeJSONResponse(error_body(_message(limit), "invalid_request_error", None, _TooLarge.code),
                            status_code=413)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    return await _too_large(self.max_bytes)(scope, receive, send)
                break
        seen = 0

        async def counted_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return msg

        try:
            await self.app(scope, counted_receive, send)  # `send` untouched: nothing added per SSE event
        except _TooLarge:  # read outside a route's body parsing; no response can have started yet
            await _too_large(self.max_bytes)(scope, receive, send)
