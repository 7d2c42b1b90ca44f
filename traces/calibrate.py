"""Calibration from the server's own step log: `stepserve profile --url URL
--step-log PATH`.

A sweep timed by its client sees each step and each request's costs only
through the client's clock, and has to infer them jointly (traces/profile.py,
`fit_points`): the step model, one overhead per request, a cost per stream, a
wake-up. Measured on a 2-core server those inferences traded off against each
other from one run to the next (the overhead fitted anywhere from 4 to 9 ms).
The engine's step log (`engine/step_log.py`) measures them one by one instead,
over the same sweep:

  step model  fitted on every busy iteration of the engine loop (the step and
              the loop's own costs around it: what the simulator's clock must
              advance by), thousands of exact shapes instead of ~60 medians
  wake_s      the median extra time, over the model, of the iterations that
              followed an idle wait of at least `IDLE_S`
  wake_curve  the same per range of idle time (`WAKE_BINS`): how the wake-up
              grows with the idling before it (the probes idle for log-uniform
              times, 2-300 ms); both from the steps of `wake_steps`: one
              decode-shaped row (the hit probes), else one prompt
  entry_s     the median time from a probe's send (client clock) to the
              engine taking it in, for probes that reached an idle engine
  delivery_s, stream_s
              from the end of the iteration that made a probe's first token
              to the client holding it, fitted as delivery_s + stream_s * k
              over probes whose step made k tokens (1 alone, B + 1 beside B
              streams)
  delivery_scatter
              quantiles of each probe's first-token delivery over that
              line (`delivery_scatter`), which the simulator draws from
  token_delivery_s, end_delivery_s
              the median of the same for a later token: each idle probe's
              third, made by the second step after its first, from the
              client's gaps between its tokens; and for its last (the 4th),
              which ends the stream
  loop_s, loop_row_s
              the time from one busy iteration's end to the next one's start
              (`loop_gaps`): the loop's poll, bookkeeping and log line, which
              no iteration holds; a least-squares line in the rows of the
              iteration before (`fit_loop`), through the gaps before
              iterations that took in no request
  intake_s    what a gap before an iteration that took requests in holds
              over that line, per request taken in (`fit_intake`): reading
              them off the pipe while the front end works beside the loop.
              A sweep takes in far more requests per step than serving does
              (19% of the one-row gaps of a sweep, 1% of a replay's at 4 req/s,
              at 0.2-1.1 ms each): in the line they lifted its constant from
              0.11 to 0.14 ms.
  cold        ((a_j, b_j), ...) for j = 1..`COLD_STEPS`: the j-th decode
              step after a step that ran P prompt tokens takes sqrt(P) *
              (a_j + b_j * t) over the model's t (`cold_index`, `fit_cold`);
              those steps are left out of the step model's fit, which they
              would pull up for every steady step
  noise       quantiles of (measured iteration / model) over busy iterations,
              and their lag-1 autocorrelation around a running median
              (`noise_lag1`); and the quantiles around that running median
              (`within_ratios`), the scatter left once the machine's speed
              of the moment is known; and both per size of step
              (`noise_by_size`: small steps scatter more than large ones)

The server and the profiler must share a clock (one machine): the step log
holds wall-clock times, and so do the probes.
"""

from __future__ import annotations

import numpy as np

from stepserve.scheduler.latency_model import (
    COLD_STEPS, LinearLatencyModel, ServingCosts, SincePrompt, StepFeatures, design, error_summary, is_cold, nnls,
    row_knots,
)

IDLE_S = 0.005  # an iteration after this much idle wait counts as a wake-up
BUSY_S = 0.0005  # ... and one after less than this as busy
WAKE_BINS = (0.0005, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, float("inf"))  # idle seconds
MIN_BIN = 5  # samples for a point of the wake curve
MIN_COLD = 20  # samples for a cold step's (a, b)


