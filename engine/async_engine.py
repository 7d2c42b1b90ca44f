"""`AsyncEngine`: the engine's step loop on a background thread, for asyncio callers.

Requests and aborts cross into the loop through a thread-safe queue; each
request's output deltas come back on its own asyncio queue. Errors raised while
adding a request (bad parameters, prompt too long) reach the caller's `await`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import AsyncIterator, Sequence

from stepserve.engine.engine import Engine, EngineConfig
from stepserve.engine.request import RequestOutput
from stepserve.engine.sampling_params import SamplingParams

log = logging.getLogger("stepserve.async_engine")


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None, **kwargs):
        self.engine = engine or Engine(config or EngineConfig(**kwargs))
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="stepserve-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- caller side (any thread, asyncio) ------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields output deltas (new text/tokens per branch) until the request ends.

        Leaving the iteration early (client gone, task cancelled) aborts it.
        """
        if self._dead is not None:
            raise RuntimeError(f"engine loop died: {self._dead!r}")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("add", (prompt, params, request_id, loop, q), fut))
        request_id = await asyncio.wrap_future(fut)
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id, None))

    def call(self, fn):
        """Runs fn(engine) on the loop thread; returns a concurrent Future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, fut))
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None, None))
        self._thread.join(timeout)

    # -- loop thread -----------------------------------------------------------
    def _handle(self, cmd) -> None:
        kind, arg, fut = cmd
        eng = self.engine
        if fut is not None and not fut.set_running_or_notify_cancel():
            return  # the caller gave up (client gone) before the loop got here
        if kind == "add":
            prompt, params, rid, loop, q = arg
            try:
                req = eng.add_request(prompt, params, rid)
            except Exception as e:  # validation errors go back to the caller
                fut.set_exception(e)
                return
            self._streams[req.request_id] = (loop, q)
            fut.set_result(req.request_id)
        elif kind == "abort":
            req = eng.abort_request(arg)
            if req is not None:
                self._deliver(req.request_id, req.output(delta=True))
        elif kind == "call":
            try:
                fut.set_result(arg(eng))
            except Exception as e:
                fut.set_exception(e)

    def _deliver(self, rid: str, item) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        loop, q = stream
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(rid, None)
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                block = not eng.has_unfinished()
                try:
                    cmd = self._cmds.get(block=block, timeout=0.5 if block else None)
                    self._handle(cmd)
                    while True:  # drain everything that queued up during the step
                        self._handle(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                if not eng.has_unfinished():
                    continue
                # one wake-up per event loop per step, not one per request: each
                # call_soon_threadsafe writes the loop's self-pipe and wakes it
                batches: dict[asyncio.AbstractEventLoop, list] = {}
                for req in eng.step():
                    out = req.output(delta=True)
                    if not (out.outputs or out.finished):
                        continue
                    stream = self._streams.get(req.request_id)
                    if stream is None:
                        continue
                    loop, q = stream
                    if out.finished:
                        self._streams.pop(req.request_id, None)
                    batches.setdefault(loop, []).append((q, out))
                for loop, items in batches.items():
                    try:
                        loop.call_soon_threadsafe(_put_all, items)
                    except RuntimeError:  # the caller's loop is closed
                        pass
        except BaseException as e:  # a bug in the step: fail every waiter loudly
            log.exception("engine loop died")
            self._dead = e
            for rid in list(self._streams):
                self._deliver(rid, RuntimeError(f"engine loop died: {e!r}"))
