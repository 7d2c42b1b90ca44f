"""Branch admission (scheduler/branch_admission.py): the modes through the
engine and the simulator, and TAPER's budget and greedy choice against a
brute-force reference on hand-made plans."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from stepserve import LLM, SamplingParams
from stepserve.engine.engine import EngineConfig
from stepserve.scheduler.branch_admission import BranchAdmissionPolicy, BranchAdmissionSpec
from stepserve.scheduler.latency_model import (
    LinearLatencyModel, linear_fit_of, load_profile, plan_features, sweep_features,
)
from stepserve.scheduler.plan import ScheduledRow, StepPlan, StepRecord
from stepserve.scheduler.policy import EngineView
from stepserve.scheduler.sequence import RequestClock, Seq
from stepserve.traces.metrics import SLO, RequestRecord, summarize, victim_tpots
from stepserve.traces.request_spec import RequestSpec, Segment
from stepserve.traces.simulator import SimConfig, Simulator


# -- specs --------------------------------------------------------------------------

@pytest.mark.parametrize("text,mode,cap,rho,utility", [
    ("eager", "eager", 0, 0.8, "concave"), ("off", "off", 0, 0.8, "concave"), ("cap:3", "cap", 3, 0.8, "concave"),
    ("taper", "taper", 0, 0.8, "concave"), ("taper:rho=0.5,utility=linear", "taper", 0, 0.5, "linear"),
    ("taper:clock=token", "taper", 0, 0.8, "concave"),
])
def test_spec_parse(text, mode, cap, rho, utility):
    s = BranchAdmissionSpec.parse(text)
    assert (s.mode, s.cap, s.rho, s.utility) == (mode, cap, rho, utility)
    assert s.clock == ("token" if "clock=token" in text else "average")
    assert BranchAdmissionSpec.parse(str(s)) == s


@pytest.mark.parametrize("bad", ["wide", "cap", "cap:0", "cap:x", "taper:rho=2", "taper:gamma=1",
                                 "taper:utility=cubic", "taper:clock=wall", "off:1"])
def test_spec_refuses(bad):
    with pytest.raises(ValueError):
        BranchAdmissionSpec.parse(bad)


def test_slos_must_be_positive_and_taper_without_any_runs_eager():
    with pytest.raises(ValueError, match="TPOT"):
        BranchAdmissionPolicy("taper", slo_tpot_s=0.0)
    with pytest.raises(ValueError, match="slo_tpot_s"):
        EngineConfig(branch_policy="taper", slo_tpot_s=-1.0)
    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])
    pol = BranchAdmissionPolicy("taper", latency_model=model)  # no default SLO, none on the requests
    plan = _plan([[(10, 0.99), (11, 0.98), (12, 0.97)], [(5, 0.99), (6, 0.99)]])
    assert pol.slack(plan, 1.0) == math.inf
    assert len(pol.plan(plan, EngineView(1.0, 5, 0, 100, 100)).rows) == 6


def test_a_request_brings_its_own_slos():
    """Per-request SLOs (on its RequestClock) override the policy's defaults:
    a request with a tight TPOT SLO sets the slack; one without any, when the
    policy has none either, sets nothing."""
    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])
    plan = _plan([[(10, 0.99), (11, 0.98)], [(5, 0.99), (6, 0.99)]])
    clocks = []
    for r in plan.rows:
        if r.num_new == 1 and r.seq.clock not in clocks:
            clocks.append(r.seq.clock)
    clocks[1].tpot_s = 0.004
    for clock in ("average", "token"):
        pol = BranchAdmissionPolicy(f"taper:clock={clock}", latency_model=model)
        want = (clocks[1].deadline(0.004) if clock == "average" else 0.99 + 0.004) - 1.0
        assert pol.slack(plan, 1.0) == pytest.approx(want)
        loose = BranchAdmissionPolicy(f"taper:clock={clock}", latency_model=model, slo_tpot_s=10.0)
        assert loose.slack(plan, 1.0) == pytest.approx(want)  # the request's own SLO is the tighter
    # a TTFT SLO of its own for a request before its first token
    clocks[1].tpot_s = None  # now no request has a TPOT SLO, and the policy has none
    p = next(r for r in plan.rows if r.num_new > 1)
    p.seq.clock = RequestClock(ttft_s=0.7)
    assert BranchAdmissionPolicy("taper", latency_model=model).slack(plan, 1.0) == pytest.approx(0.5 + 0.7 - 1.0)


# -- the engine: deferral changes timing, never tokens -----------------------------------

PROMPTS = ["In the beginning", "And God said", "Let there be light"]


def _run(ckpt, mode, **kw):
    llm = LLM(ckpt, check_invariants=True, branch_policy=mode, **kw)
    params = [SamplingParams(n=n, max_tokens=12, temperature=1.5, seed=11 + i, ignore_eos=True)
              for i, n in enumerate((4, 1, 3))]
    eng = llm.engine
    widths = []  # per step: the most rows any one request had, and the refits of TAPER's model by then
    taper = next((p for p in eng.policies if isinstance(p, BranchAdmissionPolicy)), None)

    class Watch:
        name = "watch"

        def plan(self, plan, view):
            return plan

        def observe(self, plan, record):
            per = {}
            for r in plan.rows:
                if r.num_new == 1:
                    per[id(r.seq.group)] = per.get(id(r.seq.group), 0) + 1
            refits = taper.predictor.num_refits if taper is not None and taper.predictor else 0
            widths.append((max(per.values(), default=0), refits))

    eng.scheduler.policies.append(Watch())  # the step loop's list (the core shares it)
    outs = llm.generate(PROMPTS, params)
    sched = eng.scheduler
    assert not sched.running and not sched.waiting and sched.kv.tree.protected_size() == 0
    kv = sched.kv
    assert kv.allocator.available() + kv.tree.total_size() == kv.capacity
    return [[tuple(c.token_ids) for c in o.outputs] for o in outs], widths, eng


@pytest.mark.parametrize("mode,width", [("off", 1), ("cap:2", 2)])
def test_narrow_modes_keep_tokens_and_cap_width(llama_ckpt, mode, width):
    """Seeded sampling is keyed on the branch's seed and position, so a branch
    deferred for some steps samples the same tokens: only the width changes."""
    eager, w_eager, e_eng = _run(llama_ckpt, "eager")
    narrow, w_narrow, n_eng = _run(llama_ckpt, mode)
    assert narrow == eager
    assert max(w for w, _ in w_eager) == 4 and max(w for w, _ in w_narrow) == width
    assert n_eng.step_id > e_eng.step_id
    st = n_eng.stats().policy
    assert st["branch_policy"] == mode and st["branch_rows_deferred"] > 0


def test_taper_in_the_engine(llama_ckpt):
    """Uncalibrated (no profile) it runs eager for its branching steps and says
    so; tokens never change."""
    eager, _, _ = _run(llama_ckpt, "eager")
    out, widths, eng = _run(llama_ckpt, "taper", slo_tpot_s=0.05)
    st = eng.stats().policy
    assert out == eager and max(w for w, _ in widths) == 4
    assert st["taper_uncalibrated_steps"] == st["branch_steps"] and st["branch_rows_deferred"] == 0
    assert st["taper_calibrated"] is False


def test_taper_narrows_under_a_slow_profile(llama_ckpt, tmp_path):
    """A profile whose decode rows cost 10 ms each against a 15 ms TPOT SLO:
    only the baseline (one row per request) fits the budget."""

    from stepserve.scheduler.latency_model import PROFILE_KIND

    prof = {"kind": PROFILE_KIND, "source": "measured",
            "latency": {"form": "linear", "coef": [1e-3, 1e-2, 0.0, 0.0]},
            "engine": {"cold": [[1e-4, 0.01], [1e-5, 0.0]]}}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(prof))
    eager, _, _ = _run(llama_ckpt, "eager")
    # the token clock: on this machine the real steps run far below the SLO, and the average
    # clock would bank that time and let the steps widen; the paper's slack (late=keep): every
    # baseline step is predicted past the SLO, so under late=drop every deadline would be lost
    # and every row would run
    out, widths, eng = _run(llama_ckpt, "taper:clock=token,late=keep", slo_tpot_s=0.015,
                            latency_profile=str(path))
    st = eng.stats().policy
    assert out == eager
    assert st["taper_calibrated"] is True and st["taper_uncalibrated_steps"] == 0
    # until the first online refit (after 32 observed steps) it plans with the profile: one row each
    before = [w for w, refits in widths if refits == 0]
    assert st["branch_rows_deferred"] > 0 and len(before) > 5 and max(before) == 1
    # it counts what it predicted for the plans it chose and what they took (no comparison of the
    # two: the measured side is this machine's timing, which a loaded machine can stretch past any bound)
    assert st["taper_planned_steps"] > 0 and st["taper_predicted_s"] > 0 and st["taper_measured_s"] > 0
    assert st["taper_last_budget_s"] > 0
    # it plans with the profile's price of the decode steps after a prompt chunk, and counts those apart
    (taper,) = [p for p in eng.policies if isinstance(p, BranchAdmissionPolicy)]
    assert taper.predictor.costs.cold == ((1e-4, 0.01), (1e-5, 0.0))
    assert 0 < st["taper_after_prompt_steps"] < st["taper_planned_steps"]
    assert 0 < st["taper_after_prompt_predicted_s"] < st["taper_predicted_s"]
    # late=drop (the default): no plan keeps any deadline, so none narrows the step
    out, widths, eng = _run(llama_ckpt, "taper:clock=token", slo_tpot_s=0.015, latency_profile=str(path))
    st = eng.stats().policy
    assert out == eager and st["taper_planned_steps"] > 0 and st["branch_rows_deferred"] == 0
    assert max(w for w, _ in widths) == 4


# -- TAPER's planning against brute force -----------------------------------------------

class _Req:
    pass


def _plan(groups, now=1.0):
    """groups: per request a list of (context start, last token time) of its
    decode rows; plus one prefill row of 16 tokens in its own request. Each
    branch got its first token 2 ms per output token before its last one."""
    plan = StepPlan()
    sid = itertools.count()
    for rows in groups:
        g = _Req()
        clock = RequestClock()  # as `Scheduler.update` keeps it: one token at the start, then the rest
        for start, last in rows:
            s = Seq(next(sid), [1] * (start + 1), 4, 100, 0.0, group=g, clock=clock)
            s.last_token_time = last
            s.first_token_time = last - 2e-3 * (s.num_output - 1)
            clock.start = min(clock.start if clock.start is not None else 1e9, s.first_token_time)
            clock.tokens += s.num_output
            plan.rows.append(ScheduledRow(s, start, 1, True))
        clock.first = 1
    p = Seq(next(sid), [1] * 16, 16, 10, 0.5, group=_Req())
    plan.rows.append(ScheduledRow(p, 0, 16, True))
    return plan


def _deadlines(plan, slo, clock):
    """Each request's TPOT deadline by the definitions, and its decode rows:
    {request: (deadline, rows)}."""
    by: dict = {}
    for r in plan.rows:
        if r.seq.first_token_time is not None:
            by.setdefault(id(r.seq.group), []).append(r.seq)
    if clock == "token":
        return {k: (max(s.last_token_time for s in seqs) + slo, seqs) for k, seqs in by.items()}
    return {k: (min(s.first_token_time for s in seqs) + sum(s.num_output for s in seqs) * slo, seqs)
            for k, seqs in by.items()}


def _slack(plan, slo, clock, now):
    """The slack by the definitions, request by request."""
    return min(d for d, _ in _deadlines(plan, slo, clock).values()) - now


def _catches_up(d, seqs, slo, now, t0):
    """Whether a request can still meet its TPOT SLO on average: a baseline
    step shorter than its SLO, and its last possible token (all its rows
    running, a token each per baseline step from now, until each reaches its
    max_tokens) no later than due (one SLO per token after `d`, the next
    token's due time)."""
    if t0 >= slo:
        return False
    left = [s.remaining_tokens for s in seqs]
    t, tokens = now, 0
    while any(left):
        t += t0
        tokens += sum(1 for n in left if n)
        left = [max(n - 1, 0) for n in left]
    return t <= d + (tokens - 1) * slo


def _brute_force(policy, plan, groups, now):
    """The most extra rows any admissible set holds, by exhaustive search,
    where the greedy is exact: linear utility and rows that all cost the same.
    A set is admissible when its predicted step fits its budget: T0 + rho *
    max(0, slack - T0), where under `late=drop` a deadline before the end of
    the baseline step is left out if its request cannot catch up, and under
    the average clock each
    extra row of a request moves its deadline out by one SLO, and a
    request's own deadline does not count for its own rows where a row
    costs less than the SLO: the step must fit the budget of the other
    requests' deadlines for every request that runs extra rows.
    Returns (that count, the least budget of a largest admissible set)."""
    m = policy.predictor.current()
    slo, rho, average = policy.slo_tpot_s, policy.spec.rho, policy.spec.clock == "average"
    base_rows = len(groups) + 1
    base_ctx = sum(min(rows, key=lambda x: x[1])[0] + 1 for rows in groups) + 16
    t0 = m.predict(base_rows, base_ctx, len(groups) + 16)
    deadlines = list(_deadlines(plan, slo, policy.spec.clock).values())  # in the order of `groups`
    keep = [policy.spec.late == "keep" or d - now >= t0 or _catches_up(d, seqs, slo, now, t0) for d, seqs in deadlines]
    extras = [(gi, r) for gi, rows in enumerate(groups) for r in sorted(rows, key=lambda x: x[1])[1:]]
    best = (0, t0 + rho * max(0.0, min([d for (d, _), k in zip(deadlines, keep) if k], default=math.inf)
                              - now - t0))
    for k in range(1, len(extras) + 1):
        fits = []
        for combo in itertools.combinations(extras, k):
            width = [sum(1 for gi, _ in combo if gi == g) for g in range(len(groups))]
            moved = [(g, d + (width[g] * slo if average else 0.0)) for g, ((d, _), kept)
                     in enumerate(zip(deadlines, keep)) if kept]
            budget = t0 + rho * max(0.0, min([d for _, d in moved], default=math.inf) - now - t0)
            t = m.predict(base_rows + k, base_ctx + sum(s + 1 for _, (s, _) in combo), len(groups) + 16 + k)
            row_s = m.predict(2, 0, 0) - m.predict(1, 0, 0)
            limits = [min([d for h, d in moved if h != g or not average or row_s >= slo], default=math.inf)
                      for g in range(len(groups)) if width[g]]
            if all(t <= t0 + rho * max(0.0, x - now - t0) + 1e-12 for x in limits):
                fits.append(budget)
        if fits:
            best = (k, min(fits))
    return best


@pytest.mark.parametrize("late", ["keep", "drop"])
@pytest.mark.parametrize("clock", ["token", "average"])
@pytest.mark.parametrize("slo,rho", [(0.010, 0.8), (0.020, 0.8), (0.020, 0.3), (0.050, 1.0), (0.003, 0.8),
                                     (0.0025, 0.8), (0.0026, 0.8), (0.0033, 0.8), (0.0072, 0.8)])
def test_taper_budget_and_greedy_match_brute_force(slo, rho, clock, late):
    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])  # 1 ms per row, context free
    pol = BranchAdmissionPolicy(f"taper:rho={rho},utility=linear,clock={clock},late={late}",
                                latency_model=model, slo_tpot_s=slo)
    now = 1.0
    groups = [[(40, 0.995), (41, 0.990), (42, 0.993)], [(10, 0.999)], [(7, 0.996), (8, 0.994)],
              [(30, 0.998), (31, 0.998), (32, 0.997), (33, 0.992)]]
    plan = _plan(groups, now)
    best, budget = _brute_force(pol, plan, groups, now)
    assert pol.slack(plan, now) == pytest.approx(_slack(plan, slo, clock, now))
    out = pol.plan(plan, EngineView(now, 8, 0, 100, 100))
    kept_decode = [r for r in out.rows if r.num_new == 1]
    assert len(kept_decode) == len(groups) + best
    if best:
        assert pol.last_budget_s >= budget - 1e-12
    # every request keeps its stalest row, and the prefill row stays
    for rows in groups:
        stalest = min(rows, key=lambda x: x[1])
        assert any(r.start == stalest[0] for r in kept_decode)
    assert any(r.num_new == 16 for r in out.rows)
    assert pol.last_predicted_s <= pol.last_budget_s + 1e-12


