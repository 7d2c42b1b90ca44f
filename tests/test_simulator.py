"""The simulator: the real scheduler on a virtual clock. Determinism with a
fixed seed, exact virtual timings under a constant latency model, retraction
and prefix hits through the real KV manager, policies observing every step,
and the CLI end to end (report, plot, compare)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stepserve.scheduler.latency_model import LinearLatencyModel, load_profile
from stepserve.traces.metrics import SLO
from stepserve.traces.report import build_report
from stepserve.traces.request_spec import RequestSpec, Segment
from stepserve.traces.simulator import SimConfig, Simulator
from stepserve.traces.synthetic import SyntheticConfig, generate

CONST_1MS = LinearLatencyModel("linear", [1e-3, 0.0, 0.0, 0.0])


def _spec(i, t, plen, olen, n=1, key=None):
    return RequestSpec(f"r{i}", t, olen, (Segment(key or f"own{i}", plen),), n=n)


def test_virtual_clock_timings_are_exact():
    sim = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100))
    res = sim.run([_spec(0, 0.0, 10, 5), _spec(1, 0.0105, 10, 1)])
    a, b = res.records
    # prefill step ends at 1 ms with the first token; 4 decode steps of 1 ms each
    assert a.first_token_s == pytest.approx(1e-3) and a.end_s == pytest.approx(5e-3)
    assert a.ttft == pytest.approx(1e-3) and a.tpot == pytest.approx(1e-3) and a.output_tokens == 5
    # b arrives while the engine is idle: the clock jumps to its arrival
    assert b.start_s == 0.0105 and b.ttft == pytest.approx(1e-3) and b.tpot is None
    assert res.duration_s == pytest.approx(0.0115)
    assert list(res.itl_s) == pytest.approx([1e-3] * 4)
    assert res.stats["steps"] == 6


def test_entry_cost_delays_scheduling_not_the_clock_origin():
    sim = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100, entry_s=0.004))
    (a,) = sim.run([_spec(0, 0.5, 10, 3)]).records
    assert a.start_s == 0.5 and a.ttft == pytest.approx(0.005) and a.e2e == pytest.approx(0.007)


def test_delivery_shifts_what_the_client_sees_not_the_engine():
    """Delivery delays every token alike: TTFT and E2E grow by it, the gaps
    between tokens and the engine's timeline (the second request's steps) do not."""
    specs = [_spec(0, 0.0, 10, 4), _spec(1, 0.0015, 10, 2)]
    plain = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100)).run(specs)
    late = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100, delivery_s=0.01)).run(specs)
    for p, q in zip(plain.records, late.records):
        assert q.ttft == pytest.approx(p.ttft + 0.01) and q.e2e == pytest.approx(p.e2e + 0.01)
        assert q.tpot == pytest.approx(p.tpot) if p.tpot is not None else q.tpot is None
    assert list(late.itl_s) == pytest.approx(list(plain.itl_s))
    assert late.stats["steps"] == plain.stats["steps"] and late.stats["virtual_busy_s"] == plain.stats["virtual_busy_s"]


def test_first_token_delivery_scatters_as_the_profile_measured():
    """With `delivery_scatter` each stream's first token reaches its client
    after a seeded draw from the quantiles times its delivery: TTFTs spread
    over the quantiles' range about the plain ones, seeded by the noise seed,
    and the engine's timeline does not move."""
    from stepserve.scheduler.latency_model import ServingCosts

    specs = [_spec(i, 0.05 * i, 10, 3) for i in range(400)]  # one at a time: each TTFT is 1 step + delivery
    base = dict(kv_slots=1000, max_context=256, vocab_size=100, delivery_s=0.01)
    plain = Simulator(CONST_1MS, SimConfig(**base)).run(specs)
    q = list(np.linspace(0.5, 2.5, 21))
    runs = [Simulator(CONST_1MS, SimConfig(**base, delivery_scatter=q, noise_seed=s)).run(specs) for s in (1, 1, 2)]
    extra = np.array([b.ttft - a.ttft for a, b in zip(plain.records, runs[0].records)])
    assert extra.min() >= -0.005 - 1e-9 and extra.max() <= 0.015 + 1e-9  # (q - 1) * 10 ms
    assert extra.mean() == pytest.approx(0.005, abs=0.001) and np.median(extra) == pytest.approx(0.005, abs=0.0015)
    assert np.percentile(extra, 90) == pytest.approx(0.013, abs=0.0015)
    assert [r.ttft for r in runs[0].records] == [r.ttft for r in runs[1].records]
    assert [r.ttft for r in runs[0].records] != [r.ttft for r in runs[2].records]
    assert runs[0].stats["steps"] == plain.stats["steps"]
    assert runs[0].stats["virtual_busy_s"] == plain.stats["virtual_busy_s"]
    # the profile's quantiles reach the simulator, and bad ones are refused
    cfg = SimConfig.from_profile({"kv_slots": 100, "delivery_s": 0.002, "delivery_scatter": q})
    assert cfg.delivery_scatter == q and cfg.serving().delivery_scatter == tuple(q)
    assert ServingCosts.from_engine(ServingCosts(delivery_scatter=tuple(q)).to_dict()).delivery_scatter == tuple(q)
    with pytest.raises(ValueError, match="delivery_scatter"):
        ServingCosts(delivery_scatter=(1.2, 1.0))


def test_calibration_measures_the_first_token_delivery_scatter():
    """`delivery_scatter`: quantiles of each probe's delivery over the fitted
    line, which recover a lognormal scatter about it; too few probes, none."""
    from stepserve.traces.calibrate import SCATTER_MIN, delivery_scatter

    rng = np.random.default_rng(4)
    k = rng.integers(1, 40, 2000)
    y = (1e-3 + 5e-5 * k) * np.exp(rng.normal(0.0, 0.4, 2000))
    q = delivery_scatter(list(zip(k.tolist(), y.tolist())), 1e-3, 5e-5)
    assert len(q) == 21 and all(b >= a for a, b in zip(q, q[1:]))
    assert q[10] == pytest.approx(1.0, abs=0.05)  # the median on the line
    assert q[18] == pytest.approx(math.exp(0.4 * 1.2816), rel=0.08)  # p90
    assert delivery_scatter(list(zip(k.tolist(), y.tolist()))[:SCATTER_MIN - 1], 1e-3, 5e-5) == ()
    assert delivery_scatter(list(zip(k.tolist(), y.tolist())), 0.0, 0.0) == ()


def test_per_stream_delivery_follows_the_step_size():
    """A step's tokens reach their clients delivery_s + stream_s per token of
    that step after it ends: alone, tokens wait 1 + 0.5 ms; two in a step, 1 + 1 ms.
    Steps end at 1, 2, 3, 4 ms: a alone, a alone, a and b, b alone."""
    cfg = SimConfig(kv_slots=1000, max_context=256, vocab_size=100, delivery_s=1e-3, stream_s=5e-4)
    res = Simulator(CONST_1MS, cfg).run([_spec(0, 0.0, 10, 3), _spec(1, 0.0015, 10, 2)])
    a, b = res.records
    assert a.ttft == pytest.approx(2.5e-3)
    assert a.e2e == pytest.approx(5e-3)  # its last token shares the step with b's first
    assert b.ttft == pytest.approx(5e-3 - 1.5e-3)
    # a: 2.5 -> 3.5 -> 5 ms; b: 5 -> 5.5 ms (the client sees the gaps the delays make)
    assert sorted(res.itl_s) == pytest.approx([0.5e-3, 1e-3, 1.5e-3])


