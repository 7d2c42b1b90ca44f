"""Trace simulation: the real scheduler on a virtual clock.

Everything but the model is real: the engine's own step loop (`EngineCore`:
its refusals, its sequences and forks, `Scheduler` with admission, chunked
prefill and retraction, `KVManager` over the slot allocator, the req->token
table and the radix cache, the step policies and step records). The one fake
is `SimRunner`: each step it returns a placeholder token per sample and moves
the clock by the latency model's prediction for the plan's features. Requests
decode exactly their trace output length (max_tokens = output length, EOS
ignored), so a simulated run and a real replay of the same scaled trace do the
same work, and their reports (traces/report.py) have the same shape.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from array import array
from bisect import bisect_right
from dataclasses import asdict, dataclass, field

from stepserve.kvcache import ReqToTokenPool, SlotAllocator
from stepserve.scheduler.core import EngineCore, Stage
from stepserve.scheduler.errors import RequestError
from stepserve.scheduler.kv_manager import KVManager
from stepserve.scheduler.latency_model import ServingCosts, StepFeatures
from stepserve.scheduler.limits import Limits
from stepserve.scheduler.plan import FoldRule
from stepserve.scheduler.policies import policy_stats
from stepserve.scheduler.scheduler import Scheduler, SchedulerConfig
from stepserve.scheduler.sequence import SeqStatus
from stepserve.traces.metrics import RequestRecord
from stepserve.traces.request_spec import PromptBuilder, RequestSpec

DEFAULT_MAX_CONTEXT = 32768
DEFAULT_VOCAB = 32000
# Any id works: outputs never reach a tokenizer. One the prompts never use
# (they start at MIN_TOKEN_ID) keeps an output from extending a cached prompt.
PLACEHOLDER_TOKEN = 1
_SQRT_HALF = math.sqrt(0.5)


@dataclass
class SimConfig:
    max_running: int = 256
    max_batched_tokens: int = 2048
    admission: str = "fcfs"
    prefix_caching: bool = True
    kv_slots: int | None = None  # None: the profile's
    max_context: int | None = None  # None: the profile's, else DEFAULT_MAX_CONTEXT
    vocab_size: int | None = None  # None: the profile's, else DEFAULT_VOCAB
    seed: int = 0  # prompt tokens
    check_every: int = 0  # run the KV integrity check every N steps (tests; slow)
    # which prompt chunks the engine ran as decode-shaped queries (`plan.FoldRule`, the profile's
    # `fold_tokens` / `fold_pairs`; 0: none): the plans count extend rows as the server's did
    fold_tokens: int = 0
    fold_pairs: int = 0
    # The serving system's costs around the steps (`latency_model.ServingCosts`,
    # from profiles measured through a server): a request reaches the scheduler
    # entry_s after its arrival (its TTFT still counts from the arrival); a stream's first token
    # reaches its client delivery_s + stream_s * (tokens of its step) after its
    # step ends, a later one token_delivery_s + stream_s * (...), the one that ends the stream
    # end_delivery_s + ...; the first step after the engine sat idle takes wake_s longer,
    # or, with a wake_curve, as much as the curve says for how long it idled;
    # every other step starts loop_s + loop_row_s * (rows of the step before) after that one ended, plus
    # intake_s per request that arrived at the busy engine since that step started; the j-th decode step
    # after a step that ran P prompt tokens takes sqrt(P) * (a_j + b_j * its model time) longer, (a_j, b_j)
    # the j-th pair of `cold` (`ServingCosts.cold`).
    entry_s: float = 0.0
    delivery_s: float = 0.0
    token_delivery_s: float = 0.0  # a later token's (0: as delivery_s, a first token's)
    end_delivery_s: float = 0.0  # the one that ends its stream (0: as a later one)
    stream_s: float = 0.0
    wake_s: float = 0.0
    wake_curve: list = field(default_factory=list)  # [[idle_s, extra_s], ...]
    loop_s: float = 0.0
    loop_row_s: float = 0.0
    intake_s: float = 0.0
    # the host's work outside the engine (`ServingCosts.host_request_s`, ...): a queue, first in first out, fed
    # host_token_s by each token a step makes, host_batch_s by each step that makes any (the front end takes
    # them in one message), host_request_s by each stream it starts (a request's first token), and
    # host_prompt_token_s per prompt token by each request as it arrives (the front end takes its prompt in
    # before the engine sees it); a step's tokens reach their clients after the work queued before the step
    # ended, on top of their delivery, and its i-th new stream after the i - 1 before it; a request reaches the
    # engine entry_s after the work queued before it arrived is done
    host_request_s: float = 0.0
    host_token_s: float = 0.0
    host_prompt_token_s: float = 0.0
    host_batch_s: float = 0.0
    cold: list = field(default_factory=list)  # [[a_j, b_j], ...]
    # quantiles of a first token's delivery over delivery_s + stream_s * (...) (`ServingCosts.delivery_scatter`):
    # each stream's first token is delivered after a seeded draw from them times that (empty: exactly that)
    delivery_scatter: list = field(default_factory=list)
    # The engine's overlap schedule (`EngineCore._step_overlap`; on CUDA without speculation): each step is
    # scheduled and launched while the one before runs on the device. A step's host part -- the latency
    # model's per-step `overhead_s` (a roofline profile's scheduling, launches, sampling; a measured
    # profile has none apart) -- then runs on the host beside the device's part of the step before.
    overlap_schedule: bool = False

    def serving(self) -> ServingCosts:
        return ServingCosts(**{k: getattr(self, k) for k in ServingCosts.SCALARS},
                            wake_curve=tuple((float(x), float(y)) for x, y in self.wake_curve),
                            cold=tuple((float(a), float(b)) for a, b in self.cold),
                            delivery_scatter=tuple(float(x) for x in self.delivery_scatter))
    # Step-time scatter: 101 quantiles of (measured step / model prediction) from
    # the profile; each step's predicted time is multiplied by a seeded draw from
    # them, so latency tails are the machine's, not a deterministic function of
    # the batch shape. Empty: no noise (roofline profiles have none). The draws
    # are scaled to mean 1: the scatter must not also move the mean step time,
    # which is the model's (a 6% bias of a profile's raw quantiles put the
    # simulated server past saturation at a rate the real one sustained).
    noise_quantiles: list[float] = field(default_factory=list)
    noise_seed: int = 0
    # The same per size of step, where the profile has it (`calibrate.noise_by_size`):
    # [[upto_s, quantiles], ...], upto_s increasing and None for the last (unbounded). A step
    # draws from the bin of its predicted time, each bin scaled to mean 1 on its own: a small
    # step scatters more than a large one (log-sd 0.3 under 1.5 ms against 0.1-0.13 over 15 ms
    # on a 2-core EPYC), and one set of quantiles gives every step the same width. Empty:
    # `noise_quantiles` for every step.
    noise_by_size: list = field(default_factory=list)
    # Successive steps' scatter is not independent on a real machine: it swings
    # slowly (lag-1 autocorrelation of 0.5-0.9 over a server's busy steps), and
    # a slow stretch lengthens every token of the requests in it, which is what
    # TPOT and TTFT tails are made of. The draws follow a Gaussian AR(1) with
    # this lag-1 correlation, mapped onto the quantiles (a Gaussian copula: the
    # same scatter, its correlation the machine's). 0: independent draws.
    noise_lag1: float = 0.0
    # Speculative decoding (with a speculation-length policy among the
    # policies): the probability that draft position j is accepted when every
    # draft before it was, per position (the last repeats for deeper ones);
    # each verify row's accepted run is drawn from it. Empty: no row drafts.
    acceptance: list = field(default_factory=list)
    # how much requests differ in acceptance: each request's per-position rates are the ones above shifted
    # in log-odds by a normal draw with this standard deviation (0: every request alike). On the embedded
    # draft/target pair the spread measured is about 1.2 (README, speculative decoding in the simulator).
    acceptance_spread: float = 0.0
    # The machine's speed through the run, where it is known (`stepserve validate --speed-window`: measured
    # from the step log of the real run simulated): [[t_from_s, step_factor, token_factor, loop_factor,
    # cold_factor], ...],
    # increasing in t_from. From virtual time t_from on, steps cost the latency model rescaled by these factors
    # (`LinearLatencyModel.rescaled`: one for the per-step, per-row and per-context-token part, one for the
    # per-token part; a token factor None scales all by the step factor), the busy loop's time between
    # steps (loop_s, loop_row_s, intake_s) is scaled by the loop factor, and the cold decode steps' extra
    # (`cold`) by an optional fifth, the cold factor (absent or None: as they are). Before the
    # first, and when empty, the model and the loop as they are.
    speed_schedule: list = field(default_factory=list)

    @classmethod
    def from_profile(cls, engine: dict, **overrides) -> "SimConfig":
        """Engine sizing recorded in a profile; explicit (non-None) overrides win."""
        keys = ("max_running", "max_batched_tokens", "kv_slots", "max_context", "vocab_size", "fold_tokens",
                "fold_pairs")
        kw = {k: engine[k] for k in keys if engine.get(k) is not None}
        kw.update(ServingCosts.from_engine(engine).to_dict())
        noise = overrides.pop("noise", None)
        if noise and noise.get("quantiles"):
            kw["noise_quantiles"] = list(noise["quantiles"])
            kw["noise_lag1"] = float(noise.get("lag1") or 0.0)
            kw["noise_by_size"] = [[b["upto_s"], list(b["quantiles"])] for b in noise.get("by_size") or ()]
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


class VirtualClock:
    __slots__ = ("t",)

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclass(slots=True)
class SimLaunched:
    """A simulated step launched on the device (overlap schedule)."""

    out: "SimOutput"
    end: float  # when the device finishes it (virtual seconds)


@dataclass(slots=True)
class SimOutput:
    token_ids: list[int]
    prep_s: float = 0.0
    draft_s: float = 0.0  # of the step, the proposer's time
    cold: bool = False  # (a simulated step has no one-off work: its time is the latency model's)


def shifted_rates(rates: list[float], shift: float) -> list[float]:
    """Acceptance rates moved by `shift` in log-odds (0 and 1 stay put)."""
    if not shift:
        return list(rates)
    out = []
    for a in rates:
        if 0.0 < a < 1.0:
            a = 1.0 / (1.0 + math.exp(-(math.log(a / (1.0 - a)) + shift)))
        out.append(a)
    return out


def _unit_mean(quantiles) -> list[float]:
    """Quantiles of a step's time over the model's, scaled to mean 1 (the
    scatter must not move the mean, which is the model's)."""
    mean = sum(quantiles) / len(quantiles) if quantiles else 1.0
    return [q / mean for q in quantiles]


class SimRunner:
    """Stands in for the model runner: placeholder tokens, and the clock moved
    by the latency model's prediction (times a draw of the profile's noise),
    plus the wake-up of `costs` when the engine idled before the step (`idle_s`
    set: for how long), or else the loop's time between two busy steps."""

    def __init__(self, latency_model, clock: "VirtualClock", noise_quantiles=(), noise_seed: int = 0,
                 costs: ServingCosts | None = None, noise_lag1: float = 0.0, acceptance=(), draft_model=None,
                 speed_schedule=(), noise_by_size=()):
        if not -1.0 < noise_lag1 < 1.0:
            raise ValueError(f"noise_lag1 must be in (-1, 1), got {noise_lag1}")
        if any(not 0.0 <= a <= 1.0 for a in acceptance):
            raise ValueError(f"acceptance rates must be in [0, 1], got {list(acceptance)}")
        self.model = latency_model
        self._speed_t, self._speed_models, self._loop_factors, self._cold_factors = self._schedule(
            latency_model, speed_schedule)
        self.acceptance = [float(a) for a in acceptance]
        self.draft_model = draft_model  # the draft model's step latency (None: a proposer that costs nothing)
        self.clock = clock
        self.noise = _unit_mean(noise_quantiles)
        self._noise_edges, self._noise_bins = self._size_bins(noise_by_size)
        self.rho = noise_lag1
        self._innov = math.sqrt(1.0 - noise_lag1 * noise_lag1)
        self.reset(noise_seed, costs or ServingCosts())

    def reset(self, noise_seed: int, costs: ServingCosts) -> None:
        """A new run: the noise's seed, the serving costs, an idle engine."""
        self.rng = random.Random(noise_seed)
        self.accept_rng = random.Random(noise_seed * 7919 + 1)  # its own stream: the noise's draws do not move
        self.costs = costs
        self.idle_s = float("inf")
        self._z = self.rng.gauss(0.0, 1.0) if self.rho else 0.0  # the AR(1) state, from its stationary law
        self.device_free = 0.0  # overlap schedule: when the device finishes the steps launched so far
        self.rows_before = 0  # rows of the step before (the busy loop's time after it grows with them)
        self.taken = 0  # requests that arrived at the busy engine since the last step started (intake_s each)

    @staticmethod
    def _size_bins(by_size) -> tuple[list[float], list[list[float]]]:
        """(upper edges but the last's, each bin's quantiles scaled to mean 1) of `SimConfig.noise_by_size`."""
        if not by_size:
            return [], []
        edges = [b[0] for b in by_size[:-1]]
        if any(e is None for e in edges) or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"noise_by_size: upper edges must increase, the last None; got {[b[0] for b in by_size]}")
        if any(not b[1] for b in by_size):
            raise ValueError("noise_by_size: every bin needs its quantiles")
        return [float(e) for e in edges], [_unit_mean(b[1]) for b in by_size]

    @staticmethod
    def _schedule(model, schedule) -> tuple[list[float], list, list[float], list[float]]:
        """(window starts, the model rescaled for each, the loop's factor and
        the cold steps' in each) of `SimConfig.speed_schedule`."""
        if not schedule:
            return [], [], [], []
        if not hasattr(model, "rescaled"):
            raise ValueError(f"a speed schedule rescales a measured (linear) step model, not a {type(model).__name__}")
        starts = [float(w[0]) for w in schedule]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"speed_schedule: window starts must increase, got {starts}")
        loops = [1.0 if len(w) < 4 or w[3] is None else float(w[3]) for w in schedule]
        colds = [1.0 if len(w) < 5 or w[4] is None else float(w[4]) for w in schedule]
        if any(not w[1] > 0 or (w[2] is not None and not w[2] > 0) for w in schedule) or any(
                not x > 0 for x in loops) or any(x < 0 for x in colds):
            raise ValueError("speed_schedule: factors must be positive")
        return (starts, [model.rescaled(float(w[1]), None if w[2] is None else float(w[2])) for w in schedule],
                loops, colds)

    def _window(self) -> int:
        """The speed schedule's window at the clock's time (-1: before the first, or none)."""
        return bisect_right(self._speed_t, self.clock.t) - 1 if self._speed_t else -1

    def step_time(self, f: StepFeatures) -> float:
        model = self.model
        i = self._window()
        if i >= 0:
            model = self._speed_models[i]
        dt = model.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs, f.extend_rows, f.chunk_rows,
                           f.layered)
        if self.noise or self._noise_bins:
            q = self._noise_bins[bisect_right(self._noise_edges, dt)] if self._noise_bins else self.noise
            if self.rho:
                self._z = self.rho * self._z + self._innov * self.rng.gauss(0.0, 1.0)
                u = 0.5 * (1.0 + math.erf(self._z * _SQRT_HALF))
            else:
                u = self.rng.random()
            dt *= q[int(u * (len(q) - 1) + 0.5)]
        return dt

    def _cold(self, plan, dt: float) -> float:
        """The step's extra time as the j-th decode step after a step that ran
        prompt tokens (`ServingCosts.cold_extra`, at the scheduler's count:
        `StepPlan.after_prompt`)."""
        if not self.costs.cold:
            return 0.0
        extra = self.costs.cold_extra(*plan.after_prompt, dt)
        i = self._window()
        return extra * self._cold_factors[i] if i >= 0 and extra else extra

    def run(self, plan, features: StepFeatures) -> SimOutput:
        dt = self.step_time(features)
        dt += self._cold(plan, dt)
        draft_s = self.speculate(plan) if plan.num_verify else 0.0
        dt += draft_s + self._between()
        self.rows_before = features.rows
        self.clock.t += dt
        return SimOutput([PLACEHOLDER_TOKEN] * len(plan.samples), draft_s=draft_s)

    def _between(self) -> float:
        """What the loop spends before a step: the wake-up after idling, else the busy loop's own time."""
        if self.idle_s:
            extra = self.costs.wake(self.idle_s)
            self.idle_s = 0.0
            self.taken = 0
            return extra
        i = self._window()
        dt = self.costs.loop(self.rows_before, self.taken) * (self._loop_factors[i] if i >= 0 else 1.0)
        self.taken = 0
        return dt

    def launch(self, plan, features: StepFeatures, prev=None, sample: bool = True) -> SimLaunched:
        """The overlap schedule's half of `run`: the host spends the step's
        host part (the loop's time since the step before, or the wake-up, and
        the latency model's `overhead_s`, which the step's noise scales with
        the rest), then the device runs the rest once it has finished the
        step before. (Sampling is priced with the step:
        `sample` has nothing left to do.)"""
        if plan.num_verify:
            raise ValueError("the overlap schedule does not run speculative steps")
        dt = self.step_time(features)
        dt += self._cold(plan, dt)
        between = self._between()  # host time, before the step's own
        self.rows_before = features.rows
        host = min(float(getattr(self.model, "overhead_s", 0.0)), dt) + between
        dt += between
        self.clock.t += host
        start = self.clock.t if self.clock.t > self.device_free else self.device_free
        self.device_free = start + dt - host
        return SimLaunched(SimOutput([PLACEHOLDER_TOKEN] * len(plan.samples)), self.device_free)

    def sample(self, launched: SimLaunched) -> None:
        pass

    def finish(self, launched: SimLaunched) -> SimOutput:
        """Waits (on the virtual clock) for a launched step's device part."""
        if self.clock.t < launched.end:
            self.clock.t = launched.end
        return launched.out

    def speculate(self, plan) -> float:
        """The verify rows' drafts (placeholders) and accepted runs, drawn
        position by position from `acceptance`; returns the proposer's time:
        one draft-model step per draft position, over the rows still drafting
        (each at its context so far), as the draft model runs them."""
        acc_rates = self.acceptance
        if not acc_rates:
            raise ValueError("a speculation policy drafted, but the simulation has no acceptance rates")
        last = len(acc_rates) - 1
        rng = self.accept_rng.random
        rows = plan.verify_rows
        for r in rows:
            k = r.draft_len
            r.draft = [PLACEHOLDER_TOKEN] * k
            live = r.seq.group
            rates = live.acceptance if isinstance(live, _Live) and live.acceptance is not None else acc_rates
            a = 0
            while a < k and rng() < rates[min(a, last)]:
                a += 1
            r.num_accepted = a
        if self.draft_model is None:
            return 0.0
        t = 0.0
        for j in range(max(r.draft_len for r in rows)):
            active = [r for r in rows if r.draft_len > j]
            n = len(active)
            t += self.draft_model.predict(n, sum(r.start + 1 + j for r in active), n)
        return t


