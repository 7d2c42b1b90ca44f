"""Speculation length: how many tokens each decode row drafts this step.

Source idea: Su, Giannoula and Pekhimenko, "The Synergy of Speculative
Decoding and Batching in Serving Large Language Models" (2023). A small batch
is memory-bound, so verifying k + 1 tokens per row costs little more than one;
a large batch is compute-bound, so long drafts waste work. The best k falls as
the batch grows, so it is chosen per step.

Modes (`SpecLengthSpec.parse`, `--spec-length`):

  none       no row drafts (speculation off; the proposer stays loaded)
  fixed:K    every eligible decode row drafts K tokens
  adaptive   each step, the k in [0, kmax] (0: plain decoding) that maximises
             the expected committed tokens per second of the whole step:

               rate(k) = (tokens without speculation + R_k * (E[k] - 1))
                         / (T_target(plan with k drafts per row) + T_draft(k))

             E[k] = 1 + sum_j prod_{i <= j} alpha_i, the expected tokens a
             verify row emits, from a running estimate of the per-position
             acceptance rate alpha_i (the probability that draft i is accepted
             when every draft before it was), updated from every
             verification (decayed counts, so it follows the workload);
             T_target: the shared step-latency model at this batch's rows,
             context and new tokens with the drafts counted in (an offline
             profile when given, else fitted online on the decode-shaped
             steps seen, less their drafting time: prefill tokens cost far
             less each than decode-shaped ones, and would make long drafts
             look cheap); T_draft: the proposer's own time, a linear
             fit over (k, k * rows) of the drafting time of the steps seen.
             Until the step model is calibrated k cycles through 0..kmax;
             after, one step in 64 tries each k in turn, so the estimates keep
             following the workload where k = 0 wins. Options:
             `adaptive:kmax=8`.

A row is eligible when it decodes (not a prefill chunk, not forking), its
request allows speculation (`Seq.speculative`), and at least two tokens are
left to generate. Its k is capped so that every emitted token fits its
max_tokens and the context; the step's drafts together fit the token budget
and the free KV. The KV of drafts that are not accepted is freed in the same
step, so drafting never holds memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from stepserve.scheduler.latency_model import OnlineLatencyModel, StepFeatures, nnls, plan_features
from stepserve.scheduler.plan import StepPlan, StepRecord
from stepserve.scheduler.policy import EngineView

MODES = ("none", "fixed", "adaptive")


@dataclass(frozen=True)
class SpecLengthSpec:
    mode: str = "none"
    k: int = 0  # fixed:K
    kmax: int = 8  # adaptive: the longest draft considered

    @classmethod
    def parse(cls, text: str) -> "SpecLengthSpec":
        text = (text or "none").strip()
        head, _, rest = text.partition(":")
        if head == "none" and not rest:
            return cls("none")
        if head == "fixed":
            return cls("fixed", k=_draft_length(rest, "fixed:K"))
        if head == "adaptive":
            kmax = 8
            for opt in filter(None, rest.split(",")):
                key, _, val = opt.partition("=")
                if key != "kmax":
                    raise ValueError(f"unknown adaptive option {key!r} (kmax)")
                kmax = _draft_length(val, "kmax")
            return cls("adaptive", kmax=kmax)
        raise ValueError(f"unknown speculation length {text!r} (none, fixed:K, adaptive[:kmax=K])")


def _draft_length(text: str, what: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"{what} needs an integer draft length, got {text!r}") from None
    if not 1 <= k <= 64:
        raise ValueError(f"{what} needs a draft length in [1, 64], got {k}")
    return k


class AcceptanceEstimate:
    """Per-position acceptance rates from decayed counts: position j was
    *tried* when drafts 1..j-1 were accepted and a j-th was drafted, and
    *accepted* when it was too. Starts at `prior` with the weight of
    `prior_weight` tries."""

    def __init__(self, kmax: int, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.995):
        self.tried = np.full(kmax, prior_weight, dtype=np.float64)
        self.accepted = np.full(kmax, prior * prior_weight, dtype=np.float64)
        self.decay = decay

    def update(self, drafted: list[int], accepted: list[int]) -> None:
        """One verification step: per verify row, its draft length and how many were accepted."""
        kmax = len(self.tried)
        t = np.zeros(kmax)
        a = np.zeros(kmax)
        for d, acc in zip(drafted, accepted):
            d = min(d, kmax)
            n = min(acc + 1, d)  # positions tried: each accepted one, and the first rejected
            t[:n] += 1
            a[: min(acc, d)] += 1
        self.tried = self.tried * self.decay + t
        self.accepted = self.accepted * self.decay + a

    @property
    def alpha(self) -> np.ndarray:
        return self.accepted / self.tried

    def expected_tokens(self, k: int) -> float:
        """E[tokens a verify row emits] with k drafts: 1 + the expected accepted prefix."""
        if k <= 0:
            return 1.0
        return 1.0 + float(np.cumprod(self.alpha[:k]).sum())


class DraftCost:
    """The proposer's time per step, fitted on the steps seen:
    draft_s = c0 + c1 * rows + c2 * k + c3 * k * rows when anything is drafted
    (k the longest draft of the step, rows the verify rows). Until `min_samples`
    steps are in, it predicts 0 (speculation looks cheap, so it is tried)."""

    def __init__(self, window: int = 256, min_samples: int = 8):
        self.obs: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.coef: np.ndarray | None = None
        self._since = 0

    def add(self, k: int, rows: int, seconds: float) -> None:
        self.obs.append((k, rows, seconds))
        self._since += 1
        if len(self.obs) >= self.min_samples and (self.coef is None or self._since >= 16):
            x = np.array([[1.0, r, k, k * r] for k, r, _ in self.obs])
            y = np.array([s for _, _, s in self.obs])
            self.coef = nnls(x, y)  # every term a cost: never a negative slope to extrapolate
            self._since = 0

    def predict(self, k: int, rows: int) -> float:
        if k <= 0 or rows <= 0 or self.coef is None:
            return 0.0
        return max(float(self.coef @ np.array([1.0, rows, k, k * rows])), 0.0)


class SpecLengthPolicy:
    """The step policy that turns decode rows into verify rows (`draft_len`)."""

    name = "spec-length"

    def __init__(self, spec: str | SpecLengthSpec, latency_model=None,
                 min_samples: int = 32, explore_every: int = 64):
        self.spec = SpecLengthSpec.parse(spec) if isinstance(spec, str) else spec
        kmax = self.spec.kmax if self.spec.mode == "adaptive" else max(self.spec.k, 1)
        self.acceptance = AcceptanceEstimate(kmax)
        self.draft_cost = DraftCost()
        # the target's step time without drafting: the profile's model rescaled online, or fitted online
        self.target = OnlineLatencyModel(base=latency_model, min_samples=min_samples, target="wall_s",
                                         refit_every_steps=64)
        self.explore_every = explore_every
        self.steps = 0
        self.verify_steps = 0
        self.k_hist: dict[int, int] = {}  # chosen k -> steps
        self.drafted = 0
        self.accepted = 0
        self.emitted = 0
        self.last_k = 0

    # -- planning ---------------------------------------------------------------
    def plan(self, plan: StepPlan, view: EngineView) -> StepPlan:
        if self.spec.mode == "none":
            return plan
        rows = [r for r in plan.rows if r.num_new == 1 and r.sample and r.seq.speculative
                and r.seq.num_output > 0 and not r.seq.fork_children and r.seq.remaining_tokens >= 2]
        self.steps += 1
        if not rows:
            return plan
        if self.spec.mode == "fixed":
            k = self.spec.k
        else:
            k = self._choose(plan, rows)
        self.last_k = k
        self.k_hist[k] = self.k_hist.get(k, 0) + 1
        if k <= 0:
            return plan
        planned = plan.num_new_tokens
        room = view.kv_available - planned
        if view.max_batched_tokens:
            room = min(room, view.max_batched_tokens - planned)
        max_ctx = view.max_context or 1 << 62
        any_set = False
        for r in rows:
            seq = r.seq
            kr = min(k, seq.remaining_tokens - 1, max_ctx - seq.num_tokens - 1, room)
            if kr <= 0:
                continue
            r.draft_len = kr
            r.num_new = 1 + kr
            room -= kr
            any_set = True
        if any_set:
            self.verify_steps += 1
        return plan

    def _choose(self, plan: StepPlan, rows) -> int:
        """The adaptive k for this step. Until the step model is calibrated,
        k cycles through 0..kmax, so that the fit sees every draft length (with
        one k per step, rows and new tokens would be collinear); after, one
        step in `explore_every` tries a k in turn, so that the estimates of
        acceptance and costs keep following the workload even where k = 0
        wins."""
        kmax = self.spec.kmax
        if not self.target.calibrated:
            return self.steps % (kmax + 1)
        if self.steps % self.explore_every == 0:
            return (self.steps // self.explore_every) % kmax + 1
        f = plan_features(plan)
        n_spec = len(rows)
        starts = sum(r.start for r in rows)
        base_tokens = len(plan.samples)
        best_k, best_rate = 0, -1.0
        for k in range(0, self.spec.kmax + 1):
            if k:
                pairs = f.prefill_pairs + (k + 1) * starts + n_spec * (k + 1) * (k + 2) // 2
                t = self.target.predict(f.rows, f.context_tokens + n_spec * k, f.new_tokens + n_spec * k, pairs,
                                        f.extend_rows)
            else:
                t = self.target.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs, f.extend_rows)
            t += self.draft_cost.predict(k, n_spec)
            rate = (base_tokens + n_spec * (self.acceptance.expected_tokens(k) - 1.0)) / max(t, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        return best_k

    # -- observing ---------------------------------------------------------------
    def observe(self, plan: StepPlan, record: StepRecord) -> None:
        if self.spec.mode == "none":
            return
        if plan.num_decode + plan.num_verify == len(plan.rows):
            # decode-shaped steps only: what k changes is the cost of decode-shaped tokens, which on
            # a CPU cost several times a prefill token (small GEMMs); prefill steps would set the
            # per-token cost of the fit to theirs and make long drafts look cheap
            f: StepFeatures = plan_features(plan)
            self.target.add(f, max(record.wall_s - record.draft_s, 1e-9))
        if not plan.num_verify:
            return
        vr = plan.verify_rows
        drafted = [len(r.draft) if r.draft is not None else 0 for r in vr]
        accepted = [r.num_accepted for r in vr]
        self.acceptance.update(drafted, accepted)
        self.draft_cost.add(max(r.draft_len for r in vr), len(vr), record.draft_s)
        self.drafted += sum(drafted)
        self.accepted += sum(accepted)
        self.emitted += sum(accepted) + len(vr)

    def stats(self) -> dict:
        alpha = self.acceptance.alpha
        return {
            "spec_steps": self.steps,
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.drafted,
            "spec_accepted_tokens": self.accepted,
            "spec_emitted_tokens": self.emitted,
            "spec_mean_accepted_length": (self.accepted / (self.emitted - self.accepted))
            if self.emitted > self.accepted else 0.0,
            "spec_last_k": self.last_k,
            "spec_k_steps": dict(sorted(self.k_hist.items())),
            "spec_acceptance": [round(float(a), 4) for a in alpha],
        }
