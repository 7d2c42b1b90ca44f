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


def chunk_pairs(start: int, n: int) -> int:
    """The (query, key) pairs of a chunk of `n` tokens after `start` cached
    ones under causal attention: n*start + n*(n+1)/2 (`prefill_pairs`)."""
    return n * start + n * (n + 1) // 2


def is_chunk(r: ScheduledRow) -> bool:
    """A row that prefills a chunk: more than one new token, none drafted."""
    return r.num_new > 1 and not r.draft_len


@dataclass(frozen=True, slots=True)
class FoldRule:
    """Which prompt chunks of a step the model runner runs as decode-shaped
    queries, one per position, reading their context through the req->token
    table (`ModelRunner.build_batch`), instead of through the extend path.

    It is the runner's rule (`ModelRunner.fold_rule`), given to the scheduler
    at start, so that the decision is taken once per plan, when it is
    committed (`StepPlan.folded`), and everything that prices a plan
    (`latency_model.plan_features`) counts what will run: a folded chunk pays
    none of the extend path's prices (`extend_rows`, `prefill_step`). The
    simulator takes it from the profile (`engine.fold_tokens`,
    `engine.fold_pairs`), so that it plans as the server did.

    tokens: a step of at most this many new tokens folds every chunk (the
        whole step is one native call; 0: never);
    pairs: else each chunk of at most this many query-key pairs folds
        (`chunk_pairs`; 0: never).
    Never a chunk that scores its prompt (`Seq.full_prefill`: the extend path
    computes its prompt logprobs), and never in a step that samples nothing."""

    tokens: int = 0
    pairs: int = 0

    def decide(self, rows: list[ScheduledRow], chunks: list[ScheduledRow] | None = None) -> list[bool] | None:
        """One flag per chunk row of a step's `rows` (`is_chunk`; `chunks`
        where the caller has them, in their order); None where none folds.
        A verify row counts all the tokens it reserves (its drafts may come
        out fewer: the rule then holds still)."""
        if not (self.tokens or self.pairs):
            return None
        if chunks is None:
            chunks = [r for r in rows if is_chunk(r)]
        if not chunks or not any(r.sample for r in rows):
            return None
        if (sum(r.num_new for r in rows) <= self.tokens
                and not any(r.seq.full_prefill for r in chunks)):
            return [True] * len(chunks)
        got = [not r.seq.full_prefill and chunk_pairs(r.start, r.num_new) <= self.pairs for r in chunks]
        return got if any(got) else None

    def folds_sampled(self, step_tokens: int, start: int, n: int) -> bool:
        """`decide` for one chunk of `n` tokens after `start` cached ones, in
        a step of `step_tokens` new tokens that samples, the chunk not
        scoring its prompt (a step's shape where no plan is at hand)."""
        return step_tokens <= self.tokens or chunk_pairs(start, n) <= self.pairs

    def to_dict(self) -> dict:
        return {"fold_tokens": self.tokens, "fold_pairs": self.pairs}


NO_FOLD = FoldRule()


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
    fold: FoldRule = NO_FOLD  # the runner's rule, from the scheduler
    # which chunk rows (rows[num_decode + num_verify:]) run as decode-shaped queries: `fold.decide`, frozen at
    # commit (None: none)
    folded: list[bool] | None = None
    committed: bool = False

    def chunk_folds(self) -> list[bool] | None:
        """`folded` once committed; before, what the rule would decide for
        the rows as they stand (a policy pricing a plan it shapes)."""
        return self.folded if self.committed else self.fold.decide(self.rows)

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
    extend_rows: int = 0  # rows that prefill a chunk of more than one token on the extend path (not folded)
    chunk_rows: int = 0  # rows that prefill a chunk, folded or not
    layered: bool = False  # a step with chunks that did not run as one call (`latency_model.plan_features`)
    # speculation: verify rows, tokens drafted and accepted, and of `forward_s` the proposer's time
    verify_rows: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    # the forward ran a shape the runner had not run before (`StepOutput.cold`): one-off work (kernels built
    # for it) is in its time, so it is no steady-state price
    cold: bool = False
