"""`POST /v1/completions`: prompts (text, texts, token ids, lists of token ids)
to text, streamed as SSE or whole."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from stepserve.server.beam_search import beam_search, check_beam_request
from stepserve.server.errors import SafeJSONResponse, bad_request
from stepserve.server.logprobs import completion_logprobs, join_completion_logprobs, vllm_prompt_logprobs
from stepserve.server.openai_common import (check_stream_options, chunk_usage, include_usage, output_grammar,
                                            sampling_kwargs, usage)
from stepserve.server.protocol import CompletionRequest
from stepserve.server.serving import EngineClient, new_id
from stepserve.server.sse import DONE, SSEResponse, event

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

# engine parameter name -> this endpoint's
_NAMES = {"logprobs": "logprobs", "max_tokens": "max_tokens", "prompt": "prompt"}


def _body(client: EngineClient, rid: str, created: int, choices: list, **extra) -> dict:
    """A completion object (or chunk) around `choices`."""
    return {"id": rid, "object": "text_completion", "created": created, "model": client.settings.served_model_name,
            "choices": choices, **extra}


async def _prompts(client: EngineClient, prompt, keep: int | None = None,
                   add_special_tokens: bool = True) -> list[tuple[list[int], str | None]]:
    """(token ids, text or None) per prompt, each checked; with `keep`
    (truncate_prompt_tokens), only each prompt's last `keep` tokens. A text is
    tokenized with the tokenizer's special tokens unless `add_special_tokens`
    is false (vLLM's field); token ids are taken as they are."""
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and isinstance(prompt[0], int):
        items = [list(prompt)]
    else:
        items = list(prompt)
    for p in items:  # every text's length first: one huge prompt is refused before any is tokenized
        if isinstance(p, str):
            client.check_text_length(len(p), "prompt")
    out = []
    for p in items:
        ids = await client.tokenize(p, "prompt", add_special_tokens) if isinstance(p, str) else list(p)
        text = p if isinstance(p, str) else None
        if keep is not None and len(ids) > keep:
            ids, text = ids[-keep:], None
        client.check_prompt(ids, "prompt")
        out.append((ids, text))
    return out


async def create_completion(req: CompletionRequest, request: Request, client: EngineClient):
    client.check_model(req.model)
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (ranking completions is not supported)", "best_of")
    if req.use_beam_search:
        return await _beam_completion(req, request, client)
    kw = sampling_kwargs(req, "completions")
    prompt_k = req.logprobs if req.echo else None  # echo + logprobs scores the prompt too
    if req.prompt_logprobs is not None:
        if prompt_k is not None and prompt_k != req.prompt_logprobs:
            raise bad_request("with echo and logprobs, prompt_logprobs must equal logprobs", "prompt_logprobs")
        prompt_k = req.prompt_logprobs
    prompts = await _prompts(client, req.prompt, req.truncate_prompt_tokens, req.add_special_tokens)
    factory = await output_grammar(client, req)
    params = [
        client.sampling_params(
            _NAMES,
            **kw,
            max_tokens=client.max_tokens(len(ids), req.max_tokens, DEFAULT_MAX_TOKENS, "max_tokens"),
            logprobs=req.logprobs,
            prompt_logprobs=prompt_k,
            logits_processor_factory=factory,
        )
        for ids, _ in prompts
    ]
    rid = new_id("cmpl")
    gen = await client.start(request, [p for p, _ in prompts], params, rid, req.n, _NAMES,
                             slo=(req.slo_ttft, req.slo_tpot))
    acc = gen.acc
    echoes = [(text if text is not None else client.tokenizer.decode(ids)) if req.echo else ""
              for ids, text in prompts]

    def head(choices, **extra):
        return _body(client, rid, acc.created, choices, **extra)

    offsets = {}  # choice index -> text offset of its next logprob (streamed)
    echo_lps = req.echo and req.logprobs is not None  # the echo waits for the prompt's logprobs

    def echo_logprobs(i: int) -> dict:
        lp, _ = completion_logprobs(client.texts, acc.prompt_logprobs[i], 0, prompts[i][0])
        return lp

    def first():
        if req.echo and not echo_lps:
            for i, text in enumerate(echoes):
                for b in range(req.n):
                    offsets[i * req.n + b] = len(text)
                    yield head([{"index": i * req.n + b, "text": text, "logprobs": None, "finish_reason": None}],
                               **chunk_usage(req, acc))

    def chunk(out, deltas):
        events = []
        for i in acc.new_prompt_logprobs if echo_lps else ():
            lp = echo_logprobs(i)
            for b in range(req.n):
                offsets[i * req.n + b] = len(echoes[i])
                events.append(head([{"index": i * req.n + b, "text": echoes[i], "logprobs": lp,
                                     "finish_reason": None}], **chunk_usage(req, acc)))
        for idx, o in deltas:  # one choice per chunk, as OpenAI streams them
            lp = None
            if req.logprobs is not None:
                lp, offsets[idx] = completion_logprobs(client.texts, o.logprobs or [], offsets.get(idx, 0))
            if not o.text and not o.token_ids and o.finish_reason is None:
                continue
            choice = {"index": idx, "text": o.text, "logprobs": lp, "finish_reason": o.finish_reason}
            if o.finish_reason is not None:
                choice["stop_reason"] = o.stop_reason
            events.append(head([choice], **chunk_usage(req, acc)))
        return events

    def final():
        choices = []
        for idx in sorted(acc.choices):
            st = acc.choices[idx]
            echo = echoes[idx // req.n]
            lp = None
            if req.logprobs is not None:
                lp, _ = completion_logprobs(client.texts, st.logprobs, len(echo))
                if echo_lps:
                    lp = join_completion_logprobs(echo_logprobs(idx // req.n), lp)
            choice = {"index": idx, "text": echo + "".join(st.text), "logprobs": lp,
                      "finish_reason": st.finish_reason, "stop_reason": st.stop_reason}
            choice["prompt_logprobs"] = vllm_prompt_logprobs(client.texts, acc.prompt_logprobs[idx // req.n]) \
                if req.prompt_logprobs is not None else None
            choices.append(choice)
        return head(choices, usage=acc.usage())

    last = (lambda: head([], usage=acc.usage())) if include_usage(req) else None
    return await gen.respond(req.stream, chunk, final, first(), last)


async def _beam_completion(req: CompletionRequest, request: Request, client: EngineClient):
    """vLLM's beam search (`use_beam_search`, width `n`): each prompt's `n`
    best beams are its choices, best first. Streamed, the whole answer comes
    as one chunk per choice once the search is over."""
    check_beam_request(req)
    check_stream_options(req)
    prompts = await _prompts(client, req.prompt, req.truncate_prompt_tokens, req.add_special_tokens)
    caps = [client.max_tokens(len(ids), req.max_tokens, DEFAULT_MAX_TOKENS, "max_tokens") for ids, _ in prompts]
    client.admission.check_fits(len(prompts) * req.n, "n")  # each round runs every prompt's n beams at once
    rid = new_id("cmpl")
    created = int(time.time())
    results = await asyncio.gather(*(
        beam_search(client, request, ids, req.n, cap, req.ignore_eos, req.length_penalty, f"{rid}-{i}", _NAMES)
        for i, ((ids, _), cap) in enumerate(zip(prompts, caps))))
    choices = [{"index": i * req.n + b, "text": client.tokenizer.decode(beam.tokens, skip_special_tokens=True),
                "logprobs": None, "finish_reason": beam.finish_reason, "stop_reason": beam.stop_reason}
               for i, (beams, _) in enumerate(results) for b, beam in enumerate(beams)]
    details = client.settings.enable_prompt_tokens_details
    use = usage(sum(len(ids) for ids, _ in prompts), sum(len(b.tokens) for beams, _ in results for b in beams),
                sum(c for _, c in results) if details else None)

    def head(chs, **extra):
        return _body(client, rid, created, chs, **extra)

    if not req.stream:
        return SafeJSONResponse(head(choices, usage=use))
    extra = {"usage": None} if include_usage(req) else {}

    async def body():
        for c in choices:
            yield event(head([c], **extra))
        if include_usage(req):
            yield event(head([], usage=use))
        yield DONE

    async def nothing():
        return None

    return SSEResponse(body(), nothing, rid)
