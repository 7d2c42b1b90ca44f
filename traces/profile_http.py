"""`stepserve profile --url URL`: the step-latency sweep measured through a
running server, as its clients see it.

The engine-only sweep (traces/profile.py) times `Engine.step()` alone. Inside
a server the same step costs more: the engine thread shares the process (and
the GIL) with the HTTP event loop, and every step also pays for the async
loop's command handling and output delivery. Measured on this machine, steps
ran ~1.3-2x slower in the server than alone. A simulation meant to predict what
clients observe should use a profile measured where they are:

  decode   B streams started together on prompts of L tokens; once all B
           decode in lockstep, the time per token of each stream is one step
           with B rows (the median over streams and rounds is the point's time)
  prefill  one request of P tokens (P <= the server's token budget: one step)
           on an idle server, sent exactly as `stepserve replay` sends it; its
           TTFT is the step plus the request's own way in and its token's way
           out (HTTP, the pipe, SSE), which a replay's TTFT contains too,
           plus the wake-up of an engine that idled 2-300 ms. The fit separates
           them: a per-request overhead (its own column, stored as
           `engine.delivery_s`), a wake-up (a column for the points sent to an
           idle engine, `engine.wake_s`), and the step, charged per step
  hit      the same prompt again after another idle: a full prefix hit, whose
           one step computes one token (decode-shaped), so its TTFT is the
           overhead, the wake-up and a step the decode points price
  mixed    TTFT of a P-token prompt sent (at a random phase) while B streams
           decode: overhead + half a decode step of waiting + the mixed step
           (a busy engine: no wake-up), and B streams' worth of the front
           end's and the client's per-token work in the way (a column of B,
           `engine.stream_s`)

Every request goes through the replay client itself (`Replayer`, the
completions route, streamed), so the profile holds the client's own costs too.
The server must be otherwise idle while it is profiled.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

from stepserve.engine.step_log import wall_offset
from stepserve.scheduler.latency_model import StepFeatures, shape_features
from stepserve.scheduler.plan import NO_FOLD, FoldRule
from stepserve.traces.metrics import RequestRecord
from stepserve.traces.request_spec import RequestSpec, Segment

PROBE_TOKENS = 4  # an idle probe's output tokens: its third gives a later token's delivery, its last the end's


def window_time_per_token(events: list[tuple[float, int]], w: int, n: int) -> float | None:
    """Mean time per token between a stream's w-th and n-th tokens, from its
    events' (arrival time, tokens so far): from the first event that brought
    the count to w or past it, to the last one that kept it at n or below
    (the same window as the gaps between tokens w and n where every event
    carries one token). None where fewer than half the window's tokens lie
    between such events."""
    a = next((i for i, (_, c) in enumerate(events) if c >= w), None)
    b = next((i for i in range(len(events) - 1, -1, -1) if events[i][1] <= n), None)
    if a is None or b is None or b <= a:
        return None
    (ta, ca), (tb, cb) = events[a], events[b]
    if 2 * (cb - ca) < n - w:
        return None
    return (tb - ta) / (cb - ca)


class HTTPSweep:
    def __init__(self, warmup: int, repeats: int, max_batched: int, seed: int,
                 idle_s: tuple[float, float] = (0.002, 0.3), max_len: int | None = None, fold: FoldRule = NO_FOLD):
        self.idle_s = idle_s
        self.fold = fold  # the server's (`served_sizing`): its probes' steps are priced as it runs them
        self.max_len = max_len  # the server's context: a probe's prompt and output within it
        # every TTFT probe, in wall-clock seconds, for a calibration from the server's step log
        self.probes: list[dict] = []
        self.warmup = warmup
        self.repeats = repeats
        self.max_batched = max_batched
        self.rng = random.Random(seed)
        self.raw: dict[tuple, list[tuple[StepFeatures, float]]] = {}
        # decode streams timed, and those whose events came merged past timing (a front end starved of CPU)
        self.decode_streams = {"timed": 0, "untimed": 0}
        self.keys: dict[tuple, dict] = {}
        self.terms: dict[tuple, list[tuple[float, StepFeatures]]] = {}

    def _add(self, key: dict, raw: list) -> None:
        k = tuple(sorted(key.items()))
        self.keys[k] = key
        self.raw.setdefault(k, []).extend(raw)

    def _spec(self, plen: int, out: int) -> RequestSpec:
        return RequestSpec(f"profile-{self.rng.random()}", 0.0, out, (Segment(f"profile:{self.rng.random()}", plen),))

    async def _probe(self, replayer, plen: int, spec: RequestSpec | None = None,
                     out: int = 1) -> tuple[RequestRecord, RequestSpec]:
        """One request of `plen` prompt tokens and `out` output tokens; its send
        and first-token times, and the gaps to its later tokens, are kept (wall
        clock) in `probes`. `spec`: send that prompt again (its KV cached by the
        server: a full prefix hit)."""
        hit = spec is not None
        spec = RequestSpec(f"profile-{self.rng.random()}", 0.0, out, spec.segments) if hit else self._spec(plen, out)
        rec = RequestRecord(spec.request_id, 0.0, plen)
        t0 = time.perf_counter()
        base = wall_offset() + t0
        await replayer._one(spec, rec, t0)
        if rec.error:
            raise RuntimeError(f"profile request failed: {rec.error}")
        self.probes.append({"start": base + rec.start_s, "first": base + rec.first_token_s, "prompt": plen,
                            "hit": hit, "out": out, "itl": list(rec.itl_s)})
        return rec, spec

    async def decode(self, replayer, bs: int, ctx: int) -> None:
        """B streams started together; each stream's time per token from its
        w-th token to its n-th, once all B decode in lockstep. The server
        sends one event per step per stream, except where its front end fell
        behind and merged several steps' tokens into one event (seen on a
        loaded 2-core machine): so each event's running token count is read
        (`continuous_usage_stats`), and the window runs from the first event
        that reached w tokens to the last that did not pass n."""
        # all B must be past their prefill (chunked over several steps) before timing
        w = self.warmup + math.ceil(bs * ctx / self.max_batched) + 1
        # a window of several tokens: one stream's gaps are its only samples here
        n = w + max(8, 4 * self.repeats)
        specs = [self._spec(ctx, n + self.warmup) for _ in range(bs)]
        recs = [RequestRecord(s.request_id, 0.0, ctx) for s in specs]
        progress: list[list[tuple[float, int]]] = [[] for _ in specs]
        t0 = time.perf_counter()
        await asyncio.gather(*(replayer._one(s, r, t0, p) for s, r, p in zip(specs, recs, progress)))
        mid = ctx + (w + n) / 2
        f = shape_features(bs, round(bs * mid), [])
        raw = []
        for r, events in zip(recs, progress):
            if r.error:
                raise RuntimeError(f"profile request failed: {r.error}")
            per_token = window_time_per_token(events, w, n)
            if per_token is not None:
                raw.append((f, per_token))
            self.decode_streams["timed" if per_token is not None else "untimed"] += 1
        self._add({"scenario": "decode", "batch": bs, "context": ctx}, raw)

    async def prefill(self, replayer, plen: int) -> None:
        """TTFT on an idle server through the replay client's own path (the
        OpenAI completions route, streamed), so it holds the same per-request
        overhead as a replay's TTFT. Each probe is sent after the engine idled
        for a time drawn log-uniformly from `idle_s` (low, high), as requests
        at different loads find it: the longer the idling, the deeper asleep.
        After another such idle the same prompt goes again: a full prefix hit,
        whose one step computes one token, shaped like a decode step. Those
        are what the wake-up is read from (`calibrate`): the step model prices
        decode-shaped steps from thousands of busy ones, where a lone prompt's
        step is one the busy steps (prefill chunks beside decode rows) price
        less well. Each probe makes PROBE_TOKENS tokens: the later ones'
        delivery is read off them (`calibrate.probe_costs`)."""
        raw, hits = [], []
        out = max(1, min(PROBE_TOKENS, self.max_len - plen)) if self.max_len else PROBE_TOKENS
        f = shape_features(0, 0, [(0, plen)], self.fold)
        f_hit = shape_features(1, plen, [])
        for rep in range(self.warmup + self.repeats):
            await self._idle()
            rec, spec = await self._probe(replayer, plen, out=out)
            await self._idle()
            again, _ = await self._probe(replayer, plen, spec, out=out)
            if rep >= self.warmup:
                raw.append((f, rec.ttft))
                hits.append((f_hit, again.ttft))
        self._add({"scenario": "prefill", "prompt": plen, "from_request": True, "from_idle": True}, raw)
        self._add({"scenario": "hit", "prompt": plen, "from_request": True, "from_idle": True}, hits)

    async def _idle(self) -> None:
        lo, hi = self.idle_s
        await asyncio.sleep(lo * (hi / lo) ** self.rng.random())

    async def mixed(self, replayer, bs: int, ctx: int, plen: int) -> None:
        """TTFT of a P-token prompt sent while B streams decode: the request's
        overhead, the wait for the step in flight (half a decode step on
        average: probes are sent at a random phase), and the mixed step with
        B decode rows and the prompt. The fit gets all three as terms."""
        w = self.warmup + math.ceil(bs * ctx / self.max_batched) + 1
        per_probe = 12
        for _ in range(3):
            raw, gen = await self._mixed_run(replayer, bs, ctx, plen, w, per_probe)
            if raw:
                break
            # the streams ended before a timed probe: on a loaded machine a probe's trip through the front
            # end can span dozens of a small model's decode steps (seen on CI's 2 busy cores); longer streams
            per_probe *= 4
        ctx_tokens = round(bs * (ctx + gen))
        decode = shape_features(bs, ctx_tokens, [])
        step = shape_features(bs, ctx_tokens, [(0, plen)], self.fold)
        key = {"scenario": "mixed", "batch": bs, "context": ctx, "prompt": plen, "from_request": True, "streams": bs}
        self._add(key, [(step, t) for t in raw])
        self.terms[tuple(sorted(key.items()))] = [(0.5, decode), (1.0, step)]

    async def _mixed_run(self, replayer, bs: int, ctx: int, plen: int, w: int, per_probe: int):
        """One run of `mixed`: B streams, and probes once they decode; the
        probes' TTFTs (those timed) and the streams' mean tokens decoded."""
        # long enough for every probe (each spans a few decode steps: `per_probe`); the streams
        # then end on their own: cancelling them mid-stream leaves the client's
        # connection pool with half-closed connections that fail the next request
        out = w + per_probe * (self.warmup + self.repeats) + 8
        specs = [self._spec(ctx, out) for _ in range(bs)]
        recs = [RequestRecord(s.request_id, 0.0, ctx) for s in specs]
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(replayer._one(s, r, t0)) for s, r in zip(specs, recs)]
        raw = []
        while not all(r.first_token_s is not None and len(r.itl_s) >= w - 1 for r in recs):
            if any(t.done() for t in tasks):
                break
            await asyncio.sleep(0.001)
        gen0 = statistics.median(len(r.itl_s) for r in recs)
        for rep in range(self.warmup + self.repeats):
            gaps = [g for r in recs for g in r.itl_s[-4:]]
            await asyncio.sleep(self.rng.uniform(0, statistics.median(gaps) if gaps else 0.005))
            rec, _ = await self._probe(replayer, plen)
            if any(t.done() for t in tasks):
                break  # the batch is thinning: this probe no longer saw B decode rows
            if rep >= self.warmup:
                raw.append(rec.ttft)
        gen = (gen0 + statistics.median(len(r.itl_s) for r in recs)) / 2
        await asyncio.gather(*tasks)
        if any(r.error for r in recs):
            raise RuntimeError(f"profile request failed: {next(r.error for r in recs if r.error)}")
        return raw, gen

    def points(self) -> list[dict]:
        out = []
        for k, raw in self.raw.items():
            if raw:
                p = {**self.keys[k], "features": raw[0][0], "time": statistics.median(t for _, t in raw), "raw": raw}
                if k in self.terms:
                    p["terms"] = self.terms[k]
                out.append(p)
        return out


async def run_http_sweep(sweep: HTTPSweep, replayer, plan: list[tuple], rounds: int, progress) -> list[dict]:
    """Untimed first-use requests, then `rounds` walks over `plan`, one scenario
    run per entry: ("decode", B, L), ("prefill", P) or ("mixed", B, L, P).
    `progress` (profile.SweepProgress) counts the runs and reports each round."""
    try:
        await sweep.prefill(replayer, 8)  # untimed: first-use costs
        await sweep.decode(replayer, 2, 8)
        sweep.raw.clear()
        sweep.decode_streams = {"timed": 0, "untimed": 0}
        scenarios = {"decode": sweep.decode, "prefill": sweep.prefill, "mixed": sweep.mixed}
        for rnd in range(rounds):
            for kind, *params in plan:
                await scenarios[kind](replayer, *params)
                progress.run_done()
            progress.round_done(rnd)
    finally:  # an error or Ctrl-C still closes the HTTP session and the bar
        progress.close()
        await replayer.close()
    return sweep.points()


HOST_REQUESTS = 96  # requests per pass of `host_work`
# (prompt tokens, output tokens, requests at once) of each kind of pass: the second differs from the first only in
# the tokens streamed, the third from the second in the tokens per output batch (2 at a time: ~8x its batches),
# the fourth from the first in the prompt (256 tokens, or half the server's context where that is less)
HOST_KINDS = ((16, 1, 16), (16, 33, 16), (16, 33, 2), (256, 1, 16))
# the host's costs `fit_host_work` solves for, each against its pass's column
HOST_TERMS = (("request_s", "requests"), ("token_s", "tokens"), ("prompt_token_s", "prompt_tokens"),
              ("batch_s", "batches"))


def front_end_cpu_s(url: str) -> float | None:
    """The server front end's CPU seconds so far (`process_cpu_seconds_total`
    on its /metrics, which needs no API key); None where the server does not
    report it or cannot be asked."""
    import httpx

    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    return None


async def host_work(replayer, passes: int = 2, seed: int = 0, max_len: int | None = None) -> dict | None:
    """The host's work outside the engine: the front end's (its /metrics CPU
    seconds) and this client's (its own CPU time, as a load generator on the
    same machine spends it), over passes of `HOST_REQUESTS` requests of each
    of `HOST_KINDS` in turn, `passes` times. Each pass keeps its wall-clock
    window, so that the server's step log can count the output batches the
    front end took from the engine in it (`count_batches`); `fit_host_work`
    solves the costs. `max_len`: the server's context (the long prompts
    within half of it). None where the server reports no CPU time.
    {"passes": [...], **fit_host_work(passes)}"""
    url = replayer.cfg.url
    if front_end_cpu_s(url) is None:
        return None
    rng = random.Random(seed)
    rows = []
    for k in range(passes * len(HOST_KINDS)):
        plen, out, at_once = HOST_KINDS[k % len(HOST_KINDS)]
        if max_len is not None:
            plen = min(plen, max(16, max_len // 2))
        specs = [RequestSpec(f"host-{rng.random()}", 0.0, out, (Segment(f"host:{rng.random()}", plen),))
                 for _ in range(HOST_REQUESTS)]
        recs = [RequestRecord(s.request_id, 0.0, plen) for s in specs]
        limit = asyncio.Semaphore(at_once)

        async def one(spec, rec):
            async with limit:
                await replayer._one(spec, rec, time.perf_counter())

        fe0, c0 = front_end_cpu_s(url), time.process_time()
        start = time.time()  # wall clock, as the step log's lines
        await asyncio.gather(*(one(s, r) for s, r in zip(specs, recs)))
        end = time.time()
        c1, fe1 = time.process_time(), front_end_cpu_s(url)
        failed = [r.error for r in recs if r.error]
        if failed:
            raise RuntimeError(f"profile request failed: {failed[0]}")
        if fe0 is None or fe1 is None:
            raise RuntimeError(f"the server at {url} stopped reporting its CPU time on /metrics")
        rows.append({"requests": len(specs), "tokens": sum(r.output_tokens for r in recs),
                     "prompt_tokens": plen * len(specs), "at_once": at_once, "start": start, "end": end,
                     "front_end_cpu_s": fe1 - fe0, "client_cpu_s": c1 - c0})
    return {"passes": rows, **fit_host_work(rows)}


def count_batches(rows: list[dict], lines: list[dict]) -> None:
    """Sets each `host_work` pass's `batches`: the output batches
    (`step_log.output_batches`) of the server's step log in its window (the
    log's lines come in time order)."""
    from bisect import bisect_left, bisect_right

    from stepserve.engine.step_log import output_batches

    ts = [ln["t"] for ln in lines]
    for r in rows:
        r["batches"] = output_batches(lines[bisect_left(ts, r["start"]):bisect_right(ts, r["end"])])


def fit_host_work(rows: list[dict]) -> dict:
    """The host's CPU seconds of each pass (front end + client) as
    requests * request_s + tokens * token_s + prompt_tokens * prompt_token_s
    + batches * batch_s, non-negative, each pass weighted by its own CPU time
    (every pass counts alike, a long one no more). Without the passes'
    `batches` (no step log) batch_s is 0 and the others take its share.
    {"request_s", "token_s", "prompt_token_s", "batch_s", "error"}: error,
    the passes' median |fit - cpu| / cpu."""
    import numpy as np

    from stepserve.scheduler.latency_model import nnls

    terms = [(name, col) for name, col in HOST_TERMS if all(col in r for r in rows)]
    X = np.array([[float(r[col]) for _, col in terms] for r in rows])
    y = np.array([r["front_end_cpu_s"] + r["client_cpu_s"] for r in rows])
    w = 1.0 / np.maximum(y, 1e-9)
    coef = nnls(X * w[:, None], y * w)
    got = {name: 0.0 for name, _ in HOST_TERMS} | {name: float(c) for (name, _), c in zip(terms, coef)}
    got["error"] = float(np.median(np.abs(X @ coef - y) / np.maximum(y, 1e-9)))
    return got
