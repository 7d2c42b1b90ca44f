"""Branch admission: how many of a request's parallel branches decode each step.

A request with several branches (OpenAI `n > 1`, or a parallel stage of a
fork/join request) has one decode row per branch. Running all of them every
step (`eager`, what vLLM and SGLang do) makes the shared step longer for
every request in the batch; running one (`off`) wastes the parallelism. This
step policy decides, each step, which extra branch rows run; a deferred row
keeps its KV (branches share their prefix, so narrowing frees nothing) and
simply skips the step, becoming more urgent for the next one.

Modes (`BranchAdmissionSpec.parse`, `--branch-policy`):

  eager     every branch, every step (the default: the plan is untouched)
  off       one row per request: its most urgent branch
  cap:N     at most N rows per request, the most urgent first
  taper     TAPER (Gandhi, Hari, Dally, Kozyrakis, "Regulating Branch
            Parallelism in LLM Serving", 2026), below

TAPER, each step:

  * Every request's most urgent decode row runs, and every prefill row (the
    baseline plan). The most urgent of a request's rows is the one that has
    waited longest for a token.
  * Deadlines are per request, never per row: a per-row clock counts a
    deferred branch late at once and, with the budget below, shrinks every
    later step to the baseline for good. The SLO is the request's (its TPOT
    counts the tokens of all its branches, `traces/metrics.py`); its own
    (`RequestClock.tpot_s`, `ttft_s`) or else the policy's defaults.
    - `clock=average` (default): when its next token is due for its TPOT
      since its clock started (its first token, or the start of its current
      fork/join stage) to meet the SLO, so time banked or owed counts;
    - `clock=token`: its last token (of any branch) plus the TPOT SLO;
    - before its first token: its arrival plus the TTFT SLO.
  * slack = the least time left to the deadline of a request in the step;
    T0 = the predicted time of the baseline step;
    budget = T0 + rho * max(0, slack - T0).
  * `late=drop` (default): deadlines no plan of this step can keep are left
    out of the slack: a first token due before the baseline step ends, and
    a request's next token due before then when the request cannot catch
    up: its TPOT SLO is shorter than the baseline step (it falls further
    behind whatever runs), or the tokens it may still generate (its rows'
    `max_tokens` left) are too few to win the lost time back, even at
    baseline steps with all its rows running. One that short steps let
    catch up in time stays. The baseline step it is checked at is the
    longer of this step's and the mean baseline of the recent steps, prompt
    chunks included (`catchup=recent`, the default; a running mean over
    about 32 steps): a decode-only step is short, but a request that the
    steps with prompt chunks in them keep behind does not catch up at it.
    `catchup=step` checks at this step's baseline alone. `late=keep` is the
    paper's rule, which holds the step to T0 for them and defers rows that
    save no one.
  * Extra rows are added greedily by utility gain per marginal predicted
    latency while the predicted step stays within the budget. Under the
    average clock each extra row of a request moves that request's deadline
    out by one TPOT SLO (the step brings it one more token), so the budget a
    row is checked against is the one with its request's deadline moved; and
    where a row costs less than that SLO, its request's own deadline does not
    hold it back at all (each such row leaves the request less late, or more
    ahead, than without it; counted, a request behind by more than a TPOT SLO
    could never widen to catch up, and it held every other request's rows
    to the baseline step too). A request whose row did not fit is tried
    again when the budget grows.
    Utility of a
    request running k extra rows: `linear` k, or `concave` log(1 + k) (the
    default: a second branch of a request that has none running is worth more
    than a fifth of one that has four). Among equal ratios the staler row
    wins.
  * The prediction comes from the shared step-latency model
    (`latency_model.py`): an offline fit when given, rescaled online on the
    last 200 steps this policy observes, every `refit` (50) observed steps
    and every 600 s of the scheduler's clock (`refit=0`: by the clock
    only). A decode step soon after a step with prompt chunks runs on caches
    the chunk emptied; where the profile prices that (`ServingCosts.cold`),
    so does the plan (`cold=price`, the default; `cold=ignore` leaves it
    out): its baseline is a + (1 + b) t0 and each extra row's marginal time
    (1 + b) times the model's, and the refits count each step's extra in.
    Until it is
    calibrated (no offline fit and fewer than `min_samples` steps seen)
    TAPER runs eager and counts those steps
    (`stats()['taper_uncalibrated_steps']`).
  * The paper's ablations: `budget=slo`, `replan=K`, `predictor=constant`
    (`BranchAdmissionSpec`); `late=keep` for its slack.

Only decode rows are ever deferred: a prefill chunk is the request's way to
its first token, and the admission of new requests is the scheduler's.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, fields

from stepserve.scheduler.latency_model import (
    LinearLatencyModel, OnlineLatencyModel, ServingCosts, SincePrompt, is_cold, linear_fit_of, plan_features,
    prompt_tokens,
)
from stepserve.scheduler.plan import StepPlan, StepRecord
from stepserve.scheduler.policy import EngineView

MODES = ("eager", "off", "cap", "taper")
UTILITIES = ("concave", "linear")
CLOCKS = ("average", "token")
BUDGETS = ("slack", "slo")
PREDICTORS = ("model", "constant")
LATES = ("drop", "keep")
CATCHUPS = ("step", "recent")
COLDS = ("price", "ignore")
TAPER_OPTIONS = {"rho": float, "utility": str, "clock": str, "budget": str, "replan": int, "predictor": str,
                 "late": str, "refit": int, "catchup": str, "cold": str}


@dataclass(frozen=True)
class BranchAdmissionSpec:
    mode: str = "eager"
    cap: int = 0  # cap:N
    rho: float = 0.8  # taper: share of the slack beyond the baseline step it may spend
    utility: str = "concave"  # taper: concave | linear
    clock: str = "average"  # taper: average (a request's TPOT so far) | token (its last token)
    # the TAPER paper's ablations:
    budget: str = "slack"  # slack | slo: a fixed step budget of the tightest TPOT SLO, whatever the slack
    replan: int = 1  # plan every this many branching steps; between, each request keeps its last width
    predictor: str = "model"  # model | constant: every plan predicted at the recent mean step time
    late: str = "drop"  # drop | keep (the paper): deadlines the baseline step misses and cannot win back
    # rescale the step model on the last observed steps every this many of them (0: every refit_period_s
    # only): a machine whose speed moves within seconds needs a short period (on the 2-core EPYC the
    # default servers' predictions were 11.8-18% low over runs where every 50 steps they were 2.6-7.1%; in the
    # simulator, 12.6% high against 0.03%, with the same goodput)
    refit: int = 50
    # late=drop: the baseline steps a late request is checked to catch up at: this step's (`step`), or
    # the mean baseline of the recent steps, prefill chunks included, when longer (`recent`)
    catchup: str = "recent"
    # where the profile prices the decode steps after a prompt chunk (`ServingCosts.cold`): the plan of such a
    # step adds that extra (`price`), or leaves it out (`ignore`: the prediction of a steady step)
    cold: str = "price"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"branch admission must be one of eager, off, cap:N, taper; got {self.mode!r}")
        if self.mode == "cap" and self.cap < 1:
            raise ValueError(f"cap:N needs N >= 1, got {self.cap}")
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"taper rho must be in [0, 1], got {self.rho}")
        if self.utility not in UTILITIES:
            raise ValueError(f"taper utility must be one of {', '.join(UTILITIES)}; got {self.utility!r}")
        if self.clock not in CLOCKS:
            raise ValueError(f"taper clock must be one of {', '.join(CLOCKS)}; got {self.clock!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"taper budget must be one of {', '.join(BUDGETS)}; got {self.budget!r}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"taper predictor must be one of {', '.join(PREDICTORS)}; got {self.predictor!r}")
        if self.late not in LATES:
            raise ValueError(f"taper late must be one of {', '.join(LATES)}; got {self.late!r}")
        if self.catchup not in CATCHUPS:
            raise ValueError(f"taper catchup must be one of {', '.join(CATCHUPS)}; got {self.catchup!r}")
        if self.cold not in COLDS:
            raise ValueError(f"taper cold must be one of {', '.join(COLDS)}; got {self.cold!r}")
        if self.replan < 1:
            raise ValueError(f"taper replan must be at least 1, got {self.replan}")
        if self.refit < 0:
            raise ValueError(f"taper refit must be 0 (by time only) or a number of steps, got {self.refit}")

    @classmethod
    def parse(cls, spec: str) -> "BranchAdmissionSpec":
        """`eager` | `off` | `cap:N` | `taper[:rho=R,utility=concave|linear,clock=average|token,
        budget=slack|slo,replan=K,predictor=model|constant,late=drop|keep,refit=K,catchup=step|recent,
        cold=price|ignore]`."""
        head, _, rest = spec.strip().partition(":")
        if head == "cap":
            try:
                cap = int(rest)
            except ValueError:
                raise ValueError(f"cap:N needs an integer N, got {spec!r}") from None
            return cls("cap", cap=cap)  # (which says N >= 1 where it is not)
        if head == "taper":
            kw: dict = {}
            for item in filter(None, rest.split(",")):
                k, eq, v = item.partition("=")
                if not eq or k not in TAPER_OPTIONS:
                    raise ValueError("taper options are rho=R, utility=concave|linear, clock=average|token, "
                                     "budget=slack|slo, replan=K, predictor=model|constant, late=drop|keep, "
                                     "refit=K, catchup=step|recent and cold=price|ignore; "
                                     f"got {item!r}")
                try:
                    kw[k] = TAPER_OPTIONS[k](v)
                except ValueError:
                    raise ValueError(f"taper option {k} takes a number, got {v!r}") from None
            return cls("taper", **kw)
        if rest:
            raise ValueError(f"branch admission {head!r} takes no options; got {spec!r}")
        return cls(head)

    def __str__(self) -> str:
        if self.mode == "cap":
            return f"cap:{self.cap}"
        if self.mode == "taper":
            defaults = {f.name: f.default for f in fields(self)}
            extra = "".join(f",{k}={getattr(self, k)}" for k in ("budget", "replan", "predictor", "late", "refit",
                                                                  "catchup", "cold")
                            if getattr(self, k) != defaults[k])
            return f"taper:rho={self.rho:g},utility={self.utility},clock={self.clock}{extra}"
        return self.mode


def _staleness(row) -> float:
    """When a row last got a token (before any: when its stage began, or its
    request arrived): the smaller, the more urgent among its request's rows."""
    seq = row.seq
    if seq.last_token_time is not None:
        return seq.last_token_time
    return seq.stage_start if seq.stage_start is not None else seq.arrival


