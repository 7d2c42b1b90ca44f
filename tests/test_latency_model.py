"""Step-latency model: least-squares fits, the online refit, roofline profiles,
profile files, and the `stepserve profile` sweep on a small random checkpoint.
No timing thresholds: fits are checked on synthetic data with known answers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stepserve.scheduler.latency_model import (
    FORMS, LinearLatencyModel, OnlineLatencyModel, ServingCosts, StepFeatures, error_summary, load_profile, plan_features,
    shape_features,
)
from stepserve.scheduler.roofline import (
    DEVICES, MODELS, RooflineAssumptions, builtin_names, kv_slots, parse_name, roofline_profile,
)


def _feats(n=200, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows = int(rng.integers(1, 64))
        new = rows + int(rng.integers(0, 2)) * int(rng.integers(1, 512))
        ctx = rows * int(rng.integers(1, 2000)) + new
        pairs = float(rng.integers(0, 100_000)) if new > rows else 0.0
        # a step with chunks: some on the extend path, or all folded, in one call or layer by layer
        chunks = int(rng.integers(1, min(rows, 3) + 1)) if new > rows else 0
        ext = int(rng.integers(0, chunks + 1))
        out.append(StepFeatures(rows, ctx, new, pairs, ext, chunks, chunks > 0 and bool(rng.integers(0, 2))))
    return out


SEGMENTED_TRUTH = ([2e-3, 2.5e-3, 4e-4, 3e-4, 2e-4, 2e-4, 1e-4, 3e-7, 5e-6, 1e-9, 3e-3, 2e-3, 8e-4, 1e-3],
                   (1, 2, 4, 8, 16, 32))


@pytest.mark.parametrize("form", list(FORMS))
def test_fit_recovers_coefficients(form):
    true = {"taper": [2e-3, 1e-4, 3e-7], "linear": [2e-3, 1e-4, 3e-7, 5e-6],
            "linear+attn": [2e-3, 1e-4, 3e-7, 5e-6, 1e-9], "segmented": SEGMENTED_TRUTH[0]}[form]
    knots = SEGMENTED_TRUTH[1] if form == "segmented" else ()
    ref = LinearLatencyModel(form, true, knots=knots)
    feats = _feats()
    times = [ref.predict_features(f) for f in feats]
    fit = LinearLatencyModel.fit(feats, times, form)
    assert fit.knots == knots  # rows 1..63 seen: knots up to 32, the last segment open
    assert fit.coef == pytest.approx(true, rel=1e-6, abs=1e-12)
    assert error_summary(fit, feats, times)["median_ape"] < 1e-9


def test_fit_is_relative_least_squares():
    # one huge step and many small ones: relative weighting fits the small ones
    feats = [StepFeatures(1, 10 + i, 1) for i in range(50)] + [StepFeatures(1, 100_000, 2048)]
    times = [1e-3 + 1e-7 * f.context_tokens for f in feats[:-1]] + [10.0]
    fit = LinearLatencyModel.fit(feats, times, "linear")
    errs = [abs(fit.predict_features(f) - t) / t for f, t in zip(feats[:-1], times[:-1])]
    assert max(errs) < 0.05


def test_model_dict_roundtrip_and_floor():
    m = LinearLatencyModel("linear", [-1.0, 0.0, 0.0, 0.0])
    assert m.predict(1, 1, 1) == m.min_s  # a negative intercept never gives a negative time
    m = LinearLatencyModel("taper", [1e-3, 2e-4, 1e-7])
    back = LinearLatencyModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.coef == m.coef and back.predict(4, 100, 999) == pytest.approx(1e-3 + 8e-4 + 1e-5)
    with pytest.raises(ValueError):
        LinearLatencyModel("linear", [1.0, 2.0])


def test_plan_features():
    from stepserve.scheduler.plan import ScheduledRow, StepPlan
    from stepserve.scheduler.sequence import Seq

    seq = Seq(0, [1] * 10, 10, 5, 0.0)
    plan = StepPlan(rows=[ScheduledRow(seq, 9, 1, True), ScheduledRow(seq, 4, 6, True), ScheduledRow(seq, 0, 3, False)])
    f = plan_features(plan)
    # context 10 + 10 + 3; new 1 + 6 + 3; prefill pairs: 6*4 + 21, 3*0 + 6
    assert (f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs) == (3, 23, 10, 51.0)
    assert (f.extend_rows, f.chunk_rows, f.layered) == (2, 2, True)


def test_fold_rule_decides_which_chunks_pay_the_extend_path():
    """`FoldRule`: every chunk of a step of at most `tokens` tokens folds,
    else each chunk of at most `pairs` query-key pairs; never a chunk that
    scores its prompt, never in a step that samples nothing. The plan's
    features count only the chunks left to the extend path, and the
    decision is frozen when the scheduler commits the plan."""
    from stepserve.scheduler.kv_manager import KVManager
    from stepserve.scheduler.plan import FoldRule, ScheduledRow, StepPlan
    from stepserve.scheduler.scheduler import Scheduler, SchedulerConfig
    from stepserve.scheduler.sequence import Seq
    from stepserve.kvcache.allocator import SlotAllocator
    from stepserve.kvcache.pool import ReqToTokenPool

    seq = Seq(0, [1] * 100, 100, 5, 0.0)
    scoring = Seq(1, [1] * 100, 100, 5, 0.0)
    scoring.full_prefill = True

    def plan(rule, *rows):
        return StepPlan(rows=[ScheduledRow(s, start, n, sample) for s, start, n, sample in rows], fold=rule)

    dec, small, big = (seq, 90, 1, True), (seq, 0, 6, True), (seq, 40, 20, False)  # pairs: 21 and 1,010
    assert FoldRule().decide(plan(FoldRule(), dec, small).rows) is None
    # a step of 27 tokens within `tokens`: all fold; past it, by each chunk's pairs
    assert FoldRule(32, 0).decide(plan(None, dec, small, big).rows) == [True, True]
    assert FoldRule(16, 100).decide(plan(None, dec, small, big).rows) == [True, False]
    assert FoldRule(16, 2000).decide(plan(None, dec, small, big).rows) == [True, True]
    assert FoldRule(16, 10).decide(plan(None, dec, small, big).rows) is None
    # nothing sampled: no fold; a chunk scoring its prompt: never, and not the whole step either
    assert FoldRule(32, 2000).decide(plan(None, (seq, 0, 6, False), big).rows) is None
    assert FoldRule(32, 2000).decide(plan(None, dec, (scoring, 0, 6, True), small).rows) == [False, True]
    # every chunk is a chunk row; a step is layered unless it runs as one call (all its 27 tokens within
    # `tokens`, so every chunk folded)
    for rule, ext, layered in ((FoldRule(), 2, True), (FoldRule(16, 100), 1, True), (FoldRule(32, 0), 0, False),
                               (FoldRule(16, 2000), 0, True)):
        p = plan(rule, dec, small, big)
        f = plan_features(p)
        assert (f.extend_rows, f.prefill_step, f.new_tokens, f.prefill_pairs) == (ext, float(ext > 0), 27, 1031.0)
        assert (f.chunk_rows, f.chunk_step, f.layered, f.layered_step) == (2, 1.0, layered, float(layered))
        # the same shape without a plan, as a profile's client knows it
        assert shape_features(1, 91, [(0, 6), (40, 20)], rule) == f
    assert plan_features(plan(FoldRule(32, 0), dec)) == shape_features(1, 91, [], FoldRule(32, 0))
    assert not shape_features(1, 91, []).layered and shape_features(1, 91, []).chunk_step == 0.0
    # the scheduler's plans carry its rule and freeze the decision at commit
    kv = KVManager(SlotAllocator(1000), ReqToTokenPool(8, 256), True)
    sched = Scheduler(SchedulerConfig(max_batched_tokens=64), kv)
    sched.fold = FoldRule(0, 100)
    for i, n in enumerate((6, 20, 30)):  # 21, 210 and 465 pairs
        sched.add(Seq(i, list(range(1, n + 1)), n, 4, 0.0))
    p = sched.schedule()
    assert p.committed and p.fold is sched.fold and p.folded == [True, False, False]
    assert plan_features(p).extend_rows == 2
    sched.fold = FoldRule()  # (a committed plan keeps its decision)
    assert p.chunk_folds() == [True, False, False] and plan_features(p).extend_rows == 2


class FakeRecord:
    def __init__(self, f: StepFeatures, t: float):
        self.rows, self.context_tokens, self.new_tokens, self.wall_s = f.rows, f.context_tokens, f.new_tokens, t
        self.prefill_pairs, self.extend_rows = f.prefill_pairs, f.extend_rows
        self.chunk_rows, self.layered = f.chunk_rows, f.layered


def test_online_refit_window_and_period():
    now = [0.0]
    truth = LinearLatencyModel("linear", [1e-3, 2e-4, 1e-7, 3e-6])
    m = OnlineLatencyModel(window=50, min_samples=10, refit_period_s=100.0, clock=lambda: now[0])
    assert not m.calibrated
    with pytest.raises(RuntimeError, match="not calibrated"):
        m.predict(1, 1, 1)
    feats = _feats(300, seed=1)
    for f in feats[:9]:
        m.observe(None, FakeRecord(f, truth.predict_features(f)))
    assert not m.calibrated
    m.observe(None, FakeRecord(feats[9], truth.predict_features(feats[9])))
    assert m.calibrated and m.num_refits == 1
    assert m.model.coef == pytest.approx(truth.coef, rel=1e-3)
    # the machine gets 2x slower: no refit until the period has passed...
    slow = LinearLatencyModel("linear", [2 * c for c in truth.coef])
    for f in feats[10:70]:
        m.observe(None, FakeRecord(f, slow.predict_features(f)))
    assert m.num_refits == 1
    now[0] = 150.0
    m.observe(None, FakeRecord(feats[70], slow.predict_features(feats[70])))
    assert m.num_refits == 2
    assert len(m.window) == 50  # the window holds only slow steps now
    assert m.model.coef == pytest.approx(slow.coef, rel=1e-3)


def test_online_lazy_refits_when_read_on_the_window_then():
    """A lazy model fits nothing while nobody reads it; the first read fits
    the window as it is then, as an eager model fitting at that step would."""
    truth = LinearLatencyModel("linear", [1e-3, 2e-4, 1e-7, 3e-6])
    slow = LinearLatencyModel("linear", [2 * c for c in truth.coef])
    lazy = OnlineLatencyModel(window=40, min_samples=10, refit_every_steps=16, lazy=True)
    eager = OnlineLatencyModel(window=40, min_samples=10, refit_every_steps=1)
    feats = _feats(200, seed=3)
    for i, f in enumerate(feats[:10]):
        for m in (lazy, eager):
            m.observe(None, FakeRecord(f, truth.predict_features(f)))
    assert lazy.calibrated and lazy.num_refits == 0 and lazy.model is None  # due, not run
    assert lazy.predict(3, 300, 3) == pytest.approx(truth.predict(3, 300, 3), rel=1e-3)
    assert lazy.num_refits == 1
    for f in feats[10:90]:  # many refits fall due and none runs
        for m in (lazy, eager):
            m.observe(None, FakeRecord(f, slow.predict_features(f)))
    assert lazy.num_refits == 1
    assert lazy.current().coef == pytest.approx(eager.current().coef, rel=1e-9)
    assert lazy.current().coef == pytest.approx(slow.coef, rel=1e-3) and lazy.num_refits == 2
    lazy.predict(1, 100, 1)
    assert lazy.num_refits == 2  # nothing added since: nothing due


def test_online_ridge_keeps_prior_on_degenerate_window():
    prior = LinearLatencyModel("linear", [1e-3, 2e-4, 1e-7, 3e-6])
    m = OnlineLatencyModel(base=prior, min_samples=32, refit_every_steps=32)
    assert m.calibrated and m.predict(4, 400, 4) == prior.predict(4, 400, 4)
    # decode only: rows == new_tokens, so their split is not identifiable from the data
    for i in range(64):
        f = StepFeatures(8, 8 * (100 + i), 8)
        m.observe(None, FakeRecord(f, prior.predict_features(f)))
    assert m.num_refits == 2
    assert m.predict(8, 900, 8) == pytest.approx(prior.predict(8, 900, 8), rel=1e-3)
    assert all(np.isfinite(m.model.coef))


# -- roofline -------------------------------------------------------------------


def test_model_shapes_match_published_sizes():
    # parameter counts as published (billions)
    for key, billions in {"llama3-8b": 8.03, "llama3-70b": 70.55, "llama2-70b": 68.98, "qwen3-8b": 8.19,
                          "qwen3-32b": 32.76, "llama2-7b": 6.74}.items():
        assert MODELS[key].params / 1e9 == pytest.approx(billions, abs=0.02), key
    assert MODELS["llama3-8b"].kv_bytes_per_token() == 131072  # 32 layers x 8 heads x 128 x K,V x bf16


def test_roofline_decode_is_memory_bound_and_tp_helps():
    p = load_profile("h100:llama3-8b")
    assert p.source == "roofline" and p.data["source"] == "roofline"
    m = p.model
    a = RooflineAssumptions()
    weights = MODELS["llama3-8b"].params * 2
    one = m.predict(1, 1000, 1)
    assert one == pytest.approx(a.overhead_s + (weights + 131072 * 1001) / (3350e9 * a.mem_eff), rel=1e-9)
    # a big prefill is compute-bound: time grows ~linearly with tokens
    t4k, t8k = m.predict(1, 4096, 4096, 4096 * 4097 / 2), m.predict(1, 8192, 8192, 8192 * 8193 / 2)
    assert 1.8 < t8k / t4k < 2.3
    tp8 = load_profile("h100x8:llama3-8b").model
    assert tp8.predict(1, 1000, 1) < one
    assert tp8.allreduces_per_step == 64
    # more devices, more KV room
    assert load_profile("h100x8:qwen3-32b").engine["kv_slots"] > load_profile("h100x2:qwen3-32b").engine["kv_slots"]


def test_roofline_names_and_fit_checks():
    assert parse_name("a10x8:llama2-70b") == ("a10", 8, "llama2-70b")
    assert parse_name("H100:Llama3-8B") == ("h100", 1, "llama3-8b")
    for bad in ("h100", "tpu:llama3-8b", "h100:gpt5", "h100x:llama3-8b"):
        with pytest.raises(ValueError):
            parse_name(bad)
    with pytest.raises(ValueError, match="does not fit"):
        roofline_profile("l4:llama3-70b")
    prof = roofline_profile("a10x8:llama2-70b")
    assert prof["engine"]["kv_slots"] == kv_slots(DEVICES["a10"], 8, MODELS["llama2-70b"], RooflineAssumptions())
    assert prof["engine"]["max_context"] == 4096 and prof["source"] == "roofline"
    assert "h200x4:qwen3-8b" in builtin_names()
    # the list (`simulate --list-profiles`) names only profiles that fit: each builds
    assert "l4:llama3-70b" not in builtin_names() and "a10x8:llama2-70b" in builtin_names()
    for name in builtin_names():
        assert roofline_profile(name)["engine"]["kv_slots"] > 0


def test_load_profile_file_and_errors(tmp_path):
    prof = roofline_profile("h200:qwen3-8b")
    p = tmp_path / "p.json"
    p.write_text(json.dumps(prof))
    loaded = load_profile(str(p))
    assert loaded.model.predict(3, 300, 3) == load_profile("h200:qwen3-8b").model.predict(3, 300, 3)
    with pytest.raises(FileNotFoundError):
        load_profile(str(tmp_path / "missing.json"))
    p.write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(ValueError, match="not a stepserve latency profile"):
        load_profile(str(p))


# -- the profile sweep on the engine -----------------------------------------------


def test_profile_command_writes_a_fitted_profile(llama_ckpt, tmp_path, capsys):
    from stepserve.cli import main
    from stepserve.traces.profile import POINT_FORMS

    out = tmp_path / "prof.json"
    rc = main(["profile", "--model", llama_ckpt, "--batch-sizes", "1,4", "--context-lens", "16,48",
               "--chunk-sizes", "32", "--mixed-batch-sizes", "2", "--repeats", "3", "--warmup", "1",
               "--max-batched-tokens", "256", "--out", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["source"] == "measured" and prof["target"] == "wall_s"
    assert prof["latency"]["form"] in FORMS and len(prof["latency"]["coef"]) == len(FORMS[prof["latency"]["form"]])
    assert set(prof["forms"]) == set(POINT_FORMS)  # the segmented form is fitted from a server's step log only
    scenarios = {p["scenario"] for p in prof["points"]}
    assert scenarios == {"decode", "prefill", "mixed"}
    assert prof["heldout"]["num_test_points"] >= 1 and prof["heldout"]["points"]["median_ape"] is not None
    assert prof["engine"]["max_batched_tokens"] == 256 and prof["engine"]["kv_slots"] > 0
    # usable wherever a profile is
    p = load_profile(str(out))
    assert p.source == "measured" and p.model.predict(4, 100, 4) > 0
    assert math.isfinite(p.model.predict(1, 32, 32, 528.0))
    assert "held-out" in capsys.readouterr().out


def test_fit_with_terms_and_serving_costs():
    """TTFT points = overhead + per-stream cost x B + half a decode step + a
    mixed step (busy engine, B streams), or overhead + wake-up + a prefill step
    (idle engine): the joint fit recovers the step coefficients and each cost."""
    from stepserve.traces.profile import fit_and_evaluate, fit_points

    truth = LinearLatencyModel("linear", [3e-3, 2e-4, 1e-6, 5e-5])
    overhead, wake, per_stream = 7e-3, 2.5e-3, 2e-4
    points = []
    for b in (1, 2, 4, 8, 16, 32):
        for ctx in (16, 128, 400):
            f = StepFeatures(b, b * ctx, b)
            points.append({"features": f, "time": truth.predict_features(f), "raw": [(f, truth.predict_features(f))]})
    for p in (16, 64, 256):
        f = StepFeatures(1, p, p, p * (p + 1) / 2)
        t = overhead + wake + truth.predict_features(f)
        points.append({"features": f, "time": t, "raw": [(f, t)], "from_request": True, "from_idle": True})
        for b in (4, 16):
            d = StepFeatures(b, b * 100, b)
            m = StepFeatures(b + 1, b * 100 + p, b + p, p * (p + 1) / 2)
            t = overhead + per_stream * b + 0.5 * truth.predict_features(d) + truth.predict_features(m)
            points.append({"features": m, "time": t, "raw": [(m, t)], "from_request": True, "streams": b,
                           "terms": [(0.5, d), (1.0, m)]})
    fit = fit_points(points, "linear")
    assert fit.model.coef == pytest.approx(truth.coef, rel=1e-6)
    c = fit.costs
    assert c.entry_s == 0.0  # a client cannot tell entry from delivery
    assert (c.delivery_s, c.stream_s, c.wake_s) == pytest.approx((overhead, per_stream, wake), rel=1e-6)
    # TTFTs from an idle engine only: the wake-up cannot be told from the overhead, and is not guessed
    idle_only = [p for p in points if not p.get("terms")]
    lone = fit_points(idle_only, "linear").costs
    assert lone.wake_s == 0.0 and lone.stream_s == 0.0 and lone.delivery_s == pytest.approx(overhead + wake, rel=1e-6)
    res = fit_and_evaluate(points, 0.25, seed=0)
    assert res["form"] in ("linear", "linear+attn") and res["folds"] == 4
    assert res["heldout"]["points"]["median_ape"] < 1e-6


def test_serving_costs_from_a_profile_engine_section():
    assert ServingCosts.from_engine({}) == ServingCosts()
    assert ServingCosts.from_engine({"entry_s": 1e-3, "delivery_s": 2e-3, "stream_s": 1e-4, "wake_s": 3e-3}) == \
        ServingCosts(1e-3, 2e-3, 1e-4, 3e-3)
    assert ServingCosts(delivery_s=2e-3, stream_s=1e-4).delivery(10) == pytest.approx(3e-3)
    # profiles written before the split: their one overhead was fitted from TTFTs, and is delivery
    assert ServingCosts.from_engine({"request_overhead_s": 6e-3}) == ServingCosts(delivery_s=6e-3)
    assert ServingCosts.from_engine({"request_overhead_s": 6e-3, "delivery_s": 1e-3}).delivery_s == 1e-3


def test_wake_curve_reads_piecewise_linearly_from_zero():
    c = ServingCosts(wake_s=9.0, wake_curve=((0.01, 0.002), (0.1, 0.005)))
    assert c.wake(0.0) == 0.0 and c.wake(0.005) == pytest.approx(0.001)
    assert c.wake(0.055) == pytest.approx(0.0035) and c.wake(10.0) == 0.005 and c.wake(float("inf")) == 0.005
    assert ServingCosts(wake_s=0.003).wake(0.5) == 0.003 and ServingCosts(wake_s=0.003).wake(0.0) == 0.0
    assert ServingCosts.from_engine(c.to_dict()) == c
    with pytest.raises(ValueError, match="increasing"):
        ServingCosts(wake_curve=((0.1, 0.0), (0.01, 0.0)))


def test_online_refit_with_a_base_rescales_it():
    """A window from one narrow operating point of a machine 1.5x slower than
    the sweep: the refit scales the offline fit and so predicts wide steps it
    never saw at 1.5x too, where a free fit of every coefficient on such a
    window cannot be trusted away from it."""
    base = LinearLatencyModel("linear", [1e-3, 2e-4, 1e-7, 3e-6])
    slow = base.rescaled(1.5)
    m = OnlineLatencyModel(base=base, min_samples=32, refit_every_steps=32)
    rng = np.random.default_rng(0)
    for i in range(64):
        f = StepFeatures(6, int(6 * rng.integers(900, 1100)), 6)
        m.observe(None, FakeRecord(f, slow.predict_features(f)))
    assert m.num_refits == 2
    wide = StepFeatures(256, 256 * 4000, 256)
    assert m.current().predict_features(wide) == pytest.approx(slow.predict_features(wide), rel=1e-6)
    free = LinearLatencyModel.fit([f for f, _ in m.window], [t for _, t in m.window], "linear")
    assert free.predict_features(wide) != pytest.approx(slow.predict_features(wide), rel=0.05)


def test_online_rescale_adds_up_to_the_measured_time_under_scatter():
    """Steps 1.3x the base with a log-normal scatter (sigma 0.3, about this
    machine's): the rescaled model's predictions over the window add up to
    the measured time. The least-relative-error scale, which the offline fit
    uses across shapes, comes out well below it for one scale."""
    base = LinearLatencyModel("linear", [1e-3, 2e-4, 1e-7, 3e-6])
    m = OnlineLatencyModel(base=base, window=200, min_samples=200, refit_every_steps=200)
    rng = np.random.default_rng(3)
    feats, times = [], []
    for _ in range(200):
        b = int(rng.integers(1, 64))
        f = StepFeatures(b, b * int(rng.integers(100, 900)), b)
        t = 1.3 * base.predict_features(f) * float(np.exp(rng.normal(0.0, 0.3)))
        feats.append(f)
        times.append(t)
        m.observe(None, FakeRecord(f, t))
    assert m.num_refits >= 1
    predicted = sum(m.current().predict_features(f) for f in feats)
    assert predicted == pytest.approx(sum(times), rel=1e-9)
    r = np.array([base.predict_features(f) for f in feats]) / np.array(times)
    least_relative = r.sum() / (r * r).sum()
    assert least_relative * sum(base.predict_features(f) for f in feats) < 0.9 * sum(times)


def test_online_model_leaves_cold_steps_out():
    """A step that ran a new shape (`StepRecord.cold`: kernels built for it)
    is no steady-state price: a first refit over a server's first steps,
    several of them cold and 20x their time, would price every step far
    too high until the next refit."""
    base = LinearLatencyModel("linear", [1e-3, 2e-4, 1e-7, 3e-6])
    m = OnlineLatencyModel(base=base, min_samples=32)
    rng = np.random.default_rng(4)
    for i in range(40):
        b = int(rng.integers(1, 16))
        f = StepFeatures(b, b * 200, b)
        rec = FakeRecord(f, base.predict_features(f) * (20.0 if i % 4 == 0 else 1.0))
        rec.cold = i % 4 == 0
        m.observe(None, rec)
    assert len(m.window) == 30 and m.num_refits == 0  # the cold ones never entered the window
    for _ in range(2):
        f = StepFeatures(4, 800, 4)
        m.observe(None, FakeRecord(f, base.predict_features(f)))
    assert m.num_refits == 1
    assert m.current().coef == pytest.approx(base.coef, rel=1e-9)


def test_nnls_is_exact_and_nonnegative():
    """`nnls` against the constrained optimum found by a fine grid, and the
    unconstrained solution where that is already non-negative."""
    import itertools

    import numpy as np

    from stepserve.scheduler.latency_model import nnls

    rng = np.random.default_rng(0)
    A = rng.normal(size=(40, 2))
    b = A @ np.array([1.5, -0.7]) + 0.01 * rng.normal(size=40)
    x = nnls(A, b)
    assert (x >= 0).all()
    grid = np.linspace(0, 3, 301)
    best = min(itertools.product(grid, grid), key=lambda c: float(np.sum((A @ np.array(c) - b) ** 2)))
    assert np.allclose(x, best, atol=0.011)
    pos = A @ np.array([0.4, 2.0])
    assert np.allclose(nnls(A, pos), [0.4, 2.0], atol=1e-9)


def test_online_fit_never_extrapolates_a_negative_cost():
    """Steps seen only at batch 4 to 8, with noise that makes the
    unconstrained fit's rows slope negative: the online model's coefficients
    stay non-negative, so a bigger batch never predicts a cheaper step."""
    import numpy as np

    from stepserve.scheduler.latency_model import LinearLatencyModel, OnlineLatencyModel, StepFeatures

    rng = np.random.default_rng(1)
    feats, times = [], []
    for _ in range(64):
        b = int(rng.integers(4, 9))
        ctx = int(rng.integers(100, 4000))
        feats.append(StepFeatures(b, ctx, b, 0.0))
        times.append(0.010 + 2e-6 * ctx - 2e-4 * b + 1e-4 * rng.normal())  # a falling cost in rows
    free = LinearLatencyModel.fit(feats, times, "linear")
    assert min(free.coef) < 0  # the premise: least squares alone goes negative here
    online = OnlineLatencyModel(min_samples=8)
    for f, t in zip(feats, times):
        online.add(f, t)
    m = online.current()
    assert min(m.coef) >= 0
    assert m.predict(256, 4000, 256) >= m.predict(8, 4000, 8)


def test_nnls_matches_the_best_nonnegative_subset_fit():
    """Lawson-Hanson `nnls` against an independent reference: the least-squares
    fit on every subset of columns (the rest at 0), best non-negative one. On
    problems whose columns differ in scale by 10^6, as a latency model's do."""
    import itertools

    from stepserve.scheduler.latency_model import nnls

    rng = np.random.default_rng(5)
    for trial in range(60):
        n = int(rng.integers(1, 8))
        A = rng.normal(size=(30, n)) * (10.0 ** rng.integers(-3, 4, size=n))
        b = A @ rng.normal(size=n) + 0.1 * rng.normal(size=30)
        best, best_r = np.zeros(n), float(b @ b)
        for k in range(1, n + 1):
            for cols in itertools.combinations(range(n), k):
                x, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
                r = A[:, cols] @ x - b
                if (x >= 0).all() and float(r @ r) < best_r:
                    best_r, best = float(r @ r), np.zeros(n)
                    best[list(cols)] = x
        x = nnls(A, b)
        r = A @ x - b
        assert (x >= 0).all()
        assert float(r @ r) == pytest.approx(best_r, rel=1e-9, abs=1e-12), trial
    assert (nnls(np.zeros((5, 3)), np.ones(5)) == 0).all()  # all-zero columns get 0


def test_segmented_rows_term_is_piecewise_linear():
    """The segmented form's rows term: one slope per segment between knots,
    the last open-ended; a dict round trip keeps the knots; bad knots and
    knots on another form are refused."""
    a, slopes = 1e-3, [3e-3, 5e-4, 4e-4, 3e-4]
    m = LinearLatencyModel("segmented", [a, *slopes, 0.0, 0.0, 0.0, 1e-3, 2e-3, 0.0, 0.0], knots=(1, 2, 4, 8))
    assert m.predict(1, 0, 0) == pytest.approx(a)
    assert m.predict(2, 0, 0) == pytest.approx(a + 3e-3)
    assert m.predict(3, 0, 0) == pytest.approx(a + 3e-3 + 5e-4)
    assert m.predict(100, 0, 0) == pytest.approx(a + 3e-3 + 2 * 5e-4 + 4 * 4e-4 + 92 * 3e-4)
    assert m.predict(3, 0, 0, 0.0, 1) == pytest.approx(a + 3e-3 + 5e-4 + 1e-3 + 2e-3)  # a prefill chunk
    assert m.predict(3, 0, 0, 0.0, 2) == pytest.approx(a + 3e-3 + 5e-4 + 1e-3 + 4e-3)  # two: the step's price once
    ts = [m.predict(r, 0, 0) for r in range(1, 300)]
    assert all(b > a for a, b in zip(ts, ts[1:]))
    d = json.loads(json.dumps(m.to_dict()))
    assert d["terms"][1:5] == ["rows[1,2)", "rows[2,4)", "rows[4,8)", "rows[8,)"]
    back = LinearLatencyModel.from_dict(d)
    assert back.knots == (1, 2, 4, 8) and back.predict(77, 5, 3, 1.0, 1) == m.predict(77, 5, 3, 1.0, 1)
    assert back.rescaled(2.0).predict(77, 0, 0) == pytest.approx(2 * m.predict(77, 0, 0))
    with pytest.raises(ValueError):
        LinearLatencyModel("segmented", [a, *slopes, 0, 0, 0, 0, 0, 0, 0], knots=(2, 4, 8, 16))  # must start at 1
    with pytest.raises(ValueError):
        LinearLatencyModel("segmented", [a, *slopes, 0, 0, 0, 0, 0, 0], knots=(1, 2, 4, 8))  # a coefficient short
    with pytest.raises(ValueError):
        LinearLatencyModel("linear", [a, 1e-4, 0, 0], knots=(1, 2))


def test_a_segmented_profile_without_the_step_price_loads_as_written():
    """A profile written before the segmented form priced a step's chunks
    once per step (one price per chunk, no `prefill_step` term) loads with
    that price at 0: every prediction is the one it was fitted to make."""
    terms = ["const", "rows[1,2)", "rows[2,4)", "context_tokens", "new_tokens", "prefill_pairs", "extend_rows"]
    coef = [1e-3, 2e-3, 3e-4, 1e-7, 2e-4, 1e-9, 3e-3]
    m = LinearLatencyModel.from_dict({"form": "segmented", "terms": terms, "coef": coef, "knots": [1, 2]})
    assert m.to_dict()["terms"][-4:] == ["prefill_step", "extend_rows", "chunk_step", "layered_step"]
    assert m.coef[-4:] == [0.0, 3e-3, 0.0, 0.0]
    for rows, ctx, new, pairs, ext in [(1, 30, 1, 0.0, 0), (5, 900, 300, 4e4, 1), (9, 2000, 1500, 3e5, 4)]:
        old = 1e-3 + 2e-3 * min(rows - 1, 1) + 3e-4 * max(rows - 2, 0) + 1e-7 * ctx + 2e-4 * new + 1e-9 * pairs + 3e-3 * ext
        assert m.predict(rows, ctx, new, pairs, ext) == pytest.approx(old, rel=1e-12)
    # one written before the prices of prompt work that folding does not save: both 0, as fitted
    terms = ["const", "rows[1,2)", "context_tokens", "new_tokens", "prefill_pairs", "prefill_step", "extend_rows"]
    m = LinearLatencyModel.from_dict({"form": "segmented", "terms": terms, "coef": [1e-3, 2e-3, 1e-7, 2e-4, 1e-9,
                                                                                     4e-3, 3e-3], "knots": [1]})
    assert m.coef[-2:] == [0.0, 0.0]
    assert m.predict(2, 900, 300, 4e4, 0, 1, True) == pytest.approx(1e-3 + 2e-3 + 9e-5 + 6e-2 + 4e-5, rel=1e-12)


def test_segmented_fit_follows_a_concave_batch_curve_where_linear_cannot():
    """Decode steps whose cost jumps from 1 row to 2 and then grows slowly (a
    2-core CPU server's shape): the segmented fit predicts every batch size
    within the noise; the linear one misses the small batches, where light
    load lives, and its slope is the average, not the local one."""
    truth = LinearLatencyModel("segmented", [5e-3, 2.5e-3, 4e-4, 4e-4, 3e-4, 3e-4, 4e-4, 1e-7, 0, 0, 0, 2e-3, 0, 0],
                               knots=(1, 2, 4, 8, 16, 32))
    rng = np.random.default_rng(2)
    feats, times = [], []
    for _ in range(2000):
        b = int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]))
        ctx = b * int(rng.integers(16, 500))
        ext = int(rng.random() < 0.2)
        f = StepFeatures(b + ext, ctx + 100 * ext, b + 100 * ext, 0.0, ext)
        feats.append(f)
        times.append(truth.predict_features(f) * rng.uniform(0.95, 1.05))
    seg = LinearLatencyModel.fit(feats, times, "segmented")
    lin = LinearLatencyModel.fit(feats, times, "linear")
    for b in (1, 2, 4, 16, 64):
        f = StepFeatures(b, b * 200, b)
        assert seg.predict_features(f) == pytest.approx(truth.predict_features(f), rel=0.03)
    assert max(abs(lin.predict_features(StepFeatures(b, b * 200, b)) / truth.predict_features(StepFeatures(b, b * 200, b))
                   - 1) for b in (1, 2)) > 0.1
    f = StepFeatures(2, 400, 2)
    assert seg.predict(3, 600, 3) - seg.predict_features(f) == pytest.approx(4e-4 + 200e-7, rel=0.1)


