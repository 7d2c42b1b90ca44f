"""Server-sent events: `data: {json}` lines and the closing `data: [DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse

from stepserve.server.errors import dumps, error_body

log = logging.getLogger("stepserve.server")

DONE = b"data: [DONE]\n\n"


def event(obj) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8", errors="replace") + b"\n\n"


SHUTDOWN_CUT = error_body("The server shut down before this response finished", "server_error", None,
                          "server_shutting_down")


class SSEResponse(StreamingResponse):
    """A stream with a cleanup that runs however the response ends: finished,
    client gone before the first byte, or cancelled at shutdown. (A generator
    that never started would not run its own `finally`.)

    Cancelled at shutdown (uvicorn cancels what outlives `--shutdown-timeout`),
    the stream ends like any other failed stream, with an error event and
    `[DONE]`, and the cut is logged in one line, not as a traceback."""

    def __init__(self, body: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], name: str = ""):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup
        self._name = name

    async def __call__(self, scope, receive, send) -> None:
        start = time.monotonic()
        cut = False
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            cut = True
        finally:
            try:
                # a cancelled send leaves the body suspended at a yield: close it
                # first, so that it stops iterating before its streams close
                await self.body_iterator.aclose()
            finally:
                await self._cleanup()
        if cut:
            log.warning("cut at shutdown: stream %s after %.1f s", self._name, time.monotonic() - start)
            with contextlib.suppress(Exception):  # the client may be gone too
                await send({"type": "http.response.body", "body": event(SHUTDOWN_CUT) + DONE, "more_body": False})