class BranchAdmissionPolicy:
    """The `StepPolicy` of branch admission (see the module docstring).

    `latency_model`: the offline step model TAPER starts from. A
    `LinearLatencyModel` (a measured profile) is used as it is; another kind
    (a roofline profile) is swept like an engine and fitted with the linear
    form (`linear_fit_of`), as the authors fit theirs on an offline sweep.
    Without one TAPER calibrates online only. The online refits rescale the
    offline fit (`OnlineLatencyModel`): a window of steps that all have the
    same width cannot tell a per-row cost from a fixed one, and a planner
    that stops widening would never show it otherwise.
    `slo_tpot_s` and `slo_ttft_s` are the SLOs of requests that bring none
    of their own (`Engine.add_request`'s `slo_tpot_s`, `slo_ttft_s`): a
    request with no TPOT SLO has no deadline after its first token, and none
    before it without a TTFT SLO. With no deadline anywhere the budget is
    unbounded: TAPER runs eager.
    """

    name = "branch-admission"

    def __init__(self, spec: BranchAdmissionSpec | str = "eager", *, latency_model=None,
                 slo_tpot_s: float | None = None, slo_ttft_s: float | None = None,
                 window: int = 200, min_samples: int = 32, refit_period_s: float = 600.0,
                 costs: ServingCosts | None = None):
        self.spec = BranchAdmissionSpec.parse(spec) if isinstance(spec, str) else spec
        self.slo_tpot_s = slo_tpot_s
        self.slo_ttft_s = slo_ttft_s
        self.predictor: OnlineLatencyModel | None = None
        if self.spec.mode == "taper":
            for name, v in (("TPOT", slo_tpot_s), ("TTFT", slo_ttft_s)):
                if v is not None and not v > 0:
                    raise ValueError(f"taper's default {name} SLO must be positive, got {v}")
            base = latency_model
            if base is not None and not isinstance(base, LinearLatencyModel):
                base = linear_fit_of(base)
            self.predictor = OnlineLatencyModel(base=base, window=window, min_samples=min_samples,
                                                refit_period_s=refit_period_s, clock=self._now,
                                                refit_every_steps=self.spec.refit or None,
                                                costs=costs if self.spec.cold == "price" else None)
        self._t = 0.0  # the scheduler's clock at the last plan
        self._planned = False  # the last plan() ran the taper planner (its step is observed)
        self.steps = 0  # steps that had a request with more than one decode row
        self.uncalibrated_steps = 0  # of those, taper ran eager: no calibrated predictor yet
        self.rows_candidate = 0  # decode rows of multi-row requests, summed over steps
        self.rows_deferred = 0  # of those, rows that skipped their step
        self.plan_s = 0.0  # time spent planning (taper)
        self.last_budget_s = 0.0
        self.last_predicted_s = 0.0
        self.last_slack_s = 0.0
        self.planned_steps = 0  # steps taper planned (calibrated, with branches)
        self.predicted_s = 0.0  # of those: the step times taper predicted for the plans it chose ...
        self.measured_s = 0.0  # ... and what they took
        self.after_prompt_steps = 0  # of those, the first decode steps after a step with prompt tokens (`is_cold`),
        self.after_prompt_predicted_s = 0.0  # and their predicted and measured times (`ServingCosts.cold`)
        self.after_prompt_measured_s = 0.0
        self._widths: dict[int, int] = {}  # replan > 1: each request's width at the last plan
        self._base_avg = 0.0  # catchup=recent: running mean of the steps' predicted baseline times
        self._last_base: float | None = None  # the baseline the last plan predicted
        self._since_plan = 0

    def _now(self) -> float:
        return self._t

    # -- StepPolicy -------------------------------------------------------------
    def plan(self, plan: StepPlan, view: EngineView) -> StepPlan:
        self._t = view.now
        self._planned = False
        mode = self.spec.mode
        if mode == "eager" or plan.num_rows < 2:
            return plan
        groups: dict[int, list] = {}
        multi = False
        for r in plan.rows:
            if r.num_new == 1 and r.sample:
                g = groups.setdefault(id(r.seq.group), [])
                g.append(r)
                if len(g) == 2:
                    multi = True
        if not multi:
            return plan
        self.steps += 1
        branchy = [g for g in groups.values() if len(g) > 1]
        for g in branchy:
            g.sort(key=_staleness)  # the row that waited longest for a token first
        self.rows_candidate += sum(len(g) for g in branchy)
        if mode == "taper":
            if not self.predictor.calibrated:
                self.uncalibrated_steps += 1
                return plan
            t0 = time.perf_counter()
            if self._since_plan % self.spec.replan == 0:
                deferred = self._taper(plan, branchy, view.now, view.since_prompt)
                if self.spec.replan > 1:
                    kept: dict[int, int] = {}
                    for g in branchy:
                        kept[id(g[0].seq.group)] = sum(1 for r in g if id(r) not in deferred)
                    self._widths = kept
            else:  # the paper's "no per-step replanning": the last plan's widths (new requests: one row)
                widths = self._widths
                deferred = {id(r) for g in branchy for r in g[widths.get(id(g[0].seq.group), 1):]}
            self._since_plan += 1
            self.plan_s += time.perf_counter() - t0
            self._planned = True
        else:
            width = 1 if mode == "off" else self.spec.cap
            deferred = {id(r) for g in branchy for r in g[width:]}
        if deferred:
            self.rows_deferred += len(deferred)
            plan.rows = [r for r in plan.rows if id(r) not in deferred]
        return plan

    def observe(self, plan: StepPlan, record: StepRecord) -> None:
        if self.predictor is not None:
            if self.spec.catchup == "recent" and self.predictor.calibrated:
                base = self._last_base
                if base is None:  # a step no plan narrowed is its own baseline (its record's shape: O(1))
                    r = record
                    base = self.predictor.predict(r.rows, r.context_tokens, r.new_tokens, r.prefill_pairs,
                                                  r.extend_rows, r.chunk_rows, r.layered)
                    a, b = self.predictor.cold_terms(plan.after_prompt)
                    base += a + b * base
                self._base_avg += (base - self._base_avg) / 32.0
            self._last_base = None
            if self._planned:  # the prediction it planned with, against the step's own time
                self.planned_steps += 1
                self.predicted_s += self.last_predicted_s
                took = getattr(record, self.predictor.target)
                self.measured_s += took
                if is_cold(plan.after_prompt):
                    self.after_prompt_steps += 1
                    self.after_prompt_predicted_s += self.last_predicted_s
                    self.after_prompt_measured_s += took
            self.predictor.observe(plan, record)

    # -- TAPER --------------------------------------------------------------------
    def slack(self, plan: StepPlan, now: float) -> float:
        """The least time left to a deadline of a request with a row in `plan`
        (see the module docstring): under the `average` clock, when its next
        token is due for its TPOT since its clock started (`RequestClock`) to
        meet its TPOT SLO; under the `token` clock, its last token plus that
        SLO. Before its first token, its arrival plus its TTFT SLO. A
        request's SLOs are its own (`RequestClock.tpot_s`, `ttft_s`), else the
        policy's; a request with neither has no deadline."""
        ttft, tpot = self._deadlines(plan)
        return min(ttft + [d for d, _ in tpot.values()], default=math.inf) - now

    def _deadlines(self, plan: StepPlan, left: dict | None = None) -> tuple[list[float], dict]:
        """The deadlines of `slack`: the TTFT ones, and the TPOT ones as
        {request: (deadline, its TPOT SLO)}, the request keyed by its clock
        (all its branches and stages share it) or, under the token clock
        without one, by its group. `left`, when given, is filled with
        {request: its rows' sequences} (what they may still generate is read
        only for the requests that are behind)."""
        default_tpot, default_ttft = self.slo_tpot_s, self.slo_ttft_s
        average = self.spec.clock == "average"
        ttfts: list[float] = []
        tpots: dict[int, tuple[float, float]] = {}
        last: dict[int, tuple[float, float]] = {}  # token clock: request -> (its last token, its TPOT SLO)
        for r in plan.rows:
            seq = r.seq
            c = seq.clock
            tpot = (c.tpot_s if c is not None and c.tpot_s is not None else default_tpot)
            if seq.first_token_time is None and seq.stage_start is None:  # before the request's first token
                ttft = c.ttft_s if c is not None and c.ttft_s is not None else default_ttft
                if ttft and (c is None or c.start is None):
                    ttfts.append(seq.arrival + ttft)
                continue
            if tpot is None:
                continue
            if average:
                if c is None or c.start is None:
                    continue
                k = id(c)
                if k not in tpots:
                    tpots[k] = (c.deadline(tpot), tpot)
            else:
                t = seq.last_token_time if seq.last_token_time is not None else seq.stage_start
                k = id(c) if c is not None else id(seq.group)
                if t > last.get(k, (-math.inf, 0.0))[0]:
                    last[k] = (t, tpot)
            if left is not None:
                left.setdefault(k, []).append(seq)
        for k, (t, tpot) in last.items():
            tpots[k] = (t + tpot, tpot)
        return ttfts, tpots

    def _tightest_tpot(self, plan: StepPlan) -> float:
        """The least TPOT SLO of the requests in the step (inf: none has one)."""
        d = self.slo_tpot_s if self.slo_tpot_s is not None else math.inf
        for r in plan.rows:
            c = r.seq.clock
            if c is not None and c.tpot_s is not None and c.tpot_s < d:
                d = c.tpot_s
        return d

    def _taper(self, plan: StepPlan, branchy: list, now: float, since_prompt: tuple[int, int] = (0, 0)) -> set[int]:
        # the baseline: every row but the extra branch rows (each request's stalest row runs)
        candidates = [g[1:] for g in branchy]
        extra_ids = {id(r) for g in candidates for r in g}
        f = plan_features(plan)  # of the whole plan; take the extras back out
        rows, ctx, new, pairs, ext = f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs, f.extend_rows
        chunk_terms = (f.chunk_rows, f.layered)  # (the extras are decode rows: the plan's chunks stay)
        for g in candidates:
            for r in g:
                rows -= 1
                ctx -= r.start + 1
                new -= 1
        predict = self.predictor.predict
        if self.spec.predictor == "constant":  # the paper's ablation: shape-blind, the recent mean step time
            w = self.predictor.window
            mean = sum(t for _, t in w) / len(w) if w else predict(rows, ctx, new, pairs, ext, *chunk_terms)

            def predict(*_):
                return mean
        t_raw = predict(rows, ctx, new, pairs, ext, *chunk_terms)
        # a decode step soon after a prompt chunk runs on caches the chunk emptied: a + (1 + b) t for the
        # model's t (`ServingCosts.cold`), and each extra row's marginal time grows by the same factor
        cold_a, cold_b = (self.predictor.cold_terms(SincePrompt(*since_prompt).next(prompt_tokens(plan.rows)))
                          if self.predictor.costs is not None else (0.0, 0.0))
        scale = 1.0 + cold_b
        t_base = t_raw * scale + cold_a
        self._last_base = t_base
        rho = self.spec.rho

        def budget_at(slack: float) -> float:  # the paper's step budget for a slack
            return t_base + rho * max(0.0, slack - t_base)

        drop = self.spec.late == "drop"
        left: dict | None = {} if drop else None
        ttfts, tpots = self._deadlines(plan, left)
        if drop:
            # a deadline the baseline step already misses is lost whatever runs beside it: a first
            # token's, and a token's of a request that cannot catch up: its TPOT SLO is shorter than
            # the baseline step (it falls further behind even at the baseline), or its tokens left
            # are too few to win the lost time back at baseline steps with all its rows running
            horizon = now + t_base
            step = max(t_base, self._base_avg) if self.spec.catchup == "recent" else t_base

            def catches_up(k, deadline: float, tpot: float) -> bool:
                if step >= tpot:
                    return False
                # its last token: after as many baseline steps as its longest row has tokens left
                n = [s.remaining_tokens for s in left[k]]
                tokens, longest = sum(n), max(n)
                return horizon + (longest - 1) * step <= deadline + (tokens - 1) * tpot

            ttfts = [d for d in ttfts if d >= horizon]
            tpots = {k: v for k, v in tpots.items() if v[0] >= horizon or catches_up(k, *v)}
        slack = min(ttfts + [d for d, _ in tpots.values()], default=math.inf) - now
        self.last_slack_s = slack
        if self.spec.budget == "slo":  # the paper's ablation: a fixed budget, blind to banked or owed time
            budget = max(t_base, self._tightest_tpot(plan))
            widened = None
        else:
            budget = budget_at(slack)
            # under the average clock a request's deadline moves out by one TPOT SLO for each of its
            # rows that runs: a branching request's own deadline is met by width, not by a short step
            widened: dict[int, list[float]] = {}  # request -> [time left to its deadline, its TPOT SLO]
            lheap = []
            if self.spec.clock == "average":
                for gi in range(len(candidates)):
                    k = id(branchy[gi][0].seq.clock)
                    if k in tpots:
                        d, tpot = tpots.pop(k)
                        widened[gi] = [d - now, tpot]
                        lheap.append((d - now, gi))
            other = min(ttfts + [d for d, _ in tpots.values()], default=math.inf) - now
            heapq.heapify(lheap)

            def prune() -> None:
                """Drops the stale limits off the heap's top (a widened request's older entries)."""
                while lheap and lheap[0][0] != widened[lheap[0][1]][0]:
                    heapq.heappop(lheap)

            def least(skip: int) -> float:
                """The least limit of the requests but `skip` (the heap's top is kept current)."""
                if not lheap:
                    return math.inf
                if lheap[0][1] != skip:
                    return lheap[0][0]
                top = heapq.heappop(lheap)
                prune()
                s = lheap[0][0] if lheap else math.inf
                heapq.heappush(lheap, top)
                return s

            def budget_with(gi: int, cost: float) -> float:
                """The budget for one more row of request gi, costing `cost`: its own deadline moves
                out by its TPOT SLO, and does not count where that is more than the row costs."""
                if gi not in widened:
                    return budget
                w = widened[gi]
                if cost < w[1]:
                    return budget_at(min(other, least(gi)))
                return budget_at(min(other, w[0] + w[1], least(gi)))
        # each extra row's marginal latency, priced against the baseline (the greedy adds them up), request
        # by request in row order, until they stop fitting the budget before any request's deadline moves
        costs: list[list[float]] = [[] for _ in candidates]
        t_all = t_base
        for g, got in zip(candidates, costs):
            for r in g:
                c = (predict(rows + 1, ctx + r.start + 1, new + 1, pairs, ext, *chunk_terms) - t_raw) * scale
                got.append(c)
                t_all += c
            if t_all > budget:
                break
        else:  # every extra row fits: all of them run
            if widened:  # the budget the greedy would end at: each request's deadline moved by all its rows
                budget = budget_at(min(other, min(w[0] + len(candidates[gi]) * w[1] for gi, w in widened.items())))
            self.last_budget_s = budget
            self.last_predicted_s = t_all
            return set()
        # greedy by utility gain per marginal latency: one heap entry per request, its next row
        concave = self.spec.utility == "concave"

        def entry(gi: int, k: int) -> tuple:
            """Request gi's k-th extra row: (-gain per cost, staleness, gi, k, its marginal cost)."""
            got = costs[gi]
            if k == len(got):  # (a request's rows are reached in order)
                r = candidates[gi][k]
                got.append((predict(rows + 1, ctx + r.start + 1, new + 1, pairs, ext, *chunk_terms) - t_raw) * scale)
            cost = got[k]
            gain = math.log((k + 2) / (k + 1)) if concave else 1.0
            return (-gain / max(cost, 1e-12), _staleness(candidates[gi][k]), gi, k, cost)

        heap = [entry(gi, 0) for gi in range(len(candidates))]
        heapq.heapify(heap)
        t = t_base
        admitted = set()
        closed = []  # (cost, entry) of requests whose next row did not fit: retried when the budget grows
        while heap:
            item = heapq.heappop(heap)
            _, _, gi, k, cost = item
            b = budget if not widened else budget_with(gi, cost)
            if t + cost > b:
                if widened:  # this request's later rows cost about the same: it waits for a larger budget
                    heapq.heappush(closed, (cost, item))
                continue  # (a fixed budget never grows: it is done)
            g = candidates[gi]
            admitted.add(id(g[k]))
            t += cost
            if k + 1 < len(g):
                heapq.heappush(heap, entry(gi, k + 1))
            if widened and gi in widened:
                w = widened[gi]
                w[0] += w[1]
                heapq.heappush(lheap, (w[0], gi))
                prune()
                if b > budget:  # the requests whose next row fits now are back in
                    budget = b
                    while closed and t + closed[0][0] <= budget:
                        heapq.heappush(heap, heapq.heappop(closed)[1])
        self.last_budget_s = budget
        self.last_predicted_s = t
        return extra_ids - admitted

    # -- reporting ----------------------------------------------------------------
    def stats(self) -> dict:
        d = {
            "branch_policy": str(self.spec),
            "branch_steps": self.steps,
            "branch_rows_candidate": self.rows_candidate,
            "branch_rows_deferred": self.rows_deferred,
        }
        if self.predictor is not None:
            p = self.predictor
            d.update(taper_calibrated=p.calibrated, taper_uncalibrated_steps=self.uncalibrated_steps,
                     taper_refits=p.num_refits, taper_plan_s=self.plan_s,
                     taper_plan_ms_per_step=(1e3 * self.plan_s / max(self.steps - self.uncalibrated_steps, 1)),
                     taper_planned_steps=self.planned_steps, taper_predicted_s=self.predicted_s,
                     taper_measured_s=self.measured_s,
                     taper_after_prompt_steps=self.after_prompt_steps,
                     taper_after_prompt_predicted_s=self.after_prompt_predicted_s,
                     taper_after_prompt_measured_s=self.after_prompt_measured_s,
                     # None when no deadline counted (no SLO, or every one already lost): unbounded
                     taper_last_slack_s=self.last_slack_s if math.isfinite(self.last_slack_s) else None,
                     taper_last_budget_s=self.last_budget_s if math.isfinite(self.last_budget_s) else None)
        return d
