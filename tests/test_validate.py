"""The engine's step log (what it records, checked against the engine's own
step records), the engine view `stepserve validate` derives from it, and the
validation's judgement of a rate sweep (errors, the saturation knee)."""

from __future__ import annotations

import asyncio

import pytest

from stepserve import AsyncEngine, SamplingParams
from stepserve.engine.step_log import FIELDS, read_step_log
from stepserve.scheduler.latency_model import LinearLatencyModel, ServingCosts
from stepserve.traces.validate import (compare_rate, format_rate, format_summary, judge, knee, sim_ttft_parts,
                                       step_log_view, ttft_parts)


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_step_log_records_every_step_and_the_loop_around_it(llama_ckpt, tmp_path, process):
    path = tmp_path / "steps.jsonl"

    async def go():
        async with AsyncEngine(model=llama_ckpt, process=process, step_log=str(path)) as eng:
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

            async def one(prompt):
                return [o async for o in eng.generate(prompt, params)]

            await asyncio.gather(one([5, 6, 7, 8, 9]), one([10, 11, 12]))
            rule.append((eng.info.fold_tokens, eng.info.fold_pairs))
            if process:  # its records stay in the child
                return None
            return await asyncio.wrap_future(eng.call(
                lambda e: [(r.rows, r.context_tokens, r.new_tokens, r.prefill_pairs, r.extend_rows, r.chunk_rows,
                            r.layered) for r in e.records]))

    rule = []
    records = asyncio.run(go())
    lines = read_step_log(str(path))
    steps = [ln for ln in lines if "rows" in ln]
    assert sum(ln["adds"] for ln in lines) == 2
    assert all(set(ln) <= set(FIELDS) for ln in lines)
    firsts = [rid for ln in lines for rid in ln.get("first", ())]  # each request's first output, once
    assert len(firsts) == len(set(firsts)) == 2
    assert all(a["t"] <= b["t"] for a, b in zip(lines, lines[1:]))
    assert all(ln["step"] > 0 and 0 < ln["fwd"] <= ln["step"] and ln["out"] >= 0 and ln["emit"] >= 0 for ln in steps)
    # the loop thread's CPU time over the step call: positive, and no more than that call's wall time
    assert all(0 < ln["cpu"] <= ln["step"] + 0.005 for ln in steps)
    # two 5-token requests: every token is one row of one step
    assert sum(ln["rows"] for ln in steps) == 10
    assert steps[0]["pairs"] > 0 and steps[-1]["pairs"] == 0  # a prefill first, a decode last
    # ... whose two chunks (8 tokens; 15 and 6 query-key pairs) took the extend path unless the engine folds
    # them into decode-shaped queries (`FoldRule`), and one that prefilled none
    (fold_tokens, fold_pairs), = rule
    assert steps[0]["ext"] == sum(1 for pairs in (15, 6) if not (8 <= fold_tokens or pairs <= fold_pairs))
    assert steps[-1]["ext"] == 0
    # both are chunk rows; the step runs as one call where all its 8 tokens fold
    assert steps[0]["chunks"] == 2 and steps[0]["layered"] == int(8 > fold_tokens)
    assert steps[-1]["chunks"] == steps[-1]["layered"] == 0
    if records is not None:  # the thread engine is at hand: the log is its records, step for step
        assert [(ln["rows"], ln["ctx"], ln["new"], ln["pairs"], ln["ext"], ln["chunks"], bool(ln["layered"]))
                for ln in steps] == records


def test_step_log_follows_a_stepped_wall_clock(llama_ckpt, tmp_path, monkeypatch):
    """The wall clock is stepped (an hour, as NTP or a VM's resume may) after
    the engine and its log started: the steps it logs afterwards are stamped
    in the clock as it is when they run, as a client that starts now stamps
    its requests, not in the mapping the log started with."""
    import time

    from stepserve.engine.step_log import SETTLE_S, wall_offset

    path = tmp_path / "steps.jsonl"
    real = time.time

    async def go():
        async with AsyncEngine(model=llama_ckpt, step_log=str(path)) as eng:
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            [o async for o in eng.generate([1, 2, 3], params)]  # the loop runs, its log open
            await asyncio.sleep(SETTLE_S)  # and has written that request's steps
            monkeypatch.setattr(time, "time", lambda: real() + 3600.0)
            sent = time.perf_counter() + wall_offset()  # a client's stamp of its send, as replay makes it
            [o async for o in eng.generate([5, 6, 7], params)]
            return sent, time.perf_counter() + wall_offset()

    sent, done = asyncio.run(go())
    steps = [ln for ln in read_step_log(str(path)) if "rows" in ln]
    assert len(steps) == 6 and all(ln["t"] < sent - 3000 for ln in steps[:3])
    assert all(sent <= ln["t"] <= done for ln in steps[3:])


def _line(t, wait=0.0, adds=0, step=None, rows=1, new=1):
    ln = {"t": t, "wait": wait, "adds": adds, "cmd": 0.0, "emit": 0.0, "outs": 0}
    if step is not None:
        ln.update(rows=rows, decode_rows=rows, ctx=10, new=new, pairs=0.0, step=step, fwd=step, out=0.0)
    return ln


def test_engine_view_of_a_replay():
    """A request sent at 100.000 reaches the idle engine at 100.002 (entry 2 ms);
    its first step takes 14 ms where the model says 10 (after idle: +4 ms);
    the busy steps take what the model says. A request sent while a step runs
    waits for it, which is not entry cost. The busy loop spends 0.6 ms between
    two steps once."""
    model = LinearLatencyModel("linear", [0.01, 0.0, 0.0, 0.0])
    lines = [
        _line(100.002, wait=5.0, adds=1, step=0.014),
        _line(100.016, step=0.010),
        _line(100.026, adds=1, step=0.010),  # sent at 100.020, during the step before
        _line(100.0366, step=0.010),  # 0.6 ms of the loop's own after the step before
    ]
    real = {"t0_epoch": 100.0, "requests": [{"start_s": 0.0, "end_s": 0.04}, {"start_s": 0.020, "end_s": 0.045}]}
    v = step_log_view(lines, real, model)
    assert v["steps"] == 4 and v["steps_after_idle"] == 1
    assert v["busy_s"] == pytest.approx(0.044) and v["predicted_busy_s"] == pytest.approx(0.04)
    assert v["wake_extra_s_p50"] == pytest.approx(0.004)
    assert v["busy_step_ratio_p50"] == pytest.approx(1.0)
    assert v["entry_s"]["n"] == 1 and v["entry_s"]["p50"] == pytest.approx(0.002)
    assert v["loop_s"] == pytest.approx(0.0006 / 3)  # the mean over the three busy gaps


def test_engine_view_joins_first_tokens_to_the_iterations_that_handed_them_over():
    """The step log names the requests whose first output an iteration handed
    over; the records carry the server's ids: a first token's way to its
    client is its record's first-token time less that iteration's end, and
    over the profile's delivery (1 ms + 0.1 ms per output of the iteration)."""
    model = LinearLatencyModel("linear", [0.01, 0.0, 0.0, 0.0])
    a = _line(100.002, wait=5.0, adds=1, step=0.010)
    a.update(first=["cmpl-a"], outs=1)
    b = _line(100.013, adds=1, step=0.010)
    b.update(first=["cmpl-b"], outs=2)
    real = {"t0_epoch": 100.0, "requests": [
        {"start_s": 0.0, "end_s": 0.05, "first_token_s": 0.0135, "server_id": "cmpl-a"},  # 1.5 ms after 100.012
        {"start_s": 0.011, "end_s": 0.05, "first_token_s": 0.0264, "server_id": "cmpl-b"},  # 3.4 ms after 100.023
        {"start_s": 0.02, "end_s": 0.05, "first_token_s": 0.03}]}  # no id: not joined
    v = step_log_view([a, b], real, model, costs=ServingCosts(delivery_s=1e-3, stream_s=1e-4))
    d = v["delivery_s"]
    assert d["n"] == 2 and d["p50"] == pytest.approx((0.0015 + 0.0034) / 2)
    assert d["over_p50"] == pytest.approx((0.0015 - 0.0011 + 0.0034 - 0.0012) / 2)
    assert step_log_view([a, b], real, model)["delivery_s"]["over_p50"] is None  # no profile costs


