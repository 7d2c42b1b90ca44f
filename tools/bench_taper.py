"""Cost of TAPER's per-step planning (`BranchAdmissionPolicy.plan`).

Builds decode plans of R rows -- R/B requests of B branches each, with
contexts of a few hundred to a few thousand tokens and staggered last-token
times, plus one prefill chunk -- and times `plan()` on fresh copies, median
over many repeats, with the budget set so that about half the extra rows are
admitted (the greedy's longest path: it neither stops at once nor takes all).
Under `--clock token` the slack comes from the rows' last tokens. Under
`--clock average` (TAPER's default) each request has a clock: one request in
eight is serial and 20-40 ms ahead of its TPOT SLO, one branching request is
1 ms behind it, the rest are branching and 50-100 ms ahead, so the budget
starts at the baseline and grows as the greedy widens the request whose own
deadline binds (the path that re-opens the requests it deferred).

    .venv/bin/python tools/bench_taper.py [--rows 64,256,1024] [--branches 8] [--repeats 300] [--clock average]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from stepserve.scheduler.branch_admission import BranchAdmissionPolicy
from stepserve.scheduler.latency_model import LinearLatencyModel
from stepserve.scheduler.plan import ScheduledRow, StepPlan
from stepserve.scheduler.policy import EngineView
from stepserve.scheduler.sequence import RequestClock, Seq


class _Request:
    pass


def _clock(now: float, ahead_s: float, slo: float) -> RequestClock:
    """A request clock 16 tokens in whose next token is due `ahead_s` from now."""
    c = RequestClock()
    c.first, c.tokens = 1, 17
    c.start = now + ahead_s - (c.tokens - c.first + 1) * slo  # RequestClock.deadline
    return c


def make_rows(rows: int, branches: int, rng: random.Random, now: float,
              slo: float | None = None) -> list[ScheduledRow]:
    """Requests of `branches` rows and one prefill row; with `slo`, request
    clocks (the average clock), as the module docstring says."""
    out = []
    sid = 0
    for i in range(rows // branches):
        group = _Request()
        base = rng.randint(200, 3000)
        width, clock = branches, None
        if slo is not None:
            kind = 0 if i % 8 == 0 else 1 if i == 1 else 2  # serial, ahead; branching, behind; ahead
            width = 1 if kind == 0 else branches
            ahead = (rng.uniform(0.02, 0.04), -1e-3, rng.uniform(0.05, 0.1))[kind]
            clock = _clock(now, ahead, slo)
        for b in range(width):
            start = base + rng.randint(0, 64)
            s = Seq(sid, [1] * (start + 1), base, 1000, 0.0, group=group, branch=b, clock=clock)
            s.last_token_time = now - rng.uniform(0.0, 0.03)
            s.first_token_time = s.last_token_time - 0.5  # past its first token: a TPOT deadline
            out.append(ScheduledRow(s, start, 1, True))
            sid += 1
    p = Seq(sid, [1] * 512, 512, 100, now - 0.1, group=_Request())
    out.append(ScheduledRow(p, 0, 512, True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,256,1024")
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--clock", choices=("token", "average"), default="token")
    args = ap.parse_args()
    rng = random.Random(0)
    now = 100.0
    # an H100-like decode step: 14 ms + 50 us per row + 50 ns per context token
    model = LinearLatencyModel("linear", [14e-3, 5e-5, 5e-8, 0.0])
    print(f"{'rows':>6s} {'requests':>8s} {'admitted':>9s} {'plan p50 (ms)':>14s} {'p90 (ms)':>9s}")
    for rows in (int(x) for x in args.rows.split(",")):
        if args.clock == "average":
            # TPOT SLO 30 ms; the branching request behind it binds until it is widened (the
            # baseline step, 14 ms + rows, is shorter than the SLO, so late=drop keeps it)
            template = make_rows(rows, args.branches, rng, now, slo=0.03)
            n_req = len({id(r.seq.group) for r in template}) - 1
            pol = BranchAdmissionPolicy("taper:rho=1", latency_model=model, slo_tpot_s=0.03)
            run(pol, template, rows, n_req, now, args.repeats)
            continue
        template = make_rows(rows, args.branches, rng, now)
        n_req = rows // args.branches
        full = model.predict(len(template), sum(r.start + r.num_new for r in template), rows + 512)
        base = model.predict(n_req + 1, 0, n_req + 512)
        # a TPOT SLO that puts the budget (rho = 1: the slack) halfway between the baseline and the full step
        last: dict[int, float] = {}
        for r in template:
            if r.seq.last_token_time is not None:
                k = id(r.seq.group)
                last[k] = max(last.get(k, 0.0), r.seq.last_token_time)
        slo = (base + full) / 2 + now - min(last.values())
        pol = BranchAdmissionPolicy("taper:rho=1,clock=token", latency_model=model, slo_tpot_s=slo)
        run(pol, template, rows, n_req, now, args.repeats)


def run(pol: BranchAdmissionPolicy, template: list[ScheduledRow], rows: int, n_req: int, now: float,
        repeats: int) -> None:
    times, kept = [], 0
    for _ in range(repeats):
        plan = StepPlan(rows=list(template))
        view = EngineView(now, rows, 0, 10**6, 10**6)
        t0 = time.perf_counter()
        out = pol.plan(plan, view)
        times.append(time.perf_counter() - t0)
        kept = len(out.rows)
    times.sort()
    decode = len(template) - 1
    print(f"{decode:6d} {n_req:8d} {kept - n_req - 1:4d}/{decode - n_req:<4d} "
          f"{statistics.median(times) * 1e3:14.3f} {times[int(0.9 * len(times))] * 1e3:9.3f}")


if __name__ == "__main__":
    main()
