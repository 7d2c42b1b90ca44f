"""What one step runs (`StepPlan`) and what it cost (`StepRecord`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepserve.scheduler.sequence import Seq

if TYPE_CHECKING:  # (annotations only: the CLI builds its arguments from this package without importing torch)
    import torch


@dataclass(eq=False, slots=True)
class ScheduledRow:
    seq: Seq
    start: int  # first position computed this step (== seq.num_computed)
    num_new: int  # tokens computed this step
    sample: bool  # the chunk reaches the end of the sequence: sample a token
    slots: torch.Tensor | None = None  # extend rows: KV slots of the new tokens (set at commit)
    # speculation (a verify row): `num_new` = 1 + draft_len slots are reserved for the pending
    # token and up to draft_len drafted tokens (set by the speculation-length policy, before
    # commit); the runner fills `draft` (at most draft_len tokens) and `num_accepted`. A
    # deterministic proposer (the n-gram lookup) drafts in the policy instead: `draft` is set
    # before commit and draft_len is its length, and a row it found nothing for stays a decode row
    draft_len: int = 0
    draft_asked: int = 0  # the drafts the policy asked this row for (>= draft_len)
    draft: list[int] | None = None
    # a draft model's rows under the rejection rule (`engine/speculative.py`): the distribution each drafted token was
    # drawn from [len(draft), V] (None: a deterministic proposal, or drawn with the target's noise)
    draft_probs: Any = None
    num_accepted: int = 0

    @property
    def context_len(self) -> int:
        """Tokens this row attends over after the step."""
        return self.start + self.num_new


@dataclass
class StepPlan:
    """Rows of one forward pass: decode rows (one new token) first, then verify
    rows (a decode row with drafted tokens to check), then extend rows."""

    rows: list[ScheduledRow] = field(default_factory=list)
    retracted: list[Seq] = field(default_factory=list)
    admitted: list[Seq] = field(default_factory=list)
    slots: torch.Tensor | None = None  # all new tokens' KV slots, in row order
    num_decode: int = 0  # leading rows with exactly one new token (set at commit)
    num_verify: int = 0  # verify rows, right after them (set at commit)
    samples: list[tuple[int, Seq]] = field(default_factory=list)  # `sampling()`, frozen at commit
    # (j, P): the j-th decode step after a step of P prompt tokens; j = 0 where it runs prompt tokens
    # itself, P of them (`latency_model.SincePrompt`; set at commit)
    after_prompt: tuple[int, int] = (0, 0)
    advanced: bool = False  # `Scheduler.advance` counted its slots as computed (before: `unwind` frees them)

    @property
    def empty(self) -> bool:
        return not self.rows

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_new_tokens(self) -> int:
        return sum(r.num_new for r in self.rows)

    @property
    def context_tokens(self) -> int:
        return sum(r.context_len for r in self.rows)

    def sort_decode_first(self) -> None:
        rows = self.rows
        nd = 0
        while nd < len(rows) and rows[nd].num_new == 1:
            nd += 1
        nv = sum(1 for r in rows[nd:] if r.draft_len)
        if nv:
            rows.sort(key=lambda r: 0 if r.num_new == 1 else 1 if r.draft_len else 2)  # stable
            nd = sum(1 for r in rows if r.num_new == 1)
        elif any(r.num_new == 1 for r in rows[nd:]):
            rows.sort(key=lambda r: r.num_new != 1)  # stable
            nd = sum(1 for r in rows if r.num_new == 1)
        self.num_decode = nd
        self.num_verify = nv

    @property
    def verify_rows(self) -> list[ScheduledRow]:
        return self.rows[self.num_decode : self.num_decode + self.num_verify]

    def verify_samples(self) -> tuple[int, int]:
        """[a, b): the entries of `samples` that belong to verify rows (one
        each, contiguous: samples follow the row order)."""
        a = 0
        while a < len(self.samples) and self.samples[a][0] < self.num_decode:
            a += 1
        return a, a + self.num_verify

    def sampling(self) -> list[tuple[int, Seq]]:
        """(row index, sequence) per token to sample; a forking row samples once
        for itself and once per child, all from the same logits."""
        out = []
        for i, r in enumerate(self.rows):
            if r.sample:
                seq = r.seq
                out.append((i, seq))
                if seq.fork_children and seq.num_output == 0:
                    out.extend((i, c) for c in seq.fork_children)
        return out


@dataclass
class StepRecord:
    """Measured cost of one step; the step-latency model is fitted on these."""

    step: int
    rows: int  # sequences in the batch
    decode_rows: int
    context_tokens: int  # sum of the rows' context lengths
    new_tokens: int  # tokens computed (prefill chunk tokens + decode tokens)
    wall_s: float  # whole step
    forward_s: float  # model forward + sampling
    schedule_s: float  # schedule() + update() + detokenization and outputs
    prep_s: float = 0.0  # building the batch's input tensors
    prefill_pairs: float = 0.0  # causal attention pairs of the prefill chunks (`latency_model.plan_features`)
    extend_rows: int = 0  # rows that prefill a chunk of more than one token
    # speculation: verify rows, tokens drafted and accepted, and of `forward_s` the proposer's time
    verify_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    # the forward ran a shape the runner had not run before (`StepOutput.cold`): one-off work (kernels built
    # for it) is in its time, so it is no steady-state price
    cold: bool = False