def test_tokens_wait_for_the_hosts_queued_work_past_what_it_keeps_up_with():
    """The host's work outside the engine queues: each step's tokens add
    host_token_s apiece and each stream it starts (a request's first token)
    host_request_s, and a step's tokens reach their clients after the work
    queued before the step ended, its i-th new stream after the i - 1 new
    ones before it too. One request of 5 tokens, a 1 ms step each: at
    0.5 ms of host work per token the host keeps up and nothing moves; at
    2 ms per token it falls 1 ms behind each step, so the j-th token comes
    (j - 1) ms late. Two requests whose prompts share a step, at 3 ms per
    stream: the second's first token comes 3 ms after the first's, and the
    tokens of the two steps after wait until the host has done both
    streams' work, 7 ms in (the last ended at 3 ms: both finish 4 ms late)."""
    def run(spec, **host):
        return Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100, **host)).run(spec)

    one = [_spec(0, 0.0, 10, 5)]
    plain = run(one)
    (p,) = plain.records
    (q,) = run(one, host_token_s=0.5e-3).records
    assert (q.ttft, q.e2e) == pytest.approx((p.ttft, p.e2e))
    slow = run(one, host_token_s=2e-3)
    (q,) = slow.records
    assert q.ttft == pytest.approx(p.ttft) and q.e2e == pytest.approx(p.e2e + 4e-3)
    assert list(slow.itl_s) == pytest.approx([2e-3] * 4)  # the client sees the host's pace
    assert slow.stats["virtual_busy_s"] == plain.stats["virtual_busy_s"]  # the engine's timeline is its own
    two = [_spec(0, 0.0, 10, 3), _spec(1, 0.0, 10, 3)]
    a0, b0 = run(two).records
    a, b = run(two, host_request_s=3e-3).records
    assert a.ttft == pytest.approx(a0.ttft) and b.ttft == pytest.approx(b0.ttft + 3e-3)
    assert sorted([a.e2e, b.e2e]) == pytest.approx([a0.e2e + 4e-3, b0.e2e + 4e-3])


def test_the_hosts_queue_charges_each_output_batch_and_each_prompt_token():
    """Each step that makes tokens adds host_batch_s to the host's queue (the
    front end reads its outputs as one message), and each request as it
    arrives host_prompt_token_s per prompt token (the front end takes its
    prompt in before the engine sees it). One request of 10 prompt tokens
    and 5 output tokens, 1 ms steps: at 1.5 ms a batch the host falls 0.5
    ms behind each step, so the j-th token comes (j - 1) * 0.5 ms late, as
    with 1.5 ms per token. At 0.2 ms per prompt token the host is busy with
    the prompt until 2 ms: with no entry cost its first token, made at 1
    ms, waits for it; with 3 ms of entry (the idle way in, of which that
    work is part) nothing waits."""
    def run(spec, **host):
        return Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100, **host)).run(spec)

    one = [_spec(0, 0.0, 10, 5)]
    (p,) = run(one).records
    per_batch, per_token = run(one, host_batch_s=1.5e-3), run(one, host_token_s=1.5e-3)
    (q,) = per_batch.records
    assert q.ttft == pytest.approx(p.ttft) and q.e2e == pytest.approx(p.e2e + 2e-3)
    assert list(per_batch.itl_s) == pytest.approx([1.5e-3] * 4) and list(per_token.itl_s) == pytest.approx([1.5e-3] * 4)
    prompt = run(one, host_prompt_token_s=0.2e-3)
    (q,) = prompt.records
    assert q.ttft == pytest.approx(2e-3) and q.e2e == pytest.approx(p.e2e)  # the host caught up by the third
    assert list(prompt.itl_s) == pytest.approx([0.0, 1e-3, 1e-3, 1e-3])
    (q,) = run(one, host_prompt_token_s=0.2e-3, entry_s=3e-3).records
    (e,) = run(one, entry_s=3e-3).records
    assert (q.ttft, q.e2e) == pytest.approx((e.ttft, e.e2e))
    assert (e.ttft, e.e2e) == pytest.approx((p.ttft + 3e-3, p.e2e + 3e-3))


def test_a_request_reaches_the_engine_after_the_hosts_queued_work():
    """The front end takes a new request in after the work queued ahead of
    it: a request that arrives while the host is behind on streaming
    tokens reaches the engine that much later. A streams 20 tokens from 1
    ms steps at 2 ms of host work each, so the host, 2e + 1 ms into its
    work after the step ending at e, falls behind; B arrives at 2.5 ms,
    when the work of the steps ended by then runs to 5 ms: it enters at 5,
    its prompt runs in the step from 5 to 6, and its first token reaches
    its client after the host's queue of that step's end (11 ms): TTFT 8.5
    ms, not the 1.5 of a host that keeps up."""
    def run(**host):
        sim = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100, **host))
        return sim.run([_spec(0, 0.0, 10, 20), _spec(1, 0.0025, 10, 2)]).records

    a, b = run()
    assert b.ttft == pytest.approx(1.5e-3)
    a, b = run(host_token_s=2e-3)
    assert b.ttft == pytest.approx(8.5e-3)
    assert a.e2e == pytest.approx(43e-3)  # A's 20 tokens at the host's pace, B's 2 and its start among them


def test_wake_cost_only_on_the_first_step_after_idle():
    sim = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100, wake_s=0.003))
    # a starts on an idle engine (wakes); b arrives while a decodes (no wake); c after both ended (wakes)
    a, b, c = sim.run([_spec(0, 0.0, 10, 4), _spec(1, 0.0045, 10, 2), _spec(2, 1.0, 10, 2)]).records
    assert a.ttft == pytest.approx(0.004)  # 3 ms wake + the 1 ms prefill step
    assert a.end_s == pytest.approx(0.007)  # then 3 decode steps of 1 ms
    assert b.first_token_s == pytest.approx(0.006)  # prefilled in the step after the one in flight: no wake
    assert c.ttft == pytest.approx(0.004) and c.e2e == pytest.approx(0.005)


def test_wake_curve_follows_the_idle_time():
    """With a curve the wake-up grows with the idling before the step: the
    first request finds an engine idle since forever (the curve's top), the
    second one idle for 10 ms (halfway up its first segment)."""
    cfg = SimConfig(kv_slots=1000, max_context=256, vocab_size=100, wake_curve=[[0.02, 0.004], [0.2, 0.006]])
    a, b = Simulator(CONST_1MS, cfg).run([_spec(0, 0.0, 10, 1), _spec(1, 0.017, 10, 1)]).records
    assert a.ttft == pytest.approx(0.007)  # 6 ms wake + 1 ms step; the engine is idle again at 7 ms
    assert b.ttft == pytest.approx(0.002 + 0.001)  # idle 10 ms: 2 ms wake + 1 ms step


def test_busy_loop_time_comes_before_every_step_but_a_wake_up():
    """loop_s is what the engine loop spends between two busy steps: every
    step of a busy engine starts that long after the one before ended; the
    first after idling pays the wake-up instead. The tokens leave when the
    step ends, so TTFT holds no loop time and each gap one."""
    specs = [_spec(0, 0.0, 10, 4), _spec(1, 1.0, 10, 3)]
    cfg = SimConfig(kv_slots=1000, max_context=256, vocab_size=100, wake_s=0.003, loop_s=0.0002)
    res = Simulator(CONST_1MS, cfg).run(specs)
    a, b = res.records
    assert a.ttft == pytest.approx(0.004) and b.ttft == pytest.approx(0.004)  # wake-up + prefill step
    assert a.tpot == pytest.approx(0.0012) and b.tpot == pytest.approx(0.0012)
    assert list(res.itl_s) == pytest.approx([0.0012] * 5)
    assert res.stats["virtual_busy_s"] == pytest.approx(2 * 0.003 + 7e-3 + 5 * 0.0002)