def test_late_first_token_deadline_is_left_out():
    """A prefill row whose TTFT deadline falls inside the baseline step is
    late whatever runs beside it: `late=drop` leaves it out of the slack (no
    other deadline here: every extra row runs); the paper's rule
    (`late=keep`) holds the step to the baseline for it."""
    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])
    groups = [[(40, 0.995), (41, 0.990), (42, 0.993)], [(7, 0.996), (8, 0.994)]]
    for late, ttft, extras in (("drop", 0.501, 3), ("keep", 0.501, 0), ("drop", 0.5055, 0), ("drop", 0.6, 3)):
        pol = BranchAdmissionPolicy(f"taper:late={late}", latency_model=model, slo_ttft_s=ttft)
        out = pol.plan(_plan(groups), EngineView(1.0, 5, 0, 100, 100))  # the prefill row arrived at 0.5
        assert sum(1 for r in out.rows if r.num_new == 1) == 2 + extras, (late, ttft)
        assert pol.last_slack_s == (math.inf if extras == 3 and ttft < 0.55 else pytest.approx(ttft - 0.5))
        st = pol.stats()  # reports are strict JSON: no deadline counted is reported as none, not inf
        json.dumps(st, allow_nan=False)
        assert (st["taper_last_slack_s"] is None) == (pol.last_slack_s == math.inf)


