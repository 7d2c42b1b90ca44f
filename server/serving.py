"""Between the routes and the `AsyncEngine`: prompt checks, submission, latency
metrics, merging the streams of a multi-prompt request, and client disconnects.

A route translates its request, then `client.start(...)` admits it and opens
its streams, and the `Generation` it returns answers: as SSE, with the route's
`chunk` rendering each delta, or collected whole into the route's `final` JSON.

A request is submitted and *primed* (its first output delta awaited) before any
response byte is sent, so an error the engine raises while adding it becomes a
clean 400 rather than a broken stream. Leaving a stream early (client gone,
task cancelled) closes it, which aborts the engine request at once and returns
its KV slots. If the engine dies mid-response, a stream ends with an SSE
error event (OpenAI's error body) and `[DONE]`, and a whole response is a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Iterable, Sequence

from starlette.requests import Request

from stepserve.engine.async_engine import EngineDeadError
from stepserve.engine.request import CompletionOutput, RequestOutput
from stepserve.engine.sampling_params import SamplingParams
from stepserve.kvcache.pool import ReqToTokenPool
from stepserve.scheduler.errors import RequestError
from stepserve.scheduler.limits import Limits
from stepserve.server.admission import Admission, Ticket
from stepserve.server.cli import DEFAULT_MAX_REQUEST_BYTES
from stepserve.server.errors import APIError, SafeJSONResponse, bad_request, engine_unavailable, error_body
from stepserve.server.grammar import GrammarCompiler
from stepserve.server.logprobs import TokenTexts
from stepserve.server.metrics import ServerMetrics
from stepserve.server.openai_common import Accumulator
from stepserve.server.sse import DONE, SSEResponse, event

log = logging.getLogger("stepserve.server")


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_queued_requests: int = 1024  # accepted beyond the engine's max_running, then 429
    retry_after_s: int = 1
    max_request_bytes: int | None = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413 before they are read
    metrics_poll_s: float = 1.0
    # usage.prompt_tokens_details (cached prompt tokens) on the OpenAI chat and completions routes: off by
    # default, as in vLLM (--enable-prompt-tokens-details) and SGLang (--enable-cache-report)
    enable_prompt_tokens_details: bool = False


class ClientDisconnected(Exception):
    pass


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def refused(err: RequestError, names: dict[str, str] | None) -> APIError:
    """A 400 for a request the engine refused, its parameter in the route's
    names (`names`: engine name -> API name)."""
    return bad_request(str(err), (names or {}).get(err.param, err.param), err.code)


class Stream:
    """One engine request, primed; iterate once. Measures its latencies."""

    def __init__(self, agen, first: RequestOutput, first_time: float, start: float, metrics: ServerMetrics, abort):
        self._agen = agen
        self._first_time = first_time
        self._abort = abort  # abort(request_id), for when the generator cannot be closed
        self._first = first
        self._start = start
        self._metrics = metrics
        self._closed = False
        self.prompt_tokens = len(first.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self._first.request_id

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        m = self._metrics
        first_tok = last_tok = None
        counts: dict[int, int] = {}
        item, now = self._first, self._first_time
        try:
            while True:
                k = 0
                for o in item.outputs:
                    k += len(o.token_ids)
                    counts[o.index] = counts.get(o.index, 0) + len(o.token_ids)
                if k:
                    if first_tok is None:
                        first_tok = now
                        m.ttft.observe(now - self._start)
                    else:
                        m.itl.observe(now - last_tok)
                    last_tok = now
                yield item
                if item.finished:
                    m.observe_request(self._start, first_tok, now, max(counts.values(), default=0),
                                      len(item.prompt_token_ids or ()), sum(counts.values()))
                    m.observe_phases(item.metrics)
                    return
                item = await self._agen.__anext__()
                now = time.perf_counter()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                await self._agen.aclose()  # aborts the engine request unless it finished
            except RuntimeError:  # still being iterated elsewhere: abort by id (a no-op once finished)
                self._abort(self.request_id)


async def merge(streams: Sequence[Stream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta) from every stream, in arrival order."""
    if len(streams) == 1:
        it = streams[0].__aiter__()
        try:
            async for out in it:
                yield 0, out
        finally:
            await it.aclose()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: Stream) -> None:
        it = s.__aiter__()
        try:
            async for out in it:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            await it.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def until_disconnected(request: Request, aw: Awaitable):
    """Runs aw; if the client disconnects first, cancels it (which aborts its
    engine requests) and raises ClientDisconnected."""
    task = asyncio.ensure_future(aw)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise ClientDisconnected()


