"""Mooncake trace (FAST'25, kvcache-ai/Mooncake; Apache-2.0): JSONL
`{timestamp (ms), input_length, output_length, hash_ids}`.

Each entry of `hash_ids` names one 512-token block of the prompt, the last one
possibly partial. Each block becomes a segment keyed by its id, so two prompts
whose `hash_ids` share a leading run share exactly those tokens -- the prefix
the trace says a cache could reuse. A partial block is a prefix of the same
block in full (segments with one key are prefixes of each other).
"""

from __future__ import annotations

import json
import os

from stepserve.traces.request_spec import RequestSpec, Segment

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


def load_mooncake(path: str, block_tokens: int = BLOCK_TOKENS) -> list[RequestSpec]:
    name = os.path.splitext(os.path.basename(path))[0]
    specs = []
    with open(path) as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            d = json.loads(line)
            segs = _segments(list(d.get("hash_ids", [])), int(d["input_length"]), block_tokens, f"{name}:{i}")
            specs.append(RequestSpec(
                request_id=f"{name}-{i}",
                arrival_s=float(d["timestamp"]) / 1000.0,
                output_len=max(1, int(d["output_length"])),
                segments=segs if segs else (Segment(f"{name}:{i}", 1),),
            ))
    return specs
