"""Azure LLM inference trace 2023 (Patel et al., "Splitwise", ISCA 2024; CC-BY-4.0):
CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, one row per request.

Timestamps are wall clock with 7 fractional digits (`2023-11-16 18:15:46.6805900`);
Python's %f takes at most 6, so each is cut to 26 characters. The prompts are
not in the trace: every request gets a segment of its own (no sharing), which
is what the production service's distinct user prompts look like to a cache.
"""

from __future__ import annotations

import csv
import os
from datetime import datetime

from stepserve.traces.request_spec import RequestSpec, Segment, count_field, record_at

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _parse_ts(s: str) -> datetime:
    try:
        return datetime.strptime(s.strip()[:26], "%Y-%m-%d %H:%M:%S.%f")
    except ValueError:
        raise ValueError(f"TIMESTAMP {s!r:.40} is not a time like 2023-11-16 18:15:46.6805900") from None


def load_azure(path: str) -> list[RequestSpec]:
    name = os.path.splitext(os.path.basename(path))[0]
    specs: list[RequestSpec] = []
    t0 = None
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure 2023 trace (missing columns {sorted(missing)})")
        for i, row in enumerate(reader):
            with record_at(path, reader.line_num):
                # DictReader files a long row's extra cells under None, a short row's absent ones as None
                if None in row:
                    raise ValueError(f"the row has more fields than the header's {len(reader.fieldnames)}")
                absent = [k for k in COLUMNS if row[k] is None]
                if absent:
                    raise ValueError(f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} missing "
                                     "(the row has fewer fields than the header)")
                ts = _parse_ts(row["TIMESTAMP"])
                plen = count_field(row["ContextTokens"], "ContextTokens")
                olen = count_field(row["GeneratedTokens"], "GeneratedTokens")
            if t0 is None:
                t0 = ts
            specs.append(RequestSpec(
                request_id=f"{name}-{i}",
                arrival_s=(ts - t0).total_seconds(),
                # A zero-length prompt or output cannot be served; 1 is the nearest request that can.
                output_len=max(1, olen),
                segments=(Segment(f"{name}:{i}", max(1, plen)),),
            ))
    return specs
