"""The unit of scheduling: one sequence of tokens (one branch of a request).

A request with `n` branches is `n` sequences. Only the first is queued; it
prefills the shared prompt once and, when its prefill completes, *forks*: its
siblings take the prompt's KV by reference (the prompt is in the radix tree,
locked by each branch) and every branch samples its own first token from the
same logits. After a retraction each branch is an independent sequence again,
and the radix tree lets them find the shared prompt.

KV ownership of a running sequence (`row` of the req->token table):
  [0, num_cached)            slots owned by the radix tree, protected by `node`
  [0.. num_cached, num_computed)  private slots, freed or given to the tree
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class RequestClock:
    """A request's progress against a TPOT SLO, shared by all its sequences
    (branches and stages): when its clock started (its first token, or the
    start of its current fork/join stage) and the tokens it got since, all
    branches together; `first` of them came in the first delivery (one per
    branch that sampled its first token at the start). `Scheduler.update`
    counts; a fork/join stage resets it (`EngineCore`)."""

    __slots__ = ("start", "tokens", "first", "ttft_s", "tpot_s")

    def __init__(self, ttft_s: float | None = None, tpot_s: float | None = None):
        self.start: float | None = None
        self.tokens = 0
        self.first = 0
        self.ttft_s = ttft_s  # the request's own SLOs (None: the policy's defaults)
        self.tpot_s = tpot_s

    def reset(self, start: float) -> None:
        self.start, self.tokens, self.first = start, 0, 0

    def deadline(self, tpot_s: float) -> float:
        """When its next token is due for its TPOT since the start to stay within `tpot_s`."""
        return self.start + (self.tokens - self.first + 1) * tpot_s


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted and requeued)
    RUNNING = "running"  # holds KV; prefilling (chunked) or decoding
    FORK_PENDING = "fork_pending"  # a sibling waiting for its parent's prefill
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    max_tokens: int  # generation cap, already clipped to the context
    arrival: float
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    branch: int = 0
    seed: int = 0  # sampling seed of this branch (randomness is keyed on seed and output position)
    group: Any = None  # the owning request (its owner's object), opaque to everyone else
    # what the sampler needs of this branch (the engine sets them; the scheduler never reads them)
    sampling: Any = None  # the request's SamplingParams
    logits_processor: Any = None  # proc(output_ids, logits_row) editing this branch's logits (e.g. a grammar)
    plain_greedy: bool = False  # argmax alone serves it: greedy, no penalties, bias, logprobs or min_tokens
    speculative: bool = False  # may decode speculatively (the engine allows it and the request did not opt out)
    # its own speculation record (`SpecLengthPolicy`): draft positions tried (each accepted one and the first
    # rejected, as `AcceptanceEstimate` counts them) and accepted, over every verification it had
    spec_tried: int = 0
    spec_accepted: int = 0
    spec_block: tuple[int, int] = (0, 0)  # (tried, accepted) where its current block of tries began (`RowSpread`)
    spec_prev_rate: float = -1.0  # its last whole block's acceptance rate (-1: none yet)
    spec_last: int = -1  # the policy's step in which it last drafted (a draft model is current only after one)
    ngram_index: Any = None  # the n-gram proposer's index of its history (`NgramProposer.propose_for`)
    spec_replayed: int = 0  # positions before this one have been replayed (`SpecLengthPolicy._replay`)
    # siblings created by fork when this sequence's prefill completes
    fork_children: list["Seq"] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    # KV state
    row: int | None = None
    num_computed: int = 0
    num_cached: int = 0
    node: Any = None
    # compute every prompt position (prompt logprobs): no prefix-cache match until the prompt is done
    full_prefill: bool = False
    suffix_len: int = 0  # a fork/join branch: the last tokens of its prompt are its own suffix
    stage_start: float | None = None  # a fork/join stage after the first: when it began
    clock: RequestClock | None = None  # the request's, shared by its sequences (`EngineCore.add_sequences`)
    # bookkeeping
    num_retractions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def pending(self) -> int:
        """Tokens still without KV. A decoding sequence has exactly one: the
        token it sampled last step. More than one means (chunked) prefill."""
        return len(self.token_ids) - self.num_computed

    @property
    def remaining_tokens(self) -> int:
        return max(self.max_tokens - self.num_output, 0)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
