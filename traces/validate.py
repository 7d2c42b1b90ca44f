"""`stepserve validate`: the simulator against the real server, rate by rate.

For one trace and one profile, at each rate of `--rates` (light load through
saturation), it replays the scaled trace against a running server and
simulates the same requests with the profile, then prints a table per rate
(real, simulated, error) of TTFT, TPOT, ITL and E2E p50/p90/p99, goodput and
SLO attainment, and a summary against the goals:

  goodput            within 5% (relative)
  SLO attainment     within 5 points (absolute)
  TTFT, TPOT p50/p90 within 15% (relative)
  saturation knee    the first rate whose attainment is below 90%: the same
                     grid step, or the next one

`--out` writes all of it as JSON, `--plot` a figure with both curves
(goodput, attainment, TTFT p90 and TPOT p90 against the rate).

With `--step-log PATH` (the server's `--step-log`, same machine) each rate
also gets the engine's own view: its steps, how long it was busy, how far its
measured step times were from the profile's predictions for the same shapes,
and the serving costs the step log shows (a request's entry into an idle
engine, the first step after idle). Those are what the simulator's
`ServingCosts` stand for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

from stepserve.engine.step_log import output_batches
from stepserve.scheduler.latency_model import ServingCosts
from stepserve.traces.calibrate import BUSY_S, cold_index, features, iteration_time, loop_gaps, step_lines
from stepserve.traces.options import (add_trace_args, positive_float, positive_int, rates_from_args,
                                       scaling_from_args, slo_from_args)

VALIDATION_KIND = "stepserve-validation"
GOALS = {"goodput_rel": 0.05, "attainment_abs": 0.05, "latency_rel": 0.15, "knee_steps": 1, "knee_level": 0.9}
LATENCIES = ("ttft", "tpot", "itl", "e2e")
QUANTILES = ("p50", "p90", "p99")
GATED = [(m, q) for m in ("ttft", "tpot") for q in ("p50", "p90")]  # the latency goals
MIN_WINDOW_STEPS = 30  # steps that a speed window needs to be measured on its own (`--speed-window`)
WINDOW_SPLIT = 4.0  # a window's two factors within this ratio of the run's, or one scale on the run's two


def add_validate_args(p: argparse.ArgumentParser) -> None:
    from stepserve.traces.replay_cli import add_server_args
    from stepserve.traces.simulate_cli import add_sim_engine_args

    add_trace_args(p)
    add_server_args(p)
    add_sim_engine_args(p)
    g = p.add_argument_group("validation")
    g.add_argument("--repeats", type=positive_int, default=1,
                   help="runs per rate, interleaved over the grid (up, then down); figures are medians, and the "
                        "real runs' spread is reported beside them")
    g.add_argument("--step-log", default=None, metavar="PATH",
                   help="the server's step log (`stepserve serve --step-log PATH`): adds the engine's own view per "
                        "rate")
    g.add_argument("--sim-seeds", type=int, default=1,
                   help="simulations per real run, each with its own step-noise seed (cheap: the simulated "
                        "figures are medians over all of them, so they carry less of the noise's luck than "
                        "the real ones)")
    g.add_argument("--speed-from-step-log", action="store_true",
                   help="simulate each run with the profile's step model scaled to that run's steps in the step "
                        "log (one factor for the per-step, per-row and per-context-token part, one for the per-token "
                        "part), the busy loop's time between steps scaled to the run's gaps between them, and "
                        "the host's costs (front end and client) to the run's host CPU: "
                        "the machine's speed at the time of the run, not of the profile. "
                        "What is left is the simulator's own error (a diagnostic: on a shared machine the speed "
                        "drifted by up to 1.6x between the profile and a replay)")
    g.add_argument("--speed-window", type=positive_float, default=None, metavar="S",
                   help="with --speed-from-step-log: measure the speed factors (steps, tokens, loop) per S seconds of each run "
                        "instead of once per run, and simulate each stretch at its own (the machine's speed swings "
                        "within a run too); a window with fewer than %d steps keeps the run's. The step noise is "
                        "then the profile's scatter about its running median, where it has one" % MIN_WINDOW_STEPS)
    g.add_argument("--replays", default=None, metavar="DIR",
                   help="keep each real run's report in DIR; a run already there (same trace, scaling and repeat) "
                        "is read back instead of replayed, so a profile or simulator change is validated against "
                        "the same real runs, with no server when DIR holds them all")


def _rel(real, sim) -> float | None:
    if real is None or sim is None or real == 0:
        return None
    return (sim - real) / real


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def _spread(xs: list) -> float | None:
    """(max - min) / median of the repeats: how far apart two runs of the same rate land."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = float(np.median(xs))
    return (max(xs) - min(xs)) / m if m else None


PAIRED = ("goodput",) + tuple(f"{m}_{q}" for m, q in GATED)


def paired_errors(real: dict, sims: list[dict]) -> dict:
    """One real run against its own simulations (their medians): the gated
    errors, and attainment's in points. With `--speed-from-step-log` those
    simulations ran at that run's speed, so these errors hold the simulator's
    own, not how far apart the machine put two runs of one rate."""
    out = {"goodput": _rel(real["goodput_rps"], _median([s["goodput_rps"] for s in sims])),
           "attainment": _median([s["slo_attainment"] for s in sims]) - real["slo_attainment"]}
    for m, q in GATED:
        out[f"{m}_{q}"] = _rel(real[f"{m}_s"][q], _median([s[f"{m}_s"][q] for s in sims]))
    return out


