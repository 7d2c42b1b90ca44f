"""The engine's step log (what it records, checked against the engine's own
step records), the engine view `stepserve validate` derives from it, and the
validation's judgement of a rate sweep (errors, the saturation knee)."""

from __future__ import annotations

import asyncio

import pytest

from stepserve import AsyncEngine, SamplingParams
from stepserve.engine.step_log import FIELDS, read_step_log
from stepserve.scheduler.latency_model import LinearLatencyModel
from stepserve.traces.validate import compare_rate, judge, knee, step_log_view


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_step_log_records_every_step_and_the_loop_around_it(llama_ckpt, tmp_path, process):
    path = tmp_path / "steps.jsonl"

    async def go():
        async with AsyncEngine(model=llama_ckpt, process=process, step_log=str(path)) as eng:
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

            async def one(prompt):
                return [o async for o in eng.generate(prompt, params)]

            await asyncio.gather(one([5, 6, 7, 8, 9]), one([10, 11, 12]))
            if process:  # its records stay in the child
                return None
            return await asyncio.wrap_future(eng.call(
                lambda e: [(r.rows, r.context_tokens, r.new_tokens, r.prefill_pairs) for r in e.records]))

    records = asyncio.run(go())
    lines = read_step_log(str(path))
    steps = [ln for ln in lines if "rows" in ln]
    assert sum(ln["adds"] for ln in lines) == 2
    assert all(set(ln) <= set(FIELDS) for ln in lines)
    assert all(a["t"] <= b["t"] for a, b in zip(lines, lines[1:]))
    assert all(ln["step"] > 0 and 0 < ln["fwd"] <= ln["step"] and ln["out"] >= 0 and ln["emit"] >= 0 for ln in steps)
    # two 5-token requests: every token is one row of one step
    assert sum(ln["rows"] for ln in steps) == 10
    assert steps[0]["pairs"] > 0 and steps[-1]["pairs"] == 0  # a prefill first, a decode last
    if records is not None:  # the thread engine is at hand: the log is its records, step for step
        assert [(ln["rows"], ln["ctx"], ln["new"], ln["pairs"]) for ln in steps] == records


def _line(t, wait=0.0, adds=0, step=None, rows=1, new=1):
    ln = {"t": t, "wait": wait, "adds": adds, "cmd": 0.0, "emit": 0.0, "outs": 0}
    if step is not None:
        ln.update(rows=rows, decode_rows=rows, ctx=10, new=new, pairs=0.0, step=step, fwd=step, out=0.0)
    return ln


def test_engine_view_of_a_replay():
    """A request sent at 100.000 reaches the idle engine at 100.002 (entry 2 ms);
    its first step takes 14 ms where the model says 10 (after idle: +4 ms);
    the busy steps take what the model says. A request sent while a step runs
    waits for it, which is not entry cost."""
    model = LinearLatencyModel("linear", [0.01, 0.0, 0.0, 0.0])
    lines = [
        _line(100.002, wait=5.0, adds=1, step=0.014),
        _line(100.016, step=0.010),
        _line(100.026, adds=1, step=0.010),  # sent at 100.020, during the step before
        _line(100.036, step=0.010),
    ]
    real = {"t0_epoch": 100.0, "requests": [{"start_s": 0.0, "end_s": 0.04}, {"start_s": 0.020, "end_s": 0.045}]}
    v = step_log_view(lines, real, model)
    assert v["steps"] == 4 and v["steps_after_idle"] == 1
    assert v["busy_s"] == pytest.approx(0.044) and v["predicted_busy_s"] == pytest.approx(0.04)
    assert v["wake_extra_s_p50"] == pytest.approx(0.004)
    assert v["busy_step_ratio_p50"] == pytest.approx(1.0)
    assert v["entry_s"]["n"] == 1 and v["entry_s"]["p50"] == pytest.approx(0.002)


def _report(rate, goodput, attainment, ttft, tpot):
    lat = {f"{m}_s": {q: v * f for q, f in (("p50", 1.0), ("p90", 2.0), ("p99", 3.0))}
           for m, v in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2e", 1.0))}
    return {"scaling": {"rate_rps": rate}, "goodput_rps": goodput, "slo_attainment": attainment,
            "throughput_rps": rate, "num_completed": 10, "duration_s": 1.0, **lat}


def test_judgement_of_a_sweep():
    real = [_report(1, 1.0, 1.0, 0.01, 0.01), _report(2, 1.9, 0.95, 0.02, 0.01), _report(4, 2.0, 0.5, 0.1, 0.02)]
    close = [_report(1, 1.0, 1.0, 0.0105, 0.0095), _report(2, 1.85, 0.92, 0.022, 0.011),
             _report(4, 2.05, 0.47, 0.11, 0.021)]
    per = [compare_rate(a, b) for a, b in zip(real, close)]
    assert per[1]["latency"]["ttft_p90"]["error"] == pytest.approx(0.1)
    assert per[2]["attainment_error"] == pytest.approx(-0.03)
    s = judge(per)
    assert s["all_met"] and s["knee"]["real"] == 4 and s["knee"]["sim"] == 4
    assert s["ttft_p90"]["worst"] == pytest.approx(0.1)

    # a simulator that saturates early: attainment off by 40 points, knee two grid steps early
    early = [_report(1, 0.8, 0.6, 0.03, 0.01), _report(2, 1.0, 0.5, 0.05, 0.02), _report(4, 1.0, 0.2, 0.5, 0.05)]
    s = judge([compare_rate(a, b) for a, b in zip(real, early)])
    assert not s["all_met"] and not s["attainment"]["met"] and not s["goodput"]["met"]
    assert s["knee"]["sim"] == 1 and s["knee"]["real"] == 4 and not s["knee"]["met"]


def test_knee_is_the_first_rate_below_the_level():
    assert knee([1, 2, 4, 8], [1.0, 0.95, 0.89, 0.2]) == 2
    assert knee([1, 2], [1.0, 0.95]) is None
    assert knee([1, 2], [0.5, 0.95]) == 0