def iteration_time(line: dict) -> float:
    """An iteration's own time: commands, the step, outputs, the hand-over."""
    return line["cmd"] + line.get("step", 0.0) + line.get("out", 0.0) + line["emit"]


def step_lines(lines: list[dict]) -> list[tuple[float, dict]]:
    """(idle wait before it, line) of every iteration that ran a step; the wait
    includes that of command-only iterations just before it."""
    out, acc = [], 0.0
    for ln in lines:
        acc += ln["wait"]
        if "rows" in ln:
            out.append((acc, ln))
            acc = 0.0
    return out


def features(line: dict) -> StepFeatures:
    """A step line's features. Logs written before `ext` was logged: every
    row that is not a decode row prefilled a chunk (they ran no speculation);
    before `chunks` was: every chunk was on the extend path."""
    ext = line.get("ext")
    if ext is None:
        ext = line["rows"] - line["decode_rows"]
    return StepFeatures(line["rows"], line["ctx"], line["new"], line.get("pairs", 0.0), ext,
                        line.get("chunks", ext), bool(line.get("layered", ext > 0)))


def cold_index(steps: list[tuple[float, dict]]) -> list[tuple[int, int]]:
    """(j, P) per step of `step_lines`: j = 0 and P its prompt tokens for a
    step that ran any (new tokens beyond its decode rows: prefill or extend
    chunks, verifications) or followed an idle wait, else j counts the decode
    steps since such a step, and P is that step's prompt tokens
    (`ServingCosts.cold`)."""
    out, since = [], SincePrompt()
    for idle, ln in steps:
        prompt = ln["new"] - ln["decode_rows"]
        if idle >= BUSY_S:  # the wake-up prices it, and the caches start over
            since = SincePrompt(0, prompt)
            out.append((0, prompt))
        else:
            out.append(since.advance(prompt))
    return out


def cold_steps(steps: list[tuple[float, dict]], index: list[tuple[int, int]], j: int) -> list[tuple[int, dict]]:
    """(P, line) of the busy decode steps that are the j-th after a step with
    P > 0 prompt tokens (`cold_index`)."""
    return [(p, ln) for (idle, ln), (jj, p) in zip(steps, index) if jj == j and p > 0 and idle < BUSY_S]


def fit_cold(steps: list[tuple[float, dict]], model, index: list[tuple[int, int]] | None = None,
             steps_after: int = COLD_STEPS) -> tuple[tuple[float, float], ...]:
    """(a_j, b_j) for j = 1..steps_after: the busy decode steps j after a
    step with P prompt tokens take sqrt(P) * (a_j + b_j * t) over the model's
    t, fitted to their excess over the model by least absolute deviations
    (iteratively reweighted non-negative least squares: a step the machine
    held up by a millisecond is one sample, not a pull). A j with fewer
    than `MIN_COLD` steps, and every j after it, is left out."""
    index = cold_index(steps) if index is None else index
    out = []
    for jj in range(1, steps_after + 1):
        rows = cold_steps(steps, index, jj)
        if len(rows) < MIN_COLD:
            break
        t = np.array([model.predict_features(features(ln)) for _, ln in rows])
        y = np.array([iteration_time(ln) for _, ln in rows]) - t
        root = np.sqrt(np.array([p for p, _ in rows], dtype=np.float64))
        A = np.column_stack([root, root * t])
        w = np.ones(len(y))
        coef = np.zeros(2)
        for _ in range(30):
            coef = nnls(A * w[:, None], y * w)
            w = 1.0 / np.sqrt(np.maximum(np.abs(y - A @ coef), 1e-5))
        out.append((float(coef[0]), float(coef[1])))
    return tuple(out)


