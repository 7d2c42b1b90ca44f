"""Fork/join requests (`stages`): a serial stage, parallel branches with their
own suffixes, a join that continues from everything before it. Checked
against plain requests with the prompts each stage should have seen, through
the Python API, `AsyncEngine` streams, the simulator and the synthetic traces."""

from __future__ import annotations

import asyncio

import pytest

from stepserve import LLM, AsyncEngine, SamplingParams
from stepserve.scheduler.errors import RequestError
from stepserve.scheduler.latency_model import LinearLatencyModel
from stepserve.traces.metrics import SLO, summarize
from stepserve.traces.synthetic import SyntheticConfig, generate
from stepserve.traces.simulator import SimConfig, Simulator

PROMPT = "In the beginning"


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(llama_ckpt, check_invariants=True)


def _idle(llm):
    sched = llm.engine.scheduler
    assert not sched.running and not sched.waiting and sched.kv.tree.protected_size() == 0
    kv = sched.kv
    assert kv.allocator.available() + kv.tree.total_size() == kv.capacity
    assert not llm.engine.core._staged


def _greedy(llm, ids, n):
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return llm.generate([ids], p)[0].outputs[0].token_ids


def test_stages_continue_from_what_came_before(llm):
    tok = llm.tokenizer
    suffix_b = tok.encode(" and the earth", add_special_tokens=False)
    stages = [{"branches": [{"prompt": " God said", "max_tokens": 5}, {"prompt": suffix_b, "max_tokens": 7},
                            {"max_tokens": 3}]},
              {"max_tokens": 6}]
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([PROMPT], p, stages=stages)[0]
    assert out.finished
    assert [(o.index, o.stage, len(o.token_ids)) for o in out.outputs] == [
        (0, 0, 4), (1, 1, 5), (2, 1, 7), (3, 1, 3), (4, 2, 6)]
    o = [x.token_ids for x in out.outputs]
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    ctx = prompt + o[0]
    assert o[0] == _greedy(llm, prompt, 4)
    assert o[1] == _greedy(llm, ctx + tok.encode(" God said", add_special_tokens=False), 5)
    assert o[2] == _greedy(llm, ctx + suffix_b, 7)
    assert o[3] == _greedy(llm, ctx, 3)
    assert o[4] == _greedy(llm, ctx + o[1] + o[2] + o[3], 6)
    # text is detokenized in context, as a plain request with that context as its prompt has it
    ctxs = [ctx + tok.encode(" God said", add_special_tokens=False), ctx + suffix_b, ctx, ctx + o[1] + o[2] + o[3]]
    for c, x in zip(ctxs, out.outputs[1:]):
        plain = llm.generate([c], SamplingParams(max_tokens=len(x.token_ids), temperature=0, ignore_eos=True))
        assert x.text == plain[0].outputs[0].text
    _idle(llm)


def test_seeded_stages_repeat_and_differ_by_branch(llm):
    stages = [{"branches": [{"max_tokens": 6}] * 3}, {"max_tokens": 4}]
    p = SamplingParams(max_tokens=3, temperature=1.5, seed=21, ignore_eos=True)
    a = [x.token_ids for x in llm.generate([PROMPT], p, stages=stages)[0].outputs]
    b = [x.token_ids for x in llm.generate([PROMPT], p, stages=stages)[0].outputs]
    assert a == b
    assert len({tuple(x) for x in a[1:4]}) > 1  # same context, own seeds
    _idle(llm)


@pytest.mark.parametrize("stages,match", [
    ([{"max_tokens": 0}], "positive"),
    ([{"branches": []}], "non-empty"),
    ([{"branches": [{"prompt": "x"}]}], "max_tokens"),
    ([{"max_tokens": 2, "branches": [{"max_tokens": 2}]}], "either"),
    ([{"branches": [{"prompt": [10**9], "max_tokens": 2}]}], "vocabulary"),
    ([{"branches": [{"prompt": 5, "max_tokens": 2}]}], "string or token ids"),
    ([{"max_tokens": 10**6}], "context"),
    (["serial"], "either"),
])
def test_bad_stages_are_refused_and_leave_nothing(llm, stages, match):
    with pytest.raises(RequestError, match=match):
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=2), stages=stages)
    with pytest.raises(RequestError, match="n = 1"):
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=2, n=2), stages=[{"max_tokens": 2}])
    _idle(llm)


def test_stop_in_a_branch_and_abort_mid_stage(llm):
    """A branch that stops early ends only itself; an abort during the
    parallel stage frees every branch and forgets the stages to come."""
    eng = llm.engine
    stages = [{"branches": [{"max_tokens": 30}, {"max_tokens": 30}]}, {"max_tokens": 4}]
    req = eng.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), stages=stages)
    while len(req.branches) < 3:
        eng.step()
    eng.step()
    assert not req.finished and req.stages_left == 1
    eng.abort_request(req.request_id)
    out = req.output(delta=False)
    assert out.finished and {o.finish_reason for o in out.outputs[1:]} == {"abort"}
    _idle(llm)


