"""The engine loop in a child process: `AsyncEngine(process=True)`.

The child (started with `spawn`, so no lock or CUDA state is inherited) builds
the `Engine`, answers `EngineReady` (or `EngineFailed`), then runs the same
`EngineLoop` as the thread transport. One duplex pipe carries the loop's
command messages in (`AddRequest`, `AbortRequest`, `CallEngine`, `Pause`,
`Resume`, `Stop`, from `async_engine`) and, once per loop iteration that
produced anything, one pickled `OutputBatch` out (`LoopDied` if the loop
raised). Every message is a NamedTuple, read by field name.

An `OutputBatch` is by column: one list per field across the iteration's
deltas, and one per `CompletionOutput` field across their completions, so a
64-request step pickles as a few dozen flat lists of small values under one
class reference (a NamedTuple or dataclass per delta would pickle several
times slower: a reduce call, a class reference and an argument tuple each).
The parent rebuilds the `RequestOutput`s from it (`decode_batch`).

The prompt does not travel back: the parent keeps what it sent in
`AddRequest`. `AsyncEngine` sends a text prompt with its ids (tokenized on the
caller's side, not on the loop); only a text sent alone, whose ids then exist
only in the child, gets them back on its first delta
(`OutputBatch.prompt_token_ids`). Token ids never cross twice.

In the parent a sender thread writes commands (so a long prompt never blocks
the event loop on a full pipe) and a receiver thread reads batches and hands
them to the front end; both block in system calls, outside the GIL.

The child ignores SIGINT and SIGTERM: the parent decides when it stops (after
draining) and sends `Stop`. If the parent dies, the pipe reaches EOF and the
child exits at its next poll. If the parent's interpreter exits without
`shutdown()`, an exit hook does it (multiprocessing's own would SIGTERM the
child, which ignores it, and wait forever). If the child dies, the receiver
reaps it and reports the death.
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import operator
import pickle
import queue
import signal
import threading
import traceback
import weakref
from typing import Any, NamedTuple, Sequence

from stepserve.engine.async_engine import (AddRequest, CallEngine, CallReply, Command, EngineLoop, Outputs, Replies,
                                           Stop)
from stepserve.engine.engine import EngineConfig, EngineInfo
from stepserve.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from stepserve.scheduler.errors import RequestError

log = logging.getLogger("stepserve.engine_process")

_PROTO = pickle.HIGHEST_PROTOCOL


# -- child -> parent messages ----------------------------------------------------
class EngineReady(NamedTuple):
    info: EngineInfo


class EngineFailed(NamedTuple):
    """The engine could not be built (or the child died before saying so)."""

    traceback: str


class LoopDied(NamedTuple):
    traceback: str


class RequestFailed(NamedTuple):
    """An add that raised (its error reaches the caller)."""

    before: int  # how many of the batch's deltas came before it, in the loop's order
    request_id: str
    error: BaseException


class OutputBatch(NamedTuple):
    """One loop iteration's results, by column (see the module docstring).

    The delta columns hold, per delta in the loop's order, `RequestOutput`'s
    fields but `prompt` (the parent has it), `outputs` (`num_outputs` rows of
    the completion columns each) and `metrics` (`RequestMetrics`' fields); the
    two sparse ones are dicts by delta row."""

    request_id: list[str]
    finished: list[bool]
    num_cached_tokens: list[int]
    arrival_time: list[float]
    first_token_time: list[float | None]
    finished_time: list[float | None]
    first_scheduled_time: list[float | None]
    num_outputs: list[int]  # how many of the completion rows below are this delta's
    prompt_logprobs: dict[int, list]  # delta row -> its prompt logprobs, for the deltas that have them
    prompt_token_ids: dict[int, list[int]]  # delta row -> the prompt's ids, on a text prompt's first delta
    # per completion, the deltas' in turn (`CompletionOutput`'s fields, in its order)
    index: list[int]
    text: list[str]
    token_ids: list[list[int]]
    finish_reason: list[str | None]
    stop_reason: list[str | int | None]
    logprobs: list[list | None]
    cumulative_logprob: list[float | None]
    stage: dict[int, int]  # completion row -> its fork/join stage, for the rows of a stage after the first
    error: dict[int, str]  # completion row -> why its constraint gave up, for the (rare) rows that have one
    failed: list[RequestFailed]
    replies: list[CallReply]


def _try_pickle(v) -> bool:
    try:
        pickle.dumps(v, _PROTO)
        return True
    except Exception:
        return False


def _picklable(err: BaseException) -> BaseException:
    return err if _try_pickle(err) else RuntimeError(repr(err))


def encode_batch(outputs: Outputs, replies: Replies, owed_ids: set[str]) -> OutputBatch:
    """The child's side: one iteration's outputs as an `OutputBatch`.
    `owed_ids`: the requests whose prompt the parent sent as text, so that it
    lacks their ids; each is sent (and dropped from the set) with its first
    delta, or dropped when the add failed."""
    request_id, finished, num_cached_tokens, num_outputs = [], [], [], []
    arrival_time, first_token_time, finished_time, first_scheduled_time = [], [], [], []
    index, text, token_ids, finish_reason, stop_reason, logprobs, cumulative_logprob = [], [], [], [], [], [], []
    prompt_ids: dict[int, list[int]] = {}
    prompt_lps: dict[int, list] = {}
    stage: dict[int, int] = {}
    error: dict[int, str] = {}
    failed: list[RequestFailed] = []
    for rid, out in outputs:  # one loop of appends: ~20% faster than a comprehension per column
        row = len(request_id)
        if isinstance(out, BaseException):
            owed_ids.discard(rid)
            failed.append(RequestFailed(row, rid, _picklable(out)))
            continue
        if rid in owed_ids:
            owed_ids.discard(rid)
            prompt_ids[row] = out.prompt_token_ids
        if out.prompt_logprobs is not None:
            prompt_lps[row] = out.prompt_logprobs
        request_id.append(rid)
        finished.append(out.finished)
        num_cached_tokens.append(out.num_cached_tokens)
        m = out.metrics
        arrival_time.append(m.arrival_time)
        first_token_time.append(m.first_token_time)
        finished_time.append(m.finished_time)
        first_scheduled_time.append(m.first_scheduled_time)
        num_outputs.append(len(out.outputs))
        for o in out.outputs:
            if o.stage:
                stage[len(index)] = o.stage
            if o.error is not None:
                error[len(index)] = o.error
            index.append(o.index)
            text.append(o.text)
            token_ids.append(o.token_ids)
            finish_reason.append(o.finish_reason)
            stop_reason.append(o.stop_reason)
            logprobs.append(o.logprobs)
            cumulative_logprob.append(o.cumulative_logprob)
    return OutputBatch(
        request_id=request_id, finished=finished, num_cached_tokens=num_cached_tokens, arrival_time=arrival_time,
        first_token_time=first_token_time, finished_time=finished_time, first_scheduled_time=first_scheduled_time,
        num_outputs=num_outputs,
        prompt_logprobs=prompt_lps, prompt_token_ids=prompt_ids, index=index, text=text, token_ids=token_ids,
        finish_reason=finish_reason, stop_reason=stop_reason, logprobs=logprobs,
        cumulative_logprob=cumulative_logprob, stage=stage, error=error, failed=failed, replies=replies,
    )


class KnownPrompt(NamedTuple):
    """A request's prompt in the parent, once its first delta came."""

    text: str | None  # None when it was given as token ids
    token_ids: list[int]


def decode_batch(batch: OutputBatch, prompts: dict[str, Any]) -> tuple[Outputs, Replies]:
    """The parent's side: the `RequestOutput`s (and failed adds, in the loop's
    order) and the call replies of a batch. `prompts`: request id -> the prompt
    as sent in its `AddRequest`, replaced by a `KnownPrompt` at its first delta
    and dropped at its last."""
    comps = list(map(CompletionOutput, batch.index, batch.text, batch.token_ids, batch.finish_reason,
                     batch.stop_reason, batch.logprobs, batch.cumulative_logprob))
    for row, st in batch.stage.items():
        comps[row].stage = st
    for row, err in batch.error.items():
        comps[row].error = err
    metrics = map(RequestMetrics, batch.arrival_time, batch.first_token_time, batch.finished_time,
                  batch.first_scheduled_time)
    prompt_lps, prompt_ids = batch.prompt_logprobs, batch.prompt_token_ids
    outputs: Outputs = []
    k = 0
    for row, (rid, finished, cached, n, m) in enumerate(
            zip(batch.request_id, batch.finished, batch.num_cached_tokens, batch.num_outputs, metrics)):
        prompt = prompts.pop(rid, None) if finished else prompts.get(rid)
        if type(prompt) is not KnownPrompt:  # its first delta
            prompt = _known_prompt(prompt, prompt_ids.get(row))
            if not finished:
                prompts[rid] = prompt
        outputs.append((rid, RequestOutput(rid, prompt.text, prompt.token_ids, comps[k:k + n], finished, cached, m,
                                           prompt_lps.get(row) if prompt_lps else None)))
        k += n
    for f in reversed(batch.failed):  # rare: back in their places, the later first
        prompts.pop(f.request_id, None)
        outputs.insert(f.before, (f.request_id, f.error))
    return outputs, batch.replies


def _known_prompt(sent: str | Sequence[int] | None, ids: list[int] | None) -> KnownPrompt:
    if isinstance(sent, str):  # tokenized in the child: the ids came with this delta
        return KnownPrompt(sent, ids if ids is not None else [])
    if sent is None:  # not sent from here (cannot happen): as little as is known
        return KnownPrompt(None, ids or [])
    try:  # plain ints as the engine makes them; index() is ~2.5x faster than int() and agrees on integers
        return KnownPrompt(None, list(map(operator.index, sent)))
    except TypeError:  # e.g. floats, which the engine's int() takes too
        return KnownPrompt(None, list(map(int, sent)))


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def freeze_heap() -> None:
    """Moves every object alive now out of the cyclic garbage collector's
    reach (`gc.freeze`), after one last collection: for a process whose
    start-up objects (torch, transformers, the model, the app) live as long as
    it does. Python's full collections walk every tracked object: with the
    engine loaded that is ~215,000 objects and a 93-98 ms pause, which came
    once in 4.4 s of generating at batch 64 (measured in-process on the
    embedded model), a stall of every stream in flight. Frozen, they are not
    walked again. Not for a process that makes and drops engines (an `LLM`
    in a user's program, the tests): an engine dropped after the freeze is
    never collected if it holds a reference cycle."""
    gc.collect()
    gc.freeze()


def _child_main(config: EngineConfig, conn, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from stepserve.engine.engine import Engine

    try:
        engine = Engine(config)
    except BaseException:
        conn.send(EngineFailed(traceback.format_exc()))
        return
    freeze_heap()
    conn.send(EngineReady(engine.info()))
    owed_ids: set[str] = set()  # requests whose prompt the parent sent as text alone: it lacks their ids

    def recv() -> Command:
        cmd = conn.recv()
        if type(cmd) is AddRequest and isinstance(cmd.prompt, str) and cmd.prompt_ids is None:
            owed_ids.add(cmd.request_id)
        return cmd

    def poll(timeout: float | None) -> list[Command]:
        cmds = []
        try:
            if conn.poll(timeout):
                cmds.append(recv())
                while conn.poll():
                    cmds.append(recv())
        except (EOFError, OSError):  # the parent is gone
            cmds.append(Stop())
        return cmds

    def emit(outputs: Outputs, replies: Replies) -> None:
        batch = encode_batch(outputs, replies, owed_ids)
        try:
            buf = pickle.dumps(batch, _PROTO)
        except Exception:  # a call returned or raised something that does not pickle
            batch = batch._replace(replies=[
                r if _try_pickle(r.value) else CallReply(r.call_id, False, RuntimeError(
                    f"engine call result does not pickle: {r.value!r}"[:500])) for r in replies])
            buf = pickle.dumps(batch, _PROTO)
        conn.send_bytes(buf)

    loop = EngineLoop(engine, poll, emit)
    try:
        loop.run()
    except BaseException:
        log.exception("engine loop died")
        try:
            conn.send_bytes(pickle.dumps(LoopDied(traceback.format_exc()), _PROTO))
        except OSError:
            pass


_live: "weakref.WeakSet[EngineProcess]" = weakref.WeakSet()
_exit_hook_registered = False


def _shutdown_live_processes() -> None:
    for proc in list(_live):
        proc.shutdown(timeout=10.0)


def _register_exit_hook() -> None:
    """Registered once, after multiprocessing.util registered its own exit
    function (starting a Process imports it), so that ours runs first: atexit
    runs hooks last-registered first."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_shutdown_live_processes)


class EngineProcess:
    """The parent's side: starts the child, waits for its `EngineInfo`, then
    moves commands and output batches across the pipe."""

    def __init__(self, config: EngineConfig, dispatch, died, start_timeout: float = 900.0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_child_main, args=(config, child_conn, logging.getLogger().level),
                                 name="stepserve-engine", daemon=True)
        try:
            self._proc.start()  # pickles the config: its policies must pickle too
        except Exception as e:
            self._conn.close()
            raise ValueError(f"the engine config cannot be sent to an engine process ({e!r}); "
                             "use process=False to keep the engine in this process") from e
        finally:
            child_conn.close()
        _register_exit_hook()
        self._dispatch = dispatch
        self._died = died
        self._closing = False
        try:
            if not self._conn.poll(start_timeout):
                raise RuntimeError(f"the engine process did not start within {start_timeout:.0f} s")
            hello = self._conn.recv()
        except EOFError:  # it died before saying anything (its traceback went to stderr)
            self._proc.join(10)
            hello = EngineFailed(f"the engine process exited with code {self._proc.exitcode} (see its stderr)")
        except BaseException:
            self._proc.kill()
            raise
        if not isinstance(hello, EngineReady):
            self._proc.join(10)
            raise RuntimeError(f"the engine process failed to start:\n{hello.traceback}")
        self.info: EngineInfo = hello.info
        _live.add(self)
        self._prompts: dict[str, Any] = {}  # request id -> its prompt, as sent (see decode_batch)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="stepserve-engine-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="stepserve-engine-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    def send(self, cmd: Command) -> None:
        if type(cmd) is AddRequest:
            # its deltas are rebuilt with it (a text prompt whose ids were made here: known already)
            self._prompts[cmd.request_id] = (KnownPrompt(cmd.prompt, list(cmd.prompt_ids))
                                             if cmd.prompt_ids is not None and isinstance(cmd.prompt, str)
                                             else cmd.prompt)
        self._cmds.put(cmd)

    def _send_loop(self) -> None:
        while True:
            cmd = self._cmds.get()
            if cmd is None:
                return
            try:
                self._conn.send(cmd)
            except (OSError, EOFError):  # the child is gone; the receiver reports it
                return
            except Exception as e:  # a command that does not pickle: fail its caller, not the pipe
                self._fail_command(cmd, e)

    def _fail_command(self, cmd: Command, err: Exception) -> None:
        msg = RuntimeError(f"cannot send {type(cmd).__name__} to the engine process: {err!r}")
        match cmd:
            case AddRequest(request_id=rid):  # e.g. a closure as logits processor
                self._prompts.pop(rid, None)
                self._dispatch([(rid, RequestError(str(msg)))], [])
            case CallEngine(call_id=call_id):
                self._dispatch([], [CallReply(call_id, False, msg)])
            case _:
                log.error("%s", msg)

    def _recv_loop(self) -> None:
        prompts = self._prompts
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                if isinstance(msg, LoopDied):
                    raise RuntimeError(f"engine loop died in its process:\n{msg.traceback}")
                self._dispatch(*decode_batch(msg, prompts))
        except (EOFError, OSError) as e:
            if self._closing:
                err: BaseException = RuntimeError("the engine process was shut down")
            else:
                self._proc.join(5)  # reap it (no <defunct> child) and learn how it ended
                err = RuntimeError(f"the engine process exited ({_exit_status(self._proc.exitcode)}): {e!r}")
        except BaseException as e:
            err = e
        if not self._closing:
            self._proc.join(5)
            log.error("%s", err)
        self._died(err)

    def is_alive(self) -> bool:
        return self._proc.is_alive() and self._receiver.is_alive()

    def shutdown(self, timeout: float) -> None:
        if self._closing:
            return
        self._closing = True
        _live.discard(self)
        self._cmds.put(Stop())
        self._cmds.put(None)
        self._sender.join(timeout)
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._receiver.join(5)
        self._conn.close()
