"""tools/bench_spec.py's simulated sweep, through its command line: the
speculation-length policies on a roofline step model, closed batches of B
requests."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sweep(tmp_path, acceptance: str, sizes: str = "1,8") -> dict:
    out = tmp_path / f"sweep-{acceptance}.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_spec.py"), "--simulate", "h100:llama3-8b",
           "--draft-profile", "h100:llama3.2-1b", "--acceptance", acceptance, "--batch-sizes", sizes,
           "--output-len", "48", "--prompt-len", "256", "--repeats", "1", "--out", str(out),
           # plain decoding on the plain schedule, as the speculative lengths run (the overlap schedule hides
           # the roofline's per-step overhead from plain decoding alone)
           "--overlap-schedule", "off"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Full batch" in done.stdout and "| 8 |" in done.stdout
    return {r["batch"]: r for r in json.loads(out.read_text())["rows"]}


def test_simulated_sweep_drafts_when_drafts_are_accepted(tmp_path):
    rows = sweep(tmp_path, "0.9")
    for b, r in rows.items():
        full = r["full_batch_tok_s"]
        # a memory-bound 8B target verifies 5 tokens for little more than 1: drafting wins
        assert full["fixed:4"] > 1.3 * full["none"], (b, full)
        assert r["accepted_per_row"]["fixed:4"] > 2.0
        assert sum(n for k, n in r["adaptive_k_steps"].items() if int(k) >= 2) > r["adaptive_k_steps"].get("0", 0)
        assert full["adaptive"] > 1.3 * full["none"]


def test_simulated_sweep_stops_drafting_when_nothing_is_accepted(tmp_path):
    rows = sweep(tmp_path, "0.0")
    for b, r in rows.items():
        full = r["full_batch_tok_s"]
        assert full["none"] > full["fixed:8"], (b, full)
        assert r["accepted_per_row"]["fixed:1"] == 0.0
        k = r["adaptive_k_steps"]
        # after the pairs that measure the costs, plain decoding
        assert k.get("0", 0) > 0.8 * sum(k.values()), k
        assert full["adaptive"] > 0.9 * full["none"]


def test_simulated_sweep_needs_a_draft_profile(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_spec.py"), "--simulate", "h100:llama3-8b",
           "--batch-sizes", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--draft-profile" in done.stderr


def test_acceptance_spread_of_the_engine(tmp_path):
    """The per-request acceptance of the embedded draft/target pair, as the
    simulator's --acceptance-spread takes it: every request is counted, the
    rates are ordered percentiles, and the requests of this workload do differ
    (their log-odds spread is well above what ~110 counted positions each
    would give alone). 32 requests of 128 tokens: the estimate, the
    covariance of the two halves' log-odds across requests, came out 0.0-0.03
    for three prompt sets of 12 requests of 64 tokens, and 0.65-0.68 for two
    of 32 of 128 (whole requests' log-odds spread 0.65-0.68, the counts' noise
    included, so the halves' covariance may come out a little above it)."""
    out = tmp_path / "spread.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "bench_spec.py"), "--acceptance-spread-of-engine", "32",
           "--output-len", "128", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["requests"] == 32 and rep["mean_tries"] > 60
    pct = rep["rate_percentiles_5_25_50_75_95"]
    assert pct == sorted(pct) and 0.0 < pct[0] and pct[-1] < 1.0
    assert 0.3 < rep["acceptance_spread"] < 1.2 * rep["logit_sd"]
