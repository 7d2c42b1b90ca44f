"""The JSON report of a replay or a simulation: one shape for both.

Top level (what scripts rely on): `num_requests`, `num_completed`,
`duration_s`, `throughput_rps`, `output_tps`, `goodput_rps`, `goodput_tps`,
`slo_attainment`, `ttft_s` / `tpot_s` / `itl_s` / `e2e_s` as
{mean, p50, p90, p99}, plus `mode`, `command`, `versions`, `trace`,
`scaling`, `config`, `cdf` (101 quantiles per latency, for plots), and
`requests` (one record each). A sweep over rates keeps the figures of its
last (highest) rate at the top level, and every run in `runs`, with a
one-line-per-rate digest in `sweep`.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys

import numpy as np

from stepserve.traces.metrics import SLO, RequestRecord, summarize


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("stepserve", "torch", "transformers", "numpy", "openai"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def command_line(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    return " ".join(["stepserve", *map(shlex.quote, argv)])


def _cdf(values) -> list[float] | None:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return None
    return [float(x) for x in np.percentile(a, np.arange(101))]


def build_report(
    *,
    mode: str,
    records: list[RequestRecord],
    duration_s: float,
    slo: SLO,
    trace: dict,
    scaling: dict,
    config: dict,
    itl_values=None,
    extra: dict | None = None,
    with_itl: bool = True,
    argv: list[str] | None = None,
) -> dict:
    figures = summarize(records, duration_s, slo, itl_values)
    done = [r for r in records if r.completed]
    if itl_values is None:
        itl_values = [g for r in done for g in r.itl_s]
    report = {
        "mode": mode,
        "command": command_line(argv),
        "versions": versions(),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or None},
        "trace": trace,
        "scaling": scaling,
        "config": config,
        **figures,
        "cdf": {
            "ttft_s": _cdf([r.ttft for r in done]),
            "tpot_s": _cdf([t for t in (r.tpot for r in done) if t is not None]),
            "itl_s": _cdf(itl_values),
            "e2e_s": _cdf([r.e2e for r in done]),
        },
    }
    if extra:
        report.update(extra)
    report["requests"] = [r.to_dict(with_itl) for r in records]
    return report


def combine_sweep(runs: list[dict], rates: list[float]) -> dict:
    """Several runs at increasing rates -> one report (top level = the last run)."""
    last = {k: v for k, v in runs[-1].items() if k != "requests"}
    digest = [
        {"rate": r, "rate_rps": run["scaling"].get("rate_rps"), "throughput_rps": run["throughput_rps"],
         "goodput_rps": run["goodput_rps"], "goodput_tps": run["goodput_tps"],
         "slo_attainment": run["slo_attainment"], "ttft_p90_s": run["ttft_s"]["p90"],
         "tpot_p90_s": run["tpot_s"]["p90"]}
        for r, run in zip(rates, runs)
    ]
    return {**last, "sweep": digest, "runs": runs}


def output_path(path: str) -> str:
    """`path`, after creating the folders it names that do not exist yet: every
    file a command writes (report, profile, plot, saved trace) goes through
    here, so a run never ends in a FileNotFoundError at the last step."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    return path


def write_report(report: dict, path: str) -> None:
    """The report (or profile) as indented JSON; missing folders are created."""
    with open(output_path(path), "w") as f:
        json.dump(report, f, indent=1, allow_nan=False, default=_json_default)
        f.write("\n")


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def format_summary(r: dict) -> str:
    slo = r.get("slo") or {}
    given = ", ".join(f"{k[:-2].upper()} <= {v * 1e3:g} ms" for k, v in slo.items() if v is not None) or "none"
    att = r.get("slo_attainment")
    lines = [
        f"{r['mode']}: {r['num_completed']}/{r['num_requests']} requests completed in {r['duration_s']:.2f} s",
        f"  throughput {r['throughput_rps']:.3f} req/s, {r['output_tps']:.1f} output tok/s",
        f"  SLO ({given}): attainment {'-' if att is None else f'{att:.1%}'}, goodput "
        f"{r['goodput_rps']:.3f} req/s, {r['goodput_tps']:.1f} tok/s",
        f"  {'ms':6s} {'mean':>9s} {'p50':>9s} {'p90':>9s} {'p99':>9s}",
    ]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        p = r[key]
        lines.append(f"  {key[:-2].upper():6s} " + " ".join(f"{_ms(p[q]):>9s}" for q in ("mean", "p50", "p90", "p99")))
    if r.get("num_victims"):
        p = r["victim_tpot_s"]
        lines.append(f"  {'victim':6s} " + " ".join(f"{_ms(p[q]):>9s}" for q in ("mean", "p50", "p90", "p99"))
                     + f"   (TPOT of the {r['num_victims']} serial requests that ran beside branching ones)")
    if "sweep" in r:
        lines.append(f"  {'rate':>8s} {'req/s':>8s} {'goodput':>8s} {'attain':>7s} {'TTFTp90':>8s} {'TPOTp90':>8s}")
        for s in r["sweep"]:
            rr = s["rate_rps"]
            lines.append(f"  {'-' if rr is None else f'{rr:8.3f}':>8s} {s['throughput_rps']:8.3f} {s['goodput_rps']:8.3f} "
                         f"{s['slo_attainment']:7.1%} {_ms(s['ttft_p90_s']):>8s} {_ms(s['tpot_p90_s']):>8s}")
    return "\n".join(lines)


def finish_runs(runs: list[dict], rates: list[float], out: str | None, plot: str | None) -> dict:
    """One run's report, or a rate sweep combined; printed, written, plotted."""
    report = runs[0] if len(runs) == 1 else combine_sweep(runs, rates)
    print(format_summary(report))
    if out:
        write_report(report, out)
        print(f"report written to {out}")
    if plot:
        from stepserve.traces.plot import plot_report

        plot_report(report, plot)
        print(f"plot written to {plot}")
    return report