def test_busy_loop_time_grows_with_the_rows_of_the_step_before():
    """loop_row_s more per row of the step before: two requests decode side by
    side (2 rows) after their prefill step (2 rows), then one alone."""
    specs = [_spec(0, 0.0, 10, 3), _spec(1, 0.0, 10, 5)]
    cfg = SimConfig(kv_slots=1000, max_context=256, vocab_size=100, loop_s=0.0002, loop_row_s=0.0001)
    a, b = Simulator(CONST_1MS, cfg).run(specs).records
    assert a.ttft == pytest.approx(0.001) and b.ttft == pytest.approx(0.001)
    # steps of 2 rows until a ends (2 more steps), then b alone: 0.4 ms before each step after a 2-row one,
    # 0.3 ms after a 1-row one
    assert a.end_s == pytest.approx(0.001 + 2 * 0.0014)
    assert b.end_s == pytest.approx(a.end_s + 0.0014 + 0.0013)


def test_a_busy_loop_pays_intake_for_each_request_it_takes_in():
    """intake_s per request that reaches a busy engine, before the step after
    it arrived: two arrive during the fourth step of a decoding request, so
    the fifth starts 2 x 0.5 ms after the fourth ended. One that reaches an
    idle engine pays nothing of it (its way in is entry_s)."""
    specs = [_spec(0, 0.0, 10, 8), _spec(1, 0.0035, 10, 2), _spec(2, 0.0035, 10, 2), _spec(3, 1.0, 10, 2)]
    cfg = SimConfig(kv_slots=1000, max_context=256, vocab_size=100, intake_s=0.0005)
    a, b, c, d = Simulator(CONST_1MS, cfg).run(specs).records
    assert b.ttft == pytest.approx(0.004 + 0.001 + 0.001 - 0.0035) and c.ttft == b.ttft
    assert a.end_s == pytest.approx(0.008 + 0.001)  # 8 steps of 1 ms, one of them 1 ms late
    assert d.ttft == pytest.approx(0.001)


def test_busy_loop_time_is_host_time_under_the_overlap_schedule():
    """Under the overlap schedule the loop's time is host work: it runs beside
    the device's part of the step before, so a device-bound engine hides it
    and a host-bound one pays it per step."""
    specs = [_spec(i, 0.0, 10, 20) for i in range(2)]
    for host_ms, device_ms in ((1.0, 3.0), (3.0, 1.0)):
        model = _HostAndDevice(host_ms * 1e-3, device_ms * 1e-3)
        cfg = SimConfig(kv_slots=2000, max_context=256, vocab_size=100, overlap_schedule=True)
        plain = Simulator(model, cfg).run(specs)
        looped = Simulator(model, SimConfig(**{**cfg.__dict__, "loop_s": 0.5e-3})).run(specs)
        steady = sorted(looped.itl_s)[len(looped.itl_s) // 2]
        assert steady == pytest.approx(max(host_ms + 0.5, device_ms) * 1e-3)
        assert steady - sorted(plain.itl_s)[len(plain.itl_s) // 2] == pytest.approx(
            0.0 if device_ms > host_ms + 0.5 else 0.5e-3)


def test_speed_schedule_rescales_the_steps_from_each_window_on():
    """A speed schedule says how fast the machine ran when: steps that start
    before 10 ms cost the model's 1 ms, later ones twice that; a schedule of
    factors 1 costs what no schedule does."""
    specs = [_spec(0, 0.0, 10, 20)]
    cfg = SimConfig(kv_slots=1000, max_context=256, vocab_size=100)
    slow = Simulator(CONST_1MS, SimConfig(**{**cfg.__dict__, "speed_schedule": [[0.0, 1.0, 1.0], [0.01, 2.0, 1.0]]}))
    res = slow.run(specs)
    # steps start at 0, 1, ..., 9 ms at 1 ms (the const term is per step: the step factor), then at 10, 12, ...
    assert list(res.itl_s) == pytest.approx([1e-3] * 9 + [2e-3] * 10)
    same = Simulator(CONST_1MS, SimConfig(**{**cfg.__dict__, "speed_schedule": [[0.0, 1.0, None]]})).run(specs)
    assert list(same.itl_s) == pytest.approx(list(Simulator(CONST_1MS, cfg).run(specs).itl_s))
    # a loop factor scales the busy loop's time between steps from its window on (None: as it is)
    looped = SimConfig(**{**cfg.__dict__, "loop_s": 0.5e-3,
                          "speed_schedule": [[0.0, 1.0, 1.0, None], [0.0105, 1.0, 1.0, 3.0]]})
    res = Simulator(CONST_1MS, looped).run(specs)
    # steps start at 0, 1.5, ..., 10.5 ms (0.5 ms of loop before each), and the loop after the one that
    # ends at 11.5 ms, in the second window, takes 1.5 ms
    assert list(res.itl_s) == pytest.approx([1.5e-3] * 7 + [2.5e-3] * 12)
    with pytest.raises(ValueError, match="must increase"):
        Simulator(CONST_1MS, SimConfig(**{**cfg.__dict__, "speed_schedule": [[1.0, 1.0, 1.0], [0.5, 1.0, 1.0]]}))
    with pytest.raises(ValueError, match="positive"):
        Simulator(CONST_1MS, SimConfig(**{**cfg.__dict__, "speed_schedule": [[0.0, 0.0, 1.0]]}))
    with pytest.raises(ValueError, match="positive"):
        Simulator(CONST_1MS, SimConfig(**{**cfg.__dict__, "speed_schedule": [[0.0, 1.0, 1.0, 0.0]]}))


def test_profile_serving_costs_reach_the_simulator():
    cfg = SimConfig.from_profile({"kv_slots": 100, "delivery_s": 0.002, "wake_s": 0.001, "entry_s": 0.0005,
                                  "stream_s": 0.0001, "loop_s": 0.0001})
    assert (cfg.entry_s, cfg.delivery_s, cfg.stream_s, cfg.wake_s) == (0.0005, 0.002, 0.0001, 0.001)
    assert cfg.loop_s == 0.0001 and cfg.serving().loop_s == 0.0001 and cfg.serving().loop_row_s == 0.0
    old = SimConfig.from_profile({"kv_slots": 100, "request_overhead_s": 0.006})
    assert (old.entry_s, old.delivery_s) == (0.0, 0.006)


def test_step_noise_is_seeded():
    q = list(np.linspace(0.5, 2.0, 101))
    specs = _workload(seed=7, num=40)
    runs = [_sim_run(specs, noise_quantiles=q, noise_seed=s) for s in (1, 1, 2)]
    plain = _sim_run(specs)
    assert _fingerprint(runs[0]) == _fingerprint(runs[1])
    assert _fingerprint(runs[0]) != _fingerprint(runs[2]) and _fingerprint(runs[0]) != _fingerprint(plain)
    assert min(runs[0].itl_s) < min(plain.itl_s) < max(plain.itl_s) < max(runs[0].itl_s)


def test_step_noise_scatters_without_moving_the_mean():
    """The draws are scaled to mean 1: quantiles that are all 2 (a profile whose
    model runs 2x fast) leave every step as the model has it, and a skewed
    set keeps the total busy time close to the model's."""
    specs = _workload(seed=7, num=40)
    plain = _sim_run(specs)
    flat = _sim_run(specs, noise_quantiles=[2.0] * 101)
    assert _fingerprint(flat)[:2] == _fingerprint(plain)[:2]
    skewed = _sim_run(specs, noise_quantiles=list(np.linspace(0.8, 1.0, 90)) + list(np.linspace(1.5, 3.0, 11)))
    assert skewed.stats["virtual_busy_s"] == pytest.approx(plain.stats["virtual_busy_s"], rel=0.15)


def _normal_scores(x):
    from statistics import NormalDist

    order = np.argsort(np.argsort(np.asarray(x)))
    return np.array([NormalDist().inv_cdf((k + 0.5) / len(x)) for k in order])


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.85])
def test_step_noise_carries_the_profiles_lag1_correlation(rho):
    """With noise_lag1 the step scatter is a Gaussian AR(1) on the measured
    quantiles: successive draws correlate as asked (in normal scores, what the
    calibration measures), and each quantile is still drawn as often as any
    other, so the scatter's spread and mean are the profile's."""
    from stepserve.scheduler.latency_model import StepFeatures
    from stepserve.traces.simulator import SimRunner, VirtualClock

    q = list(np.linspace(0.5, 2.0, 101))
    runner = SimRunner(LinearLatencyModel("linear", [1e-3, 0, 0, 0]), VirtualClock(), q, noise_seed=3,
                       noise_lag1=rho)
    f = StepFeatures(1, 1, 1)
    draws = np.array([runner.step_time(f) for _ in range(20000)]) / 1e-3 * np.mean(q)
    z = _normal_scores(draws + np.random.default_rng(0).uniform(0, 1e-9, draws.size))  # ties broken at random
    assert float(np.corrcoef(z[:-1], z[1:])[0, 1]) == pytest.approx(rho, abs=0.03)
    counts = np.histogram(draws, bins=[0.49, 0.875, 1.25, 1.625, 2.01])[0] / draws.size
    assert counts == pytest.approx([0.25, 0.25, 0.25, 0.25], abs=0.04 if rho > 0.6 else 0.02)
    with pytest.raises(ValueError):
        SimRunner(LinearLatencyModel("linear", [1e-3, 0, 0, 0]), VirtualClock(), q, noise_lag1=1.0)