def compare_rate(reals: list[dict], sims: list[dict], runs: list[list[dict]] | None = None,
                 views: list[dict] | None = None) -> dict:
    """Real and simulated figures of one rate (medians over the repeats of
    each), with the errors the goals judge, and the real runs' own spread.
    `runs`: the simulations of each real run (aligned with `reals`), for the
    errors of each run against its own (`paired_errors`). `views`: the real
    runs' step-log views (`step_log_view`), kept as `engine`, whose TTFT
    parts join the simulations' in `ttft_parts`."""
    out = {"rate": reals[0]["scaling"].get("rate_rps"), "repeats": len(reals), "simulations": len(sims), "latency": {},
           "real": {}, "sim": {}}
    for m in LATENCIES:
        for q in QUANTILES:
            a = [r[f"{m}_s"][q] for r in reals]
            b = [r[f"{m}_s"][q] for r in sims]
            out["latency"][f"{m}_{q}"] = {"real": _median(a), "sim": _median(b), "error": _rel(_median(a), _median(b)),
                                          "real_spread": _spread(a)}
    for k in ("throughput_rps", "goodput_rps", "slo_attainment", "num_completed", "duration_s"):
        out["real"][k] = _median([r.get(k) for r in reals])
        out["sim"][k] = _median([r.get(k) for r in sims])
    out["sim"]["steps"] = _median([(r.get("simulator") or {}).get("steps") for r in sims])
    out["sim"]["busy_s"] = _median([(r.get("simulator") or {}).get("virtual_busy_s") for r in sims])
    out["sim"]["mean_rows"] = _median([(r.get("simulator") or {}).get("mean_rows") for r in sims])
    out["real"]["goodput_spread"] = _spread([r["goodput_rps"] for r in reals])
    att = [r["slo_attainment"] for r in reals]
    out["real"]["attainment_range"] = [min(att), max(att)]
    out["goodput_error"] = _rel(out["real"]["goodput_rps"], out["sim"]["goodput_rps"])
    out["attainment_error"] = out["sim"]["slo_attainment"] - out["real"]["slo_attainment"]
    if runs is not None:
        out["paired"] = [paired_errors(r, s) for r, s in zip(reals, runs)]
    sim_parts = [sim_ttft_parts(r) for r in sims]
    if any(p["n"] for p in sim_parts):
        out["ttft_parts"] = {"sim": _median_parts(sim_parts)}
    if views:
        out["engine"] = views
        real_parts = [v["ttft_parts"] for v in views]
        if "ttft_parts" in out and any(p["n"] for p in real_parts):
            out["ttft_parts"]["real"] = _median_parts(real_parts)
    return out


def _median_parts(parts: list[dict]) -> dict:
    """The median over runs of each part's p50 and p90 (`ttft_parts`)."""
    parts = [p for p in parts if p["n"]]
    return {k: {q: _median([p[k][q] for p in parts]) for q in ("p50", "p90")} for k in TTFT_PARTS}


def knee(rates: list[float], attainment: list[float], level: float = GOALS["knee_level"]) -> int | None:
    """Index of the first rate whose SLO attainment is below `level` (None: never)."""
    for i, a in enumerate(attainment):
        if a < level:
            return i
    return None


def judge(per_rate: list[dict]) -> dict:
    """Each goal over every rate: met or not, with the worst error."""
    g = GOALS
    goodput = [abs(r["goodput_error"]) for r in per_rate if r["goodput_error"] is not None]
    att = [abs(r["attainment_error"]) for r in per_rate]
    lat = {f"{m}_{q}": [abs(r["latency"][f"{m}_{q}"]["error"]) for r in per_rate
                        if r["latency"][f"{m}_{q}"]["error"] is not None] for m, q in GATED}
    rates = [r["rate"] for r in per_rate]
    k_real = knee(rates, [r["real"]["slo_attainment"] for r in per_rate])
    k_sim = knee(rates, [r["sim"]["slo_attainment"] for r in per_rate])
    n = len(rates)
    knee_ok = abs((n if k_real is None else k_real) - (n if k_sim is None else k_sim)) <= g["knee_steps"]
    out = {
        "goodput": {"worst": max(goodput, default=None), "goal": g["goodput_rel"],
                    "met": all(x <= g["goodput_rel"] for x in goodput)},
        "attainment": {"worst": max(att, default=None), "goal": g["attainment_abs"],
                       "met": all(x <= g["attainment_abs"] for x in att)},
        **{k: {"worst": max(v, default=None), "goal": g["latency_rel"], "met": all(x <= g["latency_rel"] for x in v)}
           for k, v in lat.items()},
        "knee": {"real": None if k_real is None else rates[k_real], "sim": None if k_sim is None else rates[k_sim],
                 "level": g["knee_level"], "met": knee_ok,
                 "note": "first rate with SLO attainment below 90% (None: none of the rates)"},
    }
    out["all_met"] = all(v["met"] for v in out.values() if isinstance(v, dict))
    if per_rate and all(r.get("paired") for r in per_rate):
        out["paired"] = judge_paired(per_rate)
    return out


def judge_paired(per_rate: list[dict]) -> dict:
    """The same goals on the paired errors (`paired_errors`): at each rate,
    the median over its runs of each run's error against its own
    simulations. Where each run is simulated at its measured speed, this
    judges the simulator, not how far apart the machine put the runs."""
    out = {}
    for k in ("attainment",) + PAIRED:
        goal = GOALS[{"attainment": "attainment_abs", "goodput": "goodput_rel"}.get(k, "latency_rel")]
        med = [_median([p[k] for p in r["paired"]]) for r in per_rate]
        worst = max((abs(x) for x in med if x is not None), default=None)
        out[k] = {"per_rate": med, "worst": worst, "goal": goal,
                  "met": all(abs(x) <= goal for x in med if x is not None)}
    out["all_met"] = all(v["met"] for v in out.values())
    return out


# -- the engine's view, from its step log --------------------------------------------------------


