"""Mooncake trace (FAST'25, kvcache-ai/Mooncake; Apache-2.0): JSONL
`{timestamp (ms), input_length, output_length, hash_ids}`.

Each entry of `hash_ids` names one 512-token block of the prompt, the last one
possibly partial. Each block becomes a segment keyed by its id, so two prompts
whose `hash_ids` share a leading run share exactly those tokens -- the prefix
the trace says a cache could reuse. A partial block is a prefix of the same
block in full (segments with one key are prefixes of each other).
"""

from __future__ import annotations

import os

from stepserve.traces.request_spec import RequestSpec, Segment, count_field, json_lines, record_at, require, time_field

BLOCK_TOKENS = 512


def _segments(hash_ids: list[int], input_length: int, block: int, own_key: str) -> tuple[Segment, ...]:
    segs = []
    left = input_length
    for h in hash_ids:
        if left <= 0:
            break
        n = min(block, left)
        segs.append(Segment(f"mc:{h}", n))
        left -= n
    if left > 0:  # more tokens than blocks: the tail is this request's own
        segs.append(Segment(own_key, left))
    return tuple(segs)


def _hash_ids(v) -> list[int]:
    # a string would be iterated as characters, each read as a block id
    if not isinstance(v, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in v):
        raise ValueError(f"hash_ids must be a list of integer block ids, got {v!r:.80}")
    return v


def load_mooncake(path: str, block_tokens: int = BLOCK_TOKENS) -> list[RequestSpec]:
    name = os.path.splitext(os.path.basename(path))[0]
    specs = []
    for lineno, d in json_lines(path):
        i = lineno - 1  # ids count every line, as they always have
        with record_at(path, lineno):
            require(d, "timestamp", "input_length", "output_length")
            hash_ids = _hash_ids(d.get("hash_ids", []))
            input_length = count_field(d["input_length"], "input_length")
            # A zero-length prompt or output cannot be served; 1 is the nearest request that can.
            output_len = max(1, count_field(d["output_length"], "output_length"))
            arrival_s = time_field(d["timestamp"], "timestamp") / 1000.0
        segs = _segments(hash_ids, input_length, block_tokens, f"{name}:{i}")
        specs.append(RequestSpec(
            request_id=f"{name}-{i}",
            arrival_s=arrival_s,
            output_len=output_len,
            segments=segs if segs else (Segment(f"{name}:{i}", 1),),
        ))
    return specs
