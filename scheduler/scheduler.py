"""Continuous batching: which rows run each step.

Each step: every decoding sequence gets one row; sequences mid-prefill continue
their chunk; waiting sequences are admitted (FCFS or longest-prefix-match)
while the token budget, the running cap, req->token rows and KV slots allow.
If the KV pool cannot hold one more token per decoding sequence, the cheapest
sequences are retracted (fewest generated tokens first, then longest prompt):
their computed KV goes to the radix tree as ordinary evictable cache, and they
are requeued at the front, to recompute later -- nothing is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from stepserve.scheduler.kv_manager import KVManager
from stepserve.scheduler.latency_model import SincePrompt
from stepserve.scheduler.plan import NO_FOLD, ScheduledRow, StepPlan
from stepserve.scheduler.policy import EngineView, StepPolicy
from stepserve.scheduler.sequence import Seq, SeqStatus

if TYPE_CHECKING:  # (annotations only, as in plan.py)
    import torch


@dataclass
class SchedulerConfig:
    max_running: int = 256
    max_batched_tokens: int = 2048  # token budget per step (prefill chunks + decode rows)
    admission: str = "fcfs"  # "fcfs" | "lpm" (longest prefix match first)
    max_context: int = 2048
    prefix_caching: bool = True
    # Admission reserves KV for the running sequences' future tokens, estimated
    # as remaining_tokens * new_token_ratio (SGLang's heuristic). The ratio
    # decays while memory is calm and jumps back up after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    lpm_max_queue: int = 128  # above this, LPM sorting costs more than it gains

    def __post_init__(self):
        if self.admission not in ("fcfs", "lpm"):
            raise ValueError(f"admission must be 'fcfs' or 'lpm', not {self.admission!r}")
        if self.max_batched_tokens < 1 or self.max_running < 1:
            raise ValueError("max_batched_tokens and max_running must be >= 1")


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv: KVManager,
        policies: Iterable[StepPolicy] = (),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.kv = kv
        self.policies = list(policies)
        self.clock = clock
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.new_token_ratio = cfg.init_new_token_ratio
        self.num_retractions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.spec_drafted = 0  # draft tokens verified, and of them accepted
        self.spec_accepted = 0
        # overlap schedule (`EngineCore`): the plan launched on the device but not yet `advance`d
        self.launched: StepPlan | None = None
        self.since_prompt = SincePrompt()  # over the committed steps (`StepPlan.after_prompt`)
        # which prompt chunks the runner folds into decode-shaped queries (the engine sets the runner's rule;
        # the simulator the profile's): decided for each plan at commit (`StepPlan.folded`)
        self.fold = NO_FOLD

    # -- queue ---------------------------------------------------------------
    def add(self, seq: Seq, front: bool = False) -> None:
        """Queues `seq` (at the front: a running request's next stage, like a
        retracted sequence)."""
        seq.status = SeqStatus.WAITING
        for c in seq.fork_children:
            c.status = SeqStatus.FORK_PENDING
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Seq) -> None:
        if seq.status is SeqStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if seq.status is not SeqStatus.FINISHED:
            self.finish(seq, "abort")

    def finish(self, seq: Seq, reason: str, num_tokens: int | None = None) -> None:
        """Ends seq now (stop condition found outside the scheduler, or abort).
        `num_tokens`: keep only its first num_tokens tokens (a stop string
        completed inside a run of accepted speculative tokens), also when the
        scheduler already ended it this step; the KV of what is cut is freed."""
        if num_tokens is not None and num_tokens < len(seq.token_ids):
            if seq.status is SeqStatus.RUNNING:
                self.kv.trim(seq, num_tokens)
            del seq.token_ids[num_tokens:]
            if seq.status is SeqStatus.FINISHED:
                seq.finish_reason = reason
        if seq.status is SeqStatus.FINISHED:
            return
        running = seq.status is SeqStatus.RUNNING
        self._end(seq, reason)
        if running:
            self.running.remove(seq)

    def _end(self, seq: Seq, reason: str) -> None:
        ids = seq.token_ids
        if ids and ids[-1] < 0:
            ids.pop()  # a placeholder (`advance`) that will not be resolved: it was aborted
        if self.launched is not None:
            self._drop_launched(seq)
        self.kv.release(seq, cache=True)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def unwind(self, plan: StepPlan) -> None:
        """A step that failed after its slots were allocated (`_commit`) and
        before `advance` counted them (an exception in the forward pass or a
        logits processor, a KeyboardInterrupt): its slots go back to the
        allocator, so that aborting its sequences leaks none -- but a row
        whose sequence ended meanwhile (overlap schedule: `_end` dropped its
        launched row), whose slots are free already. A step already advanced
        owns its slots through its sequences: nothing to do."""
        if plan.advanced or plan.slots is None:
            return
        plan.advanced = True  # once
        for i, r in enumerate(plan.rows):
            if r.seq.status is not SeqStatus.FINISHED:  # (one that ended meanwhile had them freed by `_end`)
                self.kv.allocator.free(self._row_slots(plan, i))

    def _drop_launched(self, seq: Seq) -> None:
        """Frees the slots of `seq`'s row in the launched step (overlap
        schedule: it ended while that step ran, before `advance` counted
        them); `advance` then skips the row and `resolve` its token."""
        plan = self.launched
        for i, r in enumerate(plan.rows):
            if r.seq is seq:
                self.kv.allocator.free(self._row_slots(plan, i))
                return

    @staticmethod
    def _row_slots(plan: StepPlan, i: int) -> torch.Tensor:
        """The slots `_commit` gave row i of `plan` for its new tokens."""
        return plan.slots[i : i + 1] if i < plan.num_decode else plan.rows[i].slots[: plan.rows[i].num_new]

    # -- planning ------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(fold=self.fold)
        reserved = self._schedule_running(plan)
        self._admit(plan, reserved)
        if self.policies:
            view = EngineView(
                now=self.clock(),
                num_running=len(self.running),
                num_waiting=len(self.waiting),
                kv_available=self.kv.available(),
                kv_capacity=self.kv.capacity,
                max_batched_tokens=self.cfg.max_batched_tokens,
                max_context=self.cfg.max_context,
                since_prompt=(self.since_prompt.steps, self.since_prompt.tokens),
            )
            for p in self.policies:
                plan = p.plan(plan, view)
        self._commit(plan)
        self.new_token_ratio = max(
            self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay
        )
        return plan

    def _schedule_running(self, plan: StepPlan) -> int:
        # one pass over the running sequences: this runs every step
        decoding, prefilling = [], []
        max_context = self.cfg.max_context
        for s in self.running:
            n = len(s.token_ids)
            if n - s.num_computed == 1:
                if n - s.prompt_len >= s.max_tokens or n >= max_context:
                    continue  # its last token ends it, once known (overlap schedule: not yet resolved)
                decoding.append(s)
            else:
                prefilling.append(s)
        if self.kv.available() < len(decoding):
            self._retract_for(len(decoding), plan)
            decoding = [s for s in decoding if s.status is SeqStatus.RUNNING]
            prefilling = [s for s in prefilling if s.status is SeqStatus.RUNNING]
        budget = self.cfg.max_batched_tokens
        plan.rows.extend(ScheduledRow(s, s.num_computed, 1, True) for s in decoding)
        reserved = len(decoding)
        budget -= reserved
        for s in prefilling:
            n = min(s.pending, budget, self.kv.available() - reserved)
            if n <= 0:
                break
            plan.rows.append(ScheduledRow(s, s.num_computed, n, n == s.pending))
            budget -= n
            reserved += n
        return reserved

    def _retract_for(self, need: int, plan: StepPlan) -> None:
        victims = sorted(self.running, key=lambda s: (s.num_output, -s.prompt_len))
        while self.kv.available() < need and victims:
            v = victims.pop(0)
            if v.pending == 1:
                need -= 1
            self._retract(v)
            plan.retracted.append(v)
        if self.kv.available() < need:
            raise RuntimeError("KV pool cannot hold one token per running sequence")
        self.new_token_ratio = self.cfg.init_new_token_ratio

    def _retract(self, seq: Seq) -> None:
        self.running.remove(seq)
        self.kv.release(seq, cache=True)
        seq.status = SeqStatus.WAITING
        seq.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(seq)

    def _admission_order(self) -> list[Seq]:
        if self.cfg.admission == "lpm" and self.cfg.prefix_caching and len(self.waiting) <= self.cfg.lpm_max_queue:
            # (no match: a sequence that prefills in full, for its prompt logprobs, reuses nothing)
            hits = {id(s): m.length if (m := self.kv.match(s)) is not None else 0 for s in self.waiting}
            return sorted(self.waiting, key=lambda s: -hits[id(s)])  # stable: FCFS among equals
        return list(self.waiting)

    def _admit(self, plan: StepPlan, reserved: int) -> None:
        if not self.waiting:
            return
        budget = self.cfg.max_batched_tokens - sum(r.num_new for r in plan.rows)
        ratio = self.new_token_ratio
        future = ratio * sum(s.remaining_tokens for s in self.running)
        admitted = []
        # rows promised to running sequences whose n - 1 siblings fork from them once their prompt is in (they were
        # admitted with the rows free: those rows are theirs until they fork)
        rows = self.kv.req_pool.available() - sum(len(s.fork_children) for s in self.running if s.fork_children)
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) >= self.cfg.max_running:
                break
            if rows < 1 + len(seq.fork_children):
                break
            match = self.kv.match(seq)
            self.kv.admit(seq, match)  # locks the matched prefix before we count
            extend = seq.pending
            avail = self.kv.available() - reserved
            n = min(extend, budget, avail)
            own_future = ratio * seq.remaining_tokens * (1 + len(seq.fork_children))
            if n <= 0 or (self.running and n + future + own_future > avail):
                self.kv.release(seq, cache=False)
                break
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
            rows -= 1 + len(seq.fork_children)
            plan.rows.append(ScheduledRow(seq, seq.num_computed, n, n == extend))
            budget -= n
            reserved += n
            future += own_future
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += seq.num_cached
        if admitted:
            gone = set(map(id, admitted))
            self.waiting = deque(s for s in self.waiting if id(s) not in gone)
            plan.admitted = admitted

    def _commit(self, plan: StepPlan) -> None:
        """Allocates this step's KV slots and writes them into the req->token table."""
        plan.sort_decode_first()
        plan.samples = plan.sampling()
        plan.folded = plan.fold.decide(plan.rows, plan.rows[plan.num_decode + plan.num_verify:])
        plan.committed = True
        total = plan.num_new_tokens
        if total == 0:
            return
        plan.after_prompt = self.since_prompt.advance(total - plan.num_decode)
        slots = self.kv.alloc(total)
        if slots is None:
            raise RuntimeError(f"KV accounting error: {total} slots planned, {self.kv.available()} available")
        plan.slots = slots
        nd = plan.num_decode
        if nd:
            dec = plan.rows[:nd]
            self.kv.req_pool.write([r.seq.row for r in dec], [r.start for r in dec], slots[:nd])
        off = nd
        for r in plan.rows[nd:]:
            r.slots = slots[off : off + r.num_new]
            self.kv.assign(r.seq, r.slots)
            off += r.num_new

    # -- results -------------------------------------------------------------
    def update(self, plan: StepPlan, tokens: list[int]) -> list[Seq]:
        """Applies sampled tokens (one per `plan.samples` entry); returns the
        sequences that received a token. Token-level stop conditions end them.

        It is `advance` then `resolve`: with the overlap schedule
        (`EngineCore`) the two halves run a step apart."""
        return self.resolve(plan, self.advance(plan), tokens)

    def advance(self, plan: StepPlan) -> list[tuple[int, Seq]]:
        """The half of `update` that needs no token value: the rows' KV counts
        as computed, chunks are published to the prefix cache, forks happen,
        and each sampling sequence gets a *placeholder* as its next token,
        -1 - k for `plan.samples[k]` (a model runner reads it on the device,
        from the tokens of the step that sampled it). Returns the (k, seq)
        that got one; `resolve` puts the tokens in. Verify rows are left to
        `resolve` (what they computed depends on what was accepted)."""
        caching = self.cfg.prefix_caching
        nd, nv = plan.num_decode, plan.num_verify
        FINISHED = SeqStatus.FINISHED
        plan.advanced = True
        for r in plan.rows[:nd] + plan.rows[nd + nv :] if nv else plan.rows:
            seq = r.seq
            if seq.status is FINISHED:  # ended while the step ran (overlap; `_end` freed the step's slots)
                continue
            seq.num_computed += r.num_new
            if not r.sample and caching:
                self.kv.cache_prefix(seq)  # publish the chunk for concurrent prompts
        sampling = plan.samples
        # Forks first, while every parent still holds its prompt's KV.
        for i, seq in sampling:
            if seq.status is SeqStatus.FORK_PENDING:
                parent = plan.rows[i].seq
                self.kv.cache_prefix(parent)
                self.kv.fork(parent, seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
        placed = []
        a, b = plan.verify_samples() if nv else (0, 0)
        for k, (_, seq) in enumerate(sampling):
            if seq.status is FINISHED or a <= k < b:
                continue
            if seq.fork_children:
                seq.fork_children = []  # forked: the siblings are independent now
            seq.token_ids.append(-1 - k)
            placed.append((k, seq))
        return placed

    def resolve(self, plan: StepPlan, placed: list[tuple[int, Seq]], tokens: list[int]) -> list[Seq]:
        """The other half of `update`: puts the sampled tokens in place of the
        placeholders `advance` gave `placed`, stamps them, and ends the
        sequences they stop; applies the verify rows. Returns the sequences
        that received a token."""
        assert len(tokens) == len(plan.samples), (len(tokens), len(plan.samples))
        now = self.clock()
        got = []
        ended = []
        if plan.num_verify:
            a, b = plan.verify_samples()
            self._update_verify(plan, list(zip(plan.samples[a:b], tokens[a:b])), now, got, ended)
        max_context = self.cfg.max_context
        FINISHED = SeqStatus.FINISHED
        for k, seq in placed:
            if seq.status is FINISHED:  # aborted since (`_end` dropped its placeholder)
                continue
            tok = tokens[k]
            ids = seq.token_ids
            ids[-1] = tok
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            c = seq.clock
            if c is not None:
                if c.start is None:
                    c.start = now
                if c.start == now:
                    c.first += 1
                c.tokens += 1
            got.append(seq)
            # token-level stops, inlined: this loop runs once per row per step
            n_out = len(ids) - seq.prompt_len
            if n_out >= seq.min_tokens and (
                (tok in seq.eos_token_ids and not seq.ignore_eos) or tok in seq.stop_token_ids
            ):
                ended.append((seq, "stop"))
            elif n_out >= seq.max_tokens or len(ids) >= max_context:
                ended.append((seq, "length"))
        if ended:
            for seq, reason in ended:
                self._end(seq, reason)
            self.running = [s for s in self.running if s.status is not FINISHED]
        return got

    def _update_verify(self, plan: StepPlan, pairs, now: float, got: list, ended: list) -> None:
        """Applies the verify rows: each accepted draft token, then the sampled
        token (the correction, or the bonus when every draft was accepted), up
        to the first token-level stop. The KV of the pending token and the
        accepted drafts is kept; the slots of rejected and unused draft
        positions, and of anything cut by a stop, are freed at once."""
        max_context = self.cfg.max_context
        free = self.kv.allocator.free
        for (i, seq), tok in pairs:
            r = plan.rows[i]
            acc = r.num_accepted
            new = (r.draft[:acc] if acc else []) + [tok]
            self.spec_drafted += len(r.draft or ())
            self.spec_accepted += acc
            ids = seq.token_ids
            reason = None
            m = 0
            for t in new:
                ids.append(t)
                m += 1
                n_out = len(ids) - seq.prompt_len
                if n_out >= seq.min_tokens and (
                    (t in seq.eos_token_ids and not seq.ignore_eos) or t in seq.stop_token_ids
                ):
                    reason = "stop"
                    break
                if n_out >= seq.max_tokens or len(ids) >= max_context:
                    reason = "length"
                    break
            computed = min(r.start + 1 + acc, len(ids))
            keep = computed - r.start
            if keep < r.num_new:
                free(r.slots[keep:])
            seq.num_computed = computed
            seq.last_token_time = now
            c = seq.clock
            if c is not None:
                c.tokens += m
            got.append(seq)
            if reason is not None:
                ended.append((seq, reason))

    def check(self) -> None:
        self.kv.check(self.running)
        for s in self.running:
            assert s.status is SeqStatus.RUNNING and s.row is not None
        for s in self.waiting:
            assert s.status is SeqStatus.WAITING and s.row is None