def step_log_view(lines: list[dict], real: dict, model, window_s: float | None = None,
                  costs: ServingCosts | None = None) -> dict | None:
    """What the server's step log shows for one replay: steps, busy time, the
    profile's step model against the measured steps (whole iterations: the step
    plus the loop's command, output and hand-over time), a request's entry
    into an idle engine, the extra time of steps that start after idle, and
    the loop's mean time between busy steps (`ServingCosts.loop_s`).
    `costs`: the profile's serving costs, against which the loop's speed is
    measured too (`speed["loop"]`: the busy gaps' total over what `costs.loop`
    predicts for them, with their rows before and requests taken in: the
    loop is Python on the host, which the machine's load moves more than the
    steps; replays on a 2-core server ran its gaps at 0.44-0.83x of a sweep's
    where their steps ran at 0.66-1.24x).
    `window_s`: also the machine's speed per that many seconds of the run
    (`speed_windows`, a `SimConfig.speed_schedule`)."""
    t0 = real.get("t0_epoch")
    recs = real.get("requests") or []
    ends = [r["end_s"] for r in recs if r.get("end_s") is not None]
    if t0 is None or not ends:
        return None
    t_end = t0 + max(ends) + 0.05
    window = [ln for ln in lines if t0 - 0.001 <= ln["t"] <= t_end]
    timed = step_lines(window)  # (idle before it, line) per step
    if not timed:
        return None
    steps = [ln for _, ln in timed]
    it = np.array([iteration_time(ln) for ln in steps])
    feats = [features(ln) for ln in steps]  # any LatencyModel: `predict` is its one method
    pred = np.array([model.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs, f.extend_rows,
                                   f.chunk_rows, f.layered) for f in feats])
    ratio = it / pred
    # A step after idling holds the wake-up, which the simulation adds on its own (`ServingCosts.wake`,
    # unscaled) on top of the scaled step: the speed is fitted to each step's time less the wake-up the
    # simulation will add to it. Fitted to the whole times, the wake-ups of a light load's prefill steps
    # (most of its prompts reach an idle engine) went into the per-token factor (x1.4-1.5 on the Azure
    # trace at 16 req/s on the 2-core Xeon, where those steps ran at x1.0 of the model plus the wake-up),
    # and the simulation charged them twice: TTFT p50 +11-13% at 16-48 req/s.
    # The first decode steps after a prompt's (`ServingCosts.cold`) are left out of the fit and measured
    # on their own: what they take over the scaled model, against the cold extra the profile prices
    # (`speed["cold"]`). A replay's ran colder than the sweep's (1.3x their priced time where the steady
    # steps ran at 1.0x), and in the fit their excess, in steps whose per-token part is slightly larger than
    # a steady step's, came out as a per-token factor of 1.18 that the simulation then put on every prompt.
    woke = np.array([costs.wake(idle) if idle > BUSY_S else 0.0 for idle, _ in timed]) if costs is not None \
        else np.zeros(len(it))
    index = cold_index(timed)
    cold = np.array([costs is not None and costs.cold_extra(j, p, 1.0) > 0 for j, p in index], dtype=bool)
    use = ~cold
    fit_t = np.maximum(it - woke, 0.0)
    speed = run_speed(model, [f for f, u in zip(feats, use) if u], fit_t[use], pred[use])
    speed["cold"] = None
    if cold.any():
        scaled = model.rescaled(speed["step"], speed["token"]) if hasattr(model, "rescaled") else None
        c_idx = np.flatnonzero(cold)
        t_c = np.array([scaled.predict_features(feats[i]) for i in c_idx]) if scaled is not None \
            else pred[c_idx] * speed["step"]
        priced = np.array([costs.cold_extra(*index[i], t) for i, t in zip(c_idx, t_c)])
        if priced.sum() > 0:
            speed["cold"] = float(max(0.0, (fit_t[c_idx] - t_c).sum()) / priced.sum())
    gaps, gap_rows, gap_adds, gap_t = loop_gaps(window)
    loop_pred = None
    if costs is not None and len(gaps):
        loop_pred = costs.loop(gap_rows, gap_adds)  # (elementwise over the gaps)
        if loop_pred.sum() <= 0:
            loop_pred = None
    speed["loop"] = float(gaps.sum() / loop_pred.sum()) if loop_pred is not None else None
    windows = None
    if window_s:
        a, b = speed["step"], speed["token"]
        scaled = model.rescaled(a, b) if hasattr(model, "rescaled") else None
        run_pred = np.array([scaled.predict_features(f) for f in feats]) if scaled is not None else pred * a
        k = np.floor((np.array([ln["t"] for ln in steps]) - t0) / window_s).astype(int)
        kg = np.floor((gap_t - t0) / window_s).astype(int)
        windows = []
        for w in range(int(k.max()) + 1):
            loop = speed["loop"]
            g = kg == w
            if loop is not None and g.sum() >= MIN_WINDOW_STEPS:
                loop = float(gaps[g].sum() / loop_pred[g].sum())
            m = np.flatnonzero((k == w) & use)
            if len(m) < MIN_WINDOW_STEPS:
                windows.append([w * window_s, a, b, loop, speed["cold"]])
                continue
            # both factors, as for the run: the machine does not slow the two parts alike from one second to
            # the next either (one scale per window on the run's split simulated 4-10% less goodput than the
            # real runs past their knee, the two factors within 4%). A window that cannot tell the parts
            # apart (a few prefill tokens: once a factor of 0.002) scales the run's two by one.
            sp = run_speed(model, [feats[i] for i in m], fit_t[m], pred[m])
            if sp["token"] is not None and b is not None and not (
                    a / WINDOW_SPLIT <= sp["step"] <= a * WINDOW_SPLIT and b / WINDOW_SPLIT <= sp["token"] <= b * WINDOW_SPLIT):
                x = float(fit_t[m].sum() / run_pred[m].sum())
                sp = {"step": a * x, "token": b * x}
            windows.append([w * window_s, sp["step"], sp["token"], loop, speed["cold"]])
        windows[0][0] = 0.0
    by_prompt, by_rows = scaled_by_shape(model, steps, feats, fit_t, use, speed, windows, t0, window_s)
    after_idle = np.array([idle for idle, _ in timed]) > 0.001
    # entry: a request that reached an idle engine was picked up as soon as it
    # arrived, so (pickup - client send) is its way in, with no step to wait for
    starts = sorted(t0 + r["start_s"] for r in recs if r.get("start_s") is not None)
    entry = []
    for start, i in zip(starts, intakes(window, len(starts))):
        before = window[i - 1] if i else None  # busy until the iteration before ended
        if before is None or before["t"] + iteration_time(before) < start:
            entry.append(window[i]["t"] - start)

    def q(a, p):
        return float(np.percentile(a, p)) if len(a) else None

    return {
        "steps": len(steps),
        "mean_rows": float(np.mean([ln["rows"] for ln in steps])),
        "busy_s": float(it.sum()),
        "predicted_busy_s": float(pred.sum()),
        "step_ratio": {"p10": q(ratio, 10), "p50": q(ratio, 50), "p90": q(ratio, 90),
                       "sum": float(it.sum() / pred.sum())},
        "step_ape_p50": q(np.abs(ratio - 1), 50),
        "speed": speed,
        "steps_after_idle": int(after_idle.sum()),
        "wake_extra_s_p50": q((it - pred)[after_idle], 50),
        "busy_step_ratio_p50": q(ratio[~after_idle], 50),
        "entry_s": {"n": len(entry), "p50": q(np.array(entry), 50), "p90": q(np.array(entry), 90)},
        "delivery_s": first_token_delivery(window, recs, t0, costs),
        "ttft_parts": ttft_parts(window, recs, t0),
        "end_delivery_s": last_token_delivery(window, recs, t0, costs),
        "host_cpu": host_cpu(real, costs, output_batches(window)),
        "loop_s": float(gaps.mean()) if len(gaps) else None,
        "speed_windows": windows,
        "by_prompt": by_prompt,
        "by_rows": by_rows,
    }


