"""The engine loop in a child process: `AsyncEngine(process=True)`.

The child (started with `spawn`, so no lock or CUDA state is inherited) builds
the `Engine`, reports its `EngineInfo`, then runs the same `EngineLoop` as the
thread transport. One duplex pipe carries commands in and, once per step, one
pickled batch of output deltas (and call replies) out, as plain tuples
(`to_wire`). A delta carries its prompt and prompt ids only the first time;
the parent fills them in after.

In the parent a sender thread writes commands (so a long prompt never blocks
the event loop on a full pipe) and a receiver thread reads batches and hands
them to the front end; both block in system calls, outside the GIL.

The child ignores SIGINT and SIGTERM: the parent decides when it stops (after
draining) and sends "stop". If the parent dies, the pipe reaches EOF and the
child exits at its next poll. If the parent's interpreter exits without
`shutdown()`, an exit hook does it (multiprocessing's own would SIGTERM the
child, which ignores it, and wait forever). If the child dies, the receiver
reaps it and reports the death.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import traceback
import weakref

from stepserve.engine.engine import EngineConfig, EngineInfo
from stepserve.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from stepserve.scheduler.errors import RequestError

log = logging.getLogger("stepserve.engine_process")

_PROTO = pickle.HIGHEST_PROTOCOL


def _try_pickle(v) -> bool:
    try:
        pickle.dumps(v, _PROTO)
        return True
    except Exception:
        return False


def _picklable(err: BaseException) -> BaseException:
    return err if _try_pickle(err) else RuntimeError(repr(err))


def to_wire(out: RequestOutput, with_prompt: bool) -> tuple:
    """A delta as plain tuples (pickles ~3x faster than the dataclasses); the
    prompt and its ids only when the parent does not have them yet."""
    m = out.metrics
    return (
        [(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs, o.cumulative_logprob)
         for o in out.outputs],
        out.finished, out.num_cached_tokens, (m.arrival_time, m.first_token_time, m.finished_time),
        (out.prompt, out.prompt_token_ids) if with_prompt else None, out.prompt_logprobs,
    )


def from_wire(rid: str, w: tuple, prompt: tuple) -> RequestOutput:
    outs, finished, cached, metrics, _, prompt_lps = w
    return RequestOutput(rid, prompt[0], prompt[1], [CompletionOutput(*o) for o in outs], finished, cached,
                         RequestMetrics(*metrics), prompt_lps)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _child_main(config: EngineConfig, conn, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    from stepserve.engine.async_engine import EngineLoop
    from stepserve.engine.engine import Engine

    try:
        engine = Engine(config)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", engine.info()))

    def poll(timeout: float | None) -> list:
        cmds = []
        try:
            if conn.poll(timeout):
                cmds.append(conn.recv())
                while conn.poll():
                    cmds.append(conn.recv())
        except (EOFError, OSError):  # the parent is gone
            cmds.append(("stop",))
        return cmds

    announced: set[str] = set()  # requests whose prompt the parent has

    def emit(outputs, replies) -> None:
        wire = []
        for rid, out in outputs:
            if isinstance(out, BaseException):
                wire.append((rid, _picklable(out)))
                continue
            first = rid not in announced
            if out.finished:
                announced.discard(rid)
            elif first:
                announced.add(rid)
            wire.append((rid, to_wire(out, first)))
        try:
            buf = pickle.dumps(("out", wire, replies), _PROTO)
        except Exception:  # a call returned or raised something that does not pickle
            replies = [r if _try_pickle(r[2]) else (r[0], False, RuntimeError(f"engine call result does not "
                       f"pickle: {r[2]!r}"[:500])) for r in replies]
            buf = pickle.dumps(("out", wire, replies), _PROTO)
        conn.send_bytes(buf)

    loop = EngineLoop(engine, poll, emit)
    try:
        loop.run()
    except BaseException:
        log.exception("engine loop died")
        try:
            conn.send_bytes(pickle.dumps(("dead", traceback.format_exc()), _PROTO))
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
            kind, payload = self._conn.recv()
        except EOFError:  # it died before saying anything (its traceback went to stderr)
            self._proc.join(10)
            kind, payload = "failed", f"the engine process exited with code {self._proc.exitcode} (see its stderr)"
        except BaseException:
            self._proc.kill()
            raise
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(f"the engine process failed to start:\n{payload}")
        self.info: EngineInfo = payload
        _live.add(self)
        self._prompts: dict[str, tuple] = {}  # request id -> (prompt, prompt ids), from its first delta
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="stepserve-engine-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="stepserve-engine-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    def send(self, cmd: tuple) -> None:
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

    def _fail_command(self, cmd: tuple, err: Exception) -> None:
        msg = RuntimeError(f"cannot send {cmd[0]!r} to the engine process: {err!r}")
        if cmd[0] == "add":
            self._dispatch([(cmd[1], RequestError(str(msg)))], [])  # e.g. a closure as logits processor
        elif cmd[0] == "call":
            self._dispatch([], [(cmd[1], False, msg)])
        else:
            log.error("%s", msg)

    def _recv_loop(self) -> None:
        prompts = self._prompts
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                if msg[0] == "dead":
                    raise RuntimeError(f"engine loop died in its process:\n{msg[1]}")
                _, wire, replies = msg
                outputs = []
                for rid, w in wire:
                    if isinstance(w, BaseException):
                        outputs.append((rid, w))
                        continue
                    prompt = w[4] or prompts.get(rid, (None, []))
                    out = from_wire(rid, w, prompt)
                    if out.finished:
                        prompts.pop(rid, None)
                    elif w[4] is not None:
                        prompts[rid] = prompt
                    outputs.append((rid, out))
                self._dispatch(outputs, replies)
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
        self._cmds.put(("stop",))
        self._cmds.put(None)
        self._sender.join(timeout)
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._receiver.join(5)
        self._conn.close()
