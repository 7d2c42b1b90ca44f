"""`POST /v1/completions`: prompts (text, texts, token ids, lists of token ids)
to text, streamed as SSE or whole."""

from __future__ import annotations

from starlette.requests import Request

from stepserve.server.errors import SafeJSONResponse, bad_request
from stepserve.server.logprobs import completion_logprobs
from stepserve.server.openai_common import Accumulator, sampling_kwargs
from stepserve.server.protocol import CompletionRequest
from stepserve.server.serving import EngineClient, merge, new_id, until_disconnected
from stepserve.server.sse import DONE, SSEResponse, event

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

# engine parameter name -> this endpoint's
_NAMES = {"logprobs": "logprobs", "max_tokens": "max_tokens", "prompt": "prompt"}


def _prompts(client: EngineClient, prompt) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per prompt."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)
    return [(client.tokenize(p), p) if isinstance(p, str) else (list(p), None) for p in items]


async def create_completion(req: CompletionRequest, request: Request, client: EngineClient):
    client.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (ranking completions is not supported)", "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute", "echo")
    kw = sampling_kwargs(req)
    prompts = _prompts(client, req.prompt)
    for ids, _ in prompts:
        client.check_prompt(ids, "prompt")
    factory = await client.compile_grammar(req.response_format)
    params = [
        client.sampling_params(
            _NAMES,
            **kw,
            max_tokens=client.max_tokens(len(ids), req.max_tokens, DEFAULT_MAX_TOKENS, "max_tokens"),
            logprobs=req.logprobs,
            logits_processor_factory=factory,
        )
        for ids, _ in prompts
    ]
    rid = new_id("cmpl")
    ticket = client.acquire(len(prompts))
    try:
        streams = await until_disconnected(request, client.open([p for p, _ in prompts], params, rid, _NAMES))
    except BaseException:
        ticket.release()
        raise
    acc = Accumulator(req.n, [len(ids) for ids, _ in prompts])
    echoes = [(text if text is not None else client.tokenizer.decode(ids)) if req.echo else ""
              for ids, text in prompts]

    async def cleanup():
        try:
            for s in streams:
                await s.aclose()
        finally:
            ticket.release()

    def head(choices, **extra):
        return {"id": rid, "object": "text_completion", "created": acc.created, "model": client.settings.served_model_name,
                "choices": choices, **extra}

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}

        async def body():
            try:
                offsets = {}
                if req.echo:
                    for i, text in enumerate(echoes):
                        for b in range(req.n):
                            offsets[i * req.n + b] = len(text)
                            yield event(head([{"index": i * req.n + b, "text": text, "logprobs": None,
                                               "finish_reason": None}], **extra))
                async for i, out in merge(streams):
                    choices = []
                    for idx, o in acc.add(i, out):
                        lp = None
                        if req.logprobs is not None:
                            lp, offsets[idx] = completion_logprobs(client.texts, o.logprobs or [], offsets.get(idx, 0))
                        if not o.text and not o.token_ids and o.finish_reason is None:
                            continue
                        choices.append({"index": idx, "text": o.text, "logprobs": lp, "finish_reason": o.finish_reason})
                    if choices:
                        yield event(head(choices, **extra))
                if include_usage:
                    yield event(head([], usage=acc.usage()))
                yield DONE
            finally:
                await cleanup()

        return SSEResponse(body(), cleanup)

    async def collect():
        async for i, out in merge(streams):
            acc.add(i, out)

    try:
        await until_disconnected(request, collect())
    finally:
        await cleanup()
    choices = []
    for idx in sorted(acc.choices):
        st = acc.choices[idx]
        echo = echoes[idx // req.n]
        lp = None
        if req.logprobs is not None:
            lp, _ = completion_logprobs(client.texts, st.logprobs, len(echo))
        choices.append({"index": idx, "text": echo + "".join(st.text), "logprobs": lp,
                        "finish_reason": st.finish_reason})
    return SafeJSONResponse(head(choices, usage=acc.usage()))
