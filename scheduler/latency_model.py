"""The step-latency model: predicted wall time of one step from its shape.

One model serves the step policies (what would this plan cost?) and the
simulator (how far does the virtual clock move?). Forms, all linear in their
coefficients and fitted by least squares:

  taper        T = a + b*rows + c*context_tokens                 (TAPER's predictor)
  linear       T = a + b*rows + c*context_tokens + d*new_tokens  (the default)
  linear+attn  linear + e*prefill_pairs

`prefill_pairs` counts the (query, key) pairs of the prefill chunks' causal
attention, sum of num_new*start + num_new*(num_new+1)/2 over rows with more
than one new token: the one cost that grows quadratically in a chunk, which
`context_tokens` (linear) misses. Decode rows are covered by context_tokens.

The fit minimises *relative* squared error (each step weighted by 1/T): step
times span orders of magnitude (one decode row vs a 2048-token prefill), and
plain least squares would fit the big steps and leave the small ones -- the
common case -- with large relative errors.

`OnlineLatencyModel` refits on a rolling window of observed steps (TAPER
authors' defaults: last 200 steps, at least 32 samples, every 600 s). With an
offline fit it refits only a scale of it, T = alpha * base: the window is
what the engine ran lately, one operating point with little variety (a
planner that keeps steps narrow never shows what wide ones cost), and a free
fit of every coefficient there extrapolates anywhere (seen: a first refit on
32 early steps of a simulated TAPER run predicted 62 ms for a step that takes
25). An offset beside the scale is no better: on such a window the two trade
off against each other. The sweep's shape stays; the machine's drift, a
slower or faster machine, is tracked.
Without an offline fit every coefficient is fitted. It is a `StepPolicy` that
only observes.

`ServingCosts` are the serving system's costs around the steps, which a
model of the step alone cannot see; measured on a 2-core CPU server they
decided whether the simulator saturated at the right rate (issue 14).

Profiles (JSON, written by `stepserve profile` or computed by `roofline.py`)
are loaded by `load_profile(path_or_name)`; built-in roofline profiles are
named `DEVICE[xN]:MODEL` (e.g. `h100:llama3-8b`, `a10x8:llama2-70b`).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

FORMS: dict[str, tuple[str, ...]] = {
    "taper": ("const", "rows", "context_tokens"),
    "linear": ("const", "rows", "context_tokens", "new_tokens"),
    "linear+attn": ("const", "rows", "context_tokens", "new_tokens", "prefill_pairs"),
}
PROFILE_KIND = "stepserve-latency-profile"


@dataclass(slots=True)
class StepFeatures:
    rows: int
    context_tokens: int
    new_tokens: int
    prefill_pairs: float = 0.0

    def vector(self, form: str) -> list[float]:
        return [1.0 if n == "const" else float(getattr(self, n)) for n in FORMS[form]]


def plan_features(plan) -> StepFeatures:
    """Features of a `StepPlan`, in one pass over its rows."""
    ctx = new = 0
    pairs = 0
    for r in plan.rows:
        n = r.num_new
        s = r.start
        new += n
        ctx += s + n
        if n > 1:
            pairs += n * s + n * (n + 1) // 2
    return StepFeatures(len(plan.rows), ctx, new, float(pairs))


def record_features(rec) -> StepFeatures:
    """Features of a `StepRecord`."""
    return StepFeatures(rec.rows, rec.context_tokens, rec.new_tokens, rec.prefill_pairs)


class LatencyModel(Protocol):
    form: str

    def predict(self, rows: int, context_tokens: int, new_tokens: int, prefill_pairs: float = 0.0) -> float: ...

    def to_dict(self) -> dict: ...


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||A x - b|| subject to x >= 0, exactly, for the few columns a
    latency model has: the least-squares solution on each subset of columns
    (the others held at 0), the best one that is non-negative."""
    n = A.shape[1]
    if n > 8:
        raise ValueError("nnls here is for at most 8 coefficients")
    best, best_r = np.zeros(n), float(b @ b)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if (x < 0).any():
            continue
        r = A[:, cols] @ x - b
        r = float(r @ r)
        if r < best_r:
            best_r = r
            best = np.zeros(n)
            best[cols] = x
    return best