def loop_gaps(lines: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(seconds from each busy iteration's end to the next iteration's start,
    rows of the iteration before, requests the next one took in, the next
    one's start on the log's clock). Busy: the
    next iteration decoded a row, so a request was running all the while and
    the loop's poll did not block for one. Its wait is in the gap (the
    non-blocking poll, which reads the new requests off the pipe), and so is
    what the loop does after the line's last clock reading."""
    gaps, rows, adds, ts = [], [], [], []
    for a, b in zip(lines, lines[1:]):
        if "rows" in a and "rows" in b and b["decode_rows"] > 0:
            gaps.append(b["t"] - (a["t"] + iteration_time(a)))
            rows.append(a["rows"])
            adds.append(b["adds"])
            ts.append(b["t"])
    f = np.float64
    return np.maximum(np.array(gaps, dtype=f), 0.0), np.array(rows, dtype=f), np.array(adds, dtype=f), np.array(ts, dtype=f)


def fit_loop(gaps: np.ndarray, rows: np.ndarray, adds: np.ndarray | None = None) -> tuple[float, float]:
    """(loop_s, loop_row_s): the non-negative least-squares line through the
    busy gaps that took in no request (`adds` 0; None: every gap) against the
    rows of the step before (in seconds, not relative: what the simulator's
    clock must add up to); one mean where the rows do not vary."""
    if adds is not None:
        gaps, rows = gaps[adds == 0], rows[adds == 0]
    if not len(gaps):
        return 0.0, 0.0
    if np.ptp(rows) == 0:
        return float(gaps.mean()), 0.0
    a, b = nnls(np.column_stack([np.ones_like(rows), rows]), gaps)
    return float(a), float(b)


def fit_intake(gaps: np.ndarray, rows: np.ndarray, adds: np.ndarray, loop_s: float, loop_row_s: float) -> float:
    """intake_s: the median, over the busy gaps that took requests in, of
    their time over the loop's line per request taken in (a median: the
    front end's work beside the loop sometimes holds a gap for a millisecond
    or more). 0 where no gap took one in."""
    m = adds > 0
    if not m.any():
        return 0.0
    return max(0.0, float(np.median((gaps[m] - loop_s - loop_row_s * rows[m]) / adds[m])))


FOLD_BLOCK = 100  # consecutive busy steps held out together


def _folds(n: int, k: int = 4, block: int = FOLD_BLOCK) -> list[np.ndarray]:
    """k folds of whole blocks of `block` consecutive steps, the blocks dealt
    at random. Steps next to each other run the same sweep point in the same
    phase of the machine: folds of single steps would test each on its twins
    and reward a fit of the noise they share."""
    blocks = np.arange(n) // block
    order = np.random.default_rng(0).permutation(int(blocks.max()) + 1 if n else 0)
    fold_of = order[blocks] % k
    return [np.flatnonzero(fold_of == i) for i in range(k)]


def _heldout(X: np.ndarray, times: np.ndarray, form: str, knots: tuple[int, ...] = (),
             smooth: float = 0.0) -> np.ndarray:
    """4-fold held-out relative error of each step (`_folds`), from the
    steps' design matrix (`design`)."""
    n = len(times)
    errs = np.zeros(n)
    for test in _folds(n):
        train = np.setdiff1d(np.arange(n), test)
        coef = LinearLatencyModel.solve(X[train], times[train], form, knots, smooth=smooth)
        pred = np.maximum(X[test] @ coef, LinearLatencyModel.min_s)
        errs[test] = np.abs(pred - times[test]) / times[test]
    return errs


def _summary(e: np.ndarray) -> dict:
    return {"n": int(e.size), "median_ape": float(np.median(e)), "p90_ape": float(np.percentile(e, 90)),
            "mean_ape": float(e.mean())}


def time_error(errs: np.ndarray, times: np.ndarray) -> float:
    """Held-out |error| in seconds per second of step time: what the
    simulator's clock gets wrong. A median would weigh a 1-token chunk like a
    2,000-token one and hide the long steps where the forms differ most."""
    return float((errs * times).sum() / times.sum())


CANDIDATE_FORMS = ("linear", "linear+attn", "segmented")  # simplest first; each nests the one before
PARSIMONY = 0.005  # a form with more terms is taken when it is more than 0.5% better held out
SMOOTH_GRID = (0.0, 0.1, 1.0, 10.0, 100.0)  # the segmented form's slope penalties tried (`LinearLatencyModel.solve`)


