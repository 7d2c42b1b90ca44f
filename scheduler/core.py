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
queued, the rest forked from it when its prefill completes), and, for a
fork/join request, of each later stage's sequences when the stage before it
has finished (`Stage`; the owner hears of them through `StepHooks.staged`).

What stays with the owner, through `StepHooks`: what a step's tokens mean to
its requests (text, logprobs, stop strings for the engine; timing records for
the simulator).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from stepserve.scheduler.latency_model import StepFeatures, plan_features
from stepserve.scheduler.errors import RequestError
from stepserve.scheduler.limits import Limits
from stepserve.scheduler.plan import StepPlan, StepRecord
from stepserve.scheduler.scheduler import Scheduler
from stepserve.scheduler.sequence import RequestClock, Seq


@dataclass
class Stage:
    """A stage of a fork/join request after its first (serial) one: one or
    more branches, each a (suffix token ids, max_tokens) pair. A branch
    continues from the request's context -- its prompt and every earlier
    stage's output, a parallel stage's outputs in branch order -- plus its own
    suffix. A serial stage is one branch with an empty suffix. Its sequences
    are queued at the front (the request is already running), and carry the
    time the stage began (`Seq.stage_start`): a policy's clock for them starts
    there, not late for the wait on the stage before."""

    branches: list[tuple[list[int], int]]

    def __post_init__(self):
        if not self.branches:
            raise ValueError("a stage needs at least one branch")


@dataclass
class _Staged:
    """The core's state of a fork/join request between its stages."""

    stages: list[Stage]
    seeds: list[int]  # one per branch of every stage after the first, in order
    fields: dict  # the Seq fields every stage's sequences share
    arrival: float
    current: list[Seq] = field(default_factory=list)
    next: int = 0  # the stage to start when `current` has finished
    index: int = 1  # the next branch's index within the request


def stage_context(current: list[Seq]) -> list[int]:
    """What the next stage continues from: a serial stage's whole sequence, or
    a parallel stage's context plus each branch's output in order."""
    if len(current) == 1:
        return list(current[0].token_ids)
    first = current[0]
    ctx = first.token_ids[: first.prompt_len - first.suffix_len]
    for s in current:
        ctx = ctx + s.output_ids
    return ctx


class RunOutput(Protocol):
    token_ids: list[int]  # one per `plan.samples` entry
    prep_s: float  # of the run's time, building its inputs
    cold: bool  # the forward ran a shape it had not run before (one-off work in its time: `StepRecord.cold`)


class StepRunner(Protocol):
    def run(self, plan: StepPlan, features: StepFeatures) -> RunOutput: ...


class OverlapRunner(StepRunner, Protocol):
    """A runner that can start a step and finish it later (`EngineCore`'s
    overlap schedule): `launch` returns at once with the step running on the
    device, reading the placeholders of the step before from `prev`'s tokens
    there; `finish` waits for its tokens. `launch(sample=False)` runs the
    forward pass alone, and `sample` samples it once the step before is
    finished (rows whose sampling reads their output: `needs_tokens`)."""

    def launch(self, plan: StepPlan, features: StepFeatures, prev: Any = None, sample: bool = True) -> Any: ...

    def sample(self, launched: Any) -> None:
        """Samples a step launched with `sample=False`."""

    def finish(self, launched: Any) -> RunOutput: ...


@dataclass
class _InFlight:
    plan: StepPlan
    features: StepFeatures
    launched: Any  # the runner's handle
    placed: list  # `Scheduler.advance`'s placeholders
    t_start: float  # when its step() call began
    host_s: float  # that call's host time before the launch: schedule, admissions, features
    launch_s: float = 0.0  # that call's host time through the launch (`host_s`, then building and launching it)


