"""The engine loop's timeline, one JSON line per iteration that did anything.

`EngineConfig.step_log` (`stepserve serve --step-log PATH`) turns it on. It is
what the simulator is checked and calibrated against (`stepserve validate`):
not only each step's shape and time (the `StepRecord`), but everything the
loop spends around it, which a latency model of the forward pass alone does
not see:

  t       wall-clock time (epoch seconds) the iteration's work began: when the
          loop stopped waiting for commands
  wait    seconds the loop sat idle waiting for a command before it (0 when busy)
  adds    requests that entered the engine in this iteration
  cmd     seconds spent handling the commands (adding requests: their checks,
          sequences, detokenizer state)
  rows, decode_rows, ctx, new, pairs, ext, chunks, layered
          the step's features (absent: the iteration ran no step); ext: rows
          that prefill a chunk on the extend path (`StepFeatures.extend_rows`);
          chunks: rows that prefill a chunk, folded or not; layered: 1 when a
          step with chunks did not run as one call (`StepFeatures.layered`)
  step    seconds of the step (`StepRecord.wall_s`: schedule, forward, update)
  fwd     of which the forward pass (`StepRecord.forward_s`)
  cpu     seconds of CPU the loop's thread ran during the step (`time.thread_time`
          around it): below `step` by the time the thread was off the CPU, which
          is other processes on a busy machine (the front end, a load generator)
          where torch runs on that one thread, as a server's engine does on 2 cores
  out     seconds turning the step's tokens into output deltas (detokenizing)
  emit    seconds handing the batch to the transport (pickle and pipe, or queue)
  outs    requests in the batch
  first   the ids of the requests whose first output this iteration handed
          over (absent when none): against a client's first-token time of the
          same request, the way a first token takes from the engine to its client

Lines are buffered; the file is flushed every `flush_every` lines, whenever
the loop goes idle, and when it ends: a reader of an idle server sees every
step.
"""

from __future__ import annotations

import json
import time

# How long a reader waits for an engine that has just gone idle to flush its
# log (it flushes before it blocks for the next command).
SETTLE_S = 0.2

FIELDS = ("t", "wait", "adds", "cmd", "rows", "decode_rows", "ctx", "new", "pairs", "ext", "chunks", "layered", "step", "fwd", "cpu", "out",
          "emit", "outs", "first")


class StepLog:
    def __init__(self, path: str, flush_every: int = 256):
        self.f = open(path, "a", buffering=1 << 16)
        self.flush_every = flush_every
        self._n = 0
        self._flushed = 0

    def write(self, line: dict) -> None:
        self.f.write(json.dumps(line, separators=(",", ":")))
        self.f.write("\n")
        self._n += 1
        if self._n - self._flushed >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._n != self._flushed:
            self.f.flush()
            self._flushed = self._n

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()


def wall_offset() -> float:
    """Wall-clock (epoch) time = time.perf_counter() + this, now. Intervals keep
    perf_counter's resolution; the step log and the clients whose times are
    set against it (replay, the profile's probes) each read it when they
    stamp an event, never once for a process's life: a VM's wall clock is
    stepped (NTP, a pause or a migration), and a mapping read when a server
    started set its steps tens of ms off a later client's (seen under CI: a
    replay's first tokens read 40 ms after their steps, and the run's
    window lost its first step)."""
    return time.time() - time.perf_counter()


def output_batches(lines: list[dict]) -> int:
    """The iterations among `lines` that handed outputs to the front end
    (`outs` > 0): each a message it reads and spreads over its streams."""
    return sum(1 for ln in lines if ln.get("outs"))


def read_step_log(path: str, settle_s: float = 0.0) -> list[dict]:
    """The lines of a step log (a partial last line, from a live writer, is
    skipped), after `settle_s` seconds (`SETTLE_S`: of an engine that has just
    gone idle, every step)."""
    if settle_s:
        time.sleep(settle_s)
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out
