"""One step loop: the engine and the simulator run the same `EngineCore`, so
the same trace makes the same plans, step by step (admissions, chunks, forks,
retractions), and refuses the same requests."""

from __future__ import annotations

import dataclasses

import pytest

from stepserve import LLM, SamplingParams
from stepserve.scheduler.errors import RequestError
from stepserve.scheduler.latency_model import LinearLatencyModel
from stepserve.traces.request_spec import PromptBuilder
from stepserve.traces.simulator import PLACEHOLDER_TOKEN, SimConfig, Simulator
from stepserve.traces.synthetic import SyntheticConfig, generate


class PlanRecorder:
    """A step policy that changes nothing and writes down every plan."""

    name = "plan-recorder"

    def __init__(self):
        self.steps = []

    def plan(self, plan, view):
        return plan

    def observe(self, plan, record):
        self.steps.append((
            tuple((r.seq.seq_id, r.seq.branch, r.start, r.num_new, r.sample) for r in plan.rows),
            tuple(s.seq_id for s in plan.admitted),
            tuple(s.seq_id for s in plan.retracted),
            (record.rows, record.decode_rows, record.context_tokens, record.new_tokens),
        ))


class PlaceholderTokens:
    """The engine's model runner (the forward pass runs, KV is written) whose
    sampled tokens are replaced by the simulator's placeholder, so that token
    values cannot steer the two runs apart (through EOS or the radix tree)."""

    def __init__(self, runner):
        self.runner = runner

    def run(self, plan, features):
        out = self.runner.run(plan, features)
        out.token_ids = [PLACEHOLDER_TOKEN] * len(out.token_ids)
        return out


@pytest.mark.parametrize("kv_slots", [4000, 320])  # roomy, and tight enough to retract
def test_engine_and_simulator_make_identical_plans(llama_ckpt, kv_slots):
    specs = generate(SyntheticConfig.parse(
        "synthetic:num=30,rate=1,input=uniform:8:120,output=uniform:1:40,prefix_groups=3,prefix_len=48,"
        "branch_fraction=0.3,branches=3,seed=7"))
    specs = [dataclasses.replace(s, arrival_s=0.0) for s in specs]  # all queued before the first step
    specs.append(dataclasses.replace(specs[0], request_id="too-long", output_len=600))  # refused by both
    limits = dict(max_running=8, max_batched_tokens=96)

    engine_plans = PlanRecorder()
    llm = LLM(llama_ckpt, kv_slots=kv_slots, max_model_len=512, device="cpu", check_invariants=True,
              policies=[engine_plans], **limits)
    engine = llm.engine
    engine.core.runner = PlaceholderTokens(engine.runner)
    builder = PromptBuilder(384, seed=0)
    engine_refused = []
    for spec in sorted(specs, key=lambda s: s.arrival_s):
        params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, n=spec.n, temperature=0.0)
        try:
            engine.add_request(builder.prompt(spec), params, request_id=spec.request_id)
        except RequestError as e:
            engine_refused.append((spec.request_id, e.param))
    while engine.has_unfinished():
        engine.step()

    sim_plans = PlanRecorder()
    sim = Simulator(LinearLatencyModel("linear", [1e-3, 0, 0, 0]),
                    SimConfig(kv_slots=kv_slots, max_context=512, vocab_size=384, check_every=1, **limits),
                    [sim_plans])
    res = sim.run(specs)

    assert engine_refused == [("too-long", "max_tokens")]
    assert [r.request_id for r in res.records if r.error] == ["too-long"]
    assert len(engine_plans.steps) == len(sim_plans.steps) > 30
    for i, (a, b) in enumerate(zip(engine_plans.steps, sim_plans.steps)):
        assert a == b, f"step {i}: engine {a} != simulator {b}"
    if kv_slots == 320:
        assert any(step[2] for step in sim_plans.steps), "the tight pool should retract"
    assert any(len({r[0] for r in step[0]}) > 1 for step in sim_plans.steps)
    assert engine.scheduler.num_retractions == sim.core.scheduler.num_retractions