def test_engine_view_measures_the_speed_window_by_window():
    """A run whose machine ran at the model's speed for its first second and
    at half of it for the next: one window each, and a last window with too
    few steps to measure takes the run's speed. The loop between the steps
    ran at the profile's 0.1 ms in the first second and three times that in
    the next, taking in a request (0.2 ms more) before every tenth step."""
    model = LinearLatencyModel("linear", [0.01, 0.0, 0.0, 0.0])
    costs = ServingCosts(loop_s=1e-4, intake_s=2e-4)
    lines, t = [], 100.0
    gaps = pred = 0.0
    for w, (dt, n, loop) in enumerate(((0.010, 99, 1.0), (0.020, 49, 3.0), (0.010, 5, 1.0))):
        for i in range(n):
            adds = int(i % 10 == 5)
            if lines:
                gap = max(loop * (1e-4 + 2e-4 * adds), 100.001 + w - t)  # the phase from its window's start
                t += gap
                gaps, pred = gaps + gap, pred + 1e-4 + 2e-4 * adds
            lines.append(_line(t, step=dt, adds=adds))
            t += dt
    real = {"t0_epoch": 100.0, "requests": [{"start_s": 0.0, "end_s": t - 100.0}]}
    v = step_log_view(lines, real, model, window_s=1.0, costs=costs)
    run = v["speed"]["step"]
    assert run == pytest.approx((0.99 + 0.98 + 0.05) / (0.99 + 0.49 + 0.05))  # measured / predicted busy time
    assert v["speed"]["loop"] == pytest.approx(gaps / pred)
    (w0, a0, _, l0, c0), (w1, a1, _, l1, c1), (w2, a2, _, l2, c2) = v["speed_windows"]
    assert (w0, w1, w2) == (0.0, 1.0, 2.0)
    assert c0 is c1 is c2 is None  # no cold steps priced: nothing to scale
    assert a0 == pytest.approx(1.0) and a1 == pytest.approx(2.0) and a2 == pytest.approx(run)
    assert l0 == pytest.approx(1.0) and l1 == pytest.approx(3.0) and l2 == pytest.approx(gaps / pred)
    assert step_log_view(lines, real, model)["speed_windows"] is None
    assert step_log_view(lines, real, model)["speed"]["loop"] is None  # no profile costs to measure it against


def test_the_speed_is_fitted_to_the_steps_less_the_wake_up_the_simulation_adds():
    """A light load: every prompt reaches an idle engine, and its prefill step
    takes the model's time plus the profile's wake-up for the idling before
    it; the decode steps take the model's time. The machine ran at the
    profile's speed, and both factors say so: the simulation adds the
    wake-up itself, so fitted to the whole times (no costs to take it off)
    the wake-ups went into the per-token factor and were charged twice."""
    from stepserve.traces.calibrate import features

    model = LinearLatencyModel("linear", [1e-3, 1e-4, 0.0, 2e-5])
    costs = ServingCosts(wake_s=2e-3, wake_curve=((0.01, 1e-3), (0.1, 2e-3)))
    lines, t = [], 100.0
    for i in range(60):
        idle = 0.005 + 0.002 * i
        t += idle
        new = 50 + 3 * i
        ln = _line(t, wait=idle, adds=1, step=0.0, new=new)
        ln["decode_rows"] = 0
        f = features(ln)
        ln["step"] = model.predict_features(f) + costs.wake(idle)
        lines.append(ln)
        t += ln["step"]
        for rows in (1, 2, 2, 1):
            ln = _line(t, step=0.0, rows=rows, new=rows)
            ln["step"] = model.predict_features(features(ln))
            lines.append(ln)
            t += ln["step"]
    real = {"t0_epoch": 100.0, "requests": [{"start_s": 0.0, "end_s": t - 100.0}]}
    v = step_log_view(lines, real, model, window_s=1.0, costs=costs)
    assert v["speed"]["step"] == pytest.approx(1.0) and v["speed"]["token"] == pytest.approx(1.0)
    for _, a, b, _, _ in v["speed_windows"]:
        assert a == pytest.approx(1.0) and b == pytest.approx(1.0)
    assert v["steps_after_idle"] == 60 and v["wake_extra_s_p50"] > 1e-3  # the view still shows the wake-ups
    # priced as the simulation prices them, every size of step at its time: decode, 50-64 and 65-227 prompt tokens
    assert [(b["prompt"], b["n"]) for b in v["by_prompt"]] == [("none", 240), ("1-64", 5), ("65-256", 55)]
    assert [b["ratio"] for b in v["by_prompt"]] == pytest.approx([1.0, 1.0, 1.0])
    assert [(b["rows"], b["n"]) for b in v["by_rows"]] == [("1-3", 240)]  # the decode steps, by their rows
    assert [b["ratio"] for b in v["by_rows"]] == pytest.approx([1.0])
    r = compare_rate([_report(1, 1.0, 1.0, 0.01, 0.01)], [_report(1, 1.0, 1.0, 0.01, 0.01)])
    text = format_rate(r | {"engine": [v]})
    assert "measured/priced steps by prompt tokens: none 1.00 (240), 1-64 1.00 (5), 65-256 1.00 (55)" in text
    assert "decode steps by rows: 1-3 1.00 (240)" in text
    # the larger prompt steps twice as slow: the per-token factor follows the many large ones, and the bins
    # show the few small ones priced at about twice their time, which the run's totals do not
    for ln in lines:
        if ln["new"] - ln["decode_rows"] >= 65:
            ln["step"] *= 2
    skew = {b["prompt"]: b["ratio"] for b in step_log_view(lines, real, model, costs=costs)["by_prompt"]}
    assert skew["1-64"] < 0.6 and skew["65-256"] == pytest.approx(1.0, abs=0.05)
    assert skew["none"] == pytest.approx(1.0, abs=0.01)
    blind = step_log_view(lines, real, model)  # no profile costs: the wake-ups are read as slow tokens
    assert blind["speed"]["token"] > 1.2


def test_engine_view_prices_the_decode_steps_by_their_rows():
    """Decode steps of 40 rows that run at 0.8x the model where the many of
    1 row run at its time: the run's factor, fitted to all decode steps
    together, lands between the two, and the view's bins by rows show the
    large ones priced high (the misfit a simulation of the run's bursts
    inherits)."""
    from stepserve.traces.calibrate import features

    model = LinearLatencyModel("linear", [1e-3, 1e-4, 0.0, 2e-5])
    lines, t = [], 100.0
    for i in range(200):
        rows = 40 if i % 10 == 0 else 1
        ln = _line(t, step=0.0, rows=rows, new=rows)
        ln["step"] = model.predict_features(features(ln)) * (0.8 if rows == 40 else 1.0)
        lines.append(ln)
        t += ln["step"]
        if i % 4 == 0:  # and prompt steps at the model's time, for the per-token factor
            ln = _line(t, step=0.0, rows=2, new=60)
            ln["decode_rows"] = 1
            ln["step"] = model.predict_features(features(ln))
            lines.append(ln)
            t += ln["step"]
    real = {"t0_epoch": 100.0, "requests": [{"start_s": 0.0, "end_s": t - 100.0}]}
    v = step_log_view(lines, real, model)
    by_rows = {b["rows"]: (b["n"], b["ratio"]) for b in v["by_rows"]}
    assert set(by_rows) == {"1-3", "33+"} and by_rows["1-3"][0] == 180 and by_rows["33+"][0] == 20
    assert by_rows["33+"][1] < 0.92 * by_rows["1-3"][1]
    assert v["speed"]["step"] == pytest.approx(0.88, abs=0.08)  # one factor between the two