class StepHooks(Protocol):
    def admitted(self, seq: Seq) -> None:
        """`seq` was admitted this step (its prefix-cache hit is known)."""

    def ran(self, plan: StepPlan, out: RunOutput) -> None:
        """The forward pass ran; the scheduler has not taken its tokens yet."""

    def updated(self, plan: StepPlan, out: RunOutput, got: list[Seq]) -> None:
        """The scheduler appended a token to each of `got` (and ended those
        that stop on a token); the owner applies what else the tokens mean."""

    def staged(self, group: Any, seqs: list[Seq]) -> None:
        """A fork/join request's next stage began: `seqs` are its sequences,
        queued (their `branch` is their index within the request)."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: StepRunner, hooks: StepHooks, limits: Limits, *,
                 clock: Callable[[], float] = time.perf_counter, check_every: int = 0,
                 max_records: int = 4096, overlap: bool = False, needs_tokens: Callable[[Seq], bool] | None = None):
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
        self._staged: dict[int, _Staged] = {}  # id(group) -> a fork/join request's later stages
        # the overlap schedule (`_step_overlap`): the runner is an `OverlapRunner`; `needs_tokens(seq)`: seq's
        # sampling reads its output on the host (a grammar's state): its step is sampled after the one before
        # is finished
        self.overlap = overlap
        self.needs_tokens = needs_tokens or (lambda seq: False)
        self._inflight: _InFlight | None = None
        self._last_done = 0.0  # when the last step finished (overlap: the period of back-to-back steps)
        self.overlapped_steps = 0  # steps launched while the step before was still running

    # -- requests -------------------------------------------------------------
    @property
    def kv_capacity(self) -> int:
        return self.scheduler.kv.capacity

    def check_request(self, token_ids: list[int], max_tokens: int | None, n: int = 1) -> int:
        """The generation cap of a request of `n` branches, or a RequestError (`Limits`)."""
        self.limits.check_n(n)
        self.limits.check_prompt(token_ids)
        return self.limits.max_tokens(len(token_ids), max_tokens)

    def check_stages(self, token_ids: list[int], max_tokens: int, stages: list[Stage]) -> None:
        """Refuses a fork/join request whose longest context could pass the
        model's (every stage generating its whole max_tokens)."""
        cap = min(self.limits.max_context, self.limits.kv_capacity)
        ctx = len(token_ids) + max_tokens
        for k, st in enumerate(stages):
            for b, (suffix, mt) in enumerate(st.branches):
                if mt < 1:
                    raise RequestError(f"stage {k + 1} branch {b}: max_tokens must be at least 1", "stages")
                if ctx + len(suffix) + mt > cap:
                    raise RequestError(
                        f"stage {k + 1} branch {b} could reach {ctx + len(suffix) + mt} tokens of context, "
                        f"more than the {cap} the model and the KV pool allow", "stages")
            ctx += st.branches[0][1] if len(st.branches) == 1 else sum(mt for _, mt in st.branches)

    def add_sequences(self, token_ids: list[int], max_tokens: int, arrival: float, group: Any, *,
                      seeds: list[int], stages: list[Stage] | None = None, stage_seeds: list[int] | None = None,
                      slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                      **seq_fields) -> list[Seq]:
        """One sequence per seed (branch); the first is queued, the others fork
        from it when its prefill completes and share its prompt's KV.

        `stages` (after `check_stages`): a fork/join request, whose first stage
        is this one sequence (one seed) and whose later stages start as each
        finishes, with `stage_seeds` (one per later branch, in order).
        `slo_ttft_s`, `slo_tpot_s`: the request's own SLOs, on its
        `RequestClock` for the step policies (None: theirs)."""
        if stages:
            if len(seeds) != 1:
                raise ValueError("a fork/join request starts with one sequence (n = 1)")
            n_later = sum(len(st.branches) for st in stages)
            if stage_seeds is None or len(stage_seeds) != n_later:
                raise ValueError(f"stage_seeds: want {n_later}, one per branch of the later stages")
        seqs = []
        plen = len(token_ids)
        clock = RequestClock(slo_ttft_s, slo_tpot_s)
        for b, seed in enumerate(seeds):
            seqs.append(Seq(self._next_seq_id, token_ids if b == 0 else list(token_ids), plen, max_tokens,
                            arrival, branch=b, seed=seed, group=group, clock=clock, **seq_fields))
            self._next_seq_id += 1
        seqs[0].fork_children = seqs[1:]
        if stages:
            self._staged[id(group)] = _Staged(list(stages), list(stage_seeds), seq_fields, arrival, current=seqs)
        self.scheduler.add(seqs[0])
        return seqs

    def drop_stages(self, group: Any) -> None:
        """Forgets a fork/join request's later stages (it was aborted)."""
        self._staged.pop(id(group), None)

    def _advance_stages(self, got: list[Seq]) -> None:
        staged = self._staged
        for seq in got:
            if not seq.finished:
                continue
            key = id(seq.group)
            st = staged.get(key)
            if st is None or seq not in st.current or not all(s.finished for s in st.current):
                continue
            if any(s.finish_reason == "abort" for s in st.current):
                del staged[key]
                continue
            ctx = stage_context(st.current)
            stage = st.stages[st.next]
            now = self.scheduler.clock()  # the clock the scheduler stamps tokens with
            clock = seq.clock
            clock.reset(now)
            new = []
            for suffix, mt in stage.branches:
                ids = ctx + list(suffix)
                s = Seq(self._next_seq_id, ids, len(ids), mt, st.arrival,
                        branch=st.index, seed=st.seeds[st.index - 1], group=seq.group, suffix_len=len(suffix),
                        stage_start=now, clock=clock, **st.fields)
                self._next_seq_id += 1
                st.index += 1
                new.append(s)
            st.current = new
            st.next += 1
            if st.next == len(st.stages):
                del staged[key]
            for s in reversed(new):
                self.scheduler.add(s, front=True)
            self.hooks.staged(seq.group, new)

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    # -- the step ---------------------------------------------------------------
    def step(self) -> StepPlan | None:
        """One step; None if nothing could be scheduled. With the overlap
        schedule, the step whose tokens came back in this call (None: none
        did)."""
        if self.overlap:
            return self._step_overlap()
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
        try:
            out = self.runner.run(plan, features)
            t2 = clock()
            hooks.ran(plan, out)
            got = sched.update(plan, out.token_ids)
        except BaseException:  # (a processor that raised, a KeyboardInterrupt) the step's slots go back
            sched.unwind(plan)
            raise
        self._apply(plan, out, got)
        t3 = clock()
        self._record(plan, features, out, wall_s=t3 - t0, forward_s=t2 - t1 - out.prep_s,
                     schedule_s=(t1 - t0) + (t3 - t2))
        return plan

    def _apply(self, plan: StepPlan, out: RunOutput, got: list[Seq]) -> None:
        self.hooks.updated(plan, out, got)
        if self._staged:
            self._advance_stages(got)

    def _step_overlap(self) -> StepPlan | None:
        """The overlap schedule (SGLang's "overlap scheduler"): step N+1 is
        scheduled and launched while step N still runs on the device, and
        only then are N's tokens waited for and applied -- the host's work
        for a step hides behind the device's.

            schedule N+1 -> launch N+1 -> finish N (wait for its tokens,
            resolve, hooks, record) -> advance N+1

        What makes it possible: `Scheduler.advance` gives each sequence
        sampled in N a placeholder token, so N+1 schedules it as decoding,
        and the runner reads the placeholder's token on the device. Its
        costs: a sequence that N's token ends (a stop token, a stop string)
        has a row in N+1 already, whose token is dropped and whose slot is
        freed (`Scheduler._drop_launched`); and a new fork/join stage starts
        a step later. N is finished before N+1 is scheduled (no overlap for
        that step) when N+1 might have to retract (a retracted sequence must
        not carry a placeholder). Where a row of N+1 samples through a
        processor that reads its output (`needs_tokens`: a grammar), N+1's
        forward pass is launched, N finished, and then N+1 sampled: the
        forward still runs beside N's host work."""
        clock = self.clock
        sched = self.scheduler
        t0 = clock()
        prev = self._inflight
        if prev is not None and sched.kv.available() < len(sched.running):
            self._inflight = None
            self._finish(prev)
            prev = None
            t0 = clock()
        plan = sched.schedule()
        for seq in plan.admitted:
            self.hooks.admitted(seq)
        if plan.empty:
            if prev is None:
                return None
            self._inflight = None
            self._finish(prev)
            return prev.plan
        features = plan_features(plan)
        t1 = clock()
        # a row whose sampling reads its sequence's output (a grammar) waits for N's tokens: N+1's forward is
        # launched, N finished, then N+1 sampled
        defer = prev is not None and any(self.needs_tokens(s) for _, s in plan.samples)
        try:
            if defer:
                launched = self.runner.launch(plan, features, prev.launched, sample=False)
            else:
                launched = self.runner.launch(plan, features, prev.launched if prev is not None else None)
            sched.launched = plan
            t_launched = clock()
            if prev is not None:
                self.overlapped_steps += 1
                self._finish(prev, successor_host_s=t_launched - t0)
            if defer:
                self.runner.sample(launched)
            placed = sched.advance(plan)
        except BaseException:  # as in `step`; the step in flight is given up too (its rows hold placeholders,
            sched.launched = None  # which an abort drops)
            self._inflight = None
            sched.unwind(plan)
            raise
        sched.launched = None
        self._inflight = _InFlight(plan, features, launched, placed, t0, t1 - t0, t_launched - t0)
        if self.check_every and self.step_id % self.check_every == 0:
            sched.check()
        return prev.plan if prev is not None else plan

    def _finish(self, f: _InFlight, successor_host_s: float = 0.0) -> None:
        """Waits for an in-flight step's tokens and applies them.

        Its record is charged its own host work and not the next step's:
        the period between two steps' ends holds the next step's schedule
        and launch (`successor_host_s`, when it was launched in that
        period), while this step's own ran in the period before, beside the
        step before it. Moving each launch to the step launched keeps the
        sum of the records' times the wall time of the run and prices each
        step by its own plan: an eager prefill step whose launch takes long
        costs itself, not the decode step it followed."""
        clock = self.clock
        t0 = clock()
        out = self.runner.finish(f.launched)
        t1 = clock()
        self.hooks.ran(f.plan, out)
        got = self.scheduler.resolve(f.plan, f.placed, out.token_ids)
        self._apply(f.plan, out, got)
        t2 = clock()
        # its period: since the step before it finished, or since its own step() call began where none was
        # in flight then (its own launch is then inside the period); of that, the host's time on this step
        # alone, outside the wait for the device
        own_outside = self._last_done > f.t_start
        start = self._last_done if own_outside else f.t_start
        wall = t2 - start - successor_host_s + (f.launch_s if own_outside else 0.0)
        sched_s = f.host_s + (t2 - t1)
        self._record(f.plan, f.features, out, wall_s=wall,
                     forward_s=max(wall - sched_s - out.prep_s, 0.0), schedule_s=sched_s)
        self._last_done = t2

    def _record(self, plan: StepPlan, features: StepFeatures, out: RunOutput, *, wall_s: float, forward_s: float,
                schedule_s: float) -> None:
        rec = StepRecord(step=self.step_id, rows=features.rows, decode_rows=plan.num_decode,
                         context_tokens=features.context_tokens, new_tokens=features.new_tokens, wall_s=wall_s,
                         forward_s=forward_s, schedule_s=schedule_s, prep_s=out.prep_s,
                         prefill_pairs=features.prefill_pairs, extend_rows=features.extend_rows,
                         chunk_rows=features.chunk_rows, layered=features.layered, cold=out.cold)
        if plan.num_verify:
            vr = plan.verify_rows
            rec.verify_rows = len(vr)
            rec.draft_tokens = sum(len(r.draft) for r in vr if r.draft)
            rec.accepted_tokens = sum(r.num_accepted for r in vr)
            rec.draft_s = getattr(out, "draft_s", 0.0)
        self.step_id += 1
        records = self.records
        records.append(rec)
        if len(records) > self.max_records:
            del records[: len(records) - self.max_records // 2]
        for p in self.policies:
            p.observe(plan, rec)
        if not self.overlap and self.check_every and self.step_id % self.check_every == 0:
            self.scheduler.check()
