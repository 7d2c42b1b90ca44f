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
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
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
        """The inverse of `to_json`. A field that is missing or out of range
        is a ValueError naming it (the loader adds the file and line): a
        request the run cannot serve as written is refused, not served as
        something else or left out of the window as a NaN arrival would be."""
        if not isinstance(d, dict):
            raise ValueError(f"a request must be a JSON object, got {type(d).__name__}")
        require(d, "request_id", "arrival_s", "output_len", "segments")
        segs = d["segments"]
        if not isinstance(segs, list) or not segs:
            # an empty prompt has nothing to prefill: the run would count the request as failed
            raise ValueError(f"segments must be a non-empty list of [key, length] pairs, got {segs!r:.80}")
        n = count_field(d.get("n", 1), "n", least=1)
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError(f"meta must be an object, got {meta!r:.80}")
        stages = d.get("stages", [])
        if not isinstance(stages, list):
            raise ValueError(f"stages must be a list of stages, got {stages!r:.80}")
        if stages and n != 1:
            raise ValueError(f"n must be 1 for a fork/join request (stages): its branches are its stages', got {n}")
        return cls(
            request_id=str(d["request_id"]),
            arrival_s=time_field(d["arrival_s"], "arrival_s"),
            output_len=count_field(d["output_len"], "output_len", least=1),
            segments=tuple(_segment(g, f"segments[{i}]", least=1) for i, g in enumerate(segs)),
            n=n,
            meta=dict(meta),
            stages=tuple(_stage(st, k) for k, st in enumerate(stages)),
        )


def _segment(g, where: str, least: int) -> Segment:
    if not isinstance(g, (list, tuple)) or len(g) != 2:
        raise ValueError(f"{where} must be a [key, length] pair, got {g!r:.80}")
    return Segment(str(g[0]), count_field(g[1], f"{where} length", least))


def _stage(st, k: int) -> tuple[tuple[Segment | None, int], ...]:
    """Stage `k` of `stages`: branches of [suffix segment or null, output tokens].
    A suffix may be empty (a branch with no prompt of its own); an output may not
    (the engine refuses a branch of 0 tokens, and the request would fail)."""
    where = f"stages[{k}]"
    if not isinstance(st, list) or not st:
        raise ValueError(f"{where} must be a non-empty list of [suffix, output tokens] branches, got {st!r:.80}")
    out = []
    for b, br in enumerate(st):
        if not isinstance(br, (list, tuple)) or len(br) != 2:
            raise ValueError(f"{where}[{b}] must be a [suffix, output tokens] pair, got {br!r:.80}")
        seg, tokens = br
        out.append((None if seg is None else _segment(seg, f"{where}[{b}] suffix", least=0),
                    count_field(tokens, f"{where}[{b}] output tokens", least=1)))
    return tuple(out)


# -- the checks every trace loader shares: each names the field, the loader
# adds the file and line (`json_lines`, or the CSV reader's line number) --------


def require(d: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")


def count_field(v, name: str, least: int = 0) -> int:
    """A token count (or other whole number) of a trace record -- a JSON number
    or a CSV cell -- of at least `least`. A fraction, a bool or a word is refused,
    not truncated or read as some other number."""
    x = v
    if isinstance(x, str):
        try:
            x = int(x.strip())
        except ValueError:
            try:
                x = float(x.strip())
            except ValueError:
                pass
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{name} must be an integer, got {v!r:.80}")
    if x < least:
        raise ValueError(f"{name} must be at least {least}, got {x}")
    return x


def time_field(v, name: str) -> float:
    """A time of a trace record: a finite number. A NaN or an infinite arrival
    falls outside every window of the run, so the request would vanish."""
    x = v
    if isinstance(x, str):
        try:
            x = float(x.strip())
        except ValueError:
            pass
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"{name} must be a number, got {v!r:.80}")
    try:
        x = float(x)
    except OverflowError:  # an integer past a float's range
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {v!r:.80}")
    return x


@contextmanager
def record_at(path: str, line: int) -> Iterator[None]:
    """A ValueError raised inside, about one record of a trace file, comes out
    naming the file and the line: '<path>, line N: <message>'."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{path}, line {line}: {e}") from None


def json_lines(path: str) -> Iterator[tuple[int, dict]]:
    """(line number from 1, object) for each non-blank line of a JSONL file; a
    line that is not JSON, or not a JSON object, is a ValueError naming the file and line."""
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            with record_at(path, lineno):
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not JSON ({e.msg}, column {e.colno})") from None
                if not isinstance(d, dict):
                    raise ValueError(f"a request must be a JSON object, got {type(d).__name__}")
            yield lineno, d


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