def test_profile_refuses_the_segmented_form_without_a_step_log(tmp_path):
    """The segmented form is fitted from a server's step log; a sweep's few
    dozen points cannot identify a slope per batch range."""
    from stepserve.cli import main

    with pytest.raises(SystemExit, match="step log"):
        main(["profile", "--form", "segmented", "--out", str(tmp_path / "p.json")])
    with pytest.raises(SystemExit, match="step-log"):
        main(["profile", "--form", "segmented", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "p.json")])


@pytest.mark.parametrize("form,coef,knots", [
    ("linear", [1e-3, 2e-4, 1e-7, 3e-6], ()),
    ("segmented", [3e-3, 9e-4, 4e-4, 6e-5, 1e-7, 9e-5, 1e-9, 2e-3, 5e-4, 7e-4, 1e-3], (1, 2, 4)),
])
def test_rescaled_in_two_parts(form, coef, knots):
    """rescaled(a, b): the per-token terms (new tokens, prefill pairs) and the
    prompt chunks' own (prefill step, extend rows, chunk step, layered step)
    times b, everything else
    (the constant, every rows segment, context) times a."""
    m = LinearLatencyModel(form, coef, knots=knots)
    r = m.rescaled(1.5, 1.1)
    for f in (StepFeatures(1, 100, 1), StepFeatures(7, 900, 7), StepFeatures(3, 700, 600, 2.5e5, 1)):
        tok = m.token_part(f)
        assert 0 < tok < m.predict_features(f)
        assert r.predict_features(f) == pytest.approx(1.5 * (m.predict_features(f) - tok) + 1.1 * tok, rel=1e-12)
    assert m.rescaled(2.0, 2.0).coef == pytest.approx(m.rescaled(2.0).coef)
    if form == "segmented":  # by hand: const + R(3) + context, then tokens, pairs, the step's chunk price, one chunk
        rest = 3e-3 + (9e-4 + 4e-4) + 700 * 1e-7
        # (a chunk on the extend path: a chunk step, layered)
        prompt = 600 * 9e-5 + 2.5e5 * 1e-9 + 2e-3 + 5e-4 + 7e-4 + 1e-3
        assert m.token_part(StepFeatures(3, 700, 600, 2.5e5, 1)) == pytest.approx(prompt, rel=1e-12)
        assert r.predict_features(StepFeatures(3, 700, 600, 2.5e5, 1)) == pytest.approx(1.5 * rest + 1.1 * prompt)
        assert r.predict_features(StepFeatures(3, 700, 3)) == pytest.approx(1.5 * rest + 1.1 * 3 * 9e-5)
        # one folded chunk, the step as one call: only the chunk step's price
        folded = StepFeatures(3, 700, 30, 435.0, 0, 1, False)
        assert m.token_part(folded) == pytest.approx(30 * 9e-5 + 435 * 1e-9 + 7e-4, rel=1e-12)


