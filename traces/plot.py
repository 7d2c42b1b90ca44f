"""The PNG of a run: latency CDFs (TTFT, TPOT, ITL, E2E), and for a sweep over
rates, goodput and SLO attainment against the request rate. Drawn from the
report's `cdf` quantiles, so a plot never needs the raw samples again."""

from __future__ import annotations

import numpy as np

from stepserve.traces.report import output_path

_LAT = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))


def plot_report(report: dict, path: str, title: str | None = None, labels: list[str] | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    runs = report.get("runs") or [report]
    sweep = report.get("sweep")
    ncols = 3 if sweep else 2
    fig, axes = plt.subplots(2, ncols, figsize=(5 * ncols, 8))
    q = np.arange(101) / 100.0
    for i, (key, name) in enumerate(_LAT):
        ax = axes[i // 2][i % 2]
        for j, run in enumerate(runs):
            xs = (run.get("cdf") or {}).get(key)
            if not xs:
                continue
            rate = run.get("scaling", {}).get("rate_rps")
            if labels:
                label = labels[j]
            else:
                label = f"{rate:.2f} req/s" if (sweep and rate) else run.get("mode", "")
            ax.plot(np.asarray(xs) * 1e3, q, label=label)
        slo = (report.get("slo") or {}).get(key)
        if slo:
            ax.axvline(slo * 1e3, color="k", ls="--", lw=0.8, label="SLO")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("CDF")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels on a short log range overlap
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if sweep:
        rates = [s["rate_rps"] or s["rate"] for s in sweep]
        ax = axes[0][2]
        ax.plot(rates, [s["goodput_rps"] for s in sweep], "o-", label="goodput")
        ax.plot(rates, [s["throughput_rps"] for s in sweep], "s--", label="throughput")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("req/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][2]
        ax.plot(rates, [100 * s["slo_attainment"] for s in sweep], "o-")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"{report.get('mode', '')}: {report.get('trace', {}).get('path', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(output_path(path), dpi=110)
    plt.close(fig)
    return path


def plot_compare(reports: list[dict], labels: list[str], path: str) -> str:
    """Several reports' latency CDFs on shared axes (e.g. a replay and its simulation)."""
    first = reports[0]
    merged = {"mode": "compare", "trace": first.get("trace", {}), "slo": first.get("slo"), "runs": reports}
    return plot_report(merged, path, title="compare: " + " vs ".join(labels), labels=labels)


_POLICY_PANELS = (
    ("goodput_rps", "goodput (req/s)", 1.0),
    ("slo_attainment", "SLO attainment (%)", 100.0),
    ("victim_tpot_p90", "victim TPOT p90 (ms)", 1e3),
    ("goodput_tps", "goodput (tok/s)", 1.0),
)


def plot_policies(series: dict[str, list[tuple[float, dict]]], path: str, xlabel: str, title: str = "") -> str:
    """Policies side by side: for each label, its (x, report) points (x: a
    rate or a concurrency), drawn as goodput, SLO attainment, the victims'
    TPOT p90 and token goodput against x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for label, points in series.items():
        points = sorted(points, key=lambda p: p[0])
        xs = [x for x, _ in points]
        for ax, (key, name, scale) in zip(axes.flat, _POLICY_PANELS):
            if key == "victim_tpot_p90":
                ys = [((r.get("victim_tpot_s") or {}).get("p90") or float("nan")) * scale for _, r in points]
            else:
                ys = [(r.get(key) or 0.0) * scale for _, r in points]
            ax.plot(xs, ys, marker="o", label=label)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
