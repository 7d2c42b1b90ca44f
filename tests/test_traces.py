"""Trace loaders (against the public files when present), synthetic workloads,
scaling, prompt construction, and the goodput / percentile arithmetic."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest

from stepserve.traces.azure import load_azure
from stepserve.traces.load import load_trace, save_trace
from stepserve.traces.metrics import SLO, RequestRecord, percentiles, summarize
from stepserve.traces.mooncake import load_mooncake
from stepserve.traces.request_spec import MIN_TOKEN_ID, PromptBuilder, RequestSpec, Segment
from stepserve.traces.scaling import Scaling, apply_scaling
from stepserve.traces.synthetic import LengthDist, SyntheticConfig, generate

TRACES = Path(os.environ.get("STEPSERVE_TRACES_DIR", Path(__file__).resolve().parents[1].parent / "shared" / "traces"))


def _trace(name: str) -> str:
    p = TRACES / name
    if not p.is_file():
        pytest.skip(f"public trace {name} not found in {TRACES} (set STEPSERVE_TRACES_DIR to its folder)")
    return str(p)


# -- loaders against the real files ---------------------------------------------


@pytest.mark.parametrize("name,rows,mean_in,mean_out", [
    ("azure2023_conv.csv", 19366, 1155, 211),
    ("azure2023_code.csv", 8819, 2048, 28),
])
def test_azure_loader(name, rows, mean_in, mean_out):
    specs = load_azure(_trace(name))
    assert len(specs) == rows
    arrivals = [s.arrival_s for s in specs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert 3300 < arrivals[-1] < 3700  # about an hour
    assert abs(np.mean([s.prompt_len for s in specs]) - mean_in) < 1
    assert abs(np.mean([s.output_len for s in specs]) - mean_out) < 1
    # every request has a prompt of its own: nothing shared
    assert len({s.segments[0].key for s in specs}) == rows


def test_azure_timestamp_seven_digits(tmp_path):
    p = tmp_path / "t.csv"
    # no trailing newline on the last line, as in the public files
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,0")
    a, b = load_azure(str(p))
    assert a.arrival_s == 0.0 and math.isclose(b.arrival_s, 4.314579, abs_tol=1e-6)
    assert (a.prompt_len, a.output_len, b.output_len) == (374, 44, 1)  # a zero output becomes 1


def test_mooncake_loader_and_shared_blocks():
    path = _trace("mooncake_synthetic_trace.jsonl")
    specs = load_mooncake(path)
    with open(path) as f:
        raw = [json.loads(line) for line in f if line.strip()]
    assert len(specs) == len(raw) == 3993
    for s, d in zip(specs, raw):
        assert s.prompt_len == d["input_length"]
        assert s.output_len == max(1, d["output_length"])
        assert [seg.key for seg in s.segments] == [f"mc:{h}" for h in d["hash_ids"]]
        assert all(seg.length == 512 for seg in s.segments[:-1])
    assert math.isclose(specs[-1].arrival_s, raw[-1]["timestamp"] / 1000)
    # two requests whose hash_ids share a leading run share exactly those tokens
    by_first: dict[int, list[int]] = {}
    for i, d in enumerate(raw):
        by_first.setdefault(d["hash_ids"][0], []).append(i)
    i, j = next(v[:2] for v in by_first.values() if len(v) > 1)
    hi, hj = raw[i]["hash_ids"], raw[j]["hash_ids"]
    common = next((k for k, (x, y) in enumerate(zip(hi, hj)) if x != y), min(len(hi), len(hj)))
    b = PromptBuilder(vocab_size=32000, seed=3)
    ti, tj = b.prompt(specs[i]), b.prompt(specs[j])
    n = 512 * common
    shared = min(n, len(ti), len(tj))
    assert ti[:shared] == tj[:shared]
    if common < min(len(hi), len(hj)):
        assert ti[n:n + 512] != tj[n:n + 512]


def test_load_trace_dispatch(tmp_path):
    assert load_trace(_trace("azure2023_code.csv")).source == "azure"
    assert load_trace(_trace("mooncake_synthetic_trace.jsonl")).source == "mooncake"
    specs = generate(SyntheticConfig(num=5, seed=2))
    p = tmp_path / "mine.jsonl"
    save_trace(specs, str(p))
    back = load_trace(str(p))
    assert back.source == "stepserve" and back.specs == specs
    assert load_trace("synthetic:num=7,rate=3").source == "synthetic"
    bad = tmp_path / "bad.txt"
    bad.write_text("hello\n")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(str(bad))
    header = tmp_path / "header_only.csv"
    header.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="holds no requests"):  # not a run of nothing that exits 0
        load_trace(str(header))


# -- prompts ----------------------------------------------------------------------


def test_prompt_builder_prefixes_and_determinism():
    b = PromptBuilder(vocab_size=300, seed=1)
    full = b.segment(Segment("k", 40))
    assert b.segment(Segment("k", 13)) == full[:13]
    fresh = PromptBuilder(vocab_size=300, seed=1, cache_segments=1)
    assert fresh.segment(Segment("k", 13)) == full[:13]  # the short draw first, uncached: still a prefix
    assert fresh.segment(Segment("k", 40)) == full
    assert PromptBuilder(300, seed=2).segment(Segment("k", 40)) != full
    assert all(MIN_TOKEN_ID <= t < 300 for t in full)
    spec = RequestSpec("r", 0.0, 4, (Segment("a", 5), Segment("b", 7)))
    assert b.prompt(spec) == b.segment(Segment("a", 5)) + b.segment(Segment("b", 7))


# -- synthetic --------------------------------------------------------------------


def test_length_dists():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("fixed:12").sample(rng, 4).tolist() == [12] * 4
    u = LengthDist.parse("uniform:3:5").sample(rng, 500)
    assert set(u.tolist()) == {3, 4, 5}
    ln = LengthDist.parse("lognormal:200:0.5").sample(rng, 20000)
    assert abs(ln.mean() - 200) < 5
    for bad in ("fixed", "uniform:3", "zipf:2", "normal:1"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


@pytest.mark.parametrize("arrival,burst", [("poisson", 1.0), ("gamma", 0.25), ("gamma", 4.0)])
def test_synthetic_arrivals_keep_the_rate(arrival, burst):
    specs = generate(SyntheticConfig(num=4000, rate=5.0, arrival=arrival, burstiness=burst, seed=1))
    gaps = np.diff([s.arrival_s for s in specs])
    assert abs(1 / gaps.mean() - 5.0) < 0.5
    cv = gaps.std() / gaps.mean()
    assert abs(cv - 1 / math.sqrt(burst)) < 0.15 * (1 / math.sqrt(burst)) + 0.05


def test_synthetic_prefix_groups_conversations_branches():
    cfg = SyntheticConfig.parse("synthetic:num=60,rate=10,input=fixed:8,output=fixed:5,prefix_groups=3,"
                                "prefix_len=20,turns=3,branch_fraction=0.5,branches=3,seed=4")
    specs = generate(cfg)
    assert len(specs) == 60
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert {s.segments[0].key for s in specs} <= {f"syn4:sys{g}" for g in range(3)}
    by_conv: dict[int, list[RequestSpec]] = {}
    for s in specs:
        by_conv.setdefault(s.meta["conversation"], []).append(s)
    for turns in by_conv.values():
        turns.sort(key=lambda s: s.meta["turn"])
        for prev, cur in zip(turns, turns[1:]):
            # each turn is the previous prompt, its answer, and a new user message
            assert cur.segments[: len(prev.segments)] == prev.segments
            assert cur.segments[len(prev.segments)].length == prev.output_len
            assert cur.prompt_len == prev.prompt_len + prev.output_len + 8
            assert cur.arrival_s > prev.arrival_s
    assert {s.n for s in specs} == {1, 3}
    with pytest.raises(ValueError, match="unknown synthetic option"):
        SyntheticConfig.parse("synthetic:nope=1")


@pytest.mark.parametrize("spec,says", [
    ("rate=nan", "must be positive"),
    ("rate=-1", "must be positive"),
    ("output=fixed:0", "lengths from 1 on"),
    ("input=uniform:5:1", "LO <= HI"),
    ("input=normal:10:-1", "spread of 0 or more"),
    ("input=lognormal:0:1", "positive mean"),
    ("output=exponential:-5", "positive mean"),
    ("input=fixed:inf", "bad length distribution"),
    ("input=uniform:a:b", "bad length distribution"),
    ("branch_fraction=-0.5,fork_fraction=1", "branch_fraction and fork_fraction"),
])
def test_synthetic_values_out_of_range_are_refused(spec, says):
    """Each value that would have run as something else (output=fixed:0 as
    one token, rate=nan as an empty run) or failed inside numpy is a
    ValueError that says what is wrong."""
    with pytest.raises(ValueError, match=re.escape(says)):
        SyntheticConfig.parse("synthetic:num=4," + spec)
    SyntheticConfig.parse("synthetic:num=4,fork_fraction=0.5,fork_suffix=fixed:0")  # an empty suffix is fine


# -- scaling ----------------------------------------------------------------------


def _specs():
    return [RequestSpec(f"r{i}", 10.0 + 2.0 * i, 100, (Segment("shared", 512), Segment(f"own{i}", 300)))
            for i in range(10)]


def test_scaling_window_limit_rate():
    specs, info = apply_scaling(_specs(), Scaling(start_s=4.0, duration_s=10.0))
    assert [s.request_id for s in specs] == ["r2", "r3", "r4", "r5", "r6"]
    assert specs[0].arrival_s == 0.0 and specs[-1].arrival_s == 8.0
    assert info.window_requests == 5 and info.trace_requests == 10
    assert math.isclose(info.native_rate_rps, 0.5)
    specs, info = apply_scaling(_specs(), Scaling(rate=2.0, limit=4))
    assert len(specs) == 4 and math.isclose(info.applied["time_scale"], 4.0)
    assert [s.arrival_s for s in specs] == [0.0, 0.5, 1.0, 1.5]
    assert math.isclose(info.rate_rps, 2.0)


def test_scaling_lengths_keep_shared_blocks_identical():
    specs, info = apply_scaling(_specs(), Scaling(input_scale=0.05, output_scale=0.1, max_output=8))
    assert all(s.segments[0] == Segment("shared", 26) for s in specs)  # round(512 * 0.05)
    assert all(s.segments[1].length == 15 and s.output_len == 8 for s in specs)
    assert info.clipped_output == 10 and info.clipped_input == 0


def test_scaling_context_cap():
    specs, info = apply_scaling(_specs(), Scaling(max_context=600))
    s = specs[0]
    # the output is cut first; a prompt that alone overflows keeps one output token and loses its end
    assert (s.prompt_len, s.output_len) == (599, 1)
    assert s.segments == (Segment("shared", 512), Segment("own0", 87))
    specs, info = apply_scaling(_specs(), Scaling(max_context=900))
    assert specs[0].prompt_len == 812 and specs[0].output_len == 88
    assert info.clipped_output == 10 and info.clipped_input == 0
    specs, info = apply_scaling(_specs(), Scaling(max_input=600))
    assert specs[0].segments == (Segment("shared", 512), Segment("own0", 88))
    assert info.clipped_input == 10


# -- metrics ----------------------------------------------------------------------


def test_percentiles_hand_checked():
    p = percentiles([4, 1, 3, 2])
    assert p == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert percentiles([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert percentiles([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}


def _records():
    a = RequestRecord("a", 0.0, 10, start_s=0.0, first_token_s=0.5, end_s=2.5, output_tokens=5, branch_tokens=5,
                      itl_s=[0.5, 0.5, 0.5, 0.5])
    b = RequestRecord("b", 1.0, 10, start_s=1.0, first_token_s=1.2, end_s=1.2, output_tokens=1, branch_tokens=1)
    c = RequestRecord("c", 2.0, 10, start_s=2.0, first_token_s=3.0, end_s=5.0, output_tokens=3, branch_tokens=3,
                      itl_s=[1.5, 0.5])
    d = RequestRecord("d", 3.0, 10, start_s=3.0, error="HTTP 400")
    return [a, b, c, d]


def test_goodput_hand_checked():
    recs = _records()
    a, b, c, d = recs
    assert (a.ttft, a.e2e, a.tpot) == (0.5, 2.5, 0.5)
    assert b.tpot is None and b.ttft == pytest.approx(0.2)
    assert (c.ttft, c.tpot) == (1.0, 1.0)
    assert not d.completed and d.ttft is None
    s = summarize(recs, duration_s=5.0, slo=SLO(ttft_s=0.6, tpot_s=0.6))
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (4, 3, 1)
    assert s["throughput_rps"] == pytest.approx(0.6)
    assert s["output_tps"] == pytest.approx(1.8)
    # a and b meet both SLOs (b has no TPOT: met vacuously); c misses TTFT; d failed
    assert s["goodput_rps"] == pytest.approx(0.4)
    assert s["goodput_tps"] == pytest.approx(1.2)
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["ttft_s"] == pytest.approx({"mean": 1.7 / 3, "p50": 0.5, "p90": 0.9, "p99": 0.99})
    assert s["tpot_s"] == pytest.approx({"mean": 0.75, "p50": 0.75, "p90": 0.95, "p99": 0.995})
    assert s["itl_s"]["p50"] == pytest.approx(0.5) and s["itl_s"]["mean"] == pytest.approx(4.0 / 6)
    assert s["e2e_s"]["p50"] == pytest.approx(2.5)
    # no SLO: attainment is the completion rate, goodput the throughput
    s = summarize(recs, 5.0, SLO())
    assert s["slo_attainment"] == pytest.approx(0.75) and s["goodput_rps"] == pytest.approx(0.6)
    # an E2E SLO alone
    s = summarize(recs, 5.0, SLO(e2e_s=2.6))
    assert s["goodput_rps"] == pytest.approx(0.4)


def test_summary_of_nothing_is_json_safe():
    s = summarize([RequestRecord("x", 0.0, 3, error="boom")], 0.0, SLO(ttft_s=1.0))
    json.dumps(s, allow_nan=False)
    assert s["throughput_rps"] == 0.0 and s["slo_attainment"] == 0.0 and s["ttft_s"]["p50"] is None


def test_plot_policies_draws_every_series(tmp_path):
    from stepserve.traces.plot import plot_policies

    def rep(g, a, v):
        return {"goodput_rps": g, "goodput_tps": 10 * g, "slo_attainment": a, "victim_tpot_s": {"p90": v}}

    path = plot_policies({"eager": [(1, rep(1.0, 1.0, 0.01)), (2, rep(1.5, 0.8, 0.02))],
                          "taper": [(2, rep(1.6, 0.95, 0.015)), (1, rep(1.0, 1.0, None))]},
                         str(tmp_path / "p.png"), "rate")
    assert (tmp_path / "p.png").stat().st_size > 10_000 and path.endswith("p.png")