def test_average_clock_banks_time_and_owes_it():
    """The average clock: a request ahead of its TPOT SLO (its tokens came
    faster) has slack beyond one SLO; one behind it has less than the token
    clock would give it, down to below zero."""
    now = 1.0
    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])
    fast = _plan([[(44, 0.999)]], now)  # 41 tokens at 2 ms each, against a 10 ms SLO: 0.4 s banked
    avg = BranchAdmissionPolicy("taper", latency_model=model, slo_tpot_s=0.010)
    tok = BranchAdmissionPolicy("taper:clock=token", latency_model=model, slo_tpot_s=0.010)
    assert avg.slack(fast, now) == pytest.approx(0.999 - 0.08 + 41 * 0.010 - now)
    assert tok.slack(fast, now) == pytest.approx(0.999 + 0.010 - now)
    slow = _plan([[(44, 0.999)]], now)  # the same tokens at 2 ms each, against a 1 ms SLO: 41 ms owed
    avg1 = BranchAdmissionPolicy("taper", latency_model=model, slo_tpot_s=0.001)
    owed = avg1.slack(slow, now)
    assert owed == pytest.approx(0.999 - 0.08 + 41 * 0.001 - now) and owed < 0


def _clocked(now: float, rows: int, behind_s: float, slo: float, sid) -> list[ScheduledRow]:
    """One request's decode rows (its first the stalest) on one average
    clock whose next token is due `behind_s` before `now` (negative: ahead),
    each row 12 tokens into 100."""
    g, clock = _Req(), RequestClock()
    clock.start, clock.first, clock.tokens = now - 0.5, 1, round((0.5 - behind_s) / slo)
    out = []
    for i in range(rows):
        s = Seq(next(sid), [1] * 16, 4, 100, 0.0, group=g, clock=clock)
        s.first_token_time, s.last_token_time = now - 0.5, now - 0.010 + i * 1e-3
        out.append(ScheduledRow(s, 15, 1, True))
    return out


