"""One figure comparing branch policies from `stepserve simulate` / `replay`
reports: goodput, SLO attainment, the victims' TPOT p90 and token goodput
against the load.

    .venv/bin/python tools/plot_branch_policies.py --pattern 'fj_{x}_{policy}.json' --x 32,64,96 \\
        --policies off,cap_2,eager,taper --xlabel concurrency --out docs/branch-fj.png

A report that is a rate sweep (`--rates`) gives its points itself, x being
each run's rate: `--pattern 'rb_{policy}.json'` without `--x`. With
`--repeats 1,2,3` the pattern also has {rep}, and each point is the median
over the repeats of each plotted figure.
"""

from __future__ import annotations

import argparse
import json
import statistics

from stepserve.traces.plot import plot_policies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pattern", required=True, help="report path with {policy} (and {x}, with --x)")
    ap.add_argument("--policies", required=True, help="comma list, as they appear in the file names")
    ap.add_argument("--x", default=None, help="comma list of the load values in the file names")
    ap.add_argument("--xlabel", default="request rate (req/s)")
    ap.add_argument("--title", default="")
    ap.add_argument("--repeats", default=None, help="comma list of the repeat names in the file names ({rep})")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.repeats and not args.x:
        ap.error("--repeats needs --x: a point per load value, the median over its repeats")
    reps = args.repeats.split(",") if args.repeats else None

    def load(**kw) -> dict:
        if reps is None:
            return json.load(open(args.pattern.format(**kw)))
        runs = [json.load(open(args.pattern.format(rep=r, **kw))) for r in reps]
        runs = [r["runs"][0] if "runs" in r else r for r in runs]
        med = {k: statistics.median(r[k] for r in runs) for k in ("goodput_rps", "goodput_tps", "slo_attainment")}
        victims = [(r.get("victim_tpot_s") or {}).get("p90") for r in runs]
        victims = [v for v in victims if v is not None]
        med["victim_tpot_s"] = {"p90": statistics.median(victims) if victims else None}
        return med

    series = {}
    for pol in args.policies.split(","):
        label = pol.replace("_", ":", 1) if pol.startswith("cap_") else pol
        if args.x:
            series[label] = [(float(x), load(policy=pol, x=x)) for x in args.x.split(",")]
        else:
            rep = load(policy=pol)
            series[label] = [(run["scaling"]["rate_rps"], run) for run in rep.get("runs", [rep])]
    print(plot_policies(series, args.out, args.xlabel, args.title))


if __name__ == "__main__":
    main()