def pick_smooth(X: np.ndarray, times: np.ndarray, knots: tuple[int, ...]) -> tuple[float, np.ndarray, dict]:
    """(penalty, its held-out errors, held-out time error per penalty) for the
    segmented form: the largest of `SMOOTH_GRID` that is not worse held out
    than the best one by more than `PARSIMONY` of it or one standard error of
    the difference, whichever is more (the one-standard-error rule; the
    error of the difference is taken over `FOLD_BLOCK` blocks of steps,
    paired). Where the steps cannot tell the slopes apart the held-out
    errors differ by noise, and the penalty that gives one slope wins."""
    errs = {lam: _heldout(X, times, "segmented", knots, lam) for lam in SMOOTH_GRID}
    terr = {lam: time_error(e, times) for lam, e in errs.items()}
    best = min(terr, key=terr.get)
    blocks = np.arange(len(times)) // FOLD_BLOCK
    total = float(times.sum())

    def per_block(e):
        return np.bincount(blocks, weights=e * times) / total

    ok = []
    for lam in SMOOTH_GRID:
        d = per_block(errs[lam]) - per_block(errs[best])
        se = float(np.sqrt(len(d)) * d.std(ddof=1)) if len(d) > 1 else 0.0
        if d.sum() <= max(PARSIMONY * terr[best], se):
            ok.append(lam)
    lam = max(ok)
    return lam, errs[lam], terr


def fit_steps(steps: list[tuple[float, dict]], form: str = "auto",
              index: list[tuple[int, int]] | None = None) -> tuple[LinearLatencyModel, dict]:
    """The step model on busy iterations, and its 4-fold held-out error per
    iteration. `auto`: of `CANDIDATE_FORMS`, the simplest whose held-out error
    in time (`time_error`) is within `PARSIMONY` of the least (the richer
    forms nest the simpler ones: where they are no better, their extra terms
    would only fit noise); linear+attn only when its attention coefficient
    is positive. The segmented form's slopes are pulled together as far as
    the held-out error allows (`pick_smooth`). The first decode steps after
    a step with prompt tokens are left out (`fit_cold` prices them); `index`:
    the steps' `cold_index`, where the caller has it."""
    index = cold_index(steps) if index is None else index
    busy = [ln for (idle, ln), jp in zip(steps, index) if idle < BUSY_S and not is_cold(jp)]
    if len(busy) < 10:
        raise ValueError(f"the step log holds {len(busy)} busy steps in the sweep's window: too few to fit")
    feats = [features(ln) for ln in busy]
    times = np.array([iteration_time(ln) for ln in busy])
    forms = CANDIDATE_FORMS if form == "auto" else (form,)
    errs, models = {}, {}
    smooth, smooth_errs = 0.0, {}
    for f in forms:  # each form's design matrix built once, for its folds and its fit
        knots = row_knots(max(x.rows for x in feats)) if f == "segmented" else ()
        X = design(feats, f, knots)
        lam = 0.0
        if f == "segmented":
            lam, errs[f], smooth_errs = pick_smooth(X, times, knots)
            smooth = lam
        else:
            errs[f] = _heldout(X, times, f)
        coef = LinearLatencyModel.solve(X, times, f, knots, smooth=lam)
        models[f] = LinearLatencyModel(f, [float(c) for c in coef], knots=knots)
    terr = {f: time_error(e, times) for f, e in errs.items()}
    if form == "auto":
        ok = [f for f in forms if f != "linear+attn" or models[f].coef[-1] > 0]
        best = min(terr[f] for f in ok)
        form = next(f for f in ok if terr[f] <= best * (1 + PARSIMONY))
    model = models[form]
    return model, {"form": form, "heldout_steps": _summary(errs[form]) | {"time_error": terr[form]},
                   "forms_heldout_steps": {f: _summary(e) | {"time_error": terr[f]} for f, e in errs.items()},
                   "train_steps": error_summary(model, feats, times), "busy_steps": len(busy),
                   **({"smooth": smooth, "smooth_heldout_time_error": {str(k): v for k, v in smooth_errs.items()}}
                      if smooth_errs else {})}