@pytest.mark.parametrize("utility", ["concave", "linear"])
def test_a_late_branching_request_widens_to_catch_up(utility):
    """A branching request 30 ms behind its average clock (10 ms TPOT SLO)
    that can still catch up: each of its rows costs 1 ms and brings it 10
    ms, so its own deadline does not hold its rows back and all four run;
    the rows of a request far ahead still wait, since its rows would delay
    the late one's next token past its deadline. Counted against its own
    deadline, as a one-row-ahead greedy would, the late request could not
    widen (its deadline stays behind after any one more row), and it held
    the other request to its baseline row too."""
    now, slo = 1.0, 0.010
    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])  # 1 ms a row
    sid = itertools.count()
    late, ahead = _clocked(now, 4, 0.030, slo, sid), _clocked(now, 4, -0.100, slo, sid)
    serial = _clocked(now, 1, -0.050, slo, sid)
    plan = StepPlan()
    plan.rows = late + ahead + serial
    pol = BranchAdmissionPolicy(f"taper:utility={utility}", latency_model=model, slo_tpot_s=slo)
    assert pol.slack(plan, now) == pytest.approx(-0.030)
    out = pol.plan(plan, EngineView(now, 9, 0, 1000, 1000))
    kept = {id(r) for r in out.rows}
    assert all(id(r) in kept for r in late)  # T0 = 5 ms; the budget for its rows: 5 + 0.8 * (50 - 5) ms
    assert [id(r) in kept for r in ahead] == [True, False, False, False]  # its budget: the late one's 0 ms left
    assert id(serial[0]) in kept
    assert pol.last_predicted_s == pytest.approx(8e-3) and pol.last_predicted_s <= pol.last_budget_s


def test_recent_steps_decide_whether_a_late_request_can_catch_up():
    """A serial request 3 ms behind its average clock (2 ms TPOT SLO) beside a
    branching one far ahead. Its decode-only baseline step (1.2 ms) would win
    the time back, but the recent steps, prompt chunks included, ran at 4-5
    ms: under `catchup=recent` it cannot catch up at those steps, its
    deadline is left out, and the branching request's rows all run; checked
    at this step's baseline (`catchup=step`) it holds them all back."""
    now, slo = 1.0, 0.002
    model = LinearLatencyModel("linear", [1e-3, 1e-4, 0.0, 1e-5])  # 1 ms, 0.1 ms a row, 10 us a new token
    chunk = StepPlan()  # a step that prefills 400 prompt tokens: 5.1 ms
    chunk.rows = [ScheduledRow(Seq(10**6, [1] * 400, 400, 10, 0.0, group=_Req()), 0, 400, True)]
    f = plan_features(chunk)
    t_chunk = model.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs, f.extend_rows)
    widths = {}
    for catchup in ("step", "recent"):
        pol = BranchAdmissionPolicy(f"taper:catchup={catchup}", latency_model=model, slo_tpot_s=slo)
        for i in range(64):
            pol.observe(chunk, StepRecord(i, f.rows, 0, f.context_tokens, f.new_tokens, t_chunk, t_chunk, 0.0,
                                          prefill_pairs=f.prefill_pairs, extend_rows=f.extend_rows))
        sid = itertools.count()
        serial, branching = _clocked(now, 1, 0.003, slo, sid), _clocked(now, 4, -0.100, slo, sid)
        plan = StepPlan()
        plan.rows = serial + branching
        out = pol.plan(plan, EngineView(now, 5, 0, 1000, 1000))
        kept = {id(r) for r in out.rows}
        assert id(serial[0]) in kept and id(branching[0]) in kept
        widths[catchup] = sum(id(r) in kept for r in branching)
    assert widths == {"step": 1, "recent": 4}


def test_taper_concave_utility_spreads_width():
    """With room for two of three extra rows of about equal cost, concave
    utility gives each request one; linear utility takes the two cheapest."""
    model = LinearLatencyModel("linear", [1e-3, 0.0, 1e-5, 0.0])  # 10 us per context token
    groups = [[(100, 0.999), (50, 0.999), (51, 0.999)], [(100, 0.999), (52, 0.999)]]
    # baseline: contexts 101 + 101 + 16 -> T0 = 3.18 ms; extras cost 0.51, 0.52 and 0.53 ms;
    # rho = 1 and a slack of 4.48 ms leave 1.3 ms for them
    for utility, expect in (("concave", {51, 53}), ("linear", {51, 52})):
        pol = BranchAdmissionPolicy(f"taper:rho=1,utility={utility},clock=token", latency_model=model,
                                    slo_tpot_s=5.48e-3)
        out = pol.plan(_plan(groups), EngineView(1.0, 5, 0, 100, 100))
        extra = {r.start + 1 for r in out.rows if r.num_new == 1} - {101}
        assert extra == expect, (utility, extra)
        assert pol.last_budget_s == pytest.approx(4.48e-3)