def test_online_rescale_counts_the_cold_steps_extra_in():
    """Steps of a machine at 1.3x the profile's speed factor, a third of them
    the first or second decode step after a prompt chunk, which take the
    profile's cold extra on top: a predictor given the costs rescales to
    exactly 1.3 and prices the next cold step as it runs; one without them
    takes the extra for speed and prices every steady step high."""
    base = LinearLatencyModel("linear", [1e-3, 2e-4, 1e-7, 3e-6])
    costs = ServingCosts(cold=((2e-5, 0.02), (5e-6, 0.01)))
    alpha = 1.3
    rng = np.random.default_rng(7)
    with_costs = OnlineLatencyModel(base=base, min_samples=60, costs=costs)
    without = OnlineLatencyModel(base=base, min_samples=60)
    for i in range(60):
        b = int(rng.integers(1, 16))
        f = StepFeatures(b, b * 200, b)
        after = (i % 3, 144)  # j = 0 (a step with 144 prompt tokens), 1 or 2
        t = alpha * base.predict_features(f)
        t += costs.cold_extra(*after, t)
        with_costs.add(f, t, after)
        without.add(f, t, after)
    f = StepFeatures(8, 1600, 8)
    steady = alpha * base.predict_features(f)
    assert with_costs.predict(8, 1600, 8) == pytest.approx(steady, rel=1e-9)
    a, b = with_costs.cold_terms((1, 144))
    assert (a, b) == pytest.approx((12 * 2e-5, 12 * 0.02))
    assert a + (1 + b) * with_costs.predict(8, 1600, 8) == pytest.approx(steady + costs.cold_extra(1, 144, steady))
    assert without.predict(8, 1600, 8) > 1.05 * steady and without.cold_terms((1, 144)) == (0.0, 0.0)
    # a profile without cold steps priced leaves the predictor as it was
    assert OnlineLatencyModel(base=base, costs=ServingCosts()).costs is None


def test_since_prompt_counts_decode_steps_after_a_prompt_chunk():
    from stepserve.scheduler.latency_model import SincePrompt

    s = SincePrompt()
    assert s.next(0) == (1, 0) and s.next(5) == (0, 5)
    assert [s.advance(p) for p in (0, 40, 0, 0, 9, 0, 0, 0)] == [
        (1, 0), (0, 40), (1, 40), (2, 40), (0, 9), (1, 9), (2, 9), (3, 9)]
    assert ServingCosts(cold=((1e-5, 0.01),)).cold_extra(*s.next(0), 1e-3) == 0.0  # j = 4: past the priced ones