# (delta, [(choice index, that choice's delta)] as recorded by the Accumulator) -> SSE payload, a list of
# payloads (one event each), or None for no event
RenderChunk = Callable[[RequestOutput, "list[tuple[int, CompletionOutput]]"], "dict | list[dict] | None"]


class Generation:
    """The engine work of one admitted HTTP request: its primed streams, the
    admission ticket they hold and the Accumulator of their deltas. Answer with
    `respond` (or `sse` / `collect`); whichever way the response ends, the
    streams close and the ticket is released."""

    def __init__(self, request: Request, streams: list[Stream], ticket: Ticket, acc: Accumulator):
        self.request = request
        self.streams = streams
        self.ticket = ticket
        self.acc = acc

    async def aclose(self) -> None:
        try:
            for s in self.streams:
                await s.aclose()
        finally:
            self.ticket.release()

    async def respond(
        self,
        stream: bool,
        chunk: RenderChunk,
        final: Callable[[], dict],
        first: Iterable[dict] = (),
        last: Callable[[], dict | None] | None = None,
    ):
        """An SSE response (see `sse`) if `stream`, else everything collected
        and `final()` as JSON."""
        if stream:
            return self.sse(chunk, first, last)
        await self.collect()
        return SafeJSONResponse(final())

    def sse(self, chunk: RenderChunk, first: Iterable[dict] = (), last: Callable[[], dict | None] | None = None):
        """Events: each of `first` (iterated once the response starts), then
        `chunk(...)` per delta, then `last()`, where not None; then `[DONE]`.
        A failure after the first byte (the status line is gone) ends the
        stream with one error event, then `[DONE]`."""
        async def body():
            try:
                for obj in first:
                    yield event(obj)
                async for i, out in merge(self.streams):
                    obj = chunk(out, self.acc.add(i, out))
                    if isinstance(obj, list):
                        for o in obj:
                            yield event(o)
                    elif obj is not None:
                        yield event(obj)
                obj = last() if last is not None else None
                if obj is not None:
                    yield event(obj)
            except EngineDeadError as e:
                yield event(engine_unavailable(e).body())
            except APIError as e:  # after the first byte: e.g. an output constraint that gave up on the way
                yield event(e.body())
            except Exception as e:
                log.exception("stream of %s failed", self.request.url.path)
                yield event(error_body(f"Internal server error: {type(e).__name__}", "server_error"))
            finally:
                await self.aclose()
            yield DONE

        return SSEResponse(body(), self.aclose, ", ".join(s.request_id for s in self.streams))

    async def collect(self, watch: bool = True) -> None:
        """Every delta into the Accumulator; a client that leaves first gets
        ClientDisconnected (and its engine requests are aborted). `watch`
        False: the client is not waited on (a background response, whose
        HTTP request has already been answered)."""
        async def drain():
            async for i, out in merge(self.streams):
                self.acc.add(i, out)

        try:
            await (until_disconnected(self.request, drain()) if watch else drain())
        finally:
            await self.aclose()


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: the longest of each
    token's decoded text and its vocabulary piece (a SentencePiece '▁the'
    decodes to 'the' but covers ' the'; a byte-fallback piece is longer than
    its byte). Special tokens count: they can be written in a prompt."""
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    longest = max((len(p) for p in pieces if p is not None), default=1)
    for i in range(n):
        longest = max(longest, len(tokenizer.decode([i])))
    return max(longest, 1)


class EngineClient:
    """What the routes need from the engine; requests are checked here, as they
    enter, with the engine's own `Limits` and `SamplingParams` checks."""

    def __init__(self, async_engine, settings: ServerSettings, metrics: ServerMetrics):
        self.async_engine = async_engine
        info = async_engine.info
        self.settings = settings
        self.metrics = metrics
        self.tokenizer = async_engine.tokenizer
        self.max_model_len = info.max_model_len
        self.model_path = info.model  # the model directory, as vLLM reports it in root
        self.vocab_size = info.vocab_size
        self.eos_token_ids = tuple(info.eos_token_ids)
        self.limits = Limits(info.max_model_len, info.kv_capacity, info.vocab_size,  # the engine's own rules
                             ReqToTokenPool.rows_for(info.max_running))
        self.admission = Admission(info.max_running, settings.max_queued_requests, settings.retry_after_s)
        self.texts = TokenTexts(self.tokenizer)
        self.max_token_chars = longest_token_chars(self.tokenizer)
        self.grammar = GrammarCompiler(self.tokenizer, info.tokenizer, self.vocab_size, info.eos_token_ids)

    # -- checks ---------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model and model != self.settings.served_model_name:  # absent or "": the served model
            raise APIError(404, f"The model '{model}' does not exist", param="model", code="model_not_found")

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuses, before any tokenizing, a text too long for the context
        whatever its tokens: no token covers more than `max_token_chars`
        characters, so a text of more than max_model_len x that many cannot
        fit. (Tokenizing a 24 MB prompt took 40 s and 3 GB that were never
        returned, only to refuse it.)"""
        if chars > self.max_model_len * self.max_token_chars:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt has {chars} "
                f"characters, more than {self.max_model_len} tokens of at most {self.max_token_chars} characters "
                "each can hold",
                param,
                code="context_length_exceeded",
            )

    async def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text, checked for length first; long texts are
        tokenized off the event loop (the tokenizer releases the GIL).
        `add_special_tokens`: the tokenizer's own (a BOS), as `Engine.tokenize`."""
        self.check_text_length(len(text), param)
        return await self.async_engine.encode(text, add_special_tokens)

    def check_prompt(self, ids: list[int], param: str) -> None:
        try:
            self.limits.check_prompt(ids)
        except RequestError as e:
            raise refused(e, {"prompt": param}) from None

    def max_tokens(self, plen: int, requested: int | None, default: int | None, param: str) -> int:
        try:
            return self.limits.max_tokens(plen, requested, default)
        except RequestError as e:
            raise refused(e, {"max_tokens": param}) from None

    def sampling_params(self, names: dict[str, str] | None = None, **kw) -> SamplingParams:
        """SamplingParams, validated against the vocabulary; a RequestError
        becomes a 400 naming the request's parameter (via `names`)."""
        try:
            params = SamplingParams(**kw).check_token_ids(self.vocab_size)
            self.limits.check_n(params.n)
            return params
        except RequestError as e:
            raise refused(e, names) from None

    async def compile_grammar(self, response_format):
        if response_format is None or response_format.type == "text":
            return None
        return await asyncio.to_thread(self.grammar.compile, response_format)

    async def compile_schema(self, schema: dict, param: str):
        return await asyncio.to_thread(self.grammar.compile_schema, schema, param)

    # -- submission -------------------------------------------------------------
    async def open(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        request_id: str,
        names: dict[str, str] | None = None,
        stages: list[dict] | None = None,
        slo: tuple[float | None, float | None] = (None, None),
    ) -> list[Stream]:
        """Submits one engine request per prompt and primes them all. On any
        failure nothing stays submitted. `stages`: each is a fork/join
        request; `slo`: (TTFT, TPOT) seconds of each, for the step policies."""
        start = time.perf_counter()
        gens = [
            self.async_engine.generate(p, sp, f"{request_id}-{i}" if len(prompts) > 1 else request_id, stages=stages,
                                       slo_ttft_s=slo[0], slo_tpot_s=slo[1])
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        async def prime(g):
            first = await g.__anext__()
            return first, time.perf_counter()

        results = await asyncio.gather(*(prime(g) for g in gens), return_exceptions=True)
        err = next((r for r in results if isinstance(r, BaseException)), None)
        if err is not None:
            for g in gens:
                await g.aclose()
            if isinstance(err, RequestError):
                raise refused(err, names)
            if isinstance(err, EngineDeadError):
                raise engine_unavailable(err)
            raise err
        return [Stream(g, first, t, start, self.metrics, self.async_engine.abort) for g, (first, t) in zip(gens, results)]

    async def start(
        self,
        request: Request,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        request_id: str,
        n: int,
        names: dict[str, str] | None = None,
        stages: list[dict] | None = None,
        slo: tuple[float | None, float | None] = (None, None),
        watch: bool = True,
    ) -> Generation:
        """Admits the request (one slot per prompt, or 429), then opens its
        streams (see `open`) unless the client leaves first (`watch` False: the
        client is not waited on -- a background response); on any failure the
        slots are given back."""
        ticket = self.acquire(len(prompts))
        try:
            opening = self.open(prompts, params, request_id, names, stages, slo)
            streams = await (until_disconnected(request, opening) if watch else opening)
        except BaseException:
            ticket.release()
            raise
        for p in params:  # one engine request per prompt, as vLLM counts them
            self.metrics.request_params_n.observe(p.n)
            self.metrics.request_params_max_tokens.observe(p.max_tokens)
        return Generation(request, streams, ticket, Accumulator(n, [len(p) for p in prompts],
                                                                self.settings.enable_prompt_tokens_details))

    def acquire(self, k: int) -> Ticket:
        try:
            return self.admission.acquire(k)
        except APIError as e:
            if e.status == 429:
                self.metrics.rejected.inc()
            raise
