"""One entry point for every trace source: `load_trace(source)`.

`source` is a path (Azure CSV, Mooncake JSONL, or stepserve's own JSONL of
`RequestSpec`s, told apart by content) or a `synthetic:...` spec string.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from stepserve.traces.report import output_path
from stepserve.traces.request_spec import RequestSpec, json_lines, record_at


@dataclass
class Trace:
    specs: list[RequestSpec]
    source: str  # azure | mooncake | stepserve | synthetic
    path: str  # file path or the synthetic spec string

    def info(self) -> dict:
        return {"source": self.source, "path": self.path, "requests": len(self.specs)}


def _first_json_line(path: str) -> dict | None:
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError:
                    return None
                return d if isinstance(d, dict) else None
    return None


def load_trace(source: str) -> Trace:
    trace = _load(source)
    if not trace.specs:
        raise ValueError(f"{source}: the trace holds no requests")
    return trace


def _load(source: str) -> Trace:
    # Only the exact prefix selects a spec: a file named synthetic_trace.jsonl is a file.
    if source.startswith("synthetic:"):
        from stepserve.traces.synthetic import SyntheticConfig, generate

        return Trace(generate(SyntheticConfig.parse(source)), "synthetic", source)
    if not os.path.isfile(source):
        hint = " (a synthetic spec starts with 'synthetic:')" if source.startswith("synthetic") else ""
        raise FileNotFoundError(f"trace not found: {source}{hint}")
    with open(source) as f:
        head = f.readline()
    if head.startswith("TIMESTAMP"):
        from stepserve.traces.azure import load_azure

        return Trace(load_azure(source), "azure", source)
    first = _first_json_line(source)
    if first is not None and "hash_ids" in first:
        from stepserve.traces.mooncake import load_mooncake

        return Trace(load_mooncake(source), "mooncake", source)
    if first is not None and "segments" in first:
        return Trace(_load_stepserve(source), "stepserve", source)
    raise ValueError(
        f"{source}: unknown trace format (expected an Azure 2023 CSV, a Mooncake JSONL with hash_ids, "
        "a stepserve JSONL with segments, or synthetic:key=value,...)")


def _load_stepserve(path: str) -> list[RequestSpec]:
    specs = []
    for lineno, d in json_lines(path):
        with record_at(path, lineno):
            specs.append(RequestSpec.from_json(d))
    return specs


def save_trace(specs: list[RequestSpec], path: str) -> None:
    """stepserve's JSONL: one `RequestSpec.to_json()` per line (reload with load_trace);
    missing folders are created."""
    with open(output_path(path), "w") as f:
        for s in specs:
            f.write(json.dumps(s.to_json()) + "\n")