def probe_costs(lines: list[dict], probes: list[dict]) -> tuple[list[float], list[tuple[int, float]], list[float],
                                                               list[float]]:
    """(entry samples, [(tokens of the step, delivery)], later-token delivery
    samples, last-token delivery samples) of the probes: each probe is a
    request sent alone (`start` and `first`, wall-clock), so the first
    iteration that took a request in at or after its send took it in, and
    the first step from there with a prefill of its prompt made its token. A
    probe that made more (its `itl`, one gap per token) made its next ones in
    the steps right after, each of one row; its third token (`LATER_TOKEN`:
    past the host's work on its first, and not its last) gives a later
    token's delivery, and its last (the `out` it asked for, each seen) the
    stream's end's."""
    entry, delivery, later, last = [], [], [], []
    adds = [(i, ln) for i, ln in enumerate(lines) if ln["adds"]]
    for p in probes:
        hit = next(((i, ln) for i, ln in adds if ln["t"] >= p["start"]), None)
        if hit is None:
            continue
        i, ln = hit
        idle = ln["wait"] > BUSY_S  # the engine was waiting for it
        if idle:
            entry.append(ln["t"] - p["start"])
        for j in range(i, len(lines)):
            step = lines[j]
            # (a hit probe's one token is a decode-shaped row: the first step after its pickup)
            if "rows" in step and (p.get("hit") or step["new"] - step["decode_rows"] >= p["prompt"]):
                end = step["t"] + iteration_time(step)
                if p["first"] >= end:
                    delivery.append((step["rows"], p["first"] - end))
                    n = len(p.get("itl") or []) + 1  # its tokens; the last (the stream's end) when all came
                    if n > LATER_TOKEN:
                        d = _token_delivery(lines, j, p, LATER_TOKEN)
                        if d is not None:
                            later.append(d)
                        if n == p.get("out"):  # (past its third: a second token waits on the first's host work)
                            d = _token_delivery(lines, j, p, n)
                            if d is not None:
                                last.append(d)
                break
    return entry, delivery, later, last


LATER_TOKEN = 3  # a probe's token whose delivery is a later token's (`probe_costs`)


def _token_delivery(lines: list[dict], i: int, p: dict, j: int) -> float | None:
    """The delivery of probe `p`'s j-th token (j >= 2), whose first token
    lines[i] made: the (j - 1)-th step after it made it, when the steps
    between ran its row alone, and the client saw each token as an event of
    its own (`itl`)."""
    itl = p.get("itl") or []
    if len(itl) < j - 1:
        return None
    steps = []
    for ln in lines[i + 1:]:
        if "rows" in ln:
            if ln["rows"] != 1 or ln["decode_rows"] != 1:
                return None
            steps.append(ln)
            if len(steps) == j - 1:
                break
    if len(steps) < j - 1:
        return None
    end = steps[-1]["t"] + iteration_time(steps[-1])
    t = p["first"] + sum(itl[: j - 1])
    return t - end if t >= end else None


LAG1_HALF_WINDOW = 50  # busy steps each side of the running median that noise_lag1 divides out


def within_ratios(ratios: np.ndarray, half_window: int = LAG1_HALF_WINDOW) -> np.ndarray:
    """Each ratio divided by the running median of the `half_window` ratios
    either side (0, or too few ratios: as they are): the step scatter with
    the slow swings of the machine's speed taken out."""
    r = np.maximum(np.asarray(ratios, dtype=np.float64), 1e-12)
    w = 2 * half_window + 1
    if half_window <= 0 or len(r) <= w:
        return r
    log = np.log(r)
    padded = np.pad(log, half_window, mode="edge")
    return np.exp(log - np.median(np.lib.stride_tricks.sliding_window_view(padded, w), axis=1))