def test_taper_refits_online_toward_the_offline_fit():
    """Observing steps refits the predictor; a roofline profile is swept and
    fitted with the linear form to start from."""
    roof = load_profile("h100:llama3-8b").model
    pol = BranchAdmissionPolicy("taper", latency_model=roof, slo_tpot_s=0.05)
    base = pol.predictor.base
    ref = linear_fit_of(roof)
    assert base.coef == pytest.approx(ref.coef)
    feats = sweep_features()
    errs = [abs(base.predict_features(f) - roof.predict_features(f)) / roof.predict_features(f) for f in feats]
    assert sorted(errs)[len(errs) // 2] < 0.15


# -- the simulator ----------------------------------------------------------------------

def _sim(mode, specs, slo=0.06, **cfg):
    model = LinearLatencyModel("linear", [5e-3, 2e-3, 0.0, 0.0])  # 2 ms per row
    pol = []
    if mode != "eager":
        pol = [BranchAdmissionPolicy(mode, latency_model=model, slo_tpot_s=slo, slo_ttft_s=1.0)]
    sim = Simulator(model, SimConfig(kv_slots=20000, max_context=512, vocab_size=100, check_every=1, **cfg), pol)
    return sim.run(specs), pol


def _specs():
    out = []
    for i in range(12):
        n = 4 if i % 3 else 1
        out.append(RequestSpec(f"r{i}", 0.01 * i, 40, (Segment(f"p{i}", 32),), n=n))
    return out


def test_simulator_modes_order_width_and_victims():
    """Eager runs the widest steps and makes the serial requests' TPOT worst;
    off the narrowest; taper in between, its steps kept within the SLO budget
    whenever the baseline fits."""
    res = {m: _sim(m, _specs()) for m in ("eager", "off", "cap:2", "taper")}
    rows = {m: r.stats["max_rows"] for m, (r, _) in res.items()}
    assert rows["off"] <= 12 and rows["cap:2"] <= 2 * 8 + 4 and rows["eager"] > 2 * 8 + 4
    assert rows["off"] < rows["taper"] < rows["eager"]
    victims = {m: summarize(r.records, r.duration_s, SLO(tpot_s=0.06))["victim_tpot_s"]["p50"]
               for m, (r, _) in res.items()}
    assert victims["off"] < victims["taper"] < victims["eager"]
    for m, (r, _) in res.items():
        assert all(rec.completed and rec.output_tokens == 40 * rec.n for rec in r.records), m
    st = res["taper"][0].stats["policy"]
    assert st["taper_calibrated"] and st["branch_rows_deferred"] > 0


def test_victim_tpot_counts_only_overlapping_serial_requests():
    def rec(i, n, start, end):
        return RequestRecord(f"r{i}", start, 4, n=n, start_s=start, first_token_s=start + 0.1, end_s=end,
                             output_tokens=11 * n)

    recs = [rec(0, 3, 1.0, 2.0), rec(1, 1, 0.0, 0.9), rec(2, 1, 1.5, 3.5), rec(3, 1, 0.5, 1.1), rec(4, 1, 2.5, 3.0)]
    v = victim_tpots(recs)
    assert sorted(v) == sorted([recs[2].tpot, recs[3].tpot])
    assert recs[0].tpot == pytest.approx(0.9 / (33 - 3))
    assert victim_tpots([r for r in recs if r.n == 1]) is None
    s = summarize(recs, 4.0, SLO())
    assert s["num_victims"] == 2 and s["victim_tpot_s"]["p50"] == pytest.approx(
        sorted([recs[2].tpot, recs[3].tpot])[0] * 0.5 + sorted([recs[2].tpot, recs[3].tpot])[1] * 0.5)
    assert math.isclose(recs[1].tpot, 0.8 / 10)
    alone = summarize(recs[1:], 4.0, SLO())  # no branching request: no victims, same keys
    assert alone["num_victims"] is None and alone["victim_tpot_s"]["p50"] is None


# -- over HTTP ------------------------------------------------------------------------------

def test_server_branch_admission_over_http(llama_ckpt):
    """`n` choices from a server that defers branches are the same as from an
    eager one (seeded), streamed or not; the metrics count the deferrals."""
    import openai
    from server_util import ServerThread

    def ask(srv):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        kw = dict(model="test-model", prompt="In the beginning", max_tokens=8, n=3, temperature=1.2, seed=5,
                  extra_body={"ignore_eos": True})
        full = client.completions.create(**kw)
        texts = {c.index: c.text for c in full.choices}
        streamed: dict[int, str] = {}
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + c.text
        srv.wait_idle()
        srv.kv_report()
        return texts, streamed, srv.metrics()

    with ServerThread(llama_ckpt) as srv:
        eager, eager_stream, m_eager = ask(srv)
    with ServerThread(llama_ckpt, branch_policy="off") as srv:
        off, off_stream, m_off = ask(srv)
    assert off == eager == eager_stream == off_stream and len(eager) == 3
    assert "stepserve:branch_rows_deferred_total" not in m_eager
    assert m_off["stepserve:branch_rows_deferred_total"] > 0
    assert m_off["stepserve:branch_rows_candidate_total"] >= m_off["stepserve:branch_rows_deferred_total"]


def test_cli_refuses_bad_branch_admission(capsys):
    from stepserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--branch-policy", "wide"])
    assert e.value.code == 2 and "branch admission" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--branch-policy", "taper", "--slo-tpot", "-1", "--port", "1"])
    assert "slo_tpot_s must be positive" in str(e.value.code)


def _reference_taper(groups, prefill, model, deadlines, now, rho, utility, late):
    """TAPER's rule restated plainly, for small batches, under the token
    clock: (admitted extra rows, budget, deadlines left out, of those the
    ones left out for their tokens left alone). `groups`: per request its rows as
    (start, staleness), the stalest first; `prefill`: (start, num_new) of the
    prefill rows; `deadlines`: the requests' as (deadline, TPOT SLO, its
    sequences) (`late=drop`: one the baseline step misses, when the request
    cannot catch up, does not count toward the slack). Each
    round scans every request for its next row and takes the best ratio of
    utility gain to marginal predicted latency (ties: the staler row, then
    the earlier request), while the predicted step fits the budget; a request
    whose next row does not fit takes no more."""
    def feats(decode):
        rows = len(decode) + len(prefill)
        ctx = sum(s + 1 for s, _ in decode) + sum(s + n for s, n in prefill)
        new = len(decode) + sum(n for _, n in prefill)
        pairs = sum(n * s + n * (n + 1) // 2 for s, n in prefill if n > 1)
        return rows, ctx, new, pairs

    base = [g[0] for g in groups]
    t0 = model.predict(*feats(base))
    counted = [d for d, slo, seqs in deadlines if late == "keep" or d >= now + t0 or _catches_up(d, seqs, slo, now, t0)]
    slack = min(counted, default=math.inf) - now
    budget = t0 + rho * max(0.0, slack - t0)
    taken = [1] * len(groups)
    closed = set()
    t = t0
    admitted = []
    while True:
        best = None
        for gi, g in enumerate(groups):
            if gi in closed or taken[gi] >= len(g):
                continue
            r = g[taken[gi]]
            cost = model.predict(*feats(base + [r])) - t0
            k = taken[gi] - 1  # extras this request already runs
            gain = math.log((k + 2) / (k + 1)) if utility == "concave" else 1.0
            key = (gain / max(cost, 1e-12), -r[1], -gi)
            if best is None or key > best[0]:
                best = (key, gi, r, cost)
        if best is None:
            # left out by the tokens they have left alone (the baseline step is within their SLO)
            short = sum(1 for d, slo, _ in deadlines if late == "drop" and d < now + t0 and t0 < slo) - (
                len(counted) - sum(1 for d, slo, _ in deadlines if late == "keep" or d >= now + t0))
            return admitted, budget, len(deadlines) - len(counted), short
        _, gi, r, cost = best
        if t + cost > budget:
            closed.add(gi)
            continue
        admitted.append((gi, r))
        t += cost
        taken[gi] += 1


@pytest.mark.parametrize("late", ["keep", "drop"])
def test_taper_matches_the_reference_rule_on_random_batches(late):
    """Many small random batches and models: TAPER admits exactly the rows the
    plain restatement of its rule picks, keeps each request's most urgent
    row, and never predicts its step past the budget unless the baseline
    alone is past it."""
    rng = np.random.default_rng(7)
    partial = 0  # cases where the rule admitted some extra rows and deferred others
    dropped = 0  # cases where extra rows ran after a deadline the baseline misses was left out
    too_few = 0  # cases where a request was left out as it has too few tokens left to catch up
    for case in range(300):
        model = LinearLatencyModel("linear+attn", [float(rng.uniform(1e-4, 5e-3)), float(rng.uniform(0, 1e-3)),
                                                   float(rng.uniform(0, 2e-6)), float(rng.uniform(0, 1e-4)),
                                                   float(rng.uniform(0, 1e-8))])
        utility = ["concave", "linear"][case % 2]
        rho = float(rng.uniform(0, 1))
        slo = float(rng.uniform(1e-3, 0.05))
        now = 10.0
        plan = StepPlan()
        groups = []
        sid = itertools.count()
        seqs = []
        behind = case % 4 == 0  # requests whose last token is up to 0.3 s old, most with few tokens left
        for _ in range(int(rng.integers(1, 6))):
            g, rows, mine = _Req(), [], []
            for _ in range(int(rng.integers(1, 6))):
                start = int(rng.integers(0, 200))
                left = int(rng.integers(1, 6 if behind else 40))
                s = Seq(next(sid), [1] * (start + 1), 1, start + left, 0.0, group=g)
                s.last_token_time = s.first_token_time = now - float(rng.uniform(0, 0.3 if behind else 0.05))
                plan.rows.append(ScheduledRow(s, start, 1, True))
                rows.append((start, s.last_token_time))
                mine.append(s)
            groups.append(sorted(rows, key=lambda x: x[1]))
            seqs.append(mine)
        prefill = []
        for _ in range(int(rng.integers(0, 3))):
            start, n = int(rng.integers(0, 100)), int(rng.integers(2, 64))
            p = Seq(next(sid), [1] * (start + n), start + n, 10, now - 0.01, group=_Req())
            plan.rows.append(ScheduledRow(p, start, n, True))
            prefill.append((start, n))
        rng.shuffle(plan.rows)
        # mostly a TPOT SLO whose budget falls between the baseline and the whole plan
        f_all, f_base = plan_features(plan), sum(len(g) - 1 for g in groups)
        full = model.predict(f_all.rows, f_all.context_tokens, f_all.new_tokens, f_all.prefill_pairs)
        latest = min(max(t for _, t in g) for g in groups)
        if f_base and case % 3:
            t0 = full - f_base * model.coef[1]  # roughly: the extras' row costs off
            want_slack = t0 + float(rng.uniform(-0.2, 1.2)) * (full - t0) / max(rho, 0.1)
            slo = max(want_slack + now - latest, 1e-4)
        pol = BranchAdmissionPolicy(f"taper:rho={rho},utility={utility},clock=token,late={late}",
                                    latency_model=model, slo_tpot_s=slo)
        deadlines = [(max(t for _, t in g) + slo, slo, mine) for g, mine in zip(groups, seqs)]
        want, budget, left_out, short = _reference_taper(groups, prefill, model, deadlines, now, rho, utility, late)
        dropped += left_out > 0 and len(want) > 0
        too_few += short > 0
        out = pol.plan(plan, EngineView(now, 20, 0, 1000, 1000))
        decode = [r for r in out.rows if r.num_new == 1]
        kept = sorted((r.start, r.seq.last_token_time) for r in decode)
        expect = sorted([g[0] for g in groups] + [r for _, r in want])
        assert kept == expect, case
        assert sum(1 for r in out.rows if r.num_new > 1) == len(prefill)
        if all(len(g) == 1 for g in groups):
            assert pol.steps == 0  # nothing to decide: the plan is left alone
            continue
        assert pol.last_budget_s == pytest.approx(budget)
        f = plan_features(out)
        t_kept = model.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs)
        base_only = len(want) == 0
        assert t_kept <= budget + 1e-12 or base_only, case
        partial += 0 < len(want) < sum(len(g) - 1 for g in groups)
    assert partial > 30, partial  # the cases exercise the greedy, not just "all" or "none"
    assert (dropped > 5) == (late == "drop"), dropped
    assert (too_few > 5) == (late == "drop"), too_few


class _SeesSLOs:
    """Records the SLOs on the request clocks of every row it plans."""

    name = "sees-slos"

    def __init__(self):
        self.seen = set()

    def plan(self, plan, view):
        for r in plan.rows:
            c = r.seq.clock
            self.seen.add((c.ttft_s, c.tpot_s))
        return plan

    def observe(self, plan, record):
        pass


def test_per_request_slos_over_http(llama_ckpt):
    """`slo_ttft` / `slo_tpot` on completions, chat and /generate reach the
    request's clock; a bad one is a 400 naming it."""
    import httpx
    import openai
    from server_util import ServerThread

    rec = _SeesSLOs()
    with ServerThread(llama_ckpt, engine_process=False, policies=[rec]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        client.completions.create(model="test-model", prompt="In the beginning", max_tokens=3,
                                  extra_body={"slo_ttft": 0.5, "slo_tpot": 0.04})
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, extra_body={"slo_tpot": 0.07})
        r = httpx.post(srv.url + "/generate", json={"text": "x", "sampling_params": {"max_tokens": 2},
                                                    "slo_ttft": 2}, timeout=60)
        assert r.status_code == 200
        client.completions.create(model="test-model", prompt="plain", max_tokens=2)
        assert {(0.5, 0.04), (None, 0.07), (2.0, None), (None, None)} <= rec.seen
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="test-model", prompt="x", max_tokens=2, extra_body={"slo_tpot": -1})
        assert "slo_tpot" in str(e.value)
        srv.wait_idle()
        srv.kv_report()


