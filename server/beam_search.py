"""Beam search on `/v1/completions` (vLLM's `use_beam_search`, beam width
`n`, `length_penalty`), run as vLLM runs it: at the API layer, one engine
request per beam per output position.

Each round submits every live beam (the prompt plus the beam's tokens so far)
for one token with its 2 x width most likely next tokens (`logprobs`, the
model's raw distribution); each candidate extends its beam by that token and
its log-probability. A candidate that is an end-of-sequence token (unless
`ignore_eos`) completes its beam (the token is not part of the text); the
others are ranked and the best `width` go on. After `max_tokens` rounds (or
when no beam is left) the completed and the live beams are ranked together
and the best `width` are the choices, best first. The rank of a beam is
vLLM's: cumulative log-probability / (prompt + output tokens, the end token
not counted) ** length_penalty.

The rounds share each beam's prefix through the radix cache, so a round
computes one new token per beam. The engine's requests are independent of one
another, so each round's beams run batched with the rest of the traffic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.requests import Request

from stepserve.engine.sampling_params import MAX_LOGPROBS
from stepserve.server.errors import bad_request
from stepserve.server.openai_common import refuse_unsupported
from stepserve.server.protocol import CompletionRequest

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a round asks for 2 x width alternatives

# fields that mean the same under beam search, or change nothing there (the
# temperature and seed of a round's sampled token, which no beam depends on)
_BEAM_FIELDS = {"model", "prompt", "n", "best_of", "max_tokens", "temperature", "seed", "ignore_eos",
                "length_penalty", "use_beam_search", "stream", "stream_options", "user", "truncate_prompt_tokens",
                "slo_ttft", "slo_tpot", "speculative", "add_special_tokens"}


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)  # output tokens (an end token not among them)
    logprob: float = 0.0  # cumulative
    finish_reason: str | None = None  # "stop" (an end token) or "length"
    stop_reason: int | None = None  # the end token


def check_beam_request(req: CompletionRequest) -> None:
    """A 400 naming the first field beam search would not honour (unknown
    fields are judged as on any completion: `refuse_unsupported`)."""
    refuse_unsupported(req, "completions")
    if req.n > MAX_BEAM_WIDTH:
        raise bad_request(f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search", "n")
    for name in sorted(req.model_fields_set & CompletionRequest.model_fields.keys() - _BEAM_FIELDS):  # (extras: above)
        value = getattr(req, name)
        if value is not None and value != CompletionRequest.model_fields[name].default:
            raise bad_request(f"{name} is not supported with use_beam_search", name)


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    return beam.logprob / ((prompt_len + len(beam.tokens)) ** length_penalty)


async def beam_search(client, request: Request, prompt: list[int], width: int, max_tokens: int, ignore_eos: bool,
                      length_penalty: float, request_id: str, names: dict[str, str]) -> tuple[list[Beam], int]:
    """The `width` best beams of `prompt`, best first (see the module
    docstring), and the prompt tokens the first round found in the radix cache."""
    eos = frozenset(client.eos_token_ids)
    cached = 0
    live = [Beam()]
    done: list[Beam] = []
    plen = len(prompt)

    def rank(b: Beam) -> float:
        return score(b, plen, length_penalty)

    for step in range(max_tokens):
        params = [client.sampling_params(names, max_tokens=1, logprobs=2 * width, temperature=0.0, ignore_eos=True)
                  for _ in live]
        gen = await client.start(request, [prompt + b.tokens for b in live], params, f"{request_id}-{step}", 1,
                                 names)
        await gen.collect()
        if step == 0:
            cached = gen.acc.cached_tokens()
        grown: list[Beam] = []
        for i, beam in enumerate(live):
            (pos,) = gen.acc.choices[i].logprobs  # the one token's alternatives
            for tok, lp in pos.top:
                nxt = Beam(beam.tokens + [tok], beam.logprob + lp)
                if tok in eos and not ignore_eos:
                    nxt.tokens.pop()
                    nxt.finish_reason, nxt.stop_reason = "stop", tok
                    done.append(nxt)
                else:
                    grown.append(nxt)
        grown.sort(key=rank, reverse=True)
        live = grown[:width]
        if not live:
            break
    for b in live:
        b.finish_reason = "length"
    return sorted(done + live, key=rank, reverse=True)[:width], cached