def noise_lag1(ratio: list[tuple[bool, float]], half_window: int = LAG1_HALF_WINDOW) -> float:
    """Lag-1 autocorrelation of the step scatter: the correlation of the normal
    scores of measured/predicted between each busy step and the busy step
    right after it (pairs across an idle wait are left out). The simulator
    draws its scatter as a Gaussian AR(1) with it (`SimConfig.noise_lag1`);
    normal scores (ranks mapped through the inverse normal CDF) are what that
    copula correlates, and they are not thrown by the scatter's long tail.

    Each ratio is first divided by the running median of the `half_window`
    busy steps either side. What that takes out moves over hundreds of steps:
    the machine's own speed drifting through the sweep, and the model's misfit
    to one sweep point, whose steps run back to back. Left in, they read as
    step-to-step correlation: 0.81 on a 2-core sweep whose running-median
    residuals correlate at 0.52 (and a true AR(1) of 0.7 reads 0.67)."""
    from statistics import NormalDist

    busy = np.array([r for b, r in ratio if b], dtype=np.float64)
    if len(busy) < 10:
        return 0.0
    log = np.log(within_ratios(busy, half_window))
    order = np.argsort(np.argsort(log, kind="stable"), kind="stable")
    inv = NormalDist().inv_cdf
    score = iter([inv((k + 0.5) / len(busy)) for k in order])
    z = [next(score) if b else None for b, _ in ratio]
    pairs = np.array([(a, b) for a, b in zip(z, z[1:]) if a is not None and b is not None])
    if len(pairs) < 10:
        return 0.0
    rho = float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1])
    return float(np.clip(rho, 0.0, 0.99)) if np.isfinite(rho) else 0.0


# The step scatter's width depends on the step's size: on the 2-core Zen 3 EPYC the log-sd of measured over
# predicted was 0.29-0.31 for steps under 1.5 ms, 0.19 at 1.5-5 ms, 0.11-0.15 at 5-15 ms and 0.10-0.13 for
# prompt steps over 15 ms, where one set of quantiles had 0.18 for all. `noise_by_size` cuts the busy steps
# at these shares of their predicted time (the larger steps are the fewer) and keeps a bin only with at
# least NOISE_BIN_MIN steps (else it joins the bin below).
NOISE_SIZE_SHARES = (0.5, 0.8, 0.95)
NOISE_BIN_MIN = 200


def noise_by_size(predicted, ratios, within) -> list[dict]:
    """The step scatter per size of step: bins of the busy steps by their
    predicted time (`NOISE_SIZE_SHARES`, `NOISE_BIN_MIN`), each with its
    upper edge in seconds (None: the last, unbounded), its step count and
    the quantiles of its ratios (measured/predicted, and `within`: about
    the machine's speed of the moment), clipped as the overall ones are.
    Empty where fewer than two bins hold enough steps."""
    pred = np.asarray(predicted, dtype=np.float64)
    if len(pred) < 2 * NOISE_BIN_MIN:
        return []
    r, w = np.asarray(ratios, dtype=np.float64), np.asarray(within, dtype=np.float64)
    edges = sorted(set(float(e) for e in np.quantile(pred, NOISE_SIZE_SHARES)))
    bins = []  # (upper edge, mask)
    lo = -np.inf
    for hi in edges + [np.inf]:
        mask = (pred >= lo) & (pred < hi)
        lo = hi
        if bins and mask.sum() < NOISE_BIN_MIN:  # too few: joins the bin below
            bins[-1] = (hi, bins[-1][1] | mask)
        else:
            bins.append((hi, mask))
    if bins[0][1].sum() < NOISE_BIN_MIN and len(bins) > 1:
        bins[1] = (bins[1][0], bins[0][1] | bins[1][1])
        bins = bins[1:]
    if len(bins) < 2:
        return []
    return [{"upto_s": None if not np.isfinite(hi) else hi, "n": int(mask.sum()),
             "quantiles": clipped_quantiles(r[mask]), "quantiles_within": clipped_quantiles(w[mask])}
            for hi, mask in bins]


