"""What completions and chat share: sampling fields -> SamplingParams keywords,
usage, and the accumulation of deltas into whole choices."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from stepserve.engine.grammar import AllowedTokens
from stepserve.engine.request import RequestOutput, TokenLogprob
from stepserve.server.errors import bad_request
from stepserve.server.protocol import HARMLESS_VALUES, UNSUPPORTED_FIELDS, ConstraintError, _SamplingFields


def refuse_unsupported(req: _SamplingFields, route: str) -> None:
    """A 400 naming the first field of `req` that stepserve does not implement
    and that would change the result (`UNSUPPORTED_FIELDS`)."""
    refuse_fields(req.model_extra, UNSUPPORTED_FIELDS[route], HARMLESS_VALUES)


def refuse_fields(extra: dict | None, table: dict[str, str], harmless: dict[str, tuple]) -> None:
    """A 400 naming the first of a request's unknown fields (`extra`) that
    `table` lists (what it would need), unless its value is one of
    `harmless`'s for it (what its absence means)."""
    for name, value in (extra or {}).items():
        if name in table and value is not None and value not in harmless.get(name, ()):
            raise bad_request(f"'{name}' is not supported by this server ({table[name]} is not implemented)", name)


def check_stream_options(req: _SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def sampling_kwargs(req: _SamplingFields, route: str) -> dict:
    """The OpenAI (and vLLM-extension) sampling fields, in SamplingParams'
    names, after refusing the fields this route does not implement."""
    refuse_unsupported(req, route)
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is not supported with stream", "prompt_logprobs")
    kw: dict = dict(n=req.n, ignore_eos=req.ignore_eos, speculative=req.speculative, min_tokens=req.min_tokens,
                    include_stop_str_in_output=req.include_stop_str_in_output,
                    skip_special_tokens=req.skip_special_tokens)
    if req.stop_token_ids:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    check_stream_options(req)

    if req.temperature is not None:
        kw["temperature"] = req.temperature
    if req.top_p is not None:
        if req.top_p == 0.0:  # OpenAI accepts 0: keep only the most likely token
            kw["top_k"] = 1
        else:
            kw["top_p"] = req.top_p
    if req.top_k is not None:
        kw.setdefault("top_k", req.top_k)
    if req.min_p is not None:
        kw["min_p"] = req.min_p
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.logit_bias:
        kw["logit_bias"] = dict(req.logit_bias)
    return kw


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """OpenAI's usage object; `prompt_tokens_details` (the prompt tokens the
    radix cache served) only when `cached_tokens` is given, else null, as vLLM
    and SGLang answer unless told to report it (`--enable-prompt-tokens-details`)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
    }


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stage: int = 0  # a fork/join request's stage (native route)


class Accumulator:
    """Deltas of every prompt's request -> per-choice totals and usage.
    Choice index = prompt index * n + branch index (OpenAI's order)."""

    def __init__(self, n: int, prompt_tokens: list[int], prompt_details: bool = True):
        self.n = n
        self.prompt_tokens = prompt_tokens
        self.prompt_details = prompt_details  # usage reports the cached prompt tokens
        self.cached = [0] * len(prompt_tokens)
        self.choices: dict[int, ChoiceState] = {}
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt logprobs, once they came
        self.new_prompt_logprobs: list[int] = []  # prompt indexes whose prompt logprobs the last add brought
        self.created = int(time.time())

    def add(self, prompt_index: int, out: RequestOutput) -> list[tuple[int, object]]:
        """Records a delta; returns [(choice index, CompletionOutput delta)]."""
        self.cached[prompt_index] = out.num_cached_tokens
        self.new_prompt_logprobs = []
        if out.prompt_logprobs is not None and prompt_index not in self.prompt_logprobs:
            self.prompt_logprobs[prompt_index] = out.prompt_logprobs
            self.new_prompt_logprobs.append(prompt_index)
        res = []
        for o in out.outputs:
            idx = prompt_index * self.n + o.index
            st = self.choices.get(idx)
            if st is None:
                st = self.choices[idx] = ChoiceState(stage=o.stage)
            st.text.append(o.text)
            st.token_ids.extend(o.token_ids)
            if o.logprobs:
                st.logprobs.extend(o.logprobs)
            if o.finish_reason is not None:
                st.finish_reason = o.finish_reason
                st.stop_reason = o.stop_reason
            if o.error is not None:  # its output constraint gave up: no answer breaks its own constraint
                raise bad_request(f"The output constraint could not be followed to the end of the output "
                                  f"({o.error.splitlines()[0]}); simplify it", code="constraint_too_complex")
            res.append((idx, o))
        return res

    def usage(self) -> dict:
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return usage(sum(self.prompt_tokens), completion, self.cached_tokens() if self.prompt_details else None)

    def cached_tokens(self) -> int:
        return sum(self.cached)


def include_usage(req: _SamplingFields) -> bool:
    """stream_options.include_usage: a usage chunk ends the stream."""
    return bool(req.stream_options and req.stream_options.include_usage)


def chunk_usage(req: _SamplingFields, acc: Accumulator) -> dict:
    """The usage field of a streamed chunk: absent without include_usage,
    null with it, and the running totals with vLLM's continuous_usage_stats
    too (which, as in vLLM, only adds to include_usage)."""
    if not include_usage(req):
        return {}
    return {"usage": acc.usage() if req.stream_options.continuous_usage_stats else None}


async def output_grammar(client, req: _SamplingFields):
    """The request's logits processor factory: its grammar, from whichever of
    response_format, structured_outputs and guided_* it gives, or its
    allowed_token_ids (None if none); a 400 naming the field for a bad one,
    or for two."""
    try:
        c = req.constraint()
    except ConstraintError as e:
        raise bad_request(str(e), e.param) from None
    if req.allowed_token_ids:
        if c is not None:
            raise bad_request(f"allowed_token_ids cannot be combined with {c[2]}", "allowed_token_ids")
        bad = [t for t in req.allowed_token_ids if t >= client.vocab_size]
        if bad:
            raise bad_request(f"allowed_token_ids {bad[:5]} are outside the vocabulary of {client.vocab_size}",
                              "allowed_token_ids")
        return AllowedTokens(tuple(sorted(set(req.allowed_token_ids))))
    if c is None:
        return None
    kind, spec, param = c
    return await asyncio.to_thread(client.grammar.compile_kind, kind, spec, param)