def test_async_stream_reports_every_branch_with_its_stage(llama_ckpt):
    stages = [{"branches": [{"prompt": " A", "max_tokens": 4}, {"prompt": " B", "max_tokens": 6}]},
              {"max_tokens": 5}]
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ref = LLM(llama_ckpt).generate([PROMPT], p, stages=stages)[0]

    async def run():
        eng = AsyncEngine(model=llama_ckpt, process=True)
        try:
            got: dict[int, list[int]] = {}
            stage_of: dict[int, int] = {}
            async for delta in eng.generate(PROMPT, p, stages=stages):
                for o in delta.outputs:
                    got.setdefault(o.index, []).extend(o.token_ids)
                    stage_of[o.index] = o.stage
            return got, stage_of
        finally:
            eng.shutdown()

    got, stage_of = asyncio.run(run())
    assert got == {o.index: o.token_ids for o in ref.outputs}
    assert stage_of == {0: 0, 1: 1, 2: 1, 3: 2}


# -- traces and the simulator ---------------------------------------------------------

def test_synthetic_fork_join_mix():
    cfg = SyntheticConfig.parse("synthetic:num=400,rate=10,fork_fraction=0.8,fork_branches=3,fork_stages=2,"
                                "fork_suffix=fixed:5,fork_output=fixed:7,join_output=fixed:9,seed=2")
    specs = generate(cfg)
    forked = [s for s in specs if s.stages]
    assert 0.72 < len(forked) / len(specs) < 0.88
    s = forked[0]
    assert [len(st) for st in s.stages] == [3, 1, 3, 1]
    assert all(seg.length == 5 and out == 7 for seg, out in s.stages[0])
    assert s.stages[1] == ((None, 9),)
    assert s.total_output == s.output_len + 2 * (3 * 7 + 9)
    with pytest.raises(ValueError):
        SyntheticConfig.parse("synthetic:branch_fraction=0.5,fork_fraction=0.6")


def test_simulated_fork_join_runs_every_stage():
    """Every stage's tokens are generated, the join starts after the slowest
    branch, and the parallel stage's branches share the context (the radix
    cache serves it)."""
    specs = generate(SyntheticConfig.parse(
        "synthetic:num=30,rate=50,input=fixed:40,output=fixed:6,fork_fraction=1,fork_branches=4,"
        "fork_suffix=fixed:3,fork_output=uniform:2:9,join_output=fixed:5,seed=1"))
    model = LinearLatencyModel("linear", [1e-3, 1e-4, 0.0, 1e-6])
    sim = Simulator(model, SimConfig(kv_slots=20000, max_context=512, vocab_size=100, check_every=1))
    res = sim.run(specs)
    by_id = {r.request_id: r for r in res.records}
    for s in specs:
        r = by_id[s.request_id]
        assert r.completed and r.output_tokens == s.total_output and r.stages == 3
    # TPOT counts every stage's tokens after the first delivery
    r = by_id[specs[0].request_id]
    assert r.tpot == pytest.approx((r.end_s - r.first_token_s) / (r.output_tokens - 1))
    assert summarize(res.records, res.duration_s, SLO())["num_victims"] is None  # nothing serial
    assert sim.core.scheduler.prefix_hit_tokens > 0


# -- over HTTP ------------------------------------------------------------------------

def test_native_generate_with_stages(llama_ckpt):
    """`POST /generate` with `stages`: the same outputs as the Python API,
    whole or streamed (each event's outputs carry index and stage); a bad
    stage is a 400 naming `stages`, and the server keeps serving."""
    import json

    import httpx
    from server_util import ServerThread

    stages = [{"branches": [{"prompt": " A", "max_tokens": 4}, {"prompt": " B", "max_tokens": 6}]},
              {"max_tokens": 5}]
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ref = LLM(llama_ckpt).generate([PROMPT], p, stages=stages)[0]
    body = {"text": PROMPT, "sampling_params": {"max_tokens": 3, "temperature": 0, "ignore_eos": True},
            "stages": stages}
    with ServerThread(llama_ckpt) as srv:
        r = httpx.post(srv.url + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        d = r.json()
        assert [(o["index"], o["stage"], o["token_ids"]) for o in d["outputs"]] == [
            (o.index, o.stage, o.token_ids) for o in ref.outputs]
        assert d["usage"]["completion_tokens"] == 3 + 4 + 6 + 5
        got: dict[int, list[int]] = {}
        with httpx.stream("POST", srv.url + "/generate", json={**body, "stream": True}, timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for o in json.loads(line[6:])["outputs"]:
                        got.setdefault(o["index"], []).extend(o["token_ids"])
        assert got == {o.index: o.token_ids for o in ref.outputs}
        for bad in ([{"max_tokens": 2, "branches": [{"max_tokens": 1}]}], [{"max_tokens": 100000}], []):
            r = httpx.post(srv.url + "/generate", json={**body, "stages": bad}, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] is None or "stages" in err["param"], err
        srv.wait_idle()
        srv.kv_report()
        join = httpx.post(srv.url + "/generate", json=body, timeout=60).json()["outputs"][3]
        assert join["stage"] == 2 and join["token_ids"] == ref.outputs[3].token_ids