def test_step_noise_per_size_of_step():
    """With `noise_by_size` a step draws from the bin of its predicted time,
    each bin scaled to mean 1 on its own: a 1 ms step scatters as the wide
    bin does and a 20 ms step as the narrow one, and neither moves its mean."""
    from stepserve.scheduler.latency_model import StepFeatures
    from stepserve.traces.simulator import SimRunner, VirtualClock

    wide, narrow = list(np.linspace(0.4, 2.2, 101)), list(np.linspace(1.8, 2.2, 101))
    model = LinearLatencyModel("linear", [0.0, 0.0, 0.0, 1e-3])  # 1 ms per new token
    runner = SimRunner(model, VirtualClock(), [1.0] * 101, noise_seed=5, noise_by_size=[[5e-3, wide], [None, narrow]])
    small = np.array([runner.step_time(StepFeatures(1, 1, 1)) for _ in range(4000)]) / 1e-3
    large = np.array([runner.step_time(StepFeatures(1, 1, 20)) for _ in range(4000)]) / 20e-3
    assert small.mean() == pytest.approx(1.0, abs=0.03) and large.mean() == pytest.approx(1.0, abs=0.01)
    assert small.min() == pytest.approx(0.4 / 1.3, abs=0.01) and small.max() == pytest.approx(2.2 / 1.3, abs=0.01)
    assert large.min() == pytest.approx(0.9, abs=0.01) and large.max() == pytest.approx(1.1, abs=0.01)
    # a step on the edge belongs to the bin above it, as `calibrate.noise_by_size` cuts them
    edge = np.array([runner.step_time(StepFeatures(1, 1, 5)) for _ in range(500)]) / 5e-3
    assert edge.min() >= 0.9 - 1e-9
    # the profile's bins reach the simulator
    by_size = [{"upto_s": 5e-3, "n": 300, "quantiles": wide}, {"upto_s": None, "n": 300, "quantiles": narrow}]
    cfg = SimConfig.from_profile({"kv_slots": 100}, noise={"quantiles": [1.0] * 101, "by_size": by_size})
    assert cfg.noise_by_size == [[5e-3, wide], [None, narrow]]
    for bad in ([[None, wide], [None, narrow]], [[5e-3, wide], [2e-3, wide], [None, narrow]],
                [[5e-3, []], [None, wide]]):
        with pytest.raises(ValueError, match="noise_by_size"):
            SimRunner(model, VirtualClock(), [1.0] * 101, noise_by_size=bad)


def test_calibration_bins_the_step_scatter_by_size():
    """`noise_by_size` cuts busy steps at shares of their predicted time and
    recovers each size's own scatter; a bin of too few steps joins the one
    below, and too few steps in all give no bins."""
    from stepserve.traces.calibrate import NOISE_BIN_MIN, noise_by_size

    rng = np.random.default_rng(2)
    pred = np.concatenate([rng.uniform(0.5e-3, 1.5e-3, 6000), rng.uniform(2e-3, 8e-3, 3000),
                           rng.uniform(20e-3, 40e-3, 1000)])
    sd = np.where(pred < 1.5e-3, 0.3, np.where(pred < 10e-3, 0.18, 0.1))
    ratio = np.exp(rng.normal(0.0, sd))
    bins = noise_by_size(pred, ratio, ratio)
    assert [b["n"] for b in bins] == [5000, 3000, 1500, 500]  # at 50%, 80% and 95% of the steps
    assert bins[-1]["upto_s"] is None and all(a["upto_s"] < b["upto_s"] for a, b in zip(bins, bins[1:-1]))

    def log_sd(q):  # from the quantiles' interquartile range
        return (math.log(q[75]) - math.log(q[25])) / 1.349

    assert log_sd(bins[0]["quantiles"]) == pytest.approx(0.3, rel=0.1)
    assert log_sd(bins[2]["quantiles"]) == pytest.approx(0.14, rel=0.25)  # a mix of 0.18 and 0.1
    assert log_sd(bins[3]["quantiles"]) == pytest.approx(0.1, rel=0.1)
    # 1,000 steps: 500, 300, then 150 and 50 too few, each joining the bin below
    assert NOISE_BIN_MIN == 200
    few = noise_by_size(pred[:1000], ratio[:1000], ratio[:1000])
    assert [b["n"] for b in few] == [500, 500] and few[-1]["upto_s"] is None
    assert noise_by_size(pred[:500], ratio[:500], ratio[:500]) == []  # 250, then 250 together: one bin
    assert noise_by_size(pred[:399], ratio[:399], ratio[:399]) == []


def test_calibration_measures_the_lag1_of_the_step_scatter():
    """`noise_lag1` recovers the correlation of an AR(1) scatter over busy
    steps, ignores pairs across an idle wait, reads independent scatter as ~0,
    and does not read a machine whose speed drifts over hundreds of steps as
    step-to-step correlation."""
    from stepserve.traces.calibrate import noise_lag1

    rng = np.random.default_rng(1)
    z, xs = 0.0, []
    for _ in range(20000):
        z = 0.7 * z + np.sqrt(1 - 0.49) * rng.normal()
        xs.append(float(np.exp(0.2 * z)))
    # the running median it divides out takes a little of an AR(1)'s own slow part (0.7 reads ~0.67)
    assert noise_lag1([(True, x) for x in xs]) == pytest.approx(0.7, abs=0.05)
    # an idle wait after every other step: only the pairs within each busy stretch count
    assert noise_lag1([(i % 2 == 0, x) for i, x in enumerate(xs)]) == 0.0  # no busy step follows a busy one
    iid = rng.lognormal(0, 0.2, 20000)
    assert noise_lag1([(True, float(x)) for x in iid]) == pytest.approx(0.0, abs=0.03)
    # independent scatter on a speed that drifts 1.6x up and back over thousands of steps
    drift = 1.3 + 0.3 * np.sin(np.arange(20000) * 2 * np.pi / 5000)
    drifting = [(True, float(x)) for x in iid * drift]
    assert noise_lag1(drifting) == pytest.approx(0.0, abs=0.05)
    assert noise_lag1(drifting, half_window=0) > 0.3  # without the running median: the drift reads as correlation


def test_branches_decode_side_by_side():
    """Eager: 3 branches get a token each step. The request's TPOT counts the
    tokens of all its branches after the first step's three."""
    sim = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100))
    (r,) = sim.run([_spec(0, 0.0, 12, 6, n=3)]).records
    assert r.output_tokens == 18 and r.branch_tokens == 6
    assert r.end_s == pytest.approx(6e-3) and r.tpot == pytest.approx(5e-3 / 15)


