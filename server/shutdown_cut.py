"""Requests still running when uvicorn's `--shutdown-timeout` runs out are
cancelled. Streams end themselves cleanly (`sse.SSEResponse`); any other
request cut before its response started gets a 503 in OpenAI's error body
here, and one log line instead of uvicorn's "Exception in ASGI application"
traceback per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from stepserve.server.errors import SafeJSONResponse
from stepserve.server.sse import SHUTDOWN_CUT

log = logging.getLogger("stepserve.server")


class ShutdownCutMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            log.warning("cut at shutdown: %s %s after %.1f s", scope["method"], scope["path"],
                        time.monotonic() - start)
            with contextlib.suppress(Exception):  # already started, or the client is gone
                await SafeJSONResponse(SHUTDOWN_CUT, status_code=503)(scope, receive, send)