def _cold_log(truth, cold, rng, reps=60, scale=1.0):
    """Lines of a busy engine: a chunk of P prompt tokens beside B decode rows,
    then 8 decode steps of the B rows, the j-th taking the model's t plus
    scale * sqrt(P) * (a_j + b_j * t) for the (a_j, b_j) of `cold` (the
    steps after it: t); every step times a +-3% scatter."""
    import math

    lines, t = [], 1000.0

    def step(rows, ctx, new, extra_of=None):
        nonlocal t
        dt = truth.predict(rows, ctx, new, 0.0)
        dt = (dt + (extra_of(dt) if extra_of else 0.0)) * rng.uniform(0.97, 1.03)
        lines.append({"t": t, "wait": 0.0, "adds": 0, "cmd": 0.0, "rows": rows, "decode_rows": rows - (new > rows),
                      "ctx": ctx, "new": new, "pairs": 0.0, "step": dt, "fwd": dt, "out": 0.0, "emit": 0.0,
                      "outs": rows})
        t += dt + 1e-4

    for _ in range(reps):
        b, p = rng.choice([1, 2, 4, 8, 16, 32]), rng.choice([16, 64, 256, 1024])
        step(b + 1, b * 200 + p, b + p)
        for j in range(1, 9):
            a_b = cold[j - 1] if j <= len(cold) else None
            step(b, b * 200 + 8 * j, b, (lambda t_, ab=a_b: scale * math.sqrt(p) * (ab[0] + ab[1] * t_)) if a_b else None)
    return lines, t


def test_calibration_prices_the_decode_steps_that_follow_a_prompt():
    """The first decode steps after a chunk run slow by an amount growing with
    the chunk and the step: calibration recovers each one's (a, b), prices
    the third (not slow here) at nothing, and fits the step model on the
    rest, which the slow steps no longer pull up."""
    import random

    from stepserve.traces.calibrate import calibrate

    truth = LinearLatencyModel("linear", [0.6e-3, 5e-5, 3e-7, 2e-5])
    cold = ((25e-6, 0.004), (10e-6, 0.005))
    lines, t = _cold_log(truth, cold, random.Random(2))
    cal = calibrate(lines, [], 0.0, t + 1, form="linear")
    got = cal["costs"].cold
    assert len(got) == 3 and cal["samples"]["cold"] == [60, 60, 60]
    for (a, b), (ta, tb) in zip(got, cold):
        assert a == pytest.approx(ta, rel=0.25, abs=2e-6) and b == pytest.approx(tb, rel=0.25, abs=5e-4)
    assert got[2][0] < 2e-6 and got[2][1] < 5e-4
    assert cal["model"].coef == pytest.approx(truth.coef, rel=0.05, abs=2e-7)


def test_a_run_colder_than_the_profile_is_simulated_at_its_own_cold_factor():
    """A run whose cold steps take twice the extra the profile prices: the
    speed factors come from the other steps (the machine's speed, here the
    profile's), and the cold steps give a factor of 2 of their own, which
    every speed window carries to the simulation."""
    import random

    truth = LinearLatencyModel("linear", [0.6e-3, 5e-5, 3e-7, 2e-5])
    cold = ((25e-6, 0.004), (10e-6, 0.005))
    costs = ServingCosts(cold=cold)
    lines, t = _cold_log(truth, cold, random.Random(3), reps=120, scale=2.0)
    real = {"t0_epoch": 1000.0, "requests": [{"start_s": 0.0, "end_s": t - 1000.0}]}
    v = step_log_view(lines, real, truth, window_s=1.0, costs=costs)
    assert v["speed"]["step"] == pytest.approx(1.0, abs=0.02) and v["speed"]["token"] == pytest.approx(1.0, abs=0.05)
    assert v["speed"]["cold"] == pytest.approx(2.0, rel=0.05)
    assert all(w[4] == v["speed"]["cold"] for w in v["speed_windows"])


def test_the_simulator_adds_the_cold_steps_extra_after_each_prompt():
    """SimRunner: the j-th decode step after a step with P prompt tokens takes
    sqrt(P) * (a_j + b_j * t) more, times the speed window's cold factor;
    past the last j, and in a step with prompt tokens, nothing. (The plans'
    `after_prompt` counted as the scheduler counts it at commit.)"""
    from types import SimpleNamespace

    from stepserve.scheduler.latency_model import SincePrompt, StepFeatures
    from stepserve.traces.simulator import SimRunner, VirtualClock

    model = LinearLatencyModel("linear", [1e-3, 0.0, 0.0, 0.0])
    clock = VirtualClock()
    r = SimRunner(model, clock, costs=ServingCosts(cold=((1e-5, 0.01), (2e-6, 0.0))),
                  speed_schedule=[[0.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 3.0]])
    r.idle_s = 0.0
    since = SincePrompt()

    def step(rows, new, decode):
        t = clock.t
        r.run(SimpleNamespace(num_decode=decode, num_verify=0, samples=[0] * rows,
                              after_prompt=since.advance(new - decode)), StepFeatures(rows, 10, new))
        return clock.t - t

    assert step(2, 101, 1) == pytest.approx(1e-3)  # 100 prompt tokens: sqrt 10
    assert step(2, 2, 2) == pytest.approx(1e-3 + 10 * (1e-5 + 0.01 * 1e-3))
    assert step(2, 2, 2) == pytest.approx(1e-3 + 10 * 2e-6)
    assert step(2, 2, 2) == pytest.approx(1e-3)
    clock.t = 1.5  # the second window: its cold factor 3
    assert step(1, 16, 0) == pytest.approx(1e-3)  # 16 prompt tokens, no decode row
    assert step(1, 1, 1) == pytest.approx(1e-3 + 3 * 4 * (1e-5 + 0.01 * 1e-3))