def test_refusals_like_the_engine():
    sim = Simulator(CONST_1MS, SimConfig(kv_slots=50, max_context=64, vocab_size=100))
    recs = sim.run([_spec(0, 0.0, 70, 2), _spec(1, 0.0, 40, 30), _spec(2, 0.0, 30, 30), _spec(3, 0.0, 8, 4)]).records
    assert "context" in recs[0].error and "context" in recs[1].error
    assert "KV slots" in recs[2].error
    assert recs[3].completed and recs[3].output_tokens == 4
    # the last requests refused (an n that never fits, then a prompt too long): the run ends with them, recorded
    sim = Simulator(CONST_1MS, SimConfig(kv_slots=50, max_context=64, vocab_size=100, max_running=2))
    recs = sim.run([_spec(0, 0.0, 8, 4), _spec(1, 0.01, 8, 4, n=13), _spec(2, 0.02, 70, 2)]).records
    assert recs[0].completed and "n (13)" in recs[1].error and "context" in recs[2].error


def _workload(seed=0, num=120):
    return generate(SyntheticConfig(num=num, rate=40.0, arrival="gamma", burstiness=0.5, input="uniform:8:60",
                                    output="uniform:4:40", prefix_groups=3, prefix_len=24, turns=2,
                                    branch_fraction=0.2, branches=3, seed=seed))


def _sim_run(specs, **kw):
    model = LinearLatencyModel("linear", [2e-3, 1e-4, 1e-6, 2e-5])
    cfg = SimConfig(**{"kv_slots": 4000, "max_context": 512, "vocab_size": 500, "max_running": 32,
                       "max_batched_tokens": 256, "seed": 0, **kw})
    return Simulator(model, cfg).run(specs)


def _fingerprint(res):
    return ([(r.request_id, r.first_token_s, r.end_s, r.output_tokens, r.cached_tokens) for r in res.records],
            list(res.itl_s), {k: v for k, v in res.stats.items() if k not in ("cpu_s", "wall_s")})


def test_determinism_with_fixed_seed():
    a = _sim_run(_workload(seed=5))
    b = _sim_run(_workload(seed=5))
    assert _fingerprint(a) == _fingerprint(b)
    c = _sim_run(_workload(seed=6))
    assert _fingerprint(a) != _fingerprint(c)


def test_real_kv_manager_retracts_and_hits_the_prefix_cache():
    specs = _workload(seed=1)
    # a pool small enough to force retractions; the integrity check runs every step
    res = _sim_run(specs, kv_slots=300, check_every=1)
    assert all(r.completed for r in res.records)
    assert all(r.output_tokens == s.output_len * s.n for r, s in zip(res.records, specs))
    assert res.stats["retractions"] > 0
    assert res.stats["prefix_hit_rate"] > 0.1  # system prompts and earlier turns
    off = _sim_run(specs, prefix_caching=False)
    assert off.stats["prefix_hit_rate"] == 0.0
    assert off.stats["virtual_busy_s"] > _sim_run(specs).stats["virtual_busy_s"]


class CountingPolicy:
    name = "counting"

    def __init__(self):
        self.planned = self.observed = 0
        self.rows = 0

    def plan(self, plan, view):
        self.planned += 1
        assert view.now >= 0 and view.kv_capacity == 4000
        return plan

    def observe(self, plan, record):
        self.observed += 1
        self.rows += record.rows
        assert record.wall_s > 0


def test_policies_plan_and_observe_every_step():
    pol = CountingPolicy()
    model = LinearLatencyModel("linear", [2e-3, 1e-4, 1e-6, 2e-5])
    sim = Simulator(model, SimConfig(kv_slots=4000, max_context=512, vocab_size=500), [pol])
    res = sim.run(_workload(seed=2, num=40))
    assert pol.planned == pol.observed == res.stats["steps"]
    assert pol.rows == pytest.approx(res.stats["mean_rows"] * res.stats["steps"])


def test_report_shape_matches_replay():
    from stepserve.traces.metrics import RequestRecord

    res = _sim_run(_workload(seed=3, num=30))
    slo = SLO(ttft_s=0.05, tpot_s=0.01)
    common = dict(slo=slo, trace={"source": "synthetic"}, scaling={}, config={})
    sim = build_report(mode="simulate", records=res.records, duration_s=res.duration_s, itl_values=res.itl_s,
                       **common)
    rec = RequestRecord("x", 0.0, 5, start_s=0.0, first_token_s=0.1, end_s=0.3, output_tokens=3, branch_tokens=3,
                        itl_s=[0.1, 0.1])
    real = build_report(mode="replay", records=[rec], duration_s=0.3, **common)
    assert set(sim) == set(real)
    for key in ("num_requests", "num_completed", "duration_s", "throughput_rps", "output_tps", "goodput_rps",
                "goodput_tps", "slo_attainment", "scaling", "command"):
        assert key in sim
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(sim[key]) == {"mean", "p50", "p90", "p99"}
    json.dumps(sim, allow_nan=False)


def test_roofline_profile_sizes_the_simulated_engine():
    prof = load_profile("h100:llama3-8b")
    cfg = SimConfig.from_profile(prof.engine, max_running=64)
    assert cfg.kv_slots == prof.engine["kv_slots"] and cfg.max_running == 64 and cfg.max_context == 8192
    res = Simulator(prof.model, cfg).run(_workload(seed=4, num=30))
    assert all(r.completed for r in res.records)
    # one decode row of an 8B model on an H100 takes milliseconds, not microseconds or seconds
    assert 1e-3 < min(res.itl_s) < 0.1


def test_simulate_cli_report_plot_and_compare(tmp_path, capsys):
    from stepserve.cli import main

    trace = "synthetic:num=40,rate=20,input=uniform:16:200,output=uniform:4:64,prefix_groups=2,prefix_len=32"
    outs = []
    for name, extra in (("a", []), ("b", ["--admission", "lpm"])):
        out = tmp_path / f"{name}.json"
        rc = main(["simulate", "--trace", trace, "--profile", "h100:qwen3-8b", "--slo-ttft", "0.2", "--slo-tpot",
                   "0.03", "--rates", "5,20", "--length-scale", "2", "--max-output", "100", "--out", str(out),
                   "--plot", "--no-progress", *extra])
        assert rc == 0
        outs.append(str(out))
    rep = json.loads((tmp_path / "a.json").read_text())
    assert rep["mode"] == "simulate" and [s["rate"] for s in rep["sweep"]] == [5.0, 20.0]
    assert len(rep["runs"]) == 2 and rep["runs"][1]["scaling"]["rate_rps"] == pytest.approx(20.0)
    assert rep["scaling"]["applied"]["input_scale"] == 2.0 and rep["scaling"]["applied"]["max_output"] == 100
    assert rep["profile"]["source"] == "roofline" and "command" in rep
    assert (tmp_path / "a.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["replay", "--compare", *outs, "--plot", str(tmp_path / "cmp.png")]) == 0
    table = capsys.readouterr().out
    assert "goodput req/s" in table and "vs a" in table
    assert (tmp_path / "cmp.png").stat().st_size > 0


def test_max_concurrency_is_a_closed_loop():
    """All arrive at 0: with max_concurrency 1 each request is sent when the one
    before completes; 3 lets three run side by side and finishes sooner; the
    latencies count from the send."""
    specs = [_spec(i, 0.0, 8, 5) for i in range(6)]
    one = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100)).run(specs, max_concurrency=1)
    recs = sorted(one.records, key=lambda r: r.start_s)
    for a, b in zip(recs, recs[1:]):
        assert b.start_s == pytest.approx(a.end_s)
    assert all(r.e2e == pytest.approx(5e-3) for r in recs)  # alone: prefill+first token, then 4 steps
    three = Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100)).run(specs,
                                                                                              max_concurrency=3)
    assert three.duration_s < one.duration_s
    assert sum(1 for r in three.records if r.start_s == 0.0) == 3
    with pytest.raises(ValueError):
        Simulator(CONST_1MS, SimConfig(kv_slots=1000, max_context=256, vocab_size=100)).run(specs, max_concurrency=0)