SCATTER_MIN = 50  # first-token deliveries below which `delivery_scatter` gives none


def delivery_scatter(delivery: list[tuple[int, float]], delivery_s: float, stream_s: float) -> tuple[float, ...]:
    """Quantiles p0, p5, ..., p100 (clipped to p1..p99) of each probe's
    first-token delivery (`probe_costs`: its step's tokens, the time) over
    the fitted delivery_s + stream_s * tokens: how a first token's way to
    its client scatters about the line (on the 2-core Zen 5 EPYC a replay's
    ran 1.2-1.4 ms p50 and 2.3-2.8 ms p90 at light load, where the line gives
    one time). Empty with fewer than SCATTER_MIN samples or no line."""
    if len(delivery) < SCATTER_MIN:
        return ()
    k = np.array([d[0] for d in delivery], dtype=np.float64)
    y = np.array([d[1] for d in delivery], dtype=np.float64)
    line = delivery_s + stream_s * k
    if not (line > 0).all():
        return ()
    r = y / line
    q = np.percentile(r, np.arange(0, 101, 5))
    return tuple(float(x) for x in np.clip(q, np.percentile(r, 1), np.percentile(r, 99)))


def clipped_quantiles(r) -> list[float]:
    """101 quantiles (p0..p100) of `r`, clipped to p1..p99: the extremes are
    artefacts (a late read, two events at once)."""
    q = np.percentile(np.asarray(r), np.arange(101))
    return [float(x) for x in np.clip(q, q[1], q[99])]


