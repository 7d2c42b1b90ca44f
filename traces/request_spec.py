"""The common request record every trace source produces, and its prompt tokens.

A prompt is a sequence of *segments*: named runs of tokens. Two segments with
the same key are the same tokens (a shorter one is a prefix of a longer one),
so whatever a trace says is shared -- a Mooncake `hash_ids` block, a system
prompt, the earlier turns of a conversation -- is built as identical token
sequences, and the radix cache can hit exactly that and nothing else.
Tokens are drawn from a generator seeded by (seed, key), so a trace replayed
for real and the same trace simulated see the same prompts.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

# Token ids below this are left alone: specials (EOS, BOS, chat markers) sit at
# the start of the vocabularies we serve.
MIN_TOKEN_ID = 16


@dataclass(frozen=True, slots=True)
class Segment:
    key: str  # same key -> same tokens (the shorter of two is a prefix of the longer)
    length: int


@dataclass(slots=True)
class RequestSpec:
    request_id: str
    arrival_s: float  # seconds from the start of the trace (after scaling: of the run)
    output_len: int  # tokens to generate per branch (EOS is ignored, so this is exact)
    segments: tuple[Segment, ...]  # the prompt, in order
    n: int = 1  # branches (parallel samples sharing the prompt)
    meta: dict = field(default_factory=dict)  # source-specific: conversation id, turn, group ...
    # a fork/join request: its stages after the first (which is the prompt and output_len, n = 1);
    # each stage a tuple of branches (suffix segment or None, output tokens); one branch
    # without a suffix is a serial stage (see scheduler.core.Stage)
    stages: tuple[tuple[tuple[Segment | None, int], ...], ...] = ()

    @property
    def total_output(self) -> int:
        """Tokens every branch of every stage generates (EOS is ignored)."""
        return self.output_len * self.n + sum(out for st in self.stages for _, out in st)

    @property
    def prompt_len(self) -> int:
        return sum(s.length for s in self.segments)

    def to_json(self) -> dict:
        d = {"request_id": self.request_id, "arrival_s": self.arrival_s, "output_len": self.output_len,
             "segments": [[s.key, s.length] for s in self.segments]}
        if self.n != 1:
            d["n"] = self.n
        if self.meta:
            d["meta"] = self.meta
        if self.stages:
            d["stages"] = [[[None if seg is None else [seg.key, seg.length], out] for seg, out in st]
                           for st in self.stages]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RequestSpec":
        return cls(
            request_id=str(d["request_id"]),
            arrival_s=float(d["arrival_s"]),
            output_len=int(d["output_len"]),
            segments=tuple(Segment(str(k), int(n)) for k, n in d["segments"]),
            n=int(d.get("n", 1)),
            meta=dict(d.get("meta", {})),
            stages=tuple(tuple((None if seg is None else Segment(str(seg[0]), int(seg[1])), int(out))
                               for seg, out in st) for st in d.get("stages", ())),
        )


def _key_seed(key: str, seed: int) -> int:
    # Python's hash() is salted per process; a fixed digest keeps runs reproducible.
    h = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


class PromptBuilder:
    """Segment keys -> token ids in [MIN_TOKEN_ID, vocab_size).

    Keeps the most recent segments' tokens (shared blocks recur: a Mooncake
    block is used by many requests), bounded so a one-hour trace of unique
    prompts does not pile up in memory.
    """

    def __init__(self, vocab_size: int, seed: int = 0, cache_segments: int = 4096):
        if vocab_size <= MIN_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID + 1}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.seed = seed
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cap = cache_segments

    def segment(self, seg: Segment) -> list[int]:
        got = self._cache.get(seg.key)
        if got is not None and len(got) >= seg.length:
            self._cache.move_to_end(seg.key)
            return got[: seg.length]
        # A generator's stream does not depend on how many values are asked for,
        # so a longer draw extends a shorter one: partial blocks stay prefixes.
        rng = np.random.default_rng(_key_seed(seg.key, self.seed))
        toks = rng.integers(MIN_TOKEN_ID, self.vocab_size, size=seg.length, dtype=np.int64).tolist()
        self._cache[seg.key] = toks
        self._cache.move_to_end(seg.key)
        if len(self._cache) > self._cap:
            self._cache.popitem(last=False)
        return toks

    def prompt(self, spec: RequestSpec) -> list[int]:
        out: list[int] = []
        for seg in spec.segments:
            out.extend(self.segment(seg))
        return out
