"""`EngineCore`: the one step loop, shared by the engine and the simulator.

    schedule (admission, chunking, retraction; the step policies reshape the
    plan inside) -> features -> run -> update -> hooks -> record -> observe ->
    check

`Engine` runs it with the model (`ModelRunner`) on wall time; `Simulator` with
the latency model (`SimRunner`) on a virtual clock. Everything a policy can see
or change happens here, once, so a policy behaves the same in both.

The core also owns what both sides do when a request enters: the refusals
(`check_request`: `Limits`, raising `RequestError` with the parameter at fault) and the
creation of a request's sequences (`add_sequences`: one per branch, the first
queued, the rest forked from it when its prefill completes).

What stays with the owner, through `StepHooks`: what a step's tokens mean to
its requests (text, logprobs, stop strings for the engine; timing records for
the simulator).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

from stepserve.scheduler.latency_model import StepFeatures, plan_features
from stepserve.scheduler.limits import Limits
from stepserve.scheduler.plan import StepPlan, StepRecord
from stepserve.scheduler.scheduler import Scheduler
from stepserve.scheduler.sequence import Seq


class RunOutput(Protocol):
    token_ids: list[int]  # one per `plan.samples` entry
    prep_s: float  # of the run's time, building its inputs


class StepRunner(Protocol):
    def run(self, plan: StepPlan, features: StepFeatures) -> RunOutput: ...


class StepHooks(Protocol):
    def admitted(self, seq: Seq) -> None:
        """`seq` was admitted this step (its prefix-cache hit is known)."""

    def ran(self, plan: StepPlan, out: RunOutput) -> None:
        """The forward pass ran; the scheduler has not taken its tokens yet."""

    def updated(self, plan: StepPlan, out: RunOutput, got: list[Seq]) -> None:
        """The scheduler appended a token to each of `got` (and ended those
        that stop on a token); the owner applies what else the tokens mean."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: StepRunner, hooks: StepHooks, limits: Limits, *,
                 clock: Callable[[], float] = time.perf_counter, check_every: int = 0,
                 max_records: int = 4096):
        self.scheduler = scheduler
        self.runner = runner
        self.hooks = hooks
        self.limits = limits
        self.clock = clock
        self.check_every = check_every  # run the KV integrity check every N steps (0: never)
        self.policies = scheduler.policies
        self.step_id = 0
        self.records: list[StepRecord] = []  # ring of the most recent steps
        self.max_records = max_records
        self._next_seq_id = 0

    # -- requests -------------------------------------------------------------
    @property
    def kv_capacity(self) -> int:
        return self.scheduler.kv.capacity

    def check_request(self, token_ids: list[int], max_tokens: int | None) -> int:
        """The generation cap of a request, or a RequestError (`Limits`)."""
        self.limits.check_prompt(token_ids)
        return self.limits.max_tokens(len(token_ids), max_tokens)

    def add_sequences(self, token_ids: list[int], max_tokens: int, arrival: float, group: Any, *,
                      seeds: list[int], **seq_fields) -> list[Seq]:
        """One sequence per seed (branch); the first is queued, the others fork
        from it when its prefill completes and share its prompt's KV."""
        seqs = []
        plen = len(token_ids)
        for b, seed in enumerate(seeds):
            seqs.append(Seq(self._next_seq_id, token_ids if b == 0 else list(token_ids), plen, max_tokens,
                            arrival, branch=b, seed=seed, group=group, **seq_fields))
            self._next_seq_id += 1
        seqs[0].fork_children = seqs[1:]
        self.scheduler.add(seqs[0])
        return seqs

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ---------------------------------------------------------------
    def step(self) -> StepPlan | None:
        """One step; None if nothing could be scheduled."""
        clock = self.clock
        hooks = self.hooks
        sched = self.scheduler
        t0 = clock()
        plan = sched.schedule()
        for seq in plan.admitted:
            hooks.admitted(seq)
        if plan.empty:
            return None
        features = plan_features(plan)
        t1 = clock()
        out = self.runner.run(plan, features)
        t2 = clock()
        hooks.ran(plan, out)
        got = sched.update(plan, out.token_ids)
        hooks.updated(plan, out, got)
        t3 = clock()
        rec = StepRecord(step=self.step_id, rows=features.rows, decode_rows=plan.num_decode,
                         context_tokens=features.context_tokens, new_tokens=features.new_tokens, wall_s=t3 - t0,
                         forward_s=t2 - t1 - out.prep_s, schedule_s=(t1 - t0) + (t3 - t2), prep_s=out.prep_s,
                         prefill_pairs=features.prefill_pairs)
        self.step_id += 1
        records = self.records
        records.append(rec)
        if len(records) > self.max_records:
            del records[: len(records) - self.max_records // 2]
        for p in self.policies:
            p.observe(plan, rec)
        if self.check_every and self.step_id % self.check_every == 0:
            sched.check()
        return plan