# -- the paper's ablations ------------------------------------------------------------------

def test_ablation_options_parse_and_print():
    s = BranchAdmissionSpec.parse("taper:budget=slo,replan=8,predictor=constant,late=keep")
    assert (s.budget, s.replan, s.predictor, s.late) == ("slo", 8, "constant", "keep")
    assert BranchAdmissionSpec.parse(str(s)) == s
    for bad in ("taper:budget=none", "taper:replan=0", "taper:replan=x", "taper:predictor=oracle",
                "taper:late=never"):
        with pytest.raises(ValueError):
            BranchAdmissionSpec.parse(bad)


def test_refit_every_k_steps_follows_a_machine_whose_speed_moves():
    """TAPER rescales its step model on the last steps every `refit` (50 by
    default) observed ones; with refit=0, the rescale fitted when the first
    steps came in holds until refit_period_s has passed, however the
    machine's speed moves."""
    from stepserve.scheduler.latency_model import StepFeatures

    assert BranchAdmissionSpec.parse("taper").refit == 50
    assert BranchAdmissionSpec.parse("taper:refit=7").refit == 7
    for text in ("taper:refit=7", "taper:refit=0", "taper"):
        spec = BranchAdmissionSpec.parse(text)
        assert BranchAdmissionSpec.parse(str(spec)) == spec
    with pytest.raises(ValueError, match="refit"):
        BranchAdmissionSpec.parse("taper:refit=-1")
    model = LinearLatencyModel("linear", [1e-3, 1e-4, 0.0, 0.0])
    f = StepFeatures(rows=10, context_tokens=1000, new_tokens=10)
    preds = {}
    for spec in ("taper", "taper:refit=0", "taper:refit=50"):
        pol = BranchAdmissionPolicy(spec, latency_model=model, slo_tpot_s=0.05)
        for i in range(400):  # the machine runs at the profile's speed, then at half of it
            pol.predictor.add(f, model.predict_features(f) * (1.0 if i < 100 else 2.0))
        preds[spec] = pol.predictor.predict(10, 1000, 10) / model.predict_features(f)
    assert preds["taper:refit=0"] == pytest.approx(1.0)
    assert preds["taper:refit=50"] == pytest.approx(2.0)
    assert preds["taper"] == pytest.approx(2.0)