def _spec_sim(acceptance, length="fixed:4", model=CONST_1MS, draft=None, check_every=1, **kw):
    from stepserve.scheduler.policies import speculation_policy

    pol = speculation_policy(length, latency_model=model)
    cfg = SimConfig(kv_slots=4000, max_context=512, vocab_size=100, acceptance=acceptance, check_every=check_every,
                    **kw)
    return Simulator(model, cfg, [pol], draft_model=draft), pol


def test_speculation_every_draft_accepted():
    """Acceptance 1 and fixed:4: after the prefill step (the first token) each
    step emits 5 tokens per row; outputs are exactly as long as asked, and the
    KV check holds after every step."""
    sim, pol = _spec_sim([1.0])
    res = sim.run([_spec(0, 0.0, 10, 21), _spec(1, 0.0, 12, 11)])
    a, b = res.records
    assert a.output_tokens == 21 and b.output_tokens == 11
    # r0: 1 + 5 * 4 = 21 tokens in 5 steps; r1: 1 + 5 + (capped to 5 left) in 3 steps
    assert res.stats["steps"] == 5 and a.end_s == pytest.approx(5e-3) and b.end_s == pytest.approx(3e-3)
    st = pol.stats()
    assert st["spec_mean_accepted_length"] == pytest.approx(4.0, abs=0.5)


def test_speculation_nothing_accepted_is_plain_decoding_at_verify_cost():
    """Acceptance 0: one token per step as without speculation, each step
    priced with its verify tokens (here 0.1 ms per new token)."""
    model = LinearLatencyModel("linear", [1e-3, 0.0, 0.0, 1e-4])
    plain = Simulator(model, SimConfig(kv_slots=4000, max_context=512, vocab_size=100)).run([_spec(0, 0.0, 10, 9)])
    sim, _ = _spec_sim([0.0], model=model)
    spec = sim.run([_spec(0, 0.0, 10, 9)])
    assert spec.stats["steps"] == plain.stats["steps"] == 9
    (p,), (s,) = plain.records, spec.records
    # the 8 decode steps: 1 new token (1.1 ms) without, 1 + min(4, left - 1) with
    assert p.e2e == pytest.approx(1e-3 + 1e-3 + 8 * 1.1e-3)
    drafts = [min(4, 9 - i - 1) for i in range(1, 9)]
    assert s.e2e == pytest.approx(1e-3 + 1e-3 + sum(1.1e-3 + 1e-4 * d for d in drafts))


def test_speculation_acceptance_is_drawn_position_by_position():
    """Acceptance 0.6 per position, fixed:4: accepted drafts per verify row
    average 0.6 + 0.36 + 0.216 + 0.1296 (each position only after the one
    before it); a per-position list uses each rate at its position."""
    specs = [_spec(i, 0.0, 10, 400) for i in range(8)]
    sim, pol = _spec_sim([0.6], check_every=0)
    sim.run(specs)
    assert pol.stats()["spec_mean_accepted_length"] == pytest.approx(1.3056, rel=0.04)
    sim, pol = _spec_sim([0.9, 0.5, 0.0], check_every=0)
    sim.run(specs)
    assert pol.stats()["spec_mean_accepted_length"] == pytest.approx(0.9 + 0.45, rel=0.04)


def test_speculation_acceptance_spread_gives_each_request_its_own_rate():
    """With a spread, each request's drafts are accepted at its own rate (the
    rates shifted in log-odds by its draw), the same requests at the same
    rates under every policy (the draws are keyed on the trace's seed, not on
    the steps), and the pooled rate stays near the rate given. Without one,
    every request shares it."""
    from stepserve.traces.simulator import shifted_rates

    assert shifted_rates([0.8, 0.0, 1.0], 0.0) == [0.8, 0.0, 1.0]
    up, = shifted_rates([0.5], math.log(3.0))
    assert up == pytest.approx(0.75)

    def per_request(length, spread, seed=0):
        specs = [_spec(i, 0.0, 10, 200) for i in range(16)]
        sim, pol = _spec_sim([0.7], length=length, check_every=0, acceptance_spread=spread, seed=seed)
        got = {}
        orig = sim.runner.speculate

        def spy(plan):
            t = orig(plan)
            for r in plan.verify_rows:
                c = got.setdefault(r.seq.group.rec.request_id, [0, 0])
                c[0] += min(r.num_accepted + 1, r.draft_len)
                c[1] += r.num_accepted
            return t

        sim.runner.speculate = spy
        sim.run(specs)
        return {k: a / t for k, (t, a) in got.items()}

    alike = per_request("fixed:4", 0.0)
    assert max(alike.values()) - min(alike.values()) < 0.2
    spread = per_request("fixed:4", 1.5)
    assert max(spread.values()) - min(spread.values()) > 0.4
    other = per_request("fixed:2", 1.5)  # another policy, the same requests
    assert np.corrcoef([spread[k] for k in sorted(spread)], [other[k] for k in sorted(spread)])[0, 1] > 0.8
    reseeded = per_request("fixed:4", 1.5, seed=1)
    assert np.corrcoef([spread[k] for k in sorted(spread)], [reseeded[k] for k in sorted(spread)])[0, 1] < 0.8


def test_speculation_draft_model_time_is_charged():
    """A draft model of 0.5 ms per step: fixed:2 and every draft accepted
    makes each decode step 1 ms (target) + 2 x 0.5 ms."""
    draft = LinearLatencyModel("linear", [5e-4, 0.0, 0.0, 0.0])
    sim, _ = _spec_sim([1.0], length="fixed:2", draft=draft)
    (a,) = sim.run([_spec(0, 0.0, 10, 7)]).records
    assert a.output_tokens == 7 and a.end_s == pytest.approx(1e-3 + 2 * 2e-3)


def test_adaptive_speculation_in_the_simulator_follows_the_load():
    """On the H100 roofline of an 8B target with a 1B draft (acceptance 0.8):
    one request at a time drafts (k = 2-3 are within 1% of each other
    there); 256 at once hardly ever."""
    from stepserve.scheduler.policies import speculation_policy

    prof = load_profile("h100:llama3-8b")
    draft = load_profile("h100:llama3.2-1b").model
    ks = {}
    for n in (1, 256):
        pol = speculation_policy("adaptive", latency_model=prof.model)
        cfg = SimConfig.from_profile(prof.engine, max_running=256, acceptance=[0.8])
        specs = [_spec(i, 0.0, 64, 256) for i in range(n)] if n > 1 else [_spec(i, i * 10.0, 64, 256) for i in range(4)]
        res = Simulator(prof.model, cfg, [pol], draft_model=draft).run(specs)
        assert all(r.completed and r.output_tokens == 256 for r in res.records)
        hist = pol.stats()["spec_k_steps"]
        ks[n] = sum(k * c for k, c in hist.items()) / sum(hist.values())
    assert ks[1] >= 1.5 and ks[256] <= 0.1 * ks[1]