@dataclass
class LinearLatencyModel:
    form: str
    coef: list[float]
    min_s: float = 1e-6  # a prediction is never below this (a fitted intercept can be negative)

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"unknown latency form {self.form!r} ({', '.join(FORMS)})")
        if len(self.coef) != len(FORMS[self.form]):
            raise ValueError(f"form {self.form} takes {len(FORMS[self.form])} coefficients, got {len(self.coef)}")
        c = list(self.coef) + [0.0] * (5 - len(self.coef))
        # the taper form has no new_tokens term: spread into fixed slots for a branch-free predict
        if self.form == "taper":
            c = [c[0], c[1], c[2], 0.0, 0.0]
        self._c = tuple(float(x) for x in c)

    def predict(self, rows: int, context_tokens: int, new_tokens: int, prefill_pairs: float = 0.0) -> float:
        a, b, c, d, e = self._c
        t = a + b * rows + c * context_tokens + d * new_tokens + e * prefill_pairs
        return t if t > self.min_s else self.min_s

    def predict_features(self, f: StepFeatures) -> float:
        return self.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs)

    def predict_plan(self, plan) -> float:
        return self.predict_features(plan_features(plan))

    def to_dict(self) -> dict:
        return {"form": self.form, "terms": list(FORMS[self.form]), "coef": list(self.coef)}

    def rescaled(self, alpha: float) -> "LinearLatencyModel":
        """alpha * this model."""
        return LinearLatencyModel(self.form, [alpha * c for c in self.coef], self.min_s)

    @classmethod
    def from_dict(cls, d: dict) -> "LinearLatencyModel":
        return cls(d["form"], [float(x) for x in d["coef"]])

    @classmethod
    def fit(
        cls,
        feats: list[StepFeatures],
        times: list[float] | np.ndarray,
        form: str = "linear",
        prior: "LinearLatencyModel | None" = None,
        ridge: float = 0.0,
        nonneg: bool = False,
    ) -> "LinearLatencyModel":
        """Least squares on relative error; `ridge` > 0 pulls towards `prior`
        (or towards zero), scaled per term by that term's own magnitude.
        `nonneg`: every coefficient >= 0 (each term is a cost; a window of
        steps that spans little of a term's range can otherwise fit it
        negative and extrapolate nonsense outside it)."""
        X = np.array([f.vector(form) for f in feats], dtype=np.float64)
        y = np.asarray(times, dtype=np.float64)
        if len(y) == 0:
            raise ValueError("no samples to fit")
        w = 1.0 / np.maximum(y, 1e-9)
        Xw = X * w[:, None]
        yw = y * w
        A = Xw.T @ Xw
        rhs = Xw.T @ yw
        if nonneg:
            # ridge as extra rows of the system: sqrt(D) (coef - w0) ~ 0
            d = np.sqrt(np.maximum(np.diag(A), 1e-12) * ridge)
            w0 = np.asarray(prior.coef, dtype=np.float64) if prior is not None and prior.form == form \
                else np.zeros(len(FORMS[form]))
            coef = nnls(np.vstack([Xw, np.diag(d)]), np.concatenate([yw, d * w0]))
        elif ridge > 0:
            D = np.diag(np.maximum(np.diag(A), 1e-12)) * ridge
            w0 = np.zeros(len(FORMS[form]))
            if prior is not None and prior.form == form:
                w0 = np.asarray(prior.coef, dtype=np.float64)
            A = A + D
            rhs = rhs + D @ w0
            coef = np.linalg.solve(A, rhs)
        else:
            coef, *_ = np.linalg.lstsq(Xw, yw, rcond=None)
        return cls(form, [float(x) for x in coef])


