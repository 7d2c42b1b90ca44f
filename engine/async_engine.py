"""`AsyncEngine`: the engine's step loop for asyncio callers, on a background
thread or in a process of its own.

The loop (`EngineLoop`) is the same either way: between steps it takes the
commands that queued up (one NamedTuple type per command: `AddRequest`,
`AbortRequest`, `CallEngine`, `Pause`, `Resume`, `Stop`), then runs one step
and hands every request's output delta of that step, and the calls'
`CallReply`s, in one batch, to the transport. The front end (`AsyncEngine`)
routes each delta to its request's asyncio queue, with one wake-up per event
loop per step, not one per request.

- `process=False` (the default): the loop is a thread of this process. Policies
  and logits processors may be any Python object, and the `Engine` is at hand
  (`AsyncEngine.engine`), but the loop shares the GIL with the caller.
- `process=True`: the loop runs in a child process (`engine_process`), so its
  Python work (scheduling, op dispatch) runs beside the server's instead of
  taking turns with it. Commands and output batches cross a pipe; `call`
  takes a module-level function, and everything sent must pickle.

Errors raised while adding a request (bad parameters, prompt too long) reach
the caller as the first item of its stream. If the loop dies, every waiter,
and every later call, gets an `EngineDeadError`, and the callbacks given to
`on_death` run once.

An engine is stopped by `shutdown()`, by leaving `async with AsyncEngine(...)`
(or `with`), or at interpreter exit, whichever comes first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, NamedTuple, Sequence

import torch

from stepserve.engine.engine import CacheFlush, Engine, EngineConfig, EngineStats, KVReport
from stepserve.engine.request import RequestOutput
from stepserve.engine.sampling_params import SamplingParams
from stepserve.engine.step_log import StepLog, wall_offset

log = logging.getLogger("stepserve.async_engine")

# texts up to this many characters are tokenized inline: a thread hop costs
# more than their tokenizing (~1 us per character on this project's machine)
INLINE_TOKENIZE_CHARS = 4096


# -- commands: front end -> loop (through a queue, or pickled through the pipe) --
class AddRequest(NamedTuple):
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    stages: list | None = None  # a fork/join request's later stages (`Engine.add_request`)
    slo: tuple | None = None  # (ttft_s, tpot_s): the request's own SLOs, either may be None
    prompt_ids: list[int] | None = None  # a text prompt's ids, tokenized by the sender (not on the loop)


class AbortRequest(NamedTuple):
    request_id: str


class CallEngine(NamedTuple):
    """Run fn(engine, *args) between steps; answered by a `CallReply`."""

    call_id: int
    fn: Callable
    args: tuple


class Pause(NamedTuple):
    """Stop stepping after the current step; adds, aborts and calls still go through."""


class Resume(NamedTuple):
    """Step again."""


class Stop(NamedTuple):
    """End the loop (what is still running is left as it is)."""


Command = AddRequest | AbortRequest | CallEngine | Pause | Resume | Stop


class CallReply(NamedTuple):
    call_id: int
    ok: bool
    value: Any  # fn's result, or (ok=False) what it raised


# one iteration's results: (request id, delta or the error adding it raised), and the calls' replies
Outputs = list[tuple[str, Any]]
Replies = list[CallReply]


class EngineDeadError(RuntimeError):
    """The engine loop is gone (its process died, or the loop raised)."""


class EngineLoop:
    """Commands in, steps, output batches out; transport-agnostic.

    `poll(timeout)` returns the commands queued so far, waiting up to `timeout`
    seconds for one when there are none (None: wait indefinitely); `emit(outputs,
    replies)` is called once per iteration that produced anything.
    """

    def __init__(self, engine: Engine, poll: Callable[[float | None], list], emit: Callable[[Outputs, Replies], None]):
        self.engine = engine
        self.poll = poll
        self.emit = emit
        self.paused = False
        self.stopped = False
        self._started: set[str] = set()  # requests that have handed over an output (kept with a step log)

    def handle(self, cmd: Command, outputs: Outputs, replies: Replies) -> None:
        eng = self.engine
        match cmd:
            case AddRequest(request_id=rid, prompt=prompt, params=params, stages=stages, slo=slo, prompt_ids=ids):
                try:
                    ttft, tpot = slo or (None, None)
                    eng.add_request(prompt, params, rid, stages=stages, slo_ttft_s=ttft, slo_tpot_s=tpot,
                                    prompt_token_ids=ids)
                except Exception as e:  # validation errors go back to the caller
                    outputs.append((rid, e))
            case AbortRequest(request_id=rid):
                req = eng.abort_request(rid)
                if req is not None:
                    outputs.append((req.request_id, req.output(delta=True)))
            case CallEngine(call_id=call_id, fn=fn, args=args):
                try:
                    replies.append(CallReply(call_id, True, fn(eng, *args)))
                except Exception as e:
                    replies.append(CallReply(call_id, False, e))
            case Pause():
                self.paused = True
            case Resume():
                self.paused = False
            case Stop():
                self.stopped = True
            case _:
                raise ValueError(f"unknown engine command {cmd!r}")

    def run(self) -> None:
        eng = self.engine
        path = eng.config.step_log
        log = StepLog(path) if path else None
        try:
            with torch.inference_mode():  # once for the loop (`engine.inference`)
                self._run(log)
        finally:
            if log is not None:
                log.close()

    def _run(self, log: StepLog | None) -> None:
        eng = self.engine
        clock = time.perf_counter
        while not self.stopped:
            outputs: Outputs = []
            replies: Replies = []
            idle = self.paused or not eng.has_unfinished()
            if idle and log is not None:
                log.flush()  # readers see every step once the engine waits
            t_wait = clock()
            cmds = self.poll(None if idle else 0.0)
            t0 = clock()
            for cmd in cmds:
                self.handle(cmd, outputs, replies)
            t1 = t2 = clock()
            stepped = False
            if not self.paused and not self.stopped and eng.has_unfinished():
                before = eng.step_id
                c1 = time.thread_time() if log is not None else 0.0
                changed = eng.step()
                stepped = eng.step_id != before  # a step that scheduled nothing leaves no record
                t2 = clock()
                cpu = time.thread_time() - c1 if log is not None else 0.0
                for req in changed:
                    out = req.output(delta=True)
                    if out.outputs or out.finished:
                        outputs.append((req.request_id, out))
            t3 = clock()
            if outputs or replies:
                self.emit(outputs, replies)
            first = None
            if log is not None and outputs:
                # the requests whose first output this iteration handed over: a client's first-token time
                # against this iteration's end is the way a token takes to it (`stepserve validate`)
                started = self._started
                first = []
                for rid, out in outputs:
                    if not isinstance(out, Exception):
                        if rid not in started and out.outputs:
                            first.append(rid)
                            started.add(rid)
                        if out.finished:
                            started.discard(rid)
            if log is not None and (stepped or cmds):
                line = {"t": round(t0 + wall_offset(), 6), "wait": round(t0 - t_wait, 6),
                        "adds": sum(1 for c in cmds if type(c) is AddRequest), "cmd": round(t1 - t0, 6)}
                if stepped:
                    r = eng.records[-1]
                    line.update(rows=r.rows, decode_rows=r.decode_rows, ctx=r.context_tokens, new=r.new_tokens,
                                pairs=r.prefill_pairs, ext=r.extend_rows, chunks=r.chunk_rows, layered=int(r.layered),
                                step=round(r.wall_s, 6), fwd=round(r.forward_s, 6), cpu=round(cpu, 6),
                                out=round(t3 - t2, 6))
                line.update(emit=round(clock() - t3, 6), outs=len(outputs))
                if first:
                    line["first"] = first
                log.write(line)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None, *, process: bool = False,
                 **kwargs):
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._req_ids = itertools.count()
        self._dead: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._death_lock = threading.Lock()
        self._closing = False  # shutdown() was called: the loop's end is no death
        if process:
            from stepserve.engine.engine_process import EngineProcess

            if engine is not None:
                raise ValueError("process=True builds its engine in the child; pass a config")
            from stepserve.engine.engine import load_tokenizer, tokenizer_dir

            config = config or EngineConfig(**kwargs)
            # this side's tokenizer (transformers' import is most of it, ~1 s) loads while the child starts
            early = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stepserve-tokenizer")
            guess = tokenizer_dir(config)
            tok = early.submit(load_tokenizer, guess)
            early.shutdown(wait=False)
            try:
                self._core = EngineProcess(config, self._dispatch, self._died)
            finally:
                tok_error = tok.exception()  # (waits for it: no thread left importing behind an error)
            self.engine = None
            self.info = self._core.info
            # the child's own choice decides (the same directory unless the config is changed under us)
            self.tokenizer = tok.result() if guess == self.info.tokenizer and tok_error is None \
                else load_tokenizer(self.info.tokenizer)
        else:
            self.engine = engine or Engine(config or EngineConfig(**kwargs))
            self.info = self.engine.info()
            self.tokenizer = self.engine.tokenizer
            self._core = _EngineThread(self.engine, self._dispatch, self._died)

    # -- caller side (any thread, asyncio) ------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        stages: list[dict] | None = None,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields output deltas (new text/tokens per branch) until the request ends.
        `stages`: a fork/join request (`Engine.add_request`); each output's
        `index` is its branch's within the request and `stage` its stage.
        `slo_ttft_s`, `slo_tpot_s`: the request's own SLOs (`Engine.add_request`).

        Deltas that queued up while the caller was busy come as one (merged),
        so a slow consumer does less work per token, not more. Leaving the
        iteration early (client gone, task cancelled) aborts it.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
        if request_id is None:
            request_id = f"areq-{next(self._req_ids)}"
        elif request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        # text is tokenized here, a long one off this event loop, not on the engine's loop, where a
        # megabyte of it stalled every request in flight for the second it took
        prompt_ids = await self.encode(prompt) if isinstance(prompt, str) else None
        if stages:
            stages = await self._encoded_stages(stages)
        if request_id in self._streams:  # (taken while this one was tokenizing)
            raise ValueError(f"duplicate request id {request_id!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        slo = (slo_ttft_s, slo_tpot_s) if slo_ttft_s is not None or slo_tpot_s is not None else None
        self._core.send(AddRequest(request_id, prompt, params or SamplingParams(), stages, slo, prompt_ids))
        finished = False
        try:
            while True:
                item = await q.get()
                while not q.empty() and not isinstance(item, BaseException):
                    nxt = q.get_nowait()
                    item = nxt if isinstance(nxt, BaseException) else item.merge(nxt)
                if isinstance(item, BaseException):
                    finished = True  # never added, or the loop died: nothing to abort
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._core.send(AbortRequest(request_id))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids, as `Engine.tokenize` makes them; a long text in a
        worker thread (the tokenizer releases the GIL), so the caller's event
        loop goes on meanwhile."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def _encoded_stages(self, stages):
        """`stages` with each parallel branch's text suffix as token ids (copies:
        the caller's dicts stay as given). Anything not shaped as a stage is
        left for the engine to refuse."""
        if not isinstance(stages, (list, tuple)):
            return stages
        out = []
        for st in stages:
            branches = st.get("branches") if isinstance(st, dict) else None
            if isinstance(branches, (list, tuple)):
                st = dict(st, branches=[dict(b, prompt=await self.encode(b["prompt"], add_special_tokens=False))
                                        if isinstance(b, dict) and isinstance(b.get("prompt"), str) else b
                                        for b in branches])
            out.append(st)
        return out

    def call(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Runs fn(engine, *args) on the loop, between steps; returns a
        concurrent Future of its result. With process=True, fn must be a
        module-level function and args and result must pickle."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_exception(EngineDeadError(f"engine loop died: {self._dead!r}"))
            return fut
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self._core.send(CallEngine(call_id, fn, args))
        return fut

    async def stats(self, since_step: int = -1) -> EngineStats:
        return await asyncio.wrap_future(self.call(Engine.stats, since_step))

    async def flush_cache(self) -> CacheFlush:
        """Empties the prefix cache between steps (`Engine.flush_cache`)."""
        return await asyncio.wrap_future(self.call(Engine.flush_cache))

    async def kv_report(self) -> KVReport:
        """Runs the KV integrity check on the loop (an AssertionError if it fails)."""
        return await asyncio.wrap_future(self.call(Engine.kv_report))

    def pause(self) -> None:
        """Stops stepping after the current step; adds and aborts still go through."""
        self._core.send(Pause())

    def resume(self) -> None:
        self._core.send(Resume())

    def is_alive(self) -> bool:
        return self._dead is None and self._core.is_alive()

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Calls callback(error) once if the loop dies (at once if it already
        has), from the thread that saw it die: hand work to your own loop."""
        with self._death_lock:
            if self._dead is None:
                self._death_callbacks.append(callback)
                return
        callback(self._dead)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop (and its process); requests still running fail with
        EngineDeadError. Safe to call more than once."""
        self._closing = True
        self._core.shutdown(timeout)

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    async def __aenter__(self) -> "AsyncEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    # -- loop side (the loop thread, or the thread reading the child's pipe) ---
    def _dispatch(self, outputs: Outputs, replies: Replies) -> None:
        for r in replies:
            fut = self._calls.pop(r.call_id, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_result(r.value) if r.ok else fut.set_exception(r.value)
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        streams = self._streams
        for rid, item in outputs:
            stream = streams.get(rid)
            if stream is None:
                continue
            loop, q = stream
            if isinstance(item, BaseException) or item.finished:
                del streams[rid]
            batches.setdefault(loop, []).append((q, item))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _died(self, err: BaseException) -> None:
        """The loop is gone: tell whoever asked, then fail every waiter loudly."""
        with self._death_lock:
            self._dead = err
            callbacks, self._death_callbacks = ([] if self._closing else self._death_callbacks), []
        for cb in callbacks:  # first: a waiter that sees the error knows they ran
            try:
                cb(err)
            except Exception:
                log.exception("engine death callback failed")
        exc = EngineDeadError(f"engine loop died: {err!r}")
        self._dispatch([(rid, exc) for rid in list(self._streams)],
                       [CallReply(cid, False, exc) for cid in list(self._calls)])


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


class _EngineThread:
    """The loop on a daemon thread of this process; outputs are dispatched
    from that thread directly."""

    def __init__(self, engine: Engine, dispatch, died):
        self._cmds: queue.Queue = queue.Queue()
        self._loop = EngineLoop(engine, self._poll, dispatch)
        self._died = died
        self._thread = threading.Thread(target=self._run, name="stepserve-engine", daemon=True)
        self._thread.start()

    def _poll(self, timeout: float | None) -> list:
        cmds = []
        try:
            cmds.append(self._cmds.get(timeout=timeout) if timeout != 0.0 else self._cmds.get_nowait())
            while True:
                cmds.append(self._cmds.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as e:
            log.exception("engine loop died")
            self._died(e)
            return
        # stopped (`shutdown`): requests still running, and any asked for later, fail rather than wait forever
        self._died(RuntimeError("the engine was shut down"))

    def send(self, cmd: Command) -> None:
        self._cmds.put(cmd)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        self._cmds.put(Stop())
        self._thread.join(timeout)
