"""Server-sent events: `data: {json}` lines and the closing `data: [DONE]`."""

from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse

from stepserve.server.errors import dumps

DONE = b"data: [DONE]\n\n"


def event(obj) -> bytes:
    return b"data: " + dumps(obj).encode("utf-8", errors="replace") + b"\n\n"


class SSEResponse(StreamingResponse):
    """A stream with a cleanup that runs however the response ends: finished,
    client gone before the first byte, or cancelled at shutdown. (A generator
    that never started would not run its own `finally`.)"""

    def __init__(self, body: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                # a cancelled send leaves the body suspended at a yield: close it
                # first, so that it stops iterating before its streams close
                await self.body_iterator.aclose()
            finally:
                await self._cleanup()