def sweep_features(max_rows: int = 256, max_context: int = 32768) -> list[StepFeatures]:
    """The shapes of an offline sweep, as `stepserve profile` times them on an
    engine: decode steps over batch size x context length (powers of 2 and 4),
    and prefill steps of a few chunk sizes and batch sizes, so that every term
    of every form is identified."""
    feats = []
    rows = [1]
    while rows[-1] * 2 <= max_rows:
        rows.append(rows[-1] * 2)
    ctxs = [c for c in (64, 256, 1024, 4096, 16384, 65536) if c <= max_context] or [max_context]
    for b in rows:
        for c in ctxs:
            feats.append(StepFeatures(b, b * c, b, 0.0))
    for b in (1, 2, 4):
        for n in (128, 512, 2048):
            for start in (0, 1024):
                if start + n <= max_context:
                    feats.append(StepFeatures(b, b * (start + n), b * n, float(b * (n * start + n * (n + 1) // 2))))
    return feats


def linear_fit_of(model, form: str = "linear", max_rows: int = 256, max_context: int = 32768) -> LinearLatencyModel:
    """A linear model of `form` fitted to another model's predictions over an
    offline sweep (`sweep_features`): what a policy that plans with the linear
    form starts from when the profile is a roofline model."""
    feats = sweep_features(max_rows, max_context)
    times = [model.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs) for f in feats]
    return LinearLatencyModel.fit(feats, times, form)


def relative_errors(model, feats: list[StepFeatures], times) -> np.ndarray:
    pred = np.array([model.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs) for f in feats])
    y = np.asarray(times, dtype=np.float64)
    return np.abs(pred - y) / np.maximum(y, 1e-12)


def error_summary(model, feats: list[StepFeatures], times) -> dict:
    """Absolute percentage error of the predictions: median, p90, mean (fractions)."""
    e = relative_errors(model, feats, times)
    if e.size == 0:
        return {"n": 0, "median_ape": None, "p90_ape": None, "mean_ape": None}
    return {"n": int(e.size), "median_ape": float(np.median(e)), "p90_ape": float(np.percentile(e, 90)),
            "mean_ape": float(e.mean())}


def _scale_fit(base: LinearLatencyModel, feats: list[StepFeatures], times: list[float]) -> float:
    """The alpha minimising the relative error of alpha * base over the steps."""
    r = np.asarray([base.predict_features(f) for f in feats]) / np.maximum(np.asarray(times, dtype=np.float64), 1e-9)
    return float(r.sum() / max(float((r * r).sum()), 1e-18))


class OnlineLatencyModel:
    """Refits a linear model on the last `window` observed steps.

    Until `min_samples` steps are in, it answers with `base` (the offline fit),
    or -- without one -- reports itself uncalibrated (`calibrated` False; TAPER
    runs eager until then). Refits when the minimum is first reached, then
    every `refit_period_s` of `clock` time (the simulator passes its virtual
    clock) or every `refit_every_steps` observed steps, whichever comes first.
    """

    name = "latency-model"

    def __init__(
        self,
        base: LinearLatencyModel | None = None,
        form: str | None = None,
        window: int = 200,
        min_samples: int = 32,
        refit_period_s: float = 600.0,
        refit_every_steps: int | None = None,
        target: str = "wall_s",
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base = base
        self.form = form or (base.form if base is not None else "linear")
        self.window: deque[tuple[StepFeatures, float]] = deque(maxlen=window)
        self.min_samples = min_samples
        self.refit_period_s = refit_period_s
        self.refit_every_steps = refit_every_steps
        self.target = target
        self.clock = clock
        self.model: LinearLatencyModel | None = None
        self.num_refits = 0
        self._last_refit_t: float | None = None
        self._since_refit = 0

    @property
    def calibrated(self) -> bool:
        return self.model is not None or self.base is not None

    def current(self) -> LinearLatencyModel | None:
        return self.model if self.model is not None else self.base

    def predict(self, rows: int, context_tokens: int, new_tokens: int, prefill_pairs: float = 0.0) -> float:
        m = self.current()
        if m is None:
            raise RuntimeError("latency model not calibrated yet (fewer than min_samples steps, no offline profile)")
        return m.predict(rows, context_tokens, new_tokens, prefill_pairs)

    # -- StepPolicy ------------------------------------------------------------
    def plan(self, plan, view):
        return plan

    def observe(self, plan, record) -> None:
        f = plan_features(plan) if plan is not None else record_features(record)
        self.add(f, getattr(record, self.target))

    def add(self, f: StepFeatures, t: float) -> None:
        self.window.append((f, t))
        self._since_refit += 1
        if len(self.window) < self.min_samples:
            return
        now = self.clock()
        due = (
            self.model is None
            or (self._last_refit_t is not None and now - self._last_refit_t >= self.refit_period_s)
            or (self.refit_every_steps is not None and self._since_refit >= self.refit_every_steps)
        )
        if due:
            self.refit(now)

    def refit(self, now: float | None = None) -> LinearLatencyModel:
        feats = [f for f, _ in self.window]
        times = [t for _, t in self.window]
        if self.base is not None:
            self.model = self.base.rescaled(_scale_fit(self.base, feats, times))
        else:  # a whisker of ridge keeps a rank-deficient window solvable, too little to bias a well-posed one
            self.model = LinearLatencyModel.fit(feats, times, self.form, ridge=1e-9, nonneg=True)
        self.num_refits += 1
        self._last_refit_t = self.clock() if now is None else now
        self._since_refit = 0
        return self.model


# -- profiles -------------------------------------------------------------------


@dataclass(frozen=True)
class ServingCosts:
    """What a request and a step cost beyond the step's forward pass, as
    explicit terms (all seconds; 0 = not measured):

    entry_s     from a request's arrival to its reaching the scheduler (HTTP,
                validation, the pipe to the engine loop). Step logs of a
                2-core server measured 1.8-2.5 ms p50 into an idle engine.
    delivery_s  from the end of the step that made a token to the client
                holding it (output batch, pipe, SSE, the client's parsing).
    stream_s    more delivery per token the same step made: the front end
                and the client handle a step's tokens one stream after the
                other. A step with k tokens delivers them delivery_s +
                k * stream_s after it ends. Delivery shifts TTFT and E2E, and
                the gaps between tokens only as much as k changes between steps.
                A sweep timed by its client sees entry and delivery only
                together (a TTFT holds both): it stores the sum as delivery_s,
                with entry_s 0.
    wake_s      extra time of the first step after the engine sat idle: its
                threads asleep, caches cold. Busy steps do not pay it, so a
                model fitted on busy steps misses it at low load.
    wake_curve  the same as it grows with the idle time before the step:
                ((idle_s, extra_s), ...) points, increasing in idle_s, read
                piecewise linearly from (0, 0) and flat past the last. Step
                logs of a 2-core server: ~1-3 ms after 5-20 ms of idling,
                ~5 ms after 100 ms or more. When given, it replaces wake_s.

    The step policies (TAPER, speculation) choose between plans of one step
    of a busy engine: delivery does not change a step's time, and a busy
    engine does not wake, so the step model's form is all they need.
    """

    entry_s: float = 0.0
    delivery_s: float = 0.0
    stream_s: float = 0.0
    wake_s: float = 0.0
    wake_curve: tuple[tuple[float, float], ...] = ()

    KEYS = ("entry_s", "delivery_s", "stream_s", "wake_s", "wake_curve")

    def __post_init__(self):
        xs = [x for x, _ in self.wake_curve]
        if any(b <= a for a, b in zip(xs, xs[1:])) or any(x <= 0 for x in xs):
            raise ValueError(f"wake_curve: idle times must be positive and increasing, got {xs}")

    @classmethod
    def from_engine(cls, engine: dict) -> "ServingCosts":
        """From a profile's `engine` section. Profiles written before the split
        hold one `request_overhead_s`, fitted from TTFTs: delivery, by the
        same reasoning as above."""
        kw = {k: float(engine[k]) for k in cls.KEYS[:4] if engine.get(k) is not None}
        if "delivery_s" not in kw and engine.get("request_overhead_s") is not None:
            kw["delivery_s"] = float(engine["request_overhead_s"])
        if engine.get("wake_curve"):
            kw["wake_curve"] = tuple((float(x), float(y)) for x, y in engine["wake_curve"])
        return cls(**kw)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.KEYS[:4]}
        d["wake_curve"] = [list(p) for p in self.wake_curve]
        return d

    def wake(self, idle_s: float) -> float:
        """Extra time of a step after `idle_s` seconds of idling."""
        curve = self.wake_curve
        if not curve:
            return self.wake_s if idle_s > 0 else 0.0
        x0, y0 = 0.0, 0.0
        for x, y in curve:
            if idle_s <= x:
                return y0 + (y - y0) * (idle_s - x0) / (x - x0)
            x0, y0 = x, y
        return y0

    def delivery(self, tokens: int) -> float:
        """Delay from a step's end to its client holding a token, for a step that made `tokens`."""
        return self.delivery_s + self.stream_s * tokens


@dataclass
class Profile:
    """A latency model plus what the simulator needs to size an engine like it."""

    name: str
    source: str  # "measured" | "roofline"
    model: object  # LinearLatencyModel | RooflineLatencyModel
    engine: dict = field(default_factory=dict)  # kv_slots, max_running, max_batched_tokens, max_context, vocab_size
    data: dict = field(default_factory=dict)  # the whole JSON

    def to_dict(self) -> dict:
        return self.data


def profile_from_dict(d: dict, name: str = "") -> Profile:
    if d.get("kind") != PROFILE_KIND:
        raise ValueError(f"not a stepserve latency profile (kind={d.get('kind')!r})")
    lat = d["latency"]
    if lat["form"] == "roofline":
        from stepserve.scheduler.roofline import RooflineLatencyModel

        model = RooflineLatencyModel.from_dict(lat)
    else:
        model = LinearLatencyModel.from_dict(lat)
    return Profile(name=d.get("name") or name, source=d.get("source", "measured"), model=model,
                   engine=dict(d.get("engine", {})), data=d)


def load_profile(spec: str) -> Profile:
    """A profile JSON path, or a built-in roofline profile `DEVICE[xN]:MODEL`."""
    if os.path.isfile(spec):
        with open(spec) as f:
            return profile_from_dict(json.load(f), name=spec)
    from stepserve.scheduler.roofline import is_builtin_name, roofline_profile

    if is_builtin_name(spec):
        return profile_from_dict(roofline_profile(spec), name=spec)
    raise FileNotFoundError(
        f"profile {spec!r}: no such file, and not a built-in roofline profile DEVICE[xN]:MODEL "
        "(see `stepserve simulate --list-profiles`)")