def _report(rate, goodput, attainment, ttft, tpot):
    lat = {f"{m}_s": {q: v * f for q, f in (("p50", 1.0), ("p90", 2.0), ("p99", 3.0))}
           for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2e", 1.0))}
    return {"scaling": {"rate_rps": rate}, "goodput_rps": goodput, "slo_attainment": attainment,
            "throughput_rps": rate, "num_completed": 10, "duration_s": 1.0, **lat}


def test_judgement_of_a_sweep():
    real = [_report(1, 1.0, 1.0, 0.01, 0.01), _report(2, 1.9, 0.95, 0.02, 0.01), _report(4, 2.0, 0.5, 0.1, 0.02)]
    close = [_report(1, 1.0, 1.0, 0.0105, 0.0095), _report(2, 1.85, 0.92, 0.022, 0.011),
             _report(4, 2.05, 0.47, 0.11, 0.021)]
    per = [compare_rate([a], [b]) for a, b in zip(real, close)]
    assert per[1]["latency"]["ttft_p90"]["error"] == pytest.approx(0.1)
    assert per[2]["attainment_error"] == pytest.approx(-0.03)
    s = judge(per)
    assert s["all_met"] and s["knee"]["real"] == 4 and s["knee"]["sim"] == 4
    assert s["ttft_p90"]["worst"] == pytest.approx(0.1)

    # a simulator that saturates early: attainment off by 40 points, knee two grid steps early
    early = [_report(1, 0.8, 0.6, 0.03, 0.01), _report(2, 1.0, 0.5, 0.05, 0.02), _report(4, 1.0, 0.2, 0.5, 0.05)]
    s = judge([compare_rate([a], [b]) for a, b in zip(real, early)])
    assert not s["all_met"] and not s["attainment"]["met"] and not s["goodput"]["met"]
    assert s["knee"]["sim"] == 1 and s["knee"]["real"] == 4 and not s["knee"]["met"]


def test_repeats_are_medians_with_the_real_spread():
    reals = [_report(2, 1.8, 0.9, 0.02, 0.01), _report(2, 2.0, 1.0, 0.03, 0.01), _report(2, 1.9, 0.8, 0.025, 0.01)]
    sims = [_report(2, 1.9, 0.95, 0.025, 0.01)] * 3
    r = compare_rate(reals, sims)
    assert r["repeats"] == 3 and r["real"]["goodput_rps"] == pytest.approx(1.9)
    assert r["real"]["attainment_range"] == [0.8, 1.0] and r["real"]["slo_attainment"] == pytest.approx(0.9)
    c = r["latency"]["ttft_p50"]
    assert c["real"] == pytest.approx(0.025) and c["error"] == pytest.approx(0.0)
    assert c["real_spread"] == pytest.approx(0.01 / 0.025)
    assert r["goodput_error"] == pytest.approx(0.0) and r["attainment_error"] == pytest.approx(0.05)


def test_ttft_in_three_parts_from_the_step_log_and_from_the_simulator(tmp_path):
    """A TTFT is its way in (send to the iteration that took the request in),
    its time in the engine (to the end of the iteration that handed its first
    token over) and its way out (to the client). The real side reads them
    off the step log, taking the requests in the order they were sent; the
    simulation off its records' stamps. Under a constant 1 ms step, 2 ms of
    entry and 1 ms of delivery: a request into an idle engine at 0 is taken
    in at 2 ms, its first step ends at 3, its client has the token at 4; one
    sent at 2.5 ms reaches the engine at 4.5, inside the step of 4-5, so the
    loop takes it in at 5 (way in 2.5 ms), and so on."""
    from stepserve.traces.metrics import SLO
    from stepserve.traces.report import build_report
    from stepserve.traces.request_spec import RequestSpec, Segment
    from stepserve.traces.simulator import SimConfig, Simulator

    # real: r0 sent at 0, r1 at 0.0025 and r2 at 0.0026 (taken in together); ids join the first tokens
    a = _line(100.002, wait=1.0, adds=1, step=0.001)
    a.update(first=["s0"], outs=1)
    b = _line(100.003, step=0.001)
    c = _line(100.005, adds=2, step=0.001, rows=3, new=20)
    c.update(first=["s1", "s2"], outs=3)
    recs = [{"start_s": 0.0026, "first_token_s": 0.0075, "server_id": "s2"},  # out of order: sorted by send
            {"start_s": 0.0, "first_token_s": 0.004, "server_id": "s0"},
            {"start_s": 0.0025, "first_token_s": 0.007, "server_id": "s1"},
            {"start_s": 0.0027, "first_token_s": None, "error": "HTTP 400"}]  # failed: not in the engine's count
    p = ttft_parts([a, b, c], recs, 100.0)
    assert p["n"] == 3
    assert p["way_in"]["p50"] == pytest.approx(0.0024)  # 2, 2.5, 2.4 ms
    assert p["engine"]["p50"] == pytest.approx(0.001)
    assert p["way_out"]["p50"] == pytest.approx(0.001)  # 1, 1, 1.5 ms
    assert p["way_out"]["p90"] == pytest.approx(0.0014)
    assert ttft_parts([a, b, c], [], 100.0)["n"] == 0

    model = LinearLatencyModel("linear", [1e-3, 0.0, 0.0, 0.0])
    sim = Simulator(model, SimConfig(kv_slots=1000, max_context=256, vocab_size=100, entry_s=0.002, delivery_s=0.001))
    specs = [RequestSpec("r0", 0.0, 4, (Segment("p0", 10),)), RequestSpec("r1", 0.0025, 2, (Segment("p1", 10),))]
    res = sim.run(specs)
    r0, r1 = res.records
    assert (r0.engine_in_s, r0.first_out_s, r0.first_token_s) == pytest.approx((0.002, 0.003, 0.004))
    assert (r1.engine_in_s, r1.first_out_s, r1.first_token_s) == pytest.approx((0.005, 0.006, 0.007))
    report = build_report(mode="simulate", records=res.records, duration_s=res.duration_s, slo=SLO(), trace={},
                          scaling={}, config={})
    assert report["requests"][1]["engine_in_s"] == pytest.approx(0.005)
    s = sim_ttft_parts(report)
    assert s["n"] == 2
    assert s["way_in"]["p90"] == pytest.approx(0.002 + 0.9 * 0.0005)
    assert s["engine"]["p50"] == pytest.approx(0.001) and s["way_out"]["p50"] == pytest.approx(0.001)
    # a rate's figures: each side's median over its runs, printed side by side
    sims = [_report(2, 1.0, 1.0, 0.004, 0.001) | {"requests": report["requests"]}]
    r = compare_rate([_report(2, 1.0, 1.0, 0.004, 0.001)], sims)
    assert r["ttft_parts"]["sim"]["way_in"]["p50"] == pytest.approx(0.00225)
    r["ttft_parts"]["real"] = {k: {"p50": 0.002, "p90": 0.003} for k in ("way_in", "engine", "way_out")}
    text = format_rate(r)
    assert "TTFT's parts, p50 / p90 ms, real against sim: way in 2.0/3.0 against 2." in text
    assert "; engine 2.0/3.0 against 1.0/1.0; way out 2.0/3.0 against 1.0/1.0" in text


def test_each_run_is_also_judged_against_its_own_simulations():
    """Two real runs of one rate that the machine put far apart, each simulated
    at its own speed: the medians pool them, the paired errors keep each run
    with its own simulations (their median)."""
    reals = [_report(2, 1.0, 0.5, 0.04, 0.02), _report(2, 2.0, 1.0, 0.02, 0.01)]
    runs = [[_report(2, 1.1, 0.55, 0.05, 0.02), _report(2, 0.9, 0.45, 0.04, 0.02), _report(2, 1.05, 0.5, 0.042, 0.02)],
            [_report(2, 1.9, 0.97, 0.02, 0.012)]]
    r = compare_rate(reals, [s for run in runs for s in run], runs)
    first, second = r["paired"]
    assert first["goodput"] == pytest.approx(0.05) and first["attainment"] == pytest.approx(0.0)
    assert first["ttft_p50"] == pytest.approx(0.05) and first["ttft_p90"] == pytest.approx(0.05)
    assert first["tpot_p50"] == pytest.approx(0.0)
    assert second["goodput"] == pytest.approx(-0.05) and second["attainment"] == pytest.approx(-0.03)
    assert second["tpot_p90"] == pytest.approx(0.2)
    assert "each run against its own simulations: attainment +0.0pt/-3.0pt; goodput +5%/-5%" in format_rate(r)
    assert "paired" not in compare_rate(reals, runs[0])
    # judged per rate on the median over its runs: goodput +5% and -5% -> 0%; TPOT p90 0% and +20% -> +10%
    j = judge([r])["paired"]
    assert j["goodput"]["per_rate"] == [pytest.approx(0.0)] and j["goodput"]["met"]
    assert j["tpot_p90"]["per_rate"] == [pytest.approx(0.1)] and j["tpot_p90"]["met"]
    assert j["attainment"]["worst"] == pytest.approx(0.015) and j["all_met"]
    far = compare_rate(reals, [s for run in runs for s in run], [runs[0], [_report(2, 1.5, 0.8, 0.02, 0.01)]])
    assert not judge([far])["paired"]["goodput"]["met"]  # +5% and -25%: a median of -10%
    text = format_summary(judge([r]), [r])
    assert "goals on each run against its own simulations" in text and "by rate: +0%" in text
    assert "paired" not in judge([compare_rate(reals, runs[0])])


def test_knee_is_the_first_rate_below_the_level():
    assert knee([1, 2, 4, 8], [1.0, 0.95, 0.89, 0.2]) == 2
    assert knee([1, 2], [1.0, 0.95]) is None
    assert knee([1, 2], [0.5, 0.95]) == 0


def test_calibration_from_a_step_log_recovers_each_cost():
    """A synthetic step log made with known costs: busy steps follow the model
    (times a +-5% scatter), steps after idle take wake_s more, probes reach the
    idle engine entry_s after their send, their first token reaches the
    client delivery_s + stream_s * (tokens of its step) after the step ends,
    and a busy loop spends loop_s + loop_row_s per row of the step before
    between one step's end and the next's start, plus intake_s per request
    it takes in."""
    import random

    from stepserve.traces.calibrate import calibrate

    truth = LinearLatencyModel("linear", [4e-3, 1e-4, 1e-6, 1.5e-4])
    entry, delivery, stream, wake, loop, loop_row, intake = 0.4e-3, 2e-3, 1e-4, 3e-3, 0.08e-3, 3e-6, 0.15e-3
    rng = random.Random(1)
    lines, probes, t = [], [], 1000.0

    def step(t, wait, adds, rows, ctx, new, pairs, extra=0.0):
        dt = truth.predict(rows, ctx, new, pairs) * rng.uniform(0.95, 1.05) + extra
        lines.append({"t": t, "wait": wait, "adds": adds, "cmd": 0.0, "rows": rows, "decode_rows": rows - (new > rows),
                      "ctx": ctx, "new": new, "pairs": pairs, "step": dt, "fwd": dt, "out": 0.0, "emit": 0.0,
                      "outs": rows})
        return t + dt

    for rep in range(40):
        # a busy stretch of B decode rows
        b = rng.choice([2, 4, 8, 16, 32])
        for _ in range(20):
            t = step(t, 0.0, 0, b, b * rng.randint(20, 400), b, 0.0) + loop + loop_row * b
        # a probe of P tokens beside the same B decode rows (busy: no wake)
        p = rng.choice([16, 64, 256])
        send = t - 0.002  # sent during the last decode step
        t += intake
        end = step(t, 0.0, 1, b + 1, b * 200 + p, b + p, p * (p + 1) / 2)
        probes.append({"start": send, "first": end + delivery + stream * (b + 1), "prompt": p})
        t = end
        # the engine idles, then a probe alone wakes it
        send = t + 0.2
        t = send + entry
        end = step(t, t - send + 0.1999, 1, 1, p, p, p * (p + 1) / 2, extra=wake)
        probes.append({"start": send, "first": end + delivery + stream, "prompt": p})
        # eight prompts come together after 1 ms of idling: a step that runs 6 ms past the model, which
        # is the model's misfit for such a step, not a wake-up
        t = end + 0.001
        dt = truth.predict(8, 8 * 64, 8 * 64, 8 * 64 * 65 / 2) + 0.006
        lines.append({"t": t, "wait": 0.001, "adds": 8, "cmd": 0.0, "rows": 8, "decode_rows": 0, "ext": 8,
                      "ctx": 8 * 64, "new": 8 * 64, "pairs": 8 * 64 * 65 / 2, "step": dt, "fwd": dt, "out": 0.0,
                      "emit": 0.0, "outs": 8})
        t += dt + loop + loop_row * 8
    cal = calibrate(lines, probes, 0.0, t + 1, form="linear")
    c = cal["costs"]
    # the attention term's column is free here (no quadratic cost in the truth): auto may take either form
    assert calibrate(lines, probes, 0.0, t + 1)["fit"]["form"] in ("linear", "linear+attn")
    assert cal["model"].coef == pytest.approx(truth.coef, rel=0.1, abs=2e-7)
    assert c.entry_s == pytest.approx(entry, rel=1e-6)
    assert c.delivery_s == pytest.approx(delivery, rel=1e-6) and c.stream_s == pytest.approx(stream, rel=1e-6)
    assert c.wake_s == pytest.approx(wake, abs=0.5e-3)
    # every busy gap (the log's first step has none before it), and none before a step that took in a
    # prompt on an idle engine; the gap grows with the rows of the step before, and one that took a
    # request in holds its intake too
    assert c.loop_s == pytest.approx(loop, abs=1e-9) and c.loop_row_s == pytest.approx(loop_row, abs=1e-10)
    assert c.intake_s == pytest.approx(intake, abs=1e-9)
    assert cal["samples"]["loop"] == 40 * 20 - 1 and cal["samples"]["intake"] == 40
    (point,) = c.wake_curve  # every probe idled ~0.2 s: one range of idle times (the batches are no wake-up)
    assert point[0] == pytest.approx(0.2, abs=1e-3) and point[1] == pytest.approx(wake, abs=0.5e-3)
    assert cal["samples"]["delivery"] == 80 and cal["samples"]["after_idle"] == 40
    q = cal["noise"]["quantiles"]
    assert len(q) == 101 and 0.93 < q[1] < q[50] < q[99] < 1.07
    assert cal["fit"]["heldout_steps"]["median_ape"] < 0.05


def test_wake_up_is_read_off_full_prefix_hits_where_the_model_misprices_lone_prompts():
    """The busy steps (decode rows, and chunks beside them) price a lone
    prompt's step by extrapolation: here such steps run 1.5 ms under the
    model after idling, so with the wake-up they read as none. The hit
    probes' steps (one decode-shaped row after idling, a prompt sent again)
    carry the wake-up alone, and calibration reads it there, and finds each
    hit probe's token on the first step after its pickup."""
    import random

    from stepserve.traces.calibrate import calibrate

    truth = LinearLatencyModel("linear", [0.5e-3, 2e-5, 1e-6, 5e-5])
    entry, delivery, wake = 0.4e-3, 1.5e-3, 1e-3
    rng = random.Random(2)
    lines, probes, t = [], [], 1000.0

    def step(t, wait, adds, rows, decode_rows, ctx, new, pairs, extra=0.0):
        dt = truth.predict(rows, ctx, new, pairs) * rng.uniform(0.97, 1.03) + extra
        lines.append({"t": t, "wait": wait, "adds": adds, "cmd": 0.0, "rows": rows, "decode_rows": decode_rows,
                      "ctx": ctx, "new": new, "pairs": pairs, "step": dt, "fwd": dt, "out": 0.0, "emit": 0.0,
                      "outs": rows})
        return t + dt

    for rep in range(30):
        b = rng.choice([1, 2, 4, 8])
        for _ in range(20):
            t = step(t, 0.0, 0, b, b, b * rng.randint(20, 400), b, 0.0)
        p = rng.choice([32, 128])
        t = step(t, 0.0, 0, b + 1, b, b * 200 + p, b + p, p * (p + 1) / 2)  # a chunk beside the decode rows
        for hit in (False, True):
            idle_from, send = t, t + rng.uniform(0.01, 0.2)
            t = send + entry
            if hit:  # the prompt again: one token computed over its cached KV
                end = step(t, t - idle_from, 1, 1, 1, p, 1, 0.0, extra=wake)
            else:  # a lone prompt: the model overprices it by more than the wake-up
                end = step(t, t - idle_from, 1, 1, 0, p, p, p * (p + 1) / 2, extra=wake - 1.5e-3)
            probes.append({"start": send, "first": end + delivery, "prompt": p, "hit": hit})
            t = end
    cal = calibrate(lines, probes, 0.0, t + 1, form="linear")
    c = cal["costs"]
    assert cal["samples"]["wake_from"] == "hits" and cal["samples"]["after_idle"] == 30
    assert c.wake_s == pytest.approx(wake, abs=0.1e-3)
    assert c.wake_curve and all(y == pytest.approx(wake, abs=0.2e-3) for _, y in c.wake_curve)
    assert cal["samples"]["delivery"] == 60 and c.delivery_s == pytest.approx(delivery, rel=1e-6)
    assert c.entry_s == pytest.approx(entry, rel=1e-6)
    # without the hits, the lone prompts are all there is, and they read as no wake-up
    lone = calibrate([ln for ln in lines if not (ln["wait"] and ln["rows"] == ln["decode_rows"] == 1)],
                     [p for p in probes if not p["hit"]], 0.0, t + 1, form="linear")
    assert lone["samples"]["wake_from"] == "prompts" and lone["costs"].wake_s == 0.0


def test_calibration_takes_the_attention_term_where_long_prefills_need_it():
    """Steps whose cost has a quadratic attention part: most prefill chunks are
    short, a tenth attend over long contexts; auto takes linear+attn and
    recovers the attention coefficient. An explicit form is kept."""
    import random

    from stepserve.traces.calibrate import fit_steps

    truth = LinearLatencyModel("linear+attn", [4e-3, 1e-4, 1e-6, 1.2e-4, 6e-8])
    rng = random.Random(3)
    steps = []
    for _ in range(600):
        b = rng.randint(1, 32)
        if rng.random() < 0.5:
            n, start = b, 0  # decode only
            pairs = 0.0
        else:
            chunk = rng.choice([8, 16, 32]) if rng.random() < 0.9 else rng.choice([1024, 2048])
            start = rng.randint(0, 64) if chunk < 100 else rng.randint(512, 1536)
            n, pairs = b + chunk, chunk * start + chunk * (chunk + 1) / 2
        ctx = b * 200 + n - b + start
        t = truth.predict(b + (n > b), ctx, n, pairs) * rng.uniform(0.9, 1.1)
        steps.append((0.0, {"rows": b + (n > b), "decode_rows": b, "ctx": ctx, "new": n, "pairs": pairs,
                            "step": t, "cmd": 0.0, "out": 0.0, "emit": 0.0}))
    model, fit = fit_steps(steps, "auto")
    assert fit["form"] == "linear+attn" and model.coef[-1] == pytest.approx(6e-8, rel=0.2)
    assert set(fit["forms_heldout_steps"]) == {"linear", "linear+attn", "segmented"}
    assert fit_steps(steps, "linear")[1]["form"] == "linear"


def test_calibration_takes_the_segmented_form_for_a_concave_batch_curve():
    """Busy steps of a server whose second decode row costs 2.5 ms and later
    ones 0.3-0.4 ms, and whose prefill chunks cost 3 ms once a step and 1 ms
    each on the extend path, 0.8 ms once a step for any chunk (folded or
    not) and 1.2 ms more where the step runs layer by layer: auto takes the
    segmented form (better held out than the linear ones by far more than
    the parsimony margin), and its terms are the truth's: the once-a-step
    prices, each chunk's, and the slope of each batch range. A log written
    before `chunks` and `layered` (every chunk on the extend path) fits the
    step's three prices as one."""
    import random

    from stepserve.traces.calibrate import fit_steps

    truth = LinearLatencyModel("segmented", [5e-3, 2.5e-3, 4e-4, 4e-4, 3e-4, 3e-4, 4e-4, 1e-7, 1e-5, 0.0, 3e-3, 1e-3,
                                             8e-4, 1.2e-3], knots=(1, 2, 4, 8, 16, 32))
    rng = random.Random(4)
    steps, legacy = [], []
    for _ in range(3000):
        b = rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
        chunks = rng.choice([0, 0, 0, 1, 2])
        ext = rng.randint(0, chunks)
        layered = ext > 0 or (chunks > 0 and rng.random() < 0.5)
        n = b + sum(rng.choice([16, 64, 256]) for _ in range(chunks))
        ctx = b * rng.randint(16, 500) + n - b
        line = {"rows": b + chunks, "decode_rows": b, "ctx": ctx, "new": n, "pairs": 0.0, "ext": ext,
                "chunks": chunks, "layered": int(layered), "cmd": 0.0, "out": 0.0, "emit": 0.0,
                "step": truth.predict(b + chunks, ctx, n, 0.0, ext, chunks, layered) * rng.uniform(0.93, 1.07)}
        steps.append((0.0, line))
        if ext == chunks:
            legacy.append((0.0, {k: v for k, v in line.items() if k not in ("ext", "chunks", "layered")}))
    model, fit = fit_steps(steps, "auto")
    assert fit["form"] == "segmented" and model.knots[:6] == (1, 2, 4, 8, 16, 32)
    errs = fit["forms_heldout_steps"]
    assert errs["segmented"]["time_error"] < 0.5 * errs["linear"]["time_error"]
    # the extend path's price once a step and per chunk, any chunk's once a step, a layered step's
    assert model.coef[-4:] == pytest.approx([3e-3, 1e-3, 8e-4, 1.2e-3], rel=0.15)
    assert [model.predict(b, 0, 0) - model.predict(b - 1, 0, 0) for b in (2, 3, 40)] == \
        pytest.approx([2.5e-3, 4e-4, 4e-4], rel=0.15)
    old, _ = fit_steps(legacy, "segmented")
    assert old.predict(9, 2000, 72, 0.0, 1) - old.predict(8, 2000 - 64, 8) == pytest.approx(
        truth.predict(9, 2000, 72, 0.0, 1) - truth.predict(8, 2000 - 64, 8), rel=0.1)


def test_calibration_pulls_segment_slopes_together_where_the_steps_cannot_tell_them_apart():
    """A server whose every decode row costs the same, timed as a sweep
    times it (points of 15 steps that share a phase of the machine, 10%
    scatter per step): the free segmented fit gives each batch range its own
    slope out of the noise (they differ by 1.5x or more on some sweeps), and
    the calibrated fit, whose slope penalty the held-out error picks, gives
    every range one slope on every sweep. Which sweep a profile came from
    then no longer moves the per-row price the simulator and TAPER use."""
    import random

    from stepserve.traces.calibrate import SMOOTH_GRID, features, fit_steps

    truth = LinearLatencyModel("segmented", [5e-4] + [6e-5] * 6 + [8e-7, 6e-5, 0.0, 1.6e-3, 4e-5, 0.0, 0.0],
                               knots=(1, 2, 4, 8, 16, 32))
    free_spread, fitted_spread = [], []
    for seed in range(4):
        rng = random.Random(seed)
        steps = []
        for _ in range(200):
            b = rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
            ext = rng.choice([0, 0, 0, 1])
            n = b + sum(rng.choice([16, 64, 256]) for _ in range(ext))
            ctx = b * rng.randint(16, 500) + n - b
            phase = rng.lognormvariate(0, 0.08)
            for _ in range(15):
                t = truth.predict(b + ext, ctx, n, 0.0, ext) * phase * rng.lognormvariate(0, 0.1)
                steps.append((0.0, {"rows": b + ext, "decode_rows": b, "ctx": ctx, "new": n, "pairs": 0.0,
                                    "step": t, "cmd": 0.0, "out": 0.0, "emit": 0.0}))
        model, fit = fit_steps(steps, "segmented")
        assert fit["smooth"] in SMOOTH_GRID and set(fit["smooth_heldout_time_error"]) == {str(x) for x in SMOOTH_GRID}
        free = LinearLatencyModel.fit([features(ln) for _, ln in steps], [ln["step"] for _, ln in steps], "segmented")
        fitted_spread.append(max(model.coef[1:7]) / min(model.coef[1:7]))
        free_spread.append(max(free.coef[1:7]) / max(min(free.coef[1:7]), 1e-9))
    assert max(fitted_spread) < 1.1
    assert max(free_spread) > 1.5  # what the penalty takes out


def test_profile_refuses_a_step_log_it_would_not_read(tmp_path):
    """--step-log names a server's log; the in-process sweep has none to read."""
    from stepserve.cli import main

    with pytest.raises(SystemExit, match="needs --url"):
        main(["profile", "--step-log", str(tmp_path / "steps.jsonl"), "--out", str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()


def test_run_speed_tells_the_per_step_part_from_the_per_token_part():
    """Steps of a machine on which the profile's per-step/row part runs 1.5x
    slower and its per-token part 1.1x: the two factors come back. A model
    with no per-token term gets the one busy-time factor."""
    import numpy as np

    from stepserve.scheduler.latency_model import StepFeatures
    from stepserve.traces.validate import run_speed

    m = LinearLatencyModel("linear+attn", [3e-3, 5e-5, 7e-7, 1e-4, 1e-7])
    rng = np.random.default_rng(0)
    feats = [StepFeatures(int(r), int(r) * 150, int(r) if i % 3 else int(r) + 400, 0.0 if i % 3 else 1e5)
             for i, r in enumerate(rng.integers(1, 32, 300))]
    pred = np.array([m.predict_features(f) for f in feats])
    times = np.array([1.5 * (m.predict_features(f) - m.token_part(f)) + 1.1 * m.token_part(f) for f in feats])
    s = run_speed(m, feats, times, pred)
    assert s["step"] == pytest.approx(1.5) and s["token"] == pytest.approx(1.1)
    assert s["busy_ratio"] == pytest.approx(times.sum() / pred.sum())
    taper = LinearLatencyModel("taper", [3e-3, 5e-5, 7e-7])
    tp = np.array([taper.predict_features(f) for f in feats])
    s = run_speed(taper, feats, 1.3 * tp, tp)
    assert s["token"] is None and s["step"] == pytest.approx(1.3)


def test_a_stored_run_is_judged_by_the_slos_asked_for_now(tmp_path):
    """`--replays` keeps real runs; a validation with other SLOs reads them
    back judged by its own SLOs, from their per-request records."""
    from stepserve.traces.metrics import SLO, RequestRecord
    from stepserve.traces.report import build_report
    from stepserve.traces.validate import ReplayStore

    # TTFTs of 10, 30 and 50 ms; TPOTs of 5 ms
    recs = [RequestRecord(f"r{i}", 0.1 * i, 8, start_s=0.1 * i, first_token_s=0.1 * i + ttft,
                          end_s=0.1 * i + ttft + 0.02, output_tokens=5) for i, ttft in enumerate((0.01, 0.03, 0.05))]
    loose = SLO(ttft_s=1.0, tpot_s=0.1)
    trace, scaling = {"path": "t.csv"}, {"rate_rps": 10.0}
    report = build_report(mode="replay", records=recs, duration_s=2.0, slo=loose, trace=trace, scaling=scaling,
                          config={})
    store = ReplayStore(str(tmp_path), trace, 1, 1)
    store.save(0, 0, report)
    assert store.load(0, 0, scaling, loose)["slo_attainment"] == 1.0
    tight = store.load(0, 0, scaling, SLO(ttft_s=0.04, tpot_s=0.1))
    assert tight["slo_attainment"] == pytest.approx(2 / 3) and tight["goodput_rps"] == pytest.approx(1.0)
    assert tight["slo"]["ttft_s"] == 0.04 and tight["ttft_s"] == report["ttft_s"]  # the times are the run's
    assert store.load(0, 0, scaling, SLO(ttft_s=1.0, tpot_s=0.004))["slo_attainment"] == 0.0
    assert store.load(0, 0, {"rate_rps": 20.0}, loose) is None  # another rate: not this run


def test_the_scatter_within_takes_out_the_machines_slow_swings():
    """Step ratios of a machine that runs at 1.0 and then at 1.5, with a +-4%
    scatter: about their running median they scatter as before, the swing
    gone; a series shorter than the window is left as it is."""
    import numpy as np

    from stepserve.traces.calibrate import within_ratios

    rng = np.random.default_rng(0)
    scatter = rng.uniform(0.96, 1.04, 2000)
    raw = np.concatenate([np.full(1000, 1.0), np.full(1000, 1.5)]) * scatter
    w = within_ratios(raw, half_window=50)
    assert np.percentile(raw, 90) > 1.4 and np.percentile(raw, 10) < 1.0
    away = np.r_[0:950, 1050:2000]  # past the running window's reach of the swing
    assert np.allclose(w[away] * np.median(scatter), scatter[away], rtol=0.02)
    assert 0.95 < np.percentile(w, 1) and np.percentile(w, 99) < 1.05 * 1.02
    assert np.array_equal(within_ratios(raw[:50], half_window=50), raw[:50])


def test_a_window_whose_two_factors_stray_scales_the_runs_two():
    """A window's two speed factors are fitted as the run's are; one whose fit
    lands more than 4x from the run's (here a window whose steps say the
    per-step part ran 40x slower and the per-token part 40x faster) keeps
    the run's split and scales it by its measured over predicted time."""
    from stepserve.traces.validate import WINDOW_SPLIT

    model = LinearLatencyModel("linear", [0.002, 0.0, 0.0, 0.0005])
    lines, t = [], 100.0
    for w, (fs, ft), n in ((0, (1.0, 1.0), 300), (1, (40.0, 1 / 40), 40), (2, (1.0, 1.0), 300)):
        t = 100.0 + w * 10.0
        for i in range(n):
            new = 1 + (i % 9) * 4
            dt = 0.002 * fs + 0.0005 * new * ft
            lines.append(_line(t, step=dt, new=new))
            t += dt
    real = {"t0_epoch": 100.0, "requests": [{"start_s": 0.0, "end_s": t - 100.0}]}
    v = step_log_view(lines, real, model, window_s=10.0)
    a, b = v["speed"]["step"], v["speed"]["token"]
    (_, a0, b0, _, _), (_, a1, b1, _, _), (_, a2, b2, _, _) = v["speed_windows"]
    assert a0 == pytest.approx(1.0, rel=1e-3) and b0 == pytest.approx(1.0, rel=1e-3)  # fitted, as they ran
    assert a1 / a == pytest.approx(b1 / b) and not a / WINDOW_SPLIT <= 40.0 <= a * WINDOW_SPLIT
    steps = lines[300:340]
    measured = sum(ln["step"] for ln in steps)
    predicted = sum(model.rescaled(a, b).predict(1, 10, ln["new"]) for ln in steps)
    assert a1 == pytest.approx(a * measured / predicted)


def test_a_probes_third_token_gives_a_later_tokens_delivery():
    """Idle probes of 4 tokens: the step that made the first is followed by
    one-row decode steps; the third token reaches the client 0.3 ms after the
    second of those ends (a later token's delivery), the last 0.7 ms after
    the third (the stream's end), the first 1 ms after its own. A probe whose next steps ran another row, or whose client saw fewer
    events than tokens, gives none."""
    from stepserve.traces.calibrate import probe_costs

    lines, probes, t = [], [], 1000.0

    def step(t, wait, adds, rows, new, dt=0.5e-3):
        lines.append({"t": t, "wait": wait, "adds": adds, "cmd": 0.0, "rows": rows, "decode_rows": rows - (new > rows),
                      "ctx": 40, "new": new, "pairs": 0.0, "step": dt, "fwd": dt, "out": 0.0, "emit": 0.0,
                      "outs": rows})
        return t + dt

    for i in range(6):
        send = t + 0.1
        t = send + 1e-3
        e1 = step(t, 0.1, 1, 1, 32, dt=2e-3)
        ends = [e1]
        for _ in range(3):
            ends.append(step(ends[-1] + 0.1e-3, 0.0, 0, 2 if i == 4 else 1, 2 if i == 4 else 1))
        firsts = [ends[0] + 1e-3] + [e + 0.3e-3 for e in ends[1:]]
        itl = [b - a for a, b in zip(firsts, firsts[1:])]
        firsts[-1] += 0.4e-3  # the last token ends the stream: 0.7 ms after its step
        itl = [b - a for a, b in zip(firsts, firsts[1:])]
        probes.append({"start": send, "first": firsts[0], "prompt": 32, "out": 4,
                       "itl": itl[:1] if i == 5 else itl})
        t = ends[-1]
    entry, delivery, later, last = probe_costs(lines, probes)
    assert [d for _, d in delivery] == pytest.approx([1e-3] * 6)
    assert later == pytest.approx([0.3e-3] * 4)  # not the probe beside another row, nor the one of merged events
    assert last == pytest.approx([0.7e-3] * 4)


def test_engine_view_times_last_tokens_from_the_step_that_made_them():
    """A request of n tokens, one event each, made its last token in the
    (n - 1)-th step after the iteration that handed over its first: its
    record's end less that step's end is the last token's way to the client,
    and over the profile's end-of-stream delivery. One whose client saw
    merged events, or with no id, is not timed."""
    model = LinearLatencyModel("linear", [0.001, 0.0, 0.0, 0.0])
    lines = [_line(100.0 + 0.002 * i, adds=int(i == 0), step=0.001) for i in range(6)]
    lines[0].update(first=["cmpl-a", "cmpl-b"], outs=2)
    for ln in lines[1:]:
        ln["outs"] = 2
    # a: 4 tokens, its last made by lines[3] (ends 100.007), seen at +0.6 ms; b: merged events
    real = {"t0_epoch": 100.0, "requests": [
        {"start_s": 0.0, "end_s": 0.0076, "first_token_s": 0.0015, "output_tokens": 4, "itl_s": [0.002] * 3,
         "server_id": "cmpl-a"},
        {"start_s": 0.0, "end_s": 0.0076, "first_token_s": 0.0015, "output_tokens": 4, "itl_s": [0.006],
         "server_id": "cmpl-b"},
        {"start_s": 0.0, "end_s": 0.0076, "first_token_s": 0.0015, "output_tokens": 4, "itl_s": [0.002] * 3}]}
    costs = ServingCosts(delivery_s=1e-3, stream_s=1e-4, token_delivery_s=0.2e-3, end_delivery_s=0.4e-3)
    e = step_log_view(lines, real, model, costs=costs)["end_delivery_s"]
    assert e["n"] == 1 and e["p50"] == pytest.approx(0.0006)
    assert e["over_p50"] == pytest.approx(0.0006 - (0.4e-3 + 2 * 1e-4))
    assert costs.end_delivery(2) == pytest.approx(0.6e-3)
    assert ServingCosts(delivery_s=1e-3).end_delivery(1) == pytest.approx(1e-3)  # unmeasured: as a first token


def test_engine_view_sets_the_runs_host_cpu_against_the_profiles():
    """A replay's report carries the front end's and the client's CPU seconds
    over the run; against the profile's host costs for its requests and
    tokens they give the run's host factor. No CPU figure, or no host costs
    in the profile: none."""
    from stepserve.traces.validate import host_cpu

    real = {"host_cpu_s": {"front_end": 0.6, "client": 0.3},
            "requests": [{"output_tokens": 10, "prompt_tokens": 100}, {"output_tokens": 20, "prompt_tokens": 50},
                         {"output_tokens": 5, "prompt_tokens": 70, "error": "x"}]}
    costs = ServingCosts(host_request_s=1e-3, host_token_s=1e-4)
    h = host_cpu(real, costs)
    assert h["cpu_s"] == pytest.approx(0.9) and h["predicted_s"] == pytest.approx(2e-3 + 30e-4)
    assert h["factor"] == pytest.approx(0.9 / 5e-3)
    # its prompt tokens and the batches of outputs the engine handed over (from the step log) count too
    costs = ServingCosts(host_request_s=1e-3, host_token_s=1e-4, host_prompt_token_s=1e-5, host_batch_s=2e-4)
    assert host_cpu(real, costs, batches=25)["predicted_s"] == pytest.approx(2e-3 + 30e-4 + 150e-5 + 25 * 2e-4)
    assert host_cpu({"host_cpu_s": {"front_end": None, "client": 0.3}, "requests": []}, costs) is None
    assert host_cpu(real, ServingCosts()) is None and host_cpu(real, None) is None


def test_a_run_is_simulated_at_its_own_speed_its_hosts_too():
    """`--speed-from-step-log`: a run's simulation takes the step model's
    factors of its step log (window by window, or the run's), and the host's
    costs scaled by the run's host CPU over what they predict for it; a run
    with no host figure keeps the profile's."""
    from stepserve.scheduler.latency_model import Profile
    from stepserve.traces.simulator import SimConfig
    from stepserve.traces.validate import at_run_speed

    model = LinearLatencyModel("linear", [1e-3, 1e-4, 0.0, 2e-5])
    prof = Profile(name="p", source="measured", model=model, data={})
    cfg = SimConfig(kv_slots=100, loop_s=1e-4, intake_s=2e-5, host_request_s=1e-3, host_token_s=1e-4,
                    host_prompt_token_s=1e-6, host_batch_s=2e-4, cold=[[1e-5, 0.0]])
    windows = [[0.0, 1.2, 0.9, 1.1, None], [1.0, 1.3, 1.0, 1.0, None]]
    view = {"speed": {"step": 1.25, "token": 0.8, "loop": 2.0, "cold": 3.0}, "speed_windows": windows,
            "host_cpu": {"cpu_s": 3.0, "predicted_s": 2.0, "factor": 1.5}}
    p, c = at_run_speed(prof, cfg, view, windows=True, within={"noise_quantiles": [0.9, 1.1]})
    assert p is prof and c.speed_schedule == windows and c.noise_quantiles == [0.9, 1.1]
    assert (c.host_request_s, c.host_token_s, c.host_prompt_token_s, c.host_batch_s) == pytest.approx(
        (1.5e-3, 1.5e-4, 1.5e-6, 3e-4))
    assert c.loop_s == cfg.loop_s and c.entry_s == cfg.entry_s  # the windows carry the loop's factor
    p, c = at_run_speed(prof, cfg, view, windows=False)
    assert p.model.coef == pytest.approx([1.25e-3, 1.25e-4, 0.0, 1.6e-5])
    assert (c.loop_s, c.intake_s, c.cold) == (pytest.approx(2e-4), pytest.approx(4e-5), [[pytest.approx(3e-5), 0.0]])
    assert c.host_batch_s == pytest.approx(3e-4)
    _, c = at_run_speed(prof, cfg, {**view, "host_cpu": None}, windows=True)
    assert c.host_request_s == cfg.host_request_s and c.host_batch_s == cfg.host_batch_s


def test_host_work_fit_recovers_each_cost_of_its_passes():
    """`profile --url`'s host passes (`HOST_KINDS`: requests alike but for
    the tokens streamed, the requests at once and the prompt) separate the
    host's cost per request, per streamed token, per prompt token and per
    output batch; passes made with those costs (and 2% of scatter) give
    them back. Without the step log's batch counts the batch cost is 0."""
    import random

    from stepserve.traces.profile_http import HOST_KINDS, HOST_REQUESTS, count_batches, fit_host_work

    truth = {"request_s": 0.9e-3, "token_s": 60e-6, "prompt_token_s": 7e-6, "batch_s": 80e-6}
    rng = random.Random(1)
    rows, lines, t = [], [], 1000.0
    for k in range(2 * len(HOST_KINDS)):
        plen, out, at_once = HOST_KINDS[k % len(HOST_KINDS)]
        n = HOST_REQUESTS
        batches = (n // at_once) * out  # one batch per step: every stream of a wave makes a token each step
        row = {"requests": n, "tokens": n * out, "prompt_tokens": n * plen, "start": t, "end": t + batches * 1e-3}
        lines += [{"t": t + (i + 0.5) * 1e-3, "outs": at_once} for i in range(batches)]
        lines += [{"t": t + batches * 1e-3 + 0.01, "outs": 0}]  # an iteration that handed nothing over
        t += batches * 1e-3 + 1.0
        cpu = (n * truth["request_s"] + n * out * truth["token_s"] + n * plen * truth["prompt_token_s"]
               + batches * truth["batch_s"]) * rng.uniform(0.98, 1.02)
        rows.append(row | {"front_end_cpu_s": 0.6 * cpu, "client_cpu_s": 0.4 * cpu})
    plain = fit_host_work(rows)
    assert plain["batch_s"] == 0.0 and plain["token_s"] > truth["token_s"]  # the batches' share goes elsewhere
    count_batches(rows, lines)
    assert [r["batches"] for r in rows[:4]] == [6, 198, 1584, 6]
    got = fit_host_work(rows)
    for name, want in truth.items():
        assert got[name] == pytest.approx(want, rel=0.15), name
    assert got["error"] < 0.03
