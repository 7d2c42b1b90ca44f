"""`--api-key`: every route but `/health`, `/version` and `/metrics` (as in vLLM:
scrapers send no key) needs `Authorization: Bearer KEY`.

A plain ASGI middleware (not BaseHTTPMiddleware), so streaming responses and
client disconnects pass through untouched.
"""

from __future__ import annotations

import hmac

from stepserve.server.errors import SafeJSONResponse, error_body

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                got = value
                break
        # the scheme is case-insensitive (RFC 7235: "bearer KEY" is as good), the key is not
        scheme, _, key = got.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
            msg = "Incorrect API key provided" if got else "Missing API key: send 'Authorization: Bearer <key>'"
            resp = SafeJSONResponse(error_body(msg, "invalid_request_error", None, "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)