def wake_curve(samples: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """(median idle, median extra time) per `WAKE_BINS` range of idle time
    with at least `MIN_BIN` samples; extra times below 0 count as 0."""
    out = []
    for lo, hi in zip(WAKE_BINS, WAKE_BINS[1:]):
        got = [(idle, extra) for idle, extra in samples if lo <= idle < hi]
        if len(got) >= MIN_BIN:
            out.append((float(np.median([g[0] for g in got])), max(0.0, float(np.median([g[1] for g in got])))))
    return tuple(out)


def wake_steps(steps: list[tuple[float, dict]]) -> tuple[list[tuple[float, dict]], str]:
    """The steps a wake-up is read off, and which they are ("hits" or
    "prompts"): those that ran one decode-shaped row
    (a full prefix hit's first step: the profile's hit probes) where at least
    `MIN_BIN` of them followed an idle wait of `IDLE_S`, else those that took
    in at most one prompt. The busy steps price a decode-shaped step from
    thousands like it; a lone prompt's step they price only by extrapolation
    from chunks beside decode rows (measured on a 2-core server: lone prompts
    ran 0.6-1.3 ms under the model after idling, one-row hits 1 ms over it,
    the two together reading as no wake-up). Never a batch of prompts that
    arrived together after a short idle: a step the model may misprice, not a
    wake-up (58 steps of 8 prompts read as 6.6 ms of wake-up after 1 ms of
    idling, charged to every lone prompt after it)."""
    hits = [(idle, ln) for idle, ln in steps if ln["rows"] == 1 and ln["decode_rows"] == 1]
    if sum(idle >= IDLE_S for idle, _ in hits) >= MIN_BIN:
        return hits, "hits"
    return [(idle, ln) for idle, ln in steps if features(ln).chunk_rows <= 1], "prompts"


def calibrate(lines: list[dict], probes: list[dict], t_from: float, t_to: float, form: str = "auto") -> dict:
    """The step model and the serving costs from the step log's lines between
    t_from and t_to (wall clock) and the probes sent meanwhile."""
    window = [ln for ln in lines if t_from <= ln["t"] <= t_to]
    steps = step_lines(window)
    index = cold_index(steps)
    model, fit = fit_steps(steps, form, index)
    cold = fit_cold(steps, model, index)
    alone, wake_from = wake_steps(steps)
    woke = [iteration_time(ln) - model.predict_features(features(ln)) for idle, ln in alone if idle >= IDLE_S]
    curve = wake_curve([(idle, iteration_time(ln) - model.predict_features(features(ln)))
                        for idle, ln in alone if idle >= BUSY_S])
    priced = ServingCosts(cold=cold)

    def predicted(ln, jp):  # the model's time, and a cold step's extra as the simulator adds it
        t = model.predict_features(features(ln))
        return t + priced.cold_extra(jp[0], jp[1], t)

    pred = [predicted(ln, jp) for (_, ln), jp in zip(steps, index)]
    ratio = [(idle < BUSY_S, iteration_time(ln) / t) for (idle, ln), t in zip(steps, pred)]
    busy_ratio = [r for busy, r in ratio if busy]
    busy_pred = [t for (busy, _), t in zip(ratio, pred) if busy]
    entry, delivery, later, last = probe_costs(window, probes)
    gaps, gap_rows, gap_adds, _ = loop_gaps(window)
    loop_s, loop_row_s = fit_loop(gaps, gap_rows, gap_adds)
    delivery_s = stream_s = 0.0
    if delivery:
        k = np.array([d[0] for d in delivery], dtype=float)
        y = np.array([d[1] for d in delivery])
        if len(set(k.tolist())) > 1:
            # least absolute deviations would shrug off a late read; the median per
            # token count, then a line through those medians, does the same simply
            ks = sorted(set(k.tolist()))
            med = np.array([np.median(y[k == v]) for v in ks])
            stream_s, delivery_s = np.polyfit(np.array(ks), med, 1)
            if stream_s < 0:  # no growth measured: one delay for all
                stream_s, delivery_s = 0.0, float(np.median(y))
        else:
            delivery_s = float(np.median(y))
    scatter = delivery_scatter(delivery, max(0.0, float(delivery_s)), max(0.0, float(stream_s)))
    costs = ServingCosts(
        entry_s=float(np.median(entry)) if entry else 0.0,
        delivery_s=max(0.0, float(delivery_s)),
        token_delivery_s=float(np.median(later)) if later else 0.0,
        end_delivery_s=float(np.median(last)) if last and later else 0.0,
        stream_s=max(0.0, float(stream_s)),
        wake_s=max(0.0, float(np.median(woke))) if woke else 0.0,
        wake_curve=curve,
        loop_s=loop_s,
        loop_row_s=loop_row_s,
        intake_s=fit_intake(gaps, gap_rows, gap_adds, loop_s, loop_row_s),
        cold=cold,
        delivery_scatter=scatter,
    )
    within = within_ratios(np.asarray(busy_ratio))
    return {
        "model": model,
        "costs": costs,
        "fit": fit,
        "noise": {"kind": "measured/predicted iteration quantiles, busy steps of the step log, clipped to p1..p99",
                  "n": len(busy_ratio), "quantiles": clipped_quantiles(busy_ratio), "lag1": noise_lag1(ratio),
                  # the scatter about the machine's speed of the moment (`within_ratios`): for a simulation that
                  # is told that speed (`stepserve validate --speed-window`), which the raw quantiles hold too
                  "quantiles_within": clipped_quantiles(within),
                  # the same per size of step, which the simulator draws from where present
                  "by_size": noise_by_size(busy_pred, busy_ratio, within)},
        "samples": {"steps": len(steps), "after_idle": len(woke), "entry": len(entry), "delivery": len(delivery),
                    "token_delivery": len(later), "end_delivery": len(last),
                    "loop": int((gap_adds == 0).sum()), "intake": int((gap_adds > 0).sum()),
                    "cold": [len(cold_steps(steps, index, j)) for j in range(1, len(cold) + 1)],
                    "wake_from": wake_from},
    }
