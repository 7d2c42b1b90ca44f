"""Replay a trace against a running OpenAI-compatible server.

Each request is sent at its (scaled) arrival time: a streamed
`/v1/completions` call (aiohttp, with the SSE stream parsed here) whose prompt
is the trace's token ids
(so shared segments are shared tokens; see request_spec), `max_tokens` = the
trace's output length and `ignore_eos` (a vLLM-style extension the server
accepts), so every request generates exactly its trace length. Greedy
decoding: the cheapest sampler path, and what `stepserve profile` measures.

Timing: TTFT and E2E are measured from the moment the request is sent; ITL is
the gap between successive stream chunks of one choice. How late the client
sent requests against their schedule is reported too (`client_lag_s`): a
client starved of CPU shows up there instead of silently skewing the load.

The client is lean on purpose, as in vLLM's benchmark: it shares the machine
with the server, and the official `openai` client spends ~0.6 ms of CPU per
streamed chunk (pydantic models, httpx) against ~0.06 ms here, which on a
small machine measured the client more than the server.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass

import httpx

from stepserve.engine.step_log import wall_offset
from stepserve.traces.metrics import RequestRecord
from stepserve.traces.progress import progress_bar
from stepserve.traces.request_spec import PromptBuilder, RequestSpec, Segment

DEFAULT_VOCAB = 256  # safe for any model we serve; the server's own vocab_size wins when it reports one


@dataclass
class ServerInfo:
    model: str
    max_model_len: int | None
    vocab_size: int | None


@dataclass
class ReplayConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None  # served model name; None: the server's first model
    api_key: str | None = None
    vocab_size: int | None = None  # prompt token ids are drawn from [16, vocab_size)
    seed: int = 0  # prompt tokens
    temperature: float = 0.0
    timeout_s: float = 3600.0
    warmup: int = 1  # untimed requests first (lazy initialisation, kernel builds)
    progress: bool = True
    max_concurrency: int | None = None  # requests in flight at most; later arrivals wait for a completion
    flush_cache: bool = False  # empty the server's prefix cache before the run (after the warm-up)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_info(url: str, api_key: str | None = None, timeout: float = 30.0) -> ServerInfo:
    headers = auth_headers(api_key)
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout)
    r.raise_for_status()
    card = r.json()["data"][0]
    return ServerInfo(card["id"], card.get("max_model_len"), card.get("vocab_size"))


def served_engine(url: str, api_key: str | None = None, timeout: float = 30.0) -> dict | None:
    """The server's `GET /get_server_info` (SGLang's route, which stepserve
    serves too): its engine's sizing and schedule; None where the server has
    no such route (vLLM)."""
    headers = auth_headers(api_key)
    r = httpx.get(url.rstrip("/") + "/get_server_info", headers=headers, timeout=timeout)
    if r.status_code in (404, 405):
        return None
    r.raise_for_status()
    got = r.json()
    return got if isinstance(got, dict) else None


def wait_ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.2)
    raise TimeoutError(f"server at {url} not ready after {timeout:.0f} s ({last!r})")


class RequestFailed(Exception):
    pass


async def stream_events(resp):
    """The JSON payloads of an SSE response, up to `data: [DONE]`."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            for line in ev.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                obj = json.loads(payload)
                if "error" in obj:
                    raise RequestFailed(f"error event: {obj['error']}")
                yield obj
    raise RequestFailed("stream ended without [DONE]")