def test_ablation_budget_slo_and_constant_predictor():
    """budget=slo: the step budget is the TPOT SLO, whatever the slack;
    predictor=constant: every plan costs the same, so extras are all or none."""
    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])
    groups = [[(40, 0.995), (41, 0.990), (42, 0.993)], [(7, 0.996), (8, 0.994)]]
    pol = BranchAdmissionPolicy("taper:budget=slo,clock=token", latency_model=model, slo_tpot_s=0.0065)
    out = pol.plan(_plan(groups), EngineView(1.0, 5, 0, 100, 100))
    assert pol.last_budget_s == pytest.approx(0.0065)  # slack would give 0.99 + 6.5 ms - 1: less
    assert sum(1 for r in out.rows if r.num_new == 1) == 3  # 2 ms + 3 baseline rows + 1 extra = 6 ms
    const = BranchAdmissionPolicy("taper:predictor=constant,clock=token", latency_model=model, slo_tpot_s=0.02)
    out = const.plan(_plan(groups), EngineView(1.0, 5, 0, 100, 100))
    assert sum(1 for r in out.rows if r.num_new == 1) == 5


def test_ablation_replan_keeps_widths_between_plans():
    calls = []
    model = LinearLatencyModel("linear", [5e-3, 2e-3, 0.0, 0.0])
    pol = BranchAdmissionPolicy("taper:replan=5", latency_model=model, slo_tpot_s=0.06, slo_ttft_s=1.0)
    orig = pol._taper

    def spy(*a):
        calls.append(1)
        return orig(*a)

    pol._taper = spy
    sim = Simulator(model, SimConfig(kv_slots=20000, max_context=512, vocab_size=100, check_every=1), [pol])
    res = sim.run(_specs())
    st = res.stats["policy"]
    assert all(r.completed for r in res.records)
    assert st["taper_planned_steps"] > 10 and len(calls) == -(-st["taper_planned_steps"] // 5)


def test_taper_prices_the_decode_steps_after_a_prompt_chunk():
    """A decode step right after a step with P prompt tokens (the view's
    `since_prompt`) takes the profile's cold extra: TAPER's baseline is
    sqrt(P) a + (1 + sqrt(P) b) t0 and each extra row costs (1 + sqrt(P) b)
    times its model price, so a binding SLO admits fewer rows there. Past
    the priced steps, in a step with prompt tokens of its own, or with
    cold=ignore, the plain model prices it."""
    from stepserve.scheduler.latency_model import ServingCosts

    model = LinearLatencyModel("linear", [2e-3, 1e-3, 0.0, 0.0])  # 1 ms per row
    costs = ServingCosts(cold=((0.0, 0.05), (1e-4, 0.0)))
    groups = [[(40, 0.995), (41, 0.990), (42, 0.993)], [(10, 0.999)], [(7, 0.996), (8, 0.994)],
              [(30, 0.998), (31, 0.998), (32, 0.997), (33, 0.992)]]

    def plan_of(spec, since, slo=1.0, prefill=False):
        pol = BranchAdmissionPolicy(spec, latency_model=model, slo_tpot_s=slo, costs=costs)
        plan = _plan(groups)
        if not prefill:
            plan.rows = [r for r in plan.rows if r.num_new == 1]
        out = pol.plan(plan, EngineView(1.0, 11, 0, 100, 100, since_prompt=since))
        return pol, sum(1 for r in out.rows if r.num_new == 1)

    t_all = 2e-3 + 10 * 1e-3  # every row admitted (a loose SLO)
    for since, (a, b) in (((0, 100), (0.0, 0.5)), ((1, 100), (1e-3, 0.0)), ((2, 100), (0.0, 0.0)),
                          ((5, 0), (0.0, 0.0))):
        pol, n = plan_of("taper", since)
        assert n == 10 and pol.last_predicted_s == pytest.approx(a + (1 + b) * t_all), since
        pol, n = plan_of("taper:cold=ignore", since)
        assert n == 10 and pol.last_predicted_s == pytest.approx(t_all)
    pol, _ = plan_of("taper", (0, 100), prefill=True)  # its own prompt tokens: not cold (the model's price)
    assert pol.last_predicted_s == pytest.approx(model.predict(11, 0, 26) + 0.0)
    # a binding SLO: the cold step admits fewer rows and keeps its prediction within its budget
    # (the token clock: slack 0.995 + 20 ms - 1 s = 15 ms; plain, T0 6 ms and a budget of 13.2: all 6 extra
    # rows at 1 ms; cold, T0 1.5 x 6 = 9 ms and a budget of 13.8: 3 extra rows at 1.5 ms)
    tight = {spec: plan_of(f"taper:clock=token,late=keep{spec}", (0, 100), slo=0.02) for spec in ("", ",cold=ignore")}
    assert tight[""][1] == 4 + 3 and tight[",cold=ignore"][1] == 4 + 6
    assert tight[""][0].last_budget_s == pytest.approx(0.0138)
    assert tight[""][0].last_predicted_s == pytest.approx(0.0135)
    assert "cold=ignore" in str(BranchAdmissionSpec.parse("taper:cold=ignore"))
    with pytest.raises(ValueError, match="cold"):
        BranchAdmissionSpec.parse("taper:cold=never")


@pytest.mark.parametrize("overlap", [False, True])
def test_the_scheduler_counts_the_steps_since_a_prompt_chunk(overlap):
    """Each committed step's `after_prompt`, and the `since_prompt` a policy
    sees when it plans it, follow the steps in the order they run (the
    overlap schedule plans a step before the one before it is observed):
    counted again from the steps' records."""

    class Recorder:
        name = "recorder"

        def __init__(self):
            self.views, self.steps = {}, []

        def plan(self, plan, view):
            self.views[id(plan)] = view.since_prompt
            return plan

        def observe(self, plan, rec):
            self.steps.append((self.views.pop(id(plan)), plan.after_prompt, rec.new_tokens - rec.decode_rows))

    model = LinearLatencyModel("linear", [5e-3, 2e-3, 0.0, 0.0])
    rec = Recorder()
    sim = Simulator(model, SimConfig(kv_slots=20000, max_context=512, vocab_size=100, check_every=1,
                                     max_batched_tokens=24, overlap_schedule=overlap), [rec])
    res = sim.run(_specs())
    assert all(r.completed for r in res.records)
    j, p = 0, 0
    prompts = 0
    for view, after, prompt in rec.steps:
        assert view == (j, p)
        j, p = (0, prompt) if prompt > 0 else (j + 1, p)
        assert after == (j, p)
        prompts += prompt > 0
    assert prompts >= 12 and max(j for _, (j, _), _ in rec.steps) > 3


def test_taper_predicts_the_steps_after_a_prompt_chunk_in_the_simulator():
    """On a simulated engine whose decode steps after a prompt chunk take the
    profile's cold extra, TAPER given the costs predicts those steps (and the
    rest) at their simulated time; with cold=ignore it predicts them short
    and the steady steps long (its rescale spreads their extra over all)."""
    from stepserve.scheduler.latency_model import ServingCosts

    model = LinearLatencyModel("linear", [1e-3, 5e-5, 0.0, 0.0])
    cold = ((1e-4, 0.05), (5e-5, 0.02))
    out = {}
    for spec in ("taper", "taper:cold=ignore"):
        pol = BranchAdmissionPolicy(spec, latency_model=model, slo_tpot_s=0.01, slo_ttft_s=1.0,
                                    costs=ServingCosts(cold=cold))
        sim = Simulator(model, SimConfig(kv_slots=20000, max_context=512, vocab_size=100, check_every=1,
                                         cold=[list(c) for c in cold]), [pol])
        specs = [RequestSpec(f"r{i}", 0.02 * i, 24, (Segment(f"p{i}", 32),), n=4 if i % 3 else 1) for i in range(40)]
        res = sim.run(specs)
        assert all(r.completed for r in res.records)
        st = res.stats["policy"]
        assert st["taper_after_prompt_steps"] >= 50
        out[spec] = (st["taper_after_prompt_predicted_s"] / st["taper_after_prompt_measured_s"],
                     (st["taper_predicted_s"] - st["taper_after_prompt_predicted_s"])
                     / (st["taper_measured_s"] - st["taper_after_prompt_measured_s"]))
    assert out["taper"] == pytest.approx((1.0, 1.0), abs=0.02)
    assert out["taper:cold=ignore"][0] < 0.9 and out["taper:cold=ignore"][1] > 1.0