def test_simulate_cli_speculation(tmp_path):
    from stepserve.cli import main

    trace = "synthetic:num=20,rate=10,input=uniform:16:64,output=uniform:16:64"
    base = ["simulate", "--trace", trace, "--profile", "h100:llama3-8b", "--no-progress"]
    out = tmp_path / "s.json"
    assert main([*base, "--speculative", "draft", "--draft-profile", "h100:llama3.2-1b", "--acceptance", "0.8,0.7",
                 "--spec-length", "fixed:3", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["speculative"] == "draft" and rep["config"]["acceptance"] == [0.8, 0.7]
    assert rep["config"]["spec_length"] == "fixed:3"
    assert main([*base, "--speculative", "ngram", "--acceptance", "0.8", "--acceptance-spread", "1.2",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["config"]["acceptance_spread"] == 1.2
    for bad in (["--speculative", "draft", "--acceptance", "0.8"],  # no draft profile
                ["--speculative", "ngram", "--acceptance", "0.8", "--acceptance-spread", "-1"],
                ["--acceptance-spread", "1"],  # no proposer
                ["--speculative", "ngram"],  # no acceptance
                ["--acceptance", "0.8"],  # no proposer
                ["--speculative", "ngram", "--acceptance", "1.5"]):
        with pytest.raises(SystemExit):
            main([*base, *bad])


def test_compare_scores_reports_again_at_other_slos(tmp_path, capsys):
    """`replay --compare` with SLO flags scores each report's goodput and
    attainment from its request records at those SLOs: the same figures as a
    run made at them (the simulation does not read the SLO), for a tight and a
    loose TPOT SLO, where the two runs' own figures differ. A sweep report,
    whose runs keep the records, cannot be scored whole: a clear error."""
    from stepserve.cli import main

    trace = "synthetic:num=60,rate=40,input=uniform:16:400,output=uniform:4:64,seed=5"
    # (the plain schedule: its steps are the 8B roofline's host + device time, which the 8.1 ms TPOT SLO bites)
    base = ["simulate", "--trace", trace, "--profile", "h100:llama3-8b", "--no-progress", "--slo-ttft", "0.05",
            "--overlap-schedule", "off"]
    reports = {}
    for tpot in ("0.0081", "0.05"):
        out = tmp_path / f"tpot{tpot}.json"
        assert main([*base, "--slo-tpot", tpot, "--out", str(out)]) == 0
        reports[tpot] = json.loads(out.read_text())
    tight, loose = reports["0.0081"], reports["0.05"]
    assert 0 < tight["slo_attainment"] < loose["slo_attainment"]  # the SLO bites, so the scoring is seen
    assert tight["requests"] == loose["requests"]  # one run, whatever the SLO
    for tpot, want in (("0.0081", tight), ("0.05", loose)):
        capsys.readouterr()
        assert main(["replay", "--compare", str(tmp_path / "tpot0.05.json"), str(tmp_path / "tpot0.0081.json"),
                     "--slo-ttft", "0.05", "--slo-tpot", tpot]) == 0
        out = capsys.readouterr().out
        assert f"TPOT <= {float(tpot) * 1e3:g} ms" in out
        row = next(line for line in out.splitlines() if line.startswith("SLO attainment %"))
        assert row.split()[3:5] == [f"{want['slo_attainment'] * 100:.3f}"] * 2
        row = next(line for line in out.splitlines() if line.startswith("goodput req/s"))
        assert row.split()[2:4] == [f"{want['goodput_rps']:.3f}"] * 2
    sweep = tmp_path / "sweep.json"
    assert main([*base, "--rates", "20,40", "--out", str(sweep)]) == 0
    with pytest.raises(SystemExit, match="no request records"):
        main(["replay", "--compare", str(sweep), "--slo-tpot", "0.02"])


class _HostAndDevice:
    """A step of `host_s` on the host (`overhead_s`, as a roofline's) and
    `device_s` on the device."""

    form = "stub"

    def __init__(self, host_s, device_s):
        self.overhead_s, self.device_s = host_s, device_s

    def predict(self, rows, context_tokens, new_tokens, prefill_pairs=0.0, extend_rows=0, chunk_rows=0, layered=False):
        return self.overhead_s + self.device_s


@pytest.mark.parametrize("host_ms, device_ms", [(1.0, 3.0), (3.0, 1.0)])
def test_overlap_schedule_hides_the_host_part_of_each_step(host_ms, device_ms):
    """The engine's overlap schedule in virtual time: back-to-back steps take
    max(host, device) each instead of host + device; a step's tokens are the
    client's once the engine has launched the next step and the device has
    finished this one; every request gets the same tokens."""
    model = _HostAndDevice(host_ms * 1e-3, device_ms * 1e-3)
    specs = [_spec(i, 0.0, 10, 40) for i in range(4)]
    cfg = SimConfig(kv_slots=2000, max_context=256, vocab_size=100)
    plain = Simulator(model, cfg).run(specs)
    ov = Simulator(model, SimConfig(**{**cfg.__dict__, "overlap_schedule": True})).run(specs)
    assert [r.output_tokens for r in ov.records] == [r.output_tokens for r in plain.records] == [40] * 4
    assert ov.stats["steps"] == plain.stats["steps"] == 40  # one prefill step, 39 decode steps
    slow = max(host_ms, device_ms) * 1e-3
    assert list(plain.itl_s) == pytest.approx([(host_ms + device_ms) * 1e-3] * len(plain.itl_s))
    # the last step has no next step to schedule and launch first: its tokens come when its device part ends
    last = device_ms * 1e-3
    assert list(ov.itl_s) == pytest.approx([slow] * (len(ov.itl_s) - 4) + [last] * 4)
    # the first step: its host part, then its device part beside the next step's host part; then one step
    # per max(host, device)
    first = (host_ms + max(host_ms, device_ms)) * 1e-3
    assert ov.records[0].ttft == pytest.approx(first)
    assert ov.duration_s == pytest.approx(first + 38 * slow + last)
    assert plain.duration_s == pytest.approx(40 * (host_ms + device_ms) * 1e-3)


class _SlowPrefillLaunch:
    """Steps of 3 ms on the device; their host part (launch) 1 ms, or 10 ms for
    a step with a prompt chunk (an eager step on a GPU, where a decode step
    replays a graph). The runner reads `overhead_s` right after `predict`."""

    form = "stub"

    def __init__(self):
        self.overhead_s = 1e-3

    def predict(self, rows, context_tokens, new_tokens, prefill_pairs=0.0, extend_rows=0, chunk_rows=0, layered=False):
        self.overhead_s = 10e-3 if extend_rows else 1e-3
        return self.overhead_s + 3e-3


def test_overlap_schedule_charges_each_step_its_own_launch():
    """Under the overlap schedule the period between two steps' ends holds the
    next step's launch. The records move it to the step launched: a step with
    a prompt chunk (10 ms to launch) is charged it, the decode step before it
    is not, and the records still add up to the run's busy time. (Charged to
    the step before, a latency model fitted on the records would see decode
    steps that cost 10 ms whenever a request arrives, and prefill steps that
    cost 3.)"""
    specs = [_spec(0, 0.0, 10, 30), _spec(1, 0.0, 10, 30), _spec(2, 0.05, 10, 10)]
    sim = Simulator(_SlowPrefillLaunch(), SimConfig(kv_slots=2000, max_context=256, vocab_size=100,
                                                    overlap_schedule=True))
    res = sim.run(specs)
    recs = sim.core.records
    assert [r.output_tokens for r in res.records] == [30, 30, 10]
    prefill = [r for r in recs if r.extend_rows]
    assert len(prefill) == 2  # the first two prompts together, then the third beside their decode rows
    # the first: its launch and device part, less the next step's launch that ran beside its device part
    assert prefill[0].wall_s == pytest.approx(13e-3 - 1e-3)
    # the second: its 10 ms launch (the step before it had finished on the device meanwhile), then its
    # device part beside the next launch
    assert prefill[1].wall_s == pytest.approx(10e-3 + 3e-3 - 1e-3)
    before = recs[prefill[1].step - recs[0].step - 1]
    assert before.extend_rows == 0 and before.wall_s == pytest.approx(1e-3)  # its own launch only
    decode = [r for r in recs if not r.extend_rows and r is not before]
    assert all(r.wall_s == pytest.approx(3e-3) for r in decode[:-1])  # device-bound: one step per 3 ms
    assert decode[-1].wall_s == pytest.approx(4e-3)  # the last: its launch and its device part, nothing after
    assert sum(r.wall_s for r in recs) == pytest.approx(res.duration_s)  # no idle gap in this run
    assert all(r.forward_s >= 0 for r in recs)


def _sim_config(profile: str, **kw) -> SimConfig:
    """`simulate`'s SimConfig for `profile`, its options at their defaults but `kw`."""
    from argparse import Namespace

    from stepserve.traces.simulate_cli import sim_config

    a = dict(max_running=None, max_batched_tokens=None, kv_slots=None, vocab_size=None, seed=0,
             admission="fcfs", no_prefix_caching=False, check_every=0, no_step_noise=True, acceptance=None,
             acceptance_spread=None, no_serving_costs=False, overlap_schedule="auto", speculative="none")
    return sim_config(Namespace(**{**a, **kw}), load_profile(profile))


def test_overlap_schedule_is_the_roofline_default_without_speculation():
    cfg = _sim_config
    assert cfg("h100:llama3-8b").overlap_schedule is True
    assert cfg("h100:llama3-8b", overlap_schedule="off").overlap_schedule is False
    assert cfg("h100:llama3-8b", speculative="ngram", acceptance="0.8").overlap_schedule is False
    with pytest.raises(SystemExit):
        cfg("h100:llama3-8b", speculative="ngram", acceptance="0.8", overlap_schedule="on")
    with pytest.raises(ValueError, match="overlap"):
        from stepserve.scheduler.policies import speculation_policy

        Simulator(CONST_1MS, SimConfig(kv_slots=100, overlap_schedule=True, acceptance=[0.8]),
                  [speculation_policy("fixed:2", latency_model=CONST_1MS)])


@pytest.mark.parametrize("recorded", [True, False, None])
def test_overlap_schedule_follows_the_engine_a_measured_profile_recorded(tmp_path, recorded):
    """A measured profile records whether the engine or server it measured ran
    the overlap schedule (`profile --url` reads it off /get_server_info);
    `auto` simulates the same schedule, and plain where the profile does not
    say (a server without that route, an older profile)."""
    import json

    engine = {"kv_slots": 20000, "max_context": 512, "vocab_size": 384}
    if recorded is not None:
        engine["overlap_schedule"] = recorded
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "stepserve-latency-profile", "source": "measured-http",
                                "latency": {"form": "linear", "coef": [2e-3, 1e-4, 1e-7, 1e-5]}, "engine": engine}))
    assert _sim_config(str(path)).overlap_schedule is bool(recorded)
    assert _sim_config(str(path), overlap_schedule="on").overlap_schedule is True
    assert _sim_config(str(path), overlap_schedule="off").overlap_schedule is False
    assert _sim_config(str(path), speculative="ngram", acceptance="0.8").overlap_schedule is False


def test_no_serving_costs_leaves_every_serving_cost_out(tmp_path):
    """`--no-serving-costs`: the profile's entry, delivery, wake-up and
    busy-loop costs all at 0, the steps as the profile has them."""
    import json

    from stepserve.scheduler.latency_model import ServingCosts

    engine = {"kv_slots": 100, "entry_s": 0.002, "delivery_s": 0.001, "stream_s": 1e-4, "wake_s": 0.003,
              "wake_curve": [[0.01, 0.002]], "loop_s": 1e-4, "loop_row_s": 1e-6}
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"kind": "stepserve-latency-profile", "source": "measured",
                                "latency": {"form": "linear", "coef": [1e-3, 0.0, 0.0, 0.0]}, "engine": engine}))
    assert _sim_config(str(path)).serving() == ServingCosts.from_engine(engine)
    assert _sim_config(str(path), no_serving_costs=True).serving() == ServingCosts()