PROMPT_BINS = ((0, 1, "none"), (1, 65, "1-64"), (65, 257, "65-256"), (257, None, "257+"))
ROW_BINS = ((1, 4, "1-3"), (4, 16, "4-15"), (16, 33, "16-32"), (33, None, "33+"))  # decode steps' rows


def scaled_by_shape(model, steps, feats, times, use, speed, windows, t0,
                    window_s) -> tuple[list[dict] | None, list[dict] | None]:
    """The measured steps against the model the simulation prices them with
    (the profile's, rescaled by the run's speed or by each window's), by
    the prompt tokens of the step (`PROMPT_BINS`), and the decode steps (no
    prompt tokens) by their rows (`ROW_BINS`): ([{"prompt", "n", "ratio"}],
    [{"rows", "n", "ratio"}]), ratio = measured over priced time, summed,
    over the steps the speed was fitted to (`use`, their times less the
    wake-up). A form whose shape misprices one size of step against another
    shows here, where the two factors, fitted to all decode steps and all
    prompt steps together, cannot: over 30 Azure replays on the 2-core Zen 5
    EPYC, 1.28-1.53 for steps of 257+ prompt tokens and 0.48-0.63 for 1-64
    while the chunks' own prices scaled with the decode steps' factor
    (1.10-1.23 and 0.66-0.80 since); at one speed for the whole run, over the
    four Azure replays at 28-32 req/s on a 2-core Zen 3, 0.75-0.92 for
    decode steps of 33+ rows, whose many 1-row steps set that speed (each
    second at its own speed: 0.87-1.02). (None, None) for a model that is
    not rescaled."""
    if not hasattr(model, "rescaled"):
        return None, None
    run = model.rescaled(speed["step"], speed["token"])
    by_window = {}
    priced = np.empty(len(steps))
    for i, (ln, f) in enumerate(zip(steps, feats)):
        m = run
        if windows:
            w = min(int((ln["t"] - t0) // window_s), len(windows) - 1)
            m = by_window.get(w)
            if m is None:
                m = by_window[w] = model.rescaled(windows[w][1], windows[w][2])
        priced[i] = m.predict_features(f)
    prompt = np.array([ln["new"] - ln["decode_rows"] for ln in steps])
    rows = np.array([ln["rows"] for ln in steps])

    def bins(key, values, edges, among):
        out = []
        for lo, hi, label in edges:
            sel = among & (values >= lo) & (values < (hi if hi is not None else np.inf))
            if sel.any():
                out.append({key: label, "n": int(sel.sum()), "ratio": float(times[sel].sum() / priced[sel].sum())})
        return out

    return bins("prompt", prompt, PROMPT_BINS, use), bins("rows", rows, ROW_BINS, use & (prompt == 0))


def intakes(window: list[dict], n: int) -> list[int]:
    """For the first `n` requests of a run in the order they were sent, the
    index in `window` of the iteration that took each in. The step log counts
    the requests an iteration took in (`adds`), not which: they are taken to
    come in the order they were sent, which a front end keeps but for
    requests sent within its handling of one."""
    out = []
    for i, ln in enumerate(window):
        out += [i] * min(ln["adds"], n - len(out))
    return out


def handed_over(window: list[dict]) -> dict[str, dict]:
    """The step log's `first` ids: request id -> the iteration that handed
    its first output over."""
    return {rid: ln for ln in window for rid in ln.get("first", ())}


def first_token_delivery(window: list[dict], recs: list[dict], t0: float, costs: ServingCosts | None) -> dict:
    """How long each request's first token took from the end of the iteration
    that handed it over (the step log's `first` ids) to the client (its
    record's `first_token_s`), joined on the server's id of the request
    (`server_id`): {n, p50, p90}, and `over_p50`, the median of each over
    what the profile's `delivery_s` + `stream_s` per output of that
    iteration predicts. n 0 where the log or the records carry no ids."""
    first = handed_over(window)
    got, over = [], []
    for r in recs:
        ln = first.get(r.get("server_id"))
        if ln is None or r.get("first_token_s") is None:
            continue
        d = t0 + r["first_token_s"] - (ln["t"] + iteration_time(ln))
        got.append(d)
        if costs is not None:
            over.append(d - costs.delivery(ln.get("outs", 1)))
    return _delays(got, over)


TTFT_PARTS = ("way_in", "engine", "way_out")  # send -> taken in by the engine loop -> its first token's step ends -> client


def _parts(rows: list[tuple[float, float, float]]) -> dict:
    """{n, and per part of `TTFT_PARTS` {p50, p90}} of (way in, in the engine, way out) per request."""
    a = np.array(rows, dtype=float).reshape(-1, 3)
    out = {"n": len(a)}
    for j, k in enumerate(TTFT_PARTS):
        out[k] = {"p50": float(np.percentile(a[:, j], 50)), "p90": float(np.percentile(a[:, j], 90))} if len(a) \
            else {"p50": None, "p90": None}
    return out


def ttft_parts(window: list[dict], recs: list[dict], t0: float) -> dict:
    """A real run's TTFTs in three parts, from the server's step log: the way
    in (from the client's send to the iteration that took the request in:
    the front end, the pipe, and the step the engine was running), the time
    in the engine (to the end of the iteration that handed its first token
    over, the step log's `first` ids) and the way out (to the client holding
    it). The requests are joined to the iterations that took them in as
    `intakes` says, and to their first tokens by the server's id; those the
    log does not name are left out, and so are failed ones, which a front
    end may refuse before the engine sees them."""
    order = sorted((r for r in recs if r.get("start_s") is not None and r.get("error") is None),
                   key=lambda r: r["start_s"])
    first = handed_over(window)
    rows = []
    for r, i in zip(order, intakes(window, len(order))):
        ln = first.get(r.get("server_id"))
        if ln is not None and r.get("first_token_s") is not None:
            taken, out = window[i]["t"] - t0, ln["t"] - t0 + iteration_time(ln)
            rows.append((taken - r["start_s"], out - taken, r["first_token_s"] - out))
    return _parts(rows)


def sim_ttft_parts(report: dict) -> dict:
    """`ttft_parts` of a simulation, from its records' own stamps
    (`RequestRecord.engine_in_s`, `first_out_s`)."""
    return _parts([(r["engine_in_s"] - r["start_s"], r["first_out_s"] - r["engine_in_s"],
                    r["first_token_s"] - r["first_out_s"]) for r in report.get("requests") or ()
                   if r.get("first_out_s") is not None and r.get("first_token_s") is not None])


def _delays(got: list[float], over: list[float]) -> dict:
    """{n, p50, p90, over_p50} of tokens' ways to their clients, and of their
    excess over the profile's (`first_token_delivery`, `last_token_delivery`)."""
    a = np.array(got)
    return {"n": len(got), "p50": float(np.percentile(a, 50)) if len(a) else None,
            "p90": float(np.percentile(a, 90)) if len(a) else None,
            "over_p50": float(np.median(over)) if over else None}


def host_cpu(real: dict, costs: ServingCosts | None, batches: int = 0) -> dict | None:
    """The host's CPU seconds beside the engine over a real run (its report's
    `host_cpu_s`: the front end's and the client's), against what the
    profile's host costs (`host_request_s`, `host_token_s`,
    `host_prompt_token_s`, `host_batch_s`) say for its requests, output and
    prompt tokens, and the `batches` of outputs its step log shows the engine
    handed over: {cpu_s, predicted_s, factor}. None where either is missing."""
    host = real.get("host_cpu_s") or {}
    if host.get("front_end") is None or costs is None or not (costs.host_request_s or costs.host_token_s):
        return None
    recs = [r for r in real.get("requests") or [] if r.get("error") is None]
    predicted = (costs.host_request_s * len(recs) + costs.host_token_s * sum(r.get("output_tokens") or 0 for r in recs)
                 + costs.host_prompt_token_s * sum(r.get("prompt_tokens") or 0 for r in recs)
                 + costs.host_batch_s * batches)
    cpu = host["front_end"] + host["client"]
    return {"cpu_s": cpu, "predicted_s": predicted, "factor": cpu / predicted if predicted > 0 else None}


def last_token_delivery(window: list[dict], recs: list[dict], t0: float, costs: ServingCosts | None) -> dict:
    """How long each request's last token took from the end of the step that
    made it to the client (its record's `end_s`), as `first_token_delivery`
    does for first tokens, for the requests of one stream that made a token
    in each step after their first (n tokens: the (n - 1)-th step after the
    iteration that handed over the first made the last) and whose client
    saw each token as an event of its own (speculative steps, which make
    several, never count). `over_p50` against the profile's
    `ServingCosts.end_delivery`."""
    steps = [ln for ln in window if "rows" in ln]
    at = {}
    for i, ln in enumerate(steps):
        for rid in ln.get("first", ()):
            at[rid] = i
    got, over = [], []
    for r in recs:
        i = at.get(r.get("server_id"))
        n = r.get("output_tokens") or 0
        if i is None or n < 2 or r.get("end_s") is None or len(r.get("itl_s") or []) != n - 1 or r.get("n", 1) != 1:
            continue
        j = i + n - 1
        if j >= len(steps):
            continue
        ln = steps[j]
        d = t0 + r["end_s"] - (ln["t"] + iteration_time(ln))
        got.append(d)
        if costs is not None:
            over.append(d - costs.end_delivery(ln.get("outs", 1)))
    return _delays(got, over)


HOST_COSTS = ("host_request_s", "host_token_s", "host_prompt_token_s", "host_batch_s")  # `host_cpu` scales them
MIN_CLASS_STEPS = 5  # steps of each class (decode, prompt) that `run_speed` needs to split the factors


def run_speed(model, feats: list, times: np.ndarray, pred: np.ndarray) -> dict:
    """The machine's speed during a run against the profile's: `step` scales
    the per-step, per-row and per-context-token part of the model's
    prediction, `token` the per-token part and the prompt chunks' own terms
    (`TOKEN_TERMS`): a busy machine
    slows the two differently. They are the factors under which the decode
    steps' measured time and the prompt steps' (those with prompt tokens: a
    chunk or a verification) each add up to the prediction: two sums, two
    unknowns, well apart (the per-token part is 4-8% of a decode step and
    40-80% of a prompt step). A least-squares fit in seconds had been
    ruled by the few long prompt steps and, between the two kinds of prompt
    step (after idling and beside decode rows), whose per-token shares
    differ by a few points, it put a run's factors at 0.89 and 1.34 where
    its decode steps ran at 1.0-1.05 of the model: the simulated TPOT came
    out 14% low. One factor for both (measured/predicted busy time) where
    the model has no such split, either kind has fewer than
    `MIN_CLASS_STEPS` steps, or a factor would come out 0 or less."""
    one = float(times.sum() / pred.sum())
    out = {"step": one, "token": None, "busy_ratio": one}
    if not hasattr(model, "token_part"):
        return out
    tok = np.array([model.token_part(f) for f in feats])
    rest = pred - tok
    prompt = np.array([f.new_tokens > f.rows or f.extend_rows > 0 for f in feats], dtype=bool)
    if prompt.sum() < MIN_CLASS_STEPS or (~prompt).sum() < MIN_CLASS_STEPS:
        return out
    a = np.array([[rest[~prompt].sum(), tok[~prompt].sum()], [rest[prompt].sum(), tok[prompt].sum()]])
    y = np.array([times[~prompt].sum(), times[prompt].sum()])
    if abs(np.linalg.det(a)) <= 1e-12 * abs(a).max() ** 2:
        return out
    k = np.linalg.solve(a, y)
    if np.all(k > 0) and np.all(np.isfinite(k)):
        out["step"], out["token"] = float(k[0]), float(k[1])
    return out


# -- output ----------------------------------------------------------------------------------------


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _pct(v) -> str:
    return "-" if v is None else f"{v:+.0%}"


def _err(k: str, v) -> str:
    """An error as the goal on `k` reads it: attainment in points, the rest relative."""
    return "-" if v is None else f"{v * 100:+.1f}pt" if k == "attainment" else _pct(v)


def _goal_line(k: str, v: dict) -> str:
    """One goal of `judge`'s: its worst error, the goal and whether it was met."""
    att = k == "attainment"
    worst = "-" if v["worst"] is None else (f"{v['worst'] * 100:.1f}pt" if att else f"{v['worst']:.1%}")
    goal = f"{v['goal'] * 100:.0f}pt" if att else f"{v['goal']:.0%}"
    return f"  {k:12s} worst {worst:>7s} (goal {goal}): {'met' if v['met'] else 'MISSED'}"


def format_rate(r: dict) -> str:
    reps = r.get("repeats", 1)
    head = f"rate {r['rate']:.3g} req/s" + (f" (medians of {reps} runs each)" if reps > 1 else "")
    lines = [head, f"  {'ms':10s} {'real':>7s} {'sim':>7s} {'error':>7s}" + (f" {'real spread':>12s}" if reps > 1 else "")]
    for m in LATENCIES:
        for q in QUANTILES:
            c = r["latency"][f"{m}_{q}"]
            line = f"  {m.upper() + ' ' + q:10s} {_ms(c['real']):>7s} {_ms(c['sim']):>7s} {_pct(c['error']):>7s}"
            if reps > 1:
                spread = "-" if c["real_spread"] is None else f"{c['real_spread']:.0%}"
                line += f" {spread:>12s}"
            lines.append(line)
    lines.append(f"  {'goodput':10s} {r['real']['goodput_rps']:7.2f} {r['sim']['goodput_rps']:7.2f} "
                 f"{_pct(r['goodput_error']):>7s}  req/s")
    lo, hi = r["real"]["attainment_range"]
    lines.append(f"  {'attainment':10s} {r['real']['slo_attainment']:7.1%} {r['sim']['slo_attainment']:7.1%} "
                 f"{r['attainment_error'] * 100:+6.1f}pt" + (f"  (real runs {lo:.1%}-{hi:.1%})" if reps > 1 else ""))
    if r.get("paired"):
        lines.append("  each run against its own simulations: "
                     + "; ".join(f"{k.replace('_', ' ')} " + "/".join(_err(k, p[k]) for p in r["paired"])
                                 for k in ("attainment",) + PAIRED))
    parts = r.get("ttft_parts") or {}
    if parts.get("real") and parts.get("sim"):
        lines.append("  TTFT's parts, p50 / p90 ms, real against sim: " + "; ".join(
            f"{k.replace('_', ' ')} {_ms(parts['real'][k]['p50'])}/{_ms(parts['real'][k]['p90'])} against "
            f"{_ms(parts['sim'][k]['p50'])}/{_ms(parts['sim'][k]['p90'])}" for k in TTFT_PARTS))
    sim = r["sim"]
    if sim.get("steps") is not None:
        lines.append(f"  simulator: {sim['steps']:.0f} steps, busy {sim['busy_s']:.2f} s, "
                     f"{sim['mean_rows']:.1f} rows per step")
    for v in r.get("engine") or []:
        e = v["entry_s"]
        lines.append(f"  engine: {v['steps']} steps, busy {v['busy_s']:.2f} s (model {v['predicted_busy_s']:.2f} s), "
                     f"{v['mean_rows']:.1f} rows per step; "
                     f"measured/predicted step p50 {v['step_ratio']['p50']:.2f} (p10 {v['step_ratio']['p10']:.2f}, "
                     f"p90 {v['step_ratio']['p90']:.2f}); machine speed x{v['speed']['step']:.2f} per step/row"
                     + ("" if v["speed"]["token"] is None else f", x{v['speed']['token']:.2f} per token")
                     + f"; {v['steps_after_idle']} steps after idle, "
                     f"+{_ms(v['wake_extra_s_p50'])} ms p50; entry into an idle engine "
                     f"{_ms(e['p50'])} ms p50 ({e['n']} requests)"
                     + ("" if not (v.get("delivery_s") or {}).get("n") else
                        f"; first tokens delivered {_ms(v['delivery_s']['p50'])} ms p50, "
                        f"{_ms(v['delivery_s']['p90'])} p90"
                        + ("" if v["delivery_s"]["over_p50"] is None else
                           f" ({v['delivery_s']['over_p50'] * 1e3:+.1f} ms over the profile's, p50)"))
                     + ("" if not (v.get("end_delivery_s") or {}).get("n") else
                        f"; last tokens {_ms(v['end_delivery_s']['p50'])} ms p50"
                        + ("" if v["end_delivery_s"]["over_p50"] is None else
                           f" ({v['end_delivery_s']['over_p50'] * 1e3:+.1f} ms over)"))
                     + ("" if not (v.get("host_cpu") or {}).get("factor") else
                        f"; host CPU {v['host_cpu']['cpu_s']:.2f} s, x{v['host_cpu']['factor']:.2f} the profile's")
                     + ("" if v.get("loop_s") is None else f"; loop between busy steps {v['loop_s'] * 1e3:.2f} ms")
                     + ("" if v["speed"].get("loop") is None else f" (x{v['speed']['loop']:.2f} the profile's)")
                     + ("" if not v.get("by_prompt") else
                        "; measured/priced steps by prompt tokens: "
                        + ", ".join(f"{b['prompt']} {b['ratio']:.2f} ({b['n']})" for b in v["by_prompt"]))
                     + ("" if not v.get("by_rows") else
                        "; decode steps by rows: "
                        + ", ".join(f"{b['rows']} {b['ratio']:.2f} ({b['n']})" for b in v["by_rows"])))
    return "\n".join(lines)


def format_summary(summary: dict, per_rate: list[dict]) -> str:
    lines = [f"{'rate':>8s} {'attain real':>12s} {'attain sim':>11s} {'goodput err':>12s} "
             + " ".join(f"{m.upper() + ' ' + q + ' err':>13s}" for m, q in GATED)]
    for r in per_rate:
        lines.append(f"{r['rate']:8.3g} {r['real']['slo_attainment']:12.1%} {r['sim']['slo_attainment']:11.1%} "
                     f"{_pct(r['goodput_error']):>12s} "
                     + " ".join(f"{_pct(r['latency'][f'{m}_{q}']['error']):>13s}" for m, q in GATED))
    lines.append("goals:")
    for k, v in summary.items():
        if k in ("all_met", "paired"):
            continue
        if k == "knee":
            def rate(x):
                return "none" if x is None else f"{x:.3g}"
            lines.append(f"  knee (attainment < 90%): real {rate(v['real'])}, sim {rate(v['sim'])} req/s: "
                         f"{'met' if v['met'] else 'MISSED'} (within one grid step)")
            continue
        lines.append(_goal_line(k, v))
    if summary.get("paired"):
        lines.append("goals on each run against its own simulations (per rate, the median over its runs):")
        for k, v in summary["paired"].items():
            if k != "all_met":
                lines.append(_goal_line(k, v) + "   by rate: " + " ".join(_err(k, x) for x in v["per_rate"]))
    return "\n".join(lines)


def plot_validation(result: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stepserve.traces.report import output_path

    per = result["rates"]
    rates = [r["rate"] for r in per]
    fig, axes = plt.subplots(2, 2, figsize=(10, 8))
    panels = [
        (axes[0][0], "goodput (req/s)", lambda r, s: r[s]["goodput_rps"], None),
        (axes[0][1], "SLO attainment (%)", lambda r, s: 100 * r[s]["slo_attainment"], (0, 105)),
        (axes[1][0], "TTFT p90 (ms)", lambda r, s: 1e3 * r["latency"]["ttft_p90"]["real" if s == "real" else "sim"],
         None),
        (axes[1][1], "TPOT p90 (ms)", lambda r, s: 1e3 * r["latency"]["tpot_p90"]["real" if s == "real" else "sim"],
         None),
    ]
    for ax, label, get, ylim in panels:
        for side, style in (("real", "o-"), ("sim", "s--")):
            ax.plot(rates, [get(r, side) for r in per], style, label="real server" if side == "real" else "simulator")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    slo = result.get("slo") or {}
    trace = os.path.basename(result["trace"].get("path", "") or "")  # the file's name, not where this machine keeps it
    fig.suptitle(f"validate: {trace} with {result['profile']['name']}; SLO TTFT "
                 f"{_ms(slo.get('ttft_s'))} ms, TPOT {_ms(slo.get('tpot_s'))} ms", fontsize=9)
    fig.tight_layout()
    fig.savefig(output_path(path), dpi=110)
    plt.close(fig)
    return path


class ReplayStore:
    """The real runs of a validation kept in a folder (`--replays`), one
    report per (rate index, repeat). A stored run is used only if its trace
    and scaling (rate included) are those asked for now."""

    def __init__(self, folder: str | None, trace: dict, n_rates: int, repeats: int):
        self.folder, self.trace = folder, trace
        self.n_rates, self.repeats = n_rates, repeats
        if folder:
            if os.path.exists(folder) and not os.path.isdir(folder):
                raise ValueError(f"--replays {folder}: a file, not a folder (it keeps one report per real run)")
            os.makedirs(folder, exist_ok=True)

    def path(self, i: int, rep: int) -> str:
        return os.path.join(self.folder, f"rate{i}-run{rep}.json")

    def _read(self, i: int, rep: int) -> dict | None:
        if not self.folder or not os.path.isfile(self.path(i, rep)):
            return None
        with open(self.path(i, rep)) as f:
            return json.load(f)

    def load(self, i: int, rep: int, scaling: dict, slo) -> dict | None:
        """The stored run, judged by `slo` (its records hold every request's
        times: a validation with other SLOs reuses the same runs)."""
        from stepserve.traces.metrics import rejudged

        r = self._read(i, rep)
        scaling = json.loads(json.dumps(scaling))  # as it reads back
        if r is None or r.get("trace", {}).get("path") != self.trace.get("path") or r.get("scaling") != scaling:
            return None
        return rejudged(r, slo)

    def save(self, i: int, rep: int, report: dict) -> None:
        if self.folder:
            from stepserve.traces.report import write_report

            write_report(report, self.path(i, rep))

    def server_info(self):
        """The server the stored runs were replayed against (None: no run stored)."""
        from stepserve.traces.replay import ServerInfo

        for i in range(self.n_rates):
            for rep in range(self.repeats):
                r = self._read(i, rep)
                if r is not None:
                    c = r["config"]
                    return ServerInfo(c.get("model"), c.get("server_max_model_len"), c.get("vocab_size"))
        return None


def at_run_speed(prof, cfg, view: dict, windows: bool, within: dict | None = None):
    """(profile, SimConfig) to simulate a real run at its own speed
    (`--speed-from-step-log`), from its step log's `view`: the step model
    rescaled window by window (`windows`: `speed_windows`, with the scatter
    within them, `within`) or for the whole run (its step and token
    factors, and the loop's and the cold steps' factors), and the host's
    costs scaled by the run's host CPU over what they predict for it
    (`host_cpu`: the host's speed moves as the engine's does; two profiles
    of a 2-core EPYC 15 minutes apart read the same passes 25-40% apart)."""
    p, c = prof, cfg
    if windows:  # the profile's model, rescaled window by window as the run went
        c = dataclasses.replace(cfg, speed_schedule=view["speed_windows"], **(within or {}))
    else:
        speed = view["speed"]
        p = dataclasses.replace(prof, model=prof.model.rescaled(speed["step"], speed["token"]))
        if speed.get("loop") is not None:
            x = speed["loop"]
            c = dataclasses.replace(cfg, loop_s=cfg.loop_s * x, loop_row_s=cfg.loop_row_s * x, intake_s=cfg.intake_s * x)
        if speed.get("cold") is not None:
            x = speed["cold"]
            c = dataclasses.replace(c, cold=[[a * x, b * x] for a, b in cfg.cold])
    x = (view.get("host_cpu") or {}).get("factor")
    if x:
        c = dataclasses.replace(c, **{k: getattr(c, k) * x for k in HOST_COSTS})
    return p, c


def run_validate(args) -> int:
    from stepserve.engine.step_log import SETTLE_S, read_step_log
    from stepserve.scheduler.latency_model import load_profile
    from stepserve.traces.load import load_trace
    from stepserve.traces.replay import server_info
    from stepserve.traces.replay_cli import replay_one
    from stepserve.traces.report import command_line, versions, write_report
    from stepserve.traces.scaling import apply_scaling
    from stepserve.traces.simulate_cli import sim_config, simulate_one

    if not args.trace or not args.profile:
        raise SystemExit("stepserve validate: --trace and --profile are required")
    if args.sim_seeds < 1:
        raise SystemExit("stepserve validate: --sim-seeds must be at least 1")
    if args.speed_from_step_log and not args.step_log:
        raise SystemExit("stepserve validate: --speed-from-step-log reads each run's speed from --step-log")
    if args.speed_window is not None and not args.speed_from_step_log:
        raise SystemExit("stepserve validate: --speed-window measures the speed of --speed-from-step-log by window")
    prof = load_profile(args.profile)
    if args.speed_from_step_log and not hasattr(prof.model, "rescaled"):
        raise SystemExit("stepserve validate: --speed-from-step-log rescales a measured (linear) step model, and "
                         f"{args.profile} is a {prof.source} one")
    if not args.rates or len(rates_from_args(args)) < 2:
        raise SystemExit("stepserve validate: give --rates, two or more, from light load through saturation")
    slo = slo_from_args(args)
    if slo.ttft_s is None and slo.tpot_s is None and slo.e2e_s is None:
        raise SystemExit("stepserve validate: give SLOs (--slo-ttft, --slo-tpot) that bind at the top rates")
    cfg = sim_config(args, prof)
    trace = load_trace(args.trace)
    rates = rates_from_args(args)
    runs = ReplayStore(args.replays, trace.info(), len(rates), args.repeats)
    grid = [(rep, i) for rep in range(args.repeats)  # interleaved: up the grid, then down, so a slow
            # stretch of the machine does not land on one rate's every repeat
            for i in (range(len(rates)) if rep % 2 == 0 else reversed(range(len(rates))))]

    def scaled(info):
        """cfg and each run's (specs, scaling) for the server `info` describes."""
        c = cfg
        if args.vocab_size is None and info.vocab_size:  # one prompt vocabulary for both sides
            c = dataclasses.replace(cfg, vocab_size=info.vocab_size)
        limits = [x for x in (info.max_model_len, c.max_context) if x]
        max_ctx = min(limits) if limits else None  # requests both sides can serve
        return c, {(rep, i): apply_scaling(trace.specs, dataclasses.replace(scaling_from_args(args, max_ctx),
                                                                          rate=rates[i])) for rep, i in grid}

    info = runs.server_info()
    stored = {}
    if info is not None:
        cfg_s, scal = scaled(info)
        stored = {k: runs.load(k[1], k[0], scal[k][1].to_dict(), slo) for k in grid}
    if info is None or any(r is None for r in stored.values()):  # something to replay: ask the server
        info = server_info(args.url, args.api_key)
        cfg_s, scal = scaled(info)
        stored = {k: runs.load(k[1], k[0], scal[k][1].to_dict(), slo) for k in grid}
    cfg = cfg_s
    if args.vocab_size is None and info.vocab_size:
        args.vocab_size = info.vocab_size
    reals: list[list[dict]] = [[] for _ in rates]
    sims: list[list[dict]] = [[] for _ in rates]
    per_run: list[list[list[dict]]] = [[] for _ in rates]  # per real run, its own simulations
    views: list[list[dict]] = [[] for _ in rates]
    real_of = {}
    for run, (rep, i) in enumerate(grid):
        specs, sinfo = scal[rep, i]
        real = stored[rep, i]
        if real is None:
            real = replay_one(args, info, trace, slo, specs, sinfo, run)
            runs.save(i, rep, real)
        real_of[rep, i] = real
    view_of = {}
    if args.step_log:
        lines = read_step_log(args.step_log, settle_s=SETTLE_S)
        costs = cfg.serving()
        view_of = {k: step_log_view(lines, real, prof.model, args.speed_window, costs) for k, real in real_of.items()}
    # told the machine's speed of each window, the simulation draws only the scatter about it: the raw
    # quantiles also hold the speed's swings during the profile, which the windows now carry
    noise = prof.data.get("noise") or {}
    within = {}
    if args.speed_window and cfg.noise_quantiles and noise.get("quantiles_within"):
        within = {"noise_quantiles": list(noise["quantiles_within"])}
        if cfg.noise_by_size:
            within["noise_by_size"] = [[b["upto_s"], list(b["quantiles_within"])] for b in noise["by_size"]]
    for rep, i in grid:
        specs, sinfo = scal[rep, i]
        p, c = prof, cfg
        if args.speed_from_step_log:
            v = view_of.get((rep, i))
            if v is None:
                raise SystemExit(f"stepserve validate: the step log holds no steps of run {rep} at rate {rates[i]:g}")
            p, c = at_run_speed(prof, cfg, v, args.speed_window is not None, within)
        own = [simulate_one(args, p, dataclasses.replace(c, noise_seed=args.seed + rep * args.sim_seeds + j),
                            trace, slo, specs, sinfo) for j in range(args.sim_seeds)]
        sims[i] += own
        per_run[i].append(own)
        reals[i].append(real_of[rep, i])
        if view_of.get((rep, i)) is not None:
            views[i].append(view_of[rep, i])
    per_rate = []
    for i in range(len(rates)):
        per_rate.append(compare_rate(reals[i], sims[i], per_run[i], views[i]))
    summary = judge(per_rate)
    result = {
        "kind": VALIDATION_KIND, "command": command_line(), "versions": versions(), "trace": trace.info(),
        "scaling": sinfo.to_dict(), "slo": dataclasses.asdict(slo), "goals": GOALS,
        "profile": {"path": args.profile, "name": prof.name, "source": prof.source, "engine": prof.engine},
        "simulator": dataclasses.asdict(cfg) | {"noise_quantiles": len(cfg.noise_quantiles),
                                                "noise_by_size": [b[0] for b in cfg.noise_by_size],
                                                "speed_from_step_log": args.speed_from_step_log,
                                                "speed_window_s": args.speed_window, "speed_schedule": None,
                                                "noise_within_windows": bool(within)},
        "rates": per_rate, "summary": summary,
    }
    for r in per_rate:
        print(format_rate(r))
    print(format_summary(summary, per_rate))
    if args.out:
        write_report(result, args.out)
        print(f"validation written to {args.out}")
    if args.plot is not None:
        path = args.plot or (args.out.rsplit(".", 1)[0] + ".png" if args.out else "validate.png")
        print(f"plot written to {plot_validation(result, path)}")
    return 0
