"""`stepserve replay --compare A.json B.json ...`: reports side by side.

Any mix of replay and simulation reports; the last column shows each later
report relative to the first (e.g. simulated vs real: +4.2%). Those gaps only
mean something between runs of one workload: a report whose workload differs
from the first's is named in a warning under the table, with what differs.
Two reports whose request records agree (arrival times, prompt lengths,
branches) ran one workload whatever their labels say: a replay with
`--save-trace` and a simulation of the saved trace do. Otherwise the labels
decide: request count, trace, and scaling.
"""

from __future__ import annotations

import json
import os

ROWS: list[tuple[str, str, float]] = [
    # (label, path into the report, display multiplier)
    ("requests", "num_requests", 1),
    ("completed", "num_completed", 1),
    ("duration s", "duration_s", 1),
    ("throughput req/s", "throughput_rps", 1),
    ("output tok/s", "output_tps", 1),
    ("goodput req/s", "goodput_rps", 1),
    ("goodput tok/s", "goodput_tps", 1),
    ("SLO attainment %", "slo_attainment", 100),
    *[(f"{m.upper()} {q} ms", f"{m}_s.{q}", 1e3) for m in ("ttft", "tpot", "itl", "e2e") for q in ("mean", "p50", "p90", "p99")],
]


def _get(report: dict, path: str):
    v = report
    for k in path.split("."):
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


def load_reports(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        with open(p) as f:
            rep = json.load(f)
        if not isinstance(rep, dict) or "mode" not in rep or "num_requests" not in rep:
            raise ValueError(f"{p}: not a report of stepserve replay, simulate or validate (no mode, num_requests)")
        out.append(rep)
    return out


def gap(a, b) -> float | None:
    """(b - a) / a, or None when undefined."""
    if a is None or b is None or a == 0:
        return None
    return (b - a) / a


def compare_table(reports: list[dict], labels: list[str]) -> str:
    width = max(12, *(len(x) for x in labels))
    head = f"{'metric':20s} " + " ".join(f"{x:>{width}s}" for x in labels)
    if len(reports) > 1:
        head += "  " + " ".join(f"{'vs ' + labels[0][:width - 3]:>{width}s}" for _ in reports[1:])
    lines = [head, "-" * len(head)]
    modes = [str(r.get("mode", "?")) for r in reports]
    lines.append(f"{'mode':20s} " + " ".join(f"{m:>{width}s}" for m in modes))
    for label, path, mult in ROWS:
        vals = [_get(r, path) for r in reports]
        cells = []
        for v in vals:
            if v is None:
                cells.append(f"{'-':>{width}s}")
            elif isinstance(v, int) and mult == 1:
                cells.append(f"{v:>{width}d}")
            else:
                cells.append(f"{v * mult:>{width}.3f}")
        line = f"{label:20s} " + " ".join(cells)
        if len(reports) > 1:
            rel = [gap(vals[0], v) for v in vals[1:]]
            line += "  " + " ".join(f"{'-' if g is None else f'{g:+.1%}':>{width}s}" for g in rel)
        lines.append(line)
    return "\n".join(lines)


def _show(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _trace_label(t: dict | None) -> str:
    if not t:
        return "(not recorded)"
    return f"{t.get('path')} ({t.get('source')}, {t.get('requests')} requests)"


def _schedule(report: dict) -> list[tuple] | None:
    recs = report.get("requests")
    if not recs:
        return None
    return sorted((round(r["arrival_s"], 6), r["prompt_tokens"], r.get("n", 1)) for r in recs)


def workload_differences(a: dict, b: dict) -> list[str]:
    """How report `b`'s workload differs from report `a`'s, one item per kind:
    the number of requests, the trace (`trace`: path, format, size), and the
    scaling applied to it (`scaling.applied`: rate, time and length scales,
    caps, window, limit). Empty when the workloads match, and whenever the
    request records do (arrival, prompt tokens, branches)."""
    sa, sb = _schedule(a), _schedule(b)
    if sa is not None and sa == sb:
        return []
    out = []
    if a.get("num_requests") != b.get("num_requests"):
        out.append(f"requests: {a.get('num_requests')} vs {b.get('num_requests')}")
    if a.get("trace") != b.get("trace"):
        out.append(f"trace: {_trace_label(a.get('trace'))} vs {_trace_label(b.get('trace'))}")
    sa = (a.get("scaling") or {}).get("applied") or {}
    sb = (b.get("scaling") or {}).get("applied") or {}
    scaling = [f"{k} {_show(sa.get(k))} vs {_show(sb.get(k))}"
               for k in sorted(set(sa) | set(sb)) if sa.get(k) != sb.get(k)]
    if scaling:
        out.append("scaling: " + ", ".join(scaling))
    return out


def workload_warning(reports: list[dict], labels: list[str]) -> str | None:
    """The warning for every report whose workload differs from the first's, or None."""
    lines = []
    for r, label in zip(reports[1:], labels[1:]):
        diffs = workload_differences(reports[0], r)
        if diffs:
            lines.append(f"  {label} vs {labels[0]}:")
            lines.extend(f"    {d}" for d in diffs)
    if not lines:
        return None
    return "\n".join(["WARNING: these reports ran different workloads; their figures (and the "
                      "relative gaps) do not compare like for like:", *lines])


def run_compare(paths: list[str], plot: str | None = None, slo=None) -> int:
    """Print the reports side by side; with `slo` (a `metrics.SLO` that gives
    some SLO), each report's goodput and attainment are first scored again at
    it from its request records (`metrics.rescore`)."""
    reports = load_reports(paths)
    labels = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if slo is not None and slo.given():
        from stepserve.traces.metrics import rescore

        try:
            reports = [rescore(r, slo) for r in reports]
        except ValueError as e:
            raise SystemExit(f"stepserve replay --compare: {e}") from None
        shown = ", ".join(f"{k.removesuffix('_s').upper()} <= {v * 1e3:g} ms"
                          for k, v in slo.to_dict().items() if v is not None)
        print(f"SLO figures scored at {shown}, from each report's request records")
    print(compare_table(reports, labels))
    warning = workload_warning(reports, labels)
    if warning:
        print(warning)
    if plot:
        from stepserve.traces.plot import plot_compare

        plot_compare(reports, labels, plot)
        print(f"plot written to {plot}")
    return 0