def test_a_streams_later_tokens_are_delivered_sooner_than_its_first():
    """A stream's first token reaches its client delivery_s after its step,
    a later one token_delivery_s after its own, behind the host's work on
    the stream's start (host_request_s) and never before the token ahead of
    it. One request of 4 tokens, 1 ms steps ending at 1, 2, 3 and 4 ms, a
    first token's delivery of 2 ms, a later one's of 0.5 ms: the first at
    3 ms; without host work the second (made at 2 ms) would pass it, so it
    comes with it, then 3.5 and 4.5 ms; with 1.5 ms of host work on the
    start, the second waits for it until 2.5 ms, then 3.0, 3.5 and 4.5 ms
    all the same; the last takes end_delivery_s instead where given. Without
    token_delivery_s every token takes delivery_s."""
    def run(**costs):
        cfg = SimConfig(kv_slots=1000, max_context=256, vocab_size=100, delivery_s=2e-3, **costs)
        res = Simulator(CONST_1MS, cfg).run([_spec(0, 0.0, 10, 4)])
        (r,) = res.records
        return r, list(res.itl_s)

    r, itl = run()
    assert (r.ttft, r.e2e) == pytest.approx((3e-3, 6e-3)) and itl == pytest.approx([1e-3] * 3)
    for host in ({}, {"host_request_s": 1.5e-3}):
        r, itl = run(token_delivery_s=0.5e-3, **host)
        assert (r.ttft, r.e2e) == pytest.approx((3e-3, 4.5e-3)) and itl == pytest.approx([0.0, 0.5e-3, 1e-3])
    r, itl = run(token_delivery_s=0.5e-3, host_request_s=2.8e-3)  # the host holds the second until 3.8 ms
    assert (r.ttft, r.e2e) == pytest.approx((3e-3, 4.5e-3)) and itl == pytest.approx([1.3e-3, 0.0, 0.2e-3])
    # the token that ends the stream takes end_delivery_s: the 4th at 4 + 1.2 ms
    r, itl = run(token_delivery_s=0.5e-3, end_delivery_s=1.2e-3)
    assert (r.ttft, r.e2e) == pytest.approx((3e-3, 5.2e-3)) and itl == pytest.approx([0.0, 0.5e-3, 1.7e-3])
    assert run(end_delivery_s=1.2e-3)[0].e2e == pytest.approx(6e-3)  # (with no later tokens' delivery: as they)


def test_the_simulator_folds_prompt_chunks_as_the_profiled_engine_did(tmp_path):
    """A profile records which prompt chunks the engine runs as decode-shaped
    queries (`fold_tokens`, `fold_pairs`: `plan.FoldRule`); the simulated
    scheduler decides each plan's chunks by it, so a folded chunk pays none
    of the step model's extend-path prices, only the chunk step's, and the
    layered step's unless the step runs as one call. A profile that records
    no rule (an older one) prices every chunk on the extend path, as it was
    fitted."""
    from stepserve.scheduler.plan import FoldRule

    # 1 ms a step; 10 ms more for a step with chunks on the extend path (+2 ms per chunk); 0.4 ms for a step
    # with any chunk, and 3 ms more where it runs layer by layer
    model = LinearLatencyModel("segmented", [1e-3, 0.0, 0.0, 0.0, 0.0, 1e-2, 2e-3, 4e-4, 3e-3], knots=(1,))
    engine = {"kv_slots": 1000, "max_context": 256, "vocab_size": 100}
    specs = [_spec(0, 0.0, 10, 3), _spec(1, 0.5, 60, 3)]  # 55 and 1,830 query-key pairs
    ttft = {}
    for rule in (FoldRule(), FoldRule(0, 100), FoldRule(64, 0)):
        cfg = SimConfig.from_profile({**engine, **rule.to_dict()})
        assert (cfg.fold_tokens, cfg.fold_pairs) == (rule.tokens, rule.pairs)
        ttft[rule] = [r.ttft for r in Simulator(model, cfg).run(specs).records]
    assert ttft[FoldRule()] == pytest.approx([0.0164, 0.0164])  # each prompt's step: 1 + 10 + 2 + 0.4 + 3 ms
    # the short prompt's chunk folds, in a step run layer by layer (no `tokens` limit): 1 + 0.4 + 3 ms
    assert ttft[FoldRule(0, 100)] == pytest.approx([0.0044, 0.0164])
    assert ttft[FoldRule(64, 0)] == pytest.approx([0.0014, 0.0014])  # each step within 64 tokens: one call
    assert SimConfig.from_profile(engine).fold_pairs == 0