class Replayer:
    def __init__(self, cfg: ReplayConfig, info: ServerInfo):
        self.cfg = cfg
        self.info = info
        self.model = cfg.model or info.model
        self.builder = PromptBuilder(cfg.vocab_size or info.vocab_size or DEFAULT_VOCAB, cfg.seed)
        self.url = cfg.url.rstrip("/") + "/v1/completions"
        self.native_url = cfg.url.rstrip("/") + "/generate"  # fork/join requests (`stages`)
        self.headers = auth_headers(cfg.api_key)
        self._session = None
        self.flushed: dict | None = None  # the server's answer to the cache flush, when one was asked for

    @property
    def session(self):
        import aiohttp

        if self._session is None:  # made inside the running event loop
            # Idle pooled connections are closed after 2 s, before a server's own
            # keep-alive timeout (uvicorn's: 5 s) can close one just as it is
            # reused, which fails that request with ServerDisconnectedError
            # (aiohttp's default, 15 s, lost a profile run that way).
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=2.0),
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _body(self, spec: RequestSpec) -> tuple[str, dict]:
        """(url, body): OpenAI's completions route, or for a fork/join request
        the native one, its branches' suffixes as token ids."""
        if not spec.stages:
            return self.url, {"model": self.model, "prompt": self.builder.prompt(spec), "max_tokens": spec.output_len,
                              "n": spec.n, "temperature": self.cfg.temperature, "stream": True,
                              "stream_options": {"include_usage": True}, "ignore_eos": True}
        stages = []
        for st in spec.stages:
            if len(st) == 1 and st[0][0] is None:
                stages.append({"max_tokens": st[0][1]})
            else:
                stages.append({"branches": [{"prompt": [] if seg is None else self.builder.segment(seg),
                                             "max_tokens": out} for seg, out in st]})
        return self.native_url, {"model": self.model, "input_ids": self.builder.prompt(spec), "stream": True,
                                 "sampling_params": {"max_tokens": spec.output_len, "n": spec.n,
                                                     "temperature": self.cfg.temperature, "ignore_eos": True},
                                 "stages": stages}

    async def _one(self, spec: RequestSpec, rec: RequestRecord, t0: float, progress: list | None = None) -> None:
        """Sends one request and fills `rec`. `progress` (a single-choice
        completions request): each token event's (time, tokens so far) is
        appended, from vLLM's `continuous_usage_stats`, so that time per token
        holds where the server merged several steps' tokens into one event."""
        clock = time.perf_counter
        url, body = self._body(spec)
        if progress is not None:
            body = {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        last: dict[int, float] = {}
        counts: dict[int, int] = {}
        usage = None
        rec.start_s = clock() - t0
        try:
            async with self.session.post(url, json=body, headers=self.headers) as resp:
                if resp.status != 200:
                    raise RequestFailed(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for chunk in stream_events(resp):
                    now = clock() - t0
                    if rec.server_id is None:
                        rec.server_id = chunk.get("id")  # joins the record to a step log's `first` ids
                    for c in chunk.get("choices") or chunk.get("outputs") or ():
                        if "token_ids" in c and not c["token_ids"]:
                            continue  # a native output's closing event: no token
                        if rec.first_token_s is None:
                            rec.first_token_s = now
                        i = c["index"]
                        prev = last.get(i)
                        if prev is not None:
                            rec.itl_s.append(now - prev)
                        last[i] = now
                        counts[i] = counts.get(i, 0) + 1
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                        if progress is not None and chunk.get("choices"):
                            progress.append((now, usage["completion_tokens"]))
                rec.end_s = clock() - t0
                # The body's end (the chunked encoding's last chunk) follows [DONE]. Read to it, or aiohttp
                # closes the connection instead of pooling it, and the next request pays a new one (234
                # connections for 400 requests at 128 req/s; 74 once read), a TCP handshake and a new
                # protocol on both sides, which real clients, pooling theirs, do not pay.
                await resp.content.read()
        except Exception as e:  # a failed request is a data point (it misses every SLO), not a crash
            rec.error = f"{type(e).__name__}: {e}"[:500]
            return
        if usage is not None:
            rec.output_tokens = usage["completion_tokens"]
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        else:  # no usage: count chunks (a chunk holds at least one token)
            rec.output_tokens = sum(counts.values())
        rec.branch_tokens = -(-rec.output_tokens // max(1, spec.n))
        if rec.first_token_s is None:
            rec.error = "stream ended without a token"

    async def _warmup(self) -> None:
        for k in range(self.cfg.warmup):
            spec = RequestSpec(f"warmup-{k}", 0.0, 4, (Segment(f"warmup:{k}", 16),))
            rec = RequestRecord(spec.request_id, 0.0, spec.prompt_len)
            await self._one(spec, rec, time.perf_counter())
            if rec.error:  # (a wrong --served-model, --vocab-size or key: the user's to mend, in one line)
                await self.close()
                raise ValueError(f"the server failed the warm-up request: {rec.error}")

    async def flush_cache(self) -> dict:
        """Empties the server's prefix cache, so that this run finds none of an
        earlier run's prompts there (as a simulation, which starts cold, does):
        stepserve's and SGLang's `/flush_cache`, else vLLM's
        `/reset_prefix_cache`. A server with neither gets a warning, once, and
        the run goes on; the answer is kept in `flushed`."""
        base = self.cfg.url.rstrip("/")
        for route in ("/flush_cache", "/reset_prefix_cache"):
            async with self.session.post(base + route, headers=self.headers) as resp:
                if resp.status == 404:
                    continue
                if resp.status != 200:
                    raise RuntimeError(f"{route} answered HTTP {resp.status}: {(await resp.text())[:300]}")
                try:
                    body = await resp.json(content_type=None)
                except ValueError:
                    body = None
                return {"route": route, **(body if isinstance(body, dict) else {})}
        _warn_no_flush(base)
        return {"route": None}

    async def run(self, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
        await self._warmup()
        if self.cfg.flush_cache:
            self.flushed = await self.flush_cache()
        records = [RequestRecord(s.request_id, s.arrival_s, s.prompt_len, n=s.n, stages=1 + len(s.stages))
                   for s in specs]
        bar = progress_bar(len(specs), "replay", "req", self.cfg.progress)
        tasks = []
        t0 = time.perf_counter()
        self.t0_epoch = t0 + wall_offset()  # lines the records up with a server's step log

        limit = asyncio.Semaphore(self.cfg.max_concurrency) if self.cfg.max_concurrency else None

        async def tracked(spec, rec):
            if limit is None:
                await self._one(spec, rec, t0)
            else:
                async with limit:  # the send (start_s) waits for a free slot
                    await self._one(spec, rec, t0)
            bar.update(1)
            if rec.error:
                bar.set_postfix_str(f"failed: {sum(1 for r in records if r.error)}")

        for spec, rec in zip(specs, records):
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(tracked(spec, rec)))
        await asyncio.gather(*tasks)
        bar.close()
        await self.close()
        duration = max((r.end_s for r in records if r.end_s is not None), default=0.0)
        return records, duration


_WARNED_NO_FLUSH: set[str] = set()


def _warn_no_flush(base: str) -> None:
    if base not in _WARNED_NO_FLUSH:
        _WARNED_NO_FLUSH.add(base)
        print(f"warning: {base} has no /flush_cache or /reset_prefix_cache route: each run may find the prompts "
              "of the runs before it in the server's prefix cache", file=sys.stderr)


def replay(specs: list[RequestSpec], cfg: ReplayConfig, info: ServerInfo | None = None):
    """(records, duration_s, t0_epoch, flushed) of one replay of `specs` (already
    scaled): the records' times count from t0_epoch (wall-clock seconds);
    flushed is the server's answer to the cache flush (None: not asked for)."""
    info = info or server_info(cfg.url, cfg.api_key)
    r = Replayer(cfg, info)
    records, duration = asyncio.run(r.run(specs))
    return records, duration, r.t0_epoch, r.flushed