@dataclass
class _Live:
    """A request in flight: its record and branches still running."""

    rec: RequestRecord
    left: int
    cached: int = 0
    acceptance: list[float] | None = None  # its own acceptance rates (`SimConfig.acceptance_spread`)


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # virtual: t = 0 to the last completion
    itl_s: array  # all inter-token gaps, pooled
    stats: dict = field(default_factory=dict)


class Simulator:
    """Runs a trace through `EngineCore` on a virtual clock; `run` returns each
    request's timing record. Also the core's `StepHooks`: it turns each step's
    tokens into first-token times, inter-token gaps and completions."""

    def __init__(self, latency_model, cfg: SimConfig | None = None, policies=(), draft_model=None):
        self.cfg = cfg or SimConfig()
        self.policies = list(policies)
        # virtual time; policies or observers that need "now" read this clock
        self.clock = VirtualClock()
        self.runner = SimRunner(latency_model, self.clock, self.cfg.noise_quantiles, self.cfg.noise_seed,
                                noise_lag1=self.cfg.noise_lag1, noise_by_size=self.cfg.noise_by_size,
                                acceptance=self.cfg.acceptance, draft_model=draft_model,
                                speed_schedule=self.cfg.speed_schedule)
        # requests may decode speculatively where a speculation-length policy runs
        self.speculative = any(getattr(p, "name", None) == "spec-length" for p in self.policies)
        if self.speculative and not self.cfg.acceptance:
            raise ValueError("a speculation-length policy needs the simulation's acceptance rates (SimConfig.acceptance)")
        if self.speculative and self.cfg.overlap_schedule:
            raise ValueError("the overlap schedule cannot be combined with speculative decoding (as in the engine)")
        self.core: EngineCore | None = None
        self._host_free = 0.0
        # (step end, when the host's queue ran empty after it) of recent steps, for an arrival's wait (`_intake`)
        self._host_ends: list[float] = []
        self._host_frees: list[float] = []
        self._intake_free = 0.0  # when the host has taken in the last request that arrived
        self._delivery_rng = random.Random(0)
        self._itl = array("d")
        self._seen: dict[int, float] = {}  # live sequence -> when its client got its last token
        self._freed: list[float] | None = None  # `run`'s client slots, under max_concurrency

    def kv_capacity(self) -> int:
        return self.cfg.kv_slots

    def _build_core(self) -> EngineCore:
        cfg = self.cfg
        max_ctx = cfg.max_context or DEFAULT_MAX_CONTEXT
        kv = KVManager(
            SlotAllocator(cfg.kv_slots + 1),
            ReqToTokenPool(ReqToTokenPool.rows_for(cfg.max_running), max_ctx + 1),
            cfg.prefix_caching,
        )
        sched = Scheduler(
            SchedulerConfig(max_running=cfg.max_running, max_batched_tokens=cfg.max_batched_tokens,
                            admission=cfg.admission, max_context=max_ctx, prefix_caching=cfg.prefix_caching),
            kv, self.policies, clock=self.clock,
        )
        sched.fold = FoldRule(cfg.fold_tokens, cfg.fold_pairs)
        # no vocabulary check: the simulator builds the prompts itself, in range
        limits = Limits(max_ctx, kv.capacity, max_sequences=kv.req_pool.max_rows)
        return EngineCore(sched, self.runner, self, limits, clock=self.clock, check_every=cfg.check_every,
                          overlap=cfg.overlap_schedule)

    # -- EngineCore hooks -------------------------------------------------------
    def admitted(self, seq) -> None:
        live = seq.group
        if seq.num_cached > live.cached:
            live.cached = seq.num_cached

    def ran(self, plan, out) -> None:
        pass

    def staged(self, group, seqs) -> None:
        pass  # `_Live.left` counted every stage's branches when the request came in

    def updated(self, plan, out, got) -> None:
        freed = self._freed
        costs = self.runner.costs
        k = len(plan.samples)
        end = self.clock.t
        host_r = costs.host_request_s
        scatter = costs.delivery_scatter
        # when the client holds this step's later tokens (`token_delivery_s`); a first token `first` after them
        first = costs.first_extra()
        ending = costs.end_extra()  # ... and the token that ends a stream (not its first) `ending` after them
        t = end + costs.delivery(k) - first
        free = self._host_free  # ... after the host's work queued before the step ended (`host_request_s`)
        if free > end:
            t += free - end
        held = 0.0  # the host's work on the step's new streams so far, which holds the ones after them
        seen = self._seen
        itl = self._itl
        FINISHED = SeqStatus.FINISHED
        for _, s in plan.samples:
            sid = s.seq_id
            p = seen.get(sid)
            ts = t
            if p is None:
                rec = s.group.rec
                if rec.first_token_s is None:
                    rec.first_out_s = end
                    ts = t + first + held
                    if scatter:  # its own delivery's draw (`ServingCosts.delivery_scatter`)
                        u = self._delivery_rng.random() * (len(scatter) - 1)
                        j = int(u)
                        q = scatter[j] + (scatter[j + 1] - scatter[j]) * (u - j) if j + 1 < len(scatter) else scatter[j]
                        ts += (q - 1.0) * costs.delivery(k)
                    held += host_r
                    rec.first_token_s = ts
            else:
                if ending and s.status is FINISHED and s.group.left == 1:  # the token that ends the stream
                    ts += ending
                if ts < p:  # a stream's tokens reach its client in order: none passes its first's delivery
                    ts = p
                itl.append(ts - p)
            seen[sid] = ts
            if s.status is FINISHED:
                del seen[sid]
                live = s.group
                rec = live.rec
                k_out = s.num_output
                rec.output_tokens += k_out
                if k_out > rec.branch_tokens:
                    rec.branch_tokens = k_out
                live.left -= 1
                if live.left == 0:
                    rec.end_s = ts
                    rec.cached_tokens = live.cached
                    if freed is not None:
                        heapq.heappush(freed, ts)
        if k and (costs.host_token_s or costs.host_batch_s or held):
            self._host_free = (free if free > end else end) + costs.host_token_s * k + costs.host_batch_s + held
            self._host_ends.append(end)
            self._host_frees.append(self._host_free)

    def _prune_host(self, at: float) -> None:
        """Forgets the steps before the last that ended by `at`, which no later
        arrival looks up (arrivals come in order), a thousand at a time."""
        j = bisect_right(self._host_ends, at) - 1
        if j > 1000:
            del self._host_ends[:j], self._host_frees[:j]

    def _intake(self, at: float, prompt_tokens: int) -> tuple[float, float]:
        """(wait, work) of a request that arrives at `at`: how long the host's
        work queued before it (the tokens of steps that ended by then, and
        the requests that arrived before it) holds its way into the engine,
        and its own (`host_prompt_token_s` per prompt token). Pure: `run`
        commits it when the request is taken in."""
        ends = self._host_ends
        j = bisect_right(ends, at) - 1
        free = self._host_frees[j] if j >= 0 else 0.0
        if self._intake_free > free:
            free = self._intake_free
        return (free - at if free > at else 0.0), self.runner.costs.host_prompt_token_s * prompt_tokens

    # -- the run ----------------------------------------------------------------
    def run(self, specs: list[RequestSpec], progress=None, max_concurrency: int | None = None) -> SimResult:
        """`max_concurrency`: a client that keeps at most this many requests in
        flight (vLLM's benchmark option): a request is sent at its arrival or,
        when that many are out, as soon as one completes (its client holds the
        last token); its TTFT and E2E count from the send. With every arrival
        at 0 that is a closed loop at this concurrency."""
        cfg = self.cfg
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        if cfg.kv_slots is None:
            raise ValueError("SimConfig.kv_slots is not set (the profile gives none: pass --kv-slots)")
        builder = PromptBuilder(cfg.vocab_size or DEFAULT_VOCAB, cfg.seed)
        clock = self.clock
        clock.t = 0.0
        self.runner.reset(cfg.noise_seed, cfg.serving())
        self._seen = {}
        self._host_free = 0.0  # when the host's queue of work outside the engine runs empty (`host_token_s`, ...)
        self._host_ends, self._host_frees, self._intake_free = [], [], 0.0
        self._delivery_rng = random.Random(cfg.noise_seed * 104729 + 3)  # its own stream: no other draw moves
        self.core = core = self._build_core()
        sched = core.scheduler
        self._itl = itl = array("d")
        specs = sorted(specs, key=lambda s: s.arrival_s)
        # each request's acceptance level, from a stream of its own keyed on the trace's seed: every policy
        # simulated on a trace meets the same requests
        spread = cfg.acceptance_spread
        spread_rng = random.Random(cfg.seed * 1000003 + 11)
        records: list[RequestRecord] = []
        busy = 0.0
        sum_rows = sum_new = 0
        max_rows = 0
        i, n = 0, len(specs)
        oh = cfg.entry_s
        # the client's free slots: completion times (a heap), once max_concurrency requests were sent
        self._freed = freed = [] if max_concurrency is not None else None
        sent = 0

        def send_time(spec) -> float:  # when the client sends `spec` (inf: waits for a completion)
            if freed is None or sent < max_concurrency:
                return spec.arrival_s
            return max(spec.arrival_s, freed[0]) if freed else math.inf

        queued = cfg.host_prompt_token_s or cfg.host_token_s or cfg.host_batch_s or cfg.host_request_s

        def entry(spec) -> tuple[float, float, float]:
            """(send, reaching the engine: entry_s after the host's queue ahead of it, its own host work)"""
            at = send_time(spec)
            if not queued or at == math.inf:
                return at, at + oh, 0.0
            wait, work = self._intake(at, spec.prompt_len)
            return at, at + oh + wait, work

        speculative = self.speculative
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while i < n or core.has_work():
            t = clock.t
            # requests a busy loop reads off the pipe before its next step (an idle one waits for them)
            busy_loop = not self.runner.idle_s and core.has_work()
            while i < n and send_time(specs[i]) + oh <= t:
                spec = specs[i]
                at, entered, work = entry(spec)
                if entered > t:
                    break
                if queued:
                    self._intake_free = entered - oh + work
                    if work:  # the tokens queued after it wait for it too
                        self._host_free = (self._host_free if self._host_free > at else at) + work
                    self._prune_host(at)
                if freed is not None and sent >= max_concurrency:
                    heapq.heappop(freed)
                sent += 1
                i += 1
                own = shifted_rates(cfg.acceptance, spread_rng.gauss(0.0, spread)) if spread > 0 else None
                rec = RequestRecord(spec.request_id, spec.arrival_s, spec.prompt_len, n=spec.n, start_s=at,
                                    stages=1 + len(spec.stages), engine_in_s=t)
                records.append(rec)
                ids = builder.prompt(spec)
                stages = [Stage([([] if seg is None else builder.segment(seg), out) for seg, out in st])
                          for st in spec.stages]
                try:  # the engine's own refusals, as a server would answer 400
                    max_tokens = core.check_request(ids, spec.output_len, spec.n)
                    if stages:
                        core.check_stages(ids, max_tokens, stages)
                except RequestError as e:
                    rec.error = str(e)
                    if freed is not None:
                        heapq.heappush(freed, at)  # answered at once: the slot is free again
                    continue
                later = sum(len(st.branches) for st in stages)
                if busy_loop:
                    self.runner.taken += 1
                core.add_sequences(ids, max_tokens, entered, _Live(rec, spec.n + later, acceptance=own), seeds=[0] * spec.n,
                                   stages=stages or None, stage_seeds=[0] * later if stages else None,
                                   ignore_eos=True, speculative=speculative)
            if not core.has_work():
                if i == n:  # the last requests were refused: nothing is left to run
                    break
                t_next = entry(specs[i])[1]
                self.runner.idle_s += t_next - clock.t
                clock.t = t_next
                continue
            done = core.step_id
            plan = core.step()
            if plan is None:
                if i < n and send_time(specs[i]) < math.inf:  # nothing fits until more work arrives (be safe)
                    clock.t = max(clock.t, entry(specs[i])[1])
                    continue
                raise RuntimeError("simulator: the scheduler made no progress with work queued")
            if core.step_id == done:  # overlap schedule: a step was launched, none finished
                continue
            rec = core.records[-1]
            busy += rec.wall_s  # virtual: the step's predicted time
            sum_rows += rec.rows
            sum_new += rec.new_tokens
            if rec.rows > max_rows:
                max_rows = rec.rows
            if progress is not None:
                progress(len(records), clock.t)
        steps = core.step_id
        duration = max((r.end_s for r in records if r.end_s is not None), default=0.0)
        stats = {
            "steps": steps,
            "virtual_busy_s": busy,
            "mean_rows": sum_rows / steps if steps else 0.0,
            "max_rows": max_rows,
            "mean_new_tokens": sum_new / steps if steps else 0.0,
            "retractions": sched.num_retractions,
            "prefix_hit_rate": (sched.prefix_hit_tokens / sched.prefix_queried_tokens
                                if sched.prefix_queried_tokens else 0.0),
            "kv_slots": core.kv_capacity,
            "cpu_s": time.process_time() - cpu0,
            "wall_s": time.perf_counter() - wall0,
            "config": asdict(cfg),
            "policy": policy_stats(self.policies),
        }
        return SimResult(records, duration, itl, stats)
