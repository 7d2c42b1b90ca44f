"""The step-latency model: predicted wall time of one step from its shape.

One model serves the step policies (what would this plan cost?) and the
simulator (how far does the virtual clock move?). Forms, all linear in their
coefficients and fitted by least squares:

  taper        T = a + b*rows + c*context_tokens                 (TAPER's predictor)
  linear       T = a + b*rows + c*context_tokens + d*new_tokens  (the default)
  linear+attn  linear + e*prefill_pairs
  segmented    a + R(rows) + c*context_tokens + d*new_tokens + e*prefill_pairs
               + g*prefill_step + f*extend_rows + h*chunk_step + l*layered_step,
               where R is piecewise linear
               in rows: one slope per segment between knots (1, 2, 4, ... up
               to the largest batch the fit saw; the last segment
               open-ended), each >= 0

The segmented form is for measured steps where one slope does not hold from
1 row to 100: on a 2-core CPU server the second row of a decode step cost
0.9-2.5 ms (by the machine's phase) and each row past 4 or 8 an order of
magnitude less, and a linear fit through both put ~0.1 ms on every row, too
little at the small batches of light load and the intercept too high for
one row. `extend_rows` (rows that prefill a chunk through the extend path,
not folded into decode-shaped queries: `plan.FoldRule`) is the work a step does
per chunk outside the forward pass: admission, the radix cache, the chunk's
input and output bookkeeping; on that server steps with a chunk spent
0.6-3.7 ms outside the forward pass (growing with the chunk), decode steps
0.45 ms. `prefill_step` (1 when any row prefills a chunk) is what a step
pays once for having chunks at all: the prefill attention path and its
masks. Fitted on that server's sweep, the first chunk of a step cost 4.4
ms and each further one 0.7. One price per chunk (3.0 ms) overcharged the
steps of overload, which pack 16-25 short prompts' chunks into 2,048
tokens (measured 0.95x predicted, where steps with one chunk measured
1.1-1.2x), and a speed fitted to runs made of them undercharged every
small step. The forms without the two fold them into the token terms.
`chunk_step` (1 when any row prefills a chunk, folded or not) and
`layered_step` (1 when such a step does not run as one call: more new tokens
than the fold rule's `tokens`, or a chunk on the extend path) price the
prompt work that folding does not save. On a 2-core Zen 4 EPYC server,
priced without them, steps whose chunks all folded ran 1.34-1.44x the
model's price at 1-64 prompt tokens and 0.93x past 256 (the model had only
the extend path's once-a-step price, which a folded step does not pay).
Fitted with them (0.80 and 1.50 ms there, beside the extend path's 2.93
ms), over 12 Azure replays at 48-96 req/s the window-scaled model
(`validate`'s by-prompt view) priced steps of 1-64 prompt tokens at
0.90-0.95x their time and of 257+ at 0.97-1.07x, where a profile without
them read 1.18-1.29x and 0.92-0.99x on the same runs.
The step policies price all of these terms too: TAPER's marginal cost of a
branch row is R's local slope.

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
import math
import os
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from stepserve.scheduler.plan import NO_FOLD, FoldRule, chunk_pairs

FORMS: dict[str, tuple[str, ...]] = {
    "taper": ("const", "rows", "context_tokens"),
    "linear": ("const", "rows", "context_tokens", "new_tokens"),
    "linear+attn": ("const", "rows", "context_tokens", "new_tokens", "prefill_pairs"),
    # "rows" here is a piecewise-linear term: one coefficient per segment of `knots`
    "segmented": ("const", "rows", "context_tokens", "new_tokens", "prefill_pairs", "prefill_step", "extend_rows",
                  "chunk_step", "layered_step"),
}
TERMS = ("const", "rows", "context_tokens", "new_tokens", "prefill_pairs", "prefill_step", "extend_rows", "chunk_step",
         "layered_step")
# A step's cost in two parts that a busy machine slows by different amounts:
# per step, per row and per context token (the loop, small kernels and decode
# attention: latency- and memory-bound), and per token computed (the matrix
# products and prefill attention: compute-bound). Measured on 2 shared cores,
# replay traffic slowed the first by up to 1.5x where it slowed the second 1.1x.
# The prompt chunks' own terms (`prefill_step`, `extend_rows`, `chunk_step`,
# `layered_step`) go with the second: a run's speed is read off its decode
# steps for the first part and its prompt steps for the second
# (`validate.run_speed`), and a decode step has no chunk, so the decode
# steps' factor has nothing to say of them. Under
# the first (x1.3-1.8 on a 2-core Zen 5 EPYC's replays, where the prompt steps
# ran at ~1.0x) the once-a-step chunk price grew, the fitted per-token factor
# fell to 0.63-0.78 to keep the prompt steps' total, and the window-scaled
# model priced steps of 257+ prompt tokens at 1/1.28-1/1.53 of their time and
# those of 1-64 at 1.6-2.1x theirs over 30 Azure replays (`validate`'s
# by-prompt view); with them here, 1/1.10-1/1.23 and 1.25-1.5x.
TOKEN_TERMS = ("new_tokens", "prefill_pairs", "prefill_step", "extend_rows", "chunk_step", "layered_step")


def row_knots(max_rows: int) -> tuple[int, ...]:
    """The segmented form's knots for data whose largest batch is `max_rows`:
    1, 2, 4, ... below it (so every segment holds some of the data; the last,
    open-ended, extrapolates past it)."""
    knots = [1]
    while knots[-1] * 2 < max_rows:
        knots.append(knots[-1] * 2)
    return tuple(knots)


def row_segments(rows: float, knots: tuple[int, ...]) -> list[float]:
    """How much of `rows` lies in each segment [k_i, k_i+1) of `knots` (the last open)."""
    out = []
    for i, k in enumerate(knots):
        hi = knots[i + 1] if i + 1 < len(knots) else float("inf")
        out.append(float(min(max(rows - k, 0.0), hi - k)))
    return out


def term_names(form: str, knots: tuple[int, ...] = ()) -> list[str]:
    """One name per coefficient: the segmented form's rows term is one per segment."""
    out = []
    for n in FORMS[form]:
        if n == "rows" and form == "segmented":
            out += [f"rows[{k},{knots[i + 1] if i + 1 < len(knots) else ''})" for i, k in enumerate(knots)]
        else:
            out.append(n)
    return out
PROFILE_KIND = "stepserve-latency-profile"


@dataclass(slots=True)
class StepFeatures:
    rows: int
    context_tokens: int
    new_tokens: int
    prefill_pairs: float = 0.0
    extend_rows: int = 0  # rows that prefill a chunk of more than one token on the extend path (not folded)
    chunk_rows: int = 0  # rows that prefill a chunk, folded or not (at least extend_rows)
    layered: bool = False  # a step with chunks that does not run as one call (`plan_features`)

    @property
    def prefill_step(self) -> float:
        """1 when a chunk takes the extend path (its once-a-step price)."""
        return 1.0 if self.extend_rows > 0 else 0.0

    @property
    def chunk_step(self) -> float:
        """1 when the step prefills any chunk, folded or not (the prompt work's once-a-step price)."""
        return 1.0 if self.chunk_rows > 0 or self.extend_rows > 0 else 0.0

    @property
    def layered_step(self) -> float:
        """1 when a step with chunks runs layer by layer (not as one call)."""
        return 1.0 if self.layered or self.extend_rows > 0 else 0.0

    def vector(self, form: str, knots: tuple[int, ...] = ()) -> list[float]:
        out = []
        for n in FORMS[form]:
            if n == "const":
                out.append(1.0)
            elif n == "rows" and form == "segmented":
                out += row_segments(self.rows, knots)
            else:
                out.append(float(getattr(self, n)))
        return out


def plan_features(plan) -> StepFeatures:
    """Features of a `StepPlan`, in one pass over its rows. `extend_rows`
    counts the chunks that run through the extend path: not those the
    runner folds into decode-shaped queries (`StepPlan.chunk_folds`). A step
    with chunks is `layered` unless the fold rule runs it as one call (all
    its tokens within `FoldRule.tokens`, every chunk folded)."""
    ctx = new = 0
    pairs = 0
    ext = 0
    for r in plan.rows:
        n = r.num_new
        s = r.start
        new += n
        ctx += s + n
        if n > 1:
            pairs += chunk_pairs(s, n)
            if not r.draft_len:
                ext += 1
    chunks = ext
    if ext:
        folds = plan.chunk_folds()
        if folds:
            ext -= sum(folds)
    return StepFeatures(len(plan.rows), ctx, new, float(pairs), ext, chunks,
                        chunks > 0 and (ext > 0 or new > plan.fold.tokens))


def shape_features(decode_rows: int, decode_context: int, chunks: list[tuple[int, int]],
                   fold: FoldRule = NO_FOLD) -> StepFeatures:
    """What `plan_features` gives a plan of `decode_rows` decode rows over
    `decode_context` tokens of context (after the step) and prompt `chunks`
    ((start, n) each, each ending its prompt, none scoring it) under `fold`:
    the shape of a step a profile's client or sweep knows without a plan."""
    new = decode_rows + sum(n for _, n in chunks)
    ext = sum(1 for s, n in chunks if not fold.folds_sampled(new, s, n))
    return StepFeatures(decode_rows + len(chunks), decode_context + sum(s + n for s, n in chunks), new,
                        float(sum(chunk_pairs(s, n) for s, n in chunks)), ext, len(chunks),
                        bool(chunks) and (ext > 0 or new > fold.tokens))


COLD_STEPS = 3  # the decode steps after a step with prompt tokens that pay for the caches it emptied


def is_cold(after: tuple[int, int]) -> bool:
    """Whether a step that is `after` (`StepPlan.after_prompt`: the j-th decode
    step after one of P prompt tokens) is one of the first COLD_STEPS decode
    steps after prompt tokens (`ServingCosts.cold`)."""
    return 0 < after[0] <= COLD_STEPS and after[1] > 0


def prompt_tokens(rows) -> int:
    """The new tokens of a step's rows beyond one per decode row: its prefill
    and extend chunks and its verifications (`ServingCosts.cold`)."""
    return sum(r.num_new for r in rows if r.num_new != 1)


@dataclass(slots=True)
class SincePrompt:
    """Where the engine stands since its last step that ran prompt tokens
    (`prompt_tokens`), for `ServingCosts.cold`: `steps` decode steps have run
    since, and that step ran `tokens` of them (0: none yet). The scheduler
    keeps one over the steps it commits (`StepPlan.after_prompt`, and
    `EngineView.since_prompt` for the step being planned)."""

    steps: int = 0
    tokens: int = 0

    def next(self, prompt: int) -> tuple[int, int]:
        """(j, P) of a step with `prompt` prompt tokens if it runs next: j = 0
        and P = `prompt` where it has any, else the j-th decode step after a
        step of P prompt tokens."""
        return (0, prompt) if prompt > 0 else (self.steps + 1, self.tokens)

    def advance(self, prompt: int) -> tuple[int, int]:
        """Counts in a step with `prompt` prompt tokens; returns its (j, P)."""
        self.steps, self.tokens = jp = self.next(prompt)
        return jp


def record_features(rec) -> StepFeatures:
    """Features of a `StepRecord`."""
    return StepFeatures(rec.rows, rec.context_tokens, rec.new_tokens, rec.prefill_pairs, rec.extend_rows,
                        rec.chunk_rows, rec.layered)


class LatencyModel(Protocol):
    form: str

    def predict(self, rows: int, context_tokens: int, new_tokens: int, prefill_pairs: float = 0.0,
                extend_rows: int = 0, chunk_rows: int = 0, layered: bool = False) -> float: ...

    def to_dict(self) -> dict: ...


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||A x - b|| subject to x >= 0: Lawson and Hanson's active-set
    method (exact: it ends at the least-squares solution on the columns left
    free, with the KKT conditions met), on columns scaled to unit norm so that
    terms of very different magnitudes (a constant, tokens, attention pairs)
    are treated alike. Columns that are all zero get 0."""
    A = np.asarray(A, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    n = A.shape[1]
    norms = np.linalg.norm(A, axis=0)
    live = norms > 0
    x = np.zeros(n)
    if not live.any():
        return x
    M = A[:, live] / norms[live]
    m = M.shape[1]
    z = np.zeros(m)
    free = np.zeros(m, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(M.T @ b).max()))
    for _ in range(3 * m + 10):
        w = M.T @ (b - M @ z)
        cand = np.where(free, -np.inf, w)
        j = int(np.argmax(cand))
        if free.all() or cand[j] <= tol:
            break
        free[j] = True
        while True:
            s = np.zeros(m)
            s[free] = np.linalg.lstsq(M[:, free], b, rcond=None)[0]
            if (s[free] > 0).all():
                z = s
                break
            neg = free & (s <= 0)
            alpha = float(np.min(z[neg] / (z[neg] - s[neg])))
            z = z + alpha * (s - z)
            free &= z > 1e-15
            z[~free] = 0.0
            if not free.any():
                break
    x[live] = z / norms[live]
    return x


@dataclass
class LinearLatencyModel:
    form: str
    coef: list[float]
    min_s: float = 1e-6  # a prediction is never below this (a fitted intercept can be negative)
    knots: tuple[int, ...] = ()  # the segmented form's row knots (`row_knots`)

    def __post_init__(self):
        if self.form not in FORMS:
            raise ValueError(f"unknown latency form {self.form!r} ({', '.join(FORMS)})")
        self.knots = tuple(int(k) for k in self.knots)
        if self.form == "segmented":
            if not self.knots or self.knots[0] != 1 or any(b <= a for a, b in zip(self.knots, self.knots[1:])):
                raise ValueError(f"the segmented form needs increasing row knots from 1, got {self.knots}")
        elif self.knots:
            raise ValueError(f"form {self.form} has no row knots")
        names = term_names(self.form, self.knots)
        if len(self.coef) != len(names):
            raise ValueError(f"form {self.form} takes {len(names)} coefficients ({', '.join(names)}), "
                             f"got {len(self.coef)}")
        # spread into fixed slots (const, context, new, pairs, prefill step, extend, chunk step, layered step;
        # 0 where the form has no such term), and the rows term as a piecewise-linear function: cumulative
        # value at each knot, slope after it
        coef = iter(float(x) for x in self.coef)
        c, slopes = {}, []
        for n in FORMS[self.form]:
            if n == "rows":
                slopes = [next(coef) for _ in range(max(1, len(self.knots)))]
            else:
                c[n] = next(coef)
        self._c = tuple(c.get(n, 0.0) for n in TERMS if n != "rows")
        knots = self.knots or (0,)
        cum = [0.0]
        for i in range(1, len(knots)):
            cum.append(cum[-1] + slopes[i - 1] * (knots[i] - knots[i - 1]))
        self._knots, self._cum, self._slopes = knots, tuple(cum), tuple(slopes)

    def row_cost(self, rows: float) -> float:
        """The rows term: b * rows, or the segmented form's piecewise-linear R(rows)."""
        knots = self._knots
        i = bisect_right(knots, rows) - 1
        if i < 0:  # below the first knot (0 rows of the segmented form): flat
            return 0.0
        return self._cum[i] + self._slopes[i] * (rows - knots[i])

    def predict(self, rows: int, context_tokens: int, new_tokens: int, prefill_pairs: float = 0.0,
                extend_rows: int = 0, chunk_rows: int = 0, layered: bool = False) -> float:
        """(`StepFeatures`' fields, in order; a chunk on the extend path makes
        a chunk step that runs layer by layer, whatever the last two say.)"""
        a, c, d, e, g, f, h, lay = self._c
        t = a + self.row_cost(rows) + c * context_tokens + d * new_tokens + e * prefill_pairs + f * extend_rows
        if extend_rows > 0:
            t += g + h + lay
        elif chunk_rows > 0:
            t += h + lay if layered else h
        return t if t > self.min_s else self.min_s

    def predict_features(self, f: StepFeatures) -> float:
        return self.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs, f.extend_rows, f.chunk_rows,
                            f.layered)

    def predict_plan(self, plan) -> float:
        return self.predict_features(plan_features(plan))

    def to_dict(self) -> dict:
        d = {"form": self.form, "terms": term_names(self.form, self.knots), "coef": list(self.coef)}
        if self.knots:
            d["knots"] = list(self.knots)
        return d

    def rescaled(self, alpha: float, token_alpha: float | None = None) -> "LinearLatencyModel":
        """alpha * this model; with `token_alpha`, the `TOKEN_TERMS` part
        (per token, and the prompt chunks' own terms) times token_alpha and
        the rest (per step, per row, per context token) times alpha."""
        if token_alpha is None:
            return LinearLatencyModel(self.form, [alpha * c for c in self.coef], self.min_s, self.knots)
        n_rows = max(1, len(self.knots))
        scale = [s for n in FORMS[self.form]
                 for s in ([alpha] * n_rows if n == "rows" else [token_alpha if n in TOKEN_TERMS else alpha])]
        return LinearLatencyModel(self.form, [k * c for k, c in zip(scale, self.coef)], self.min_s, self.knots)

    def token_part(self, f: StepFeatures) -> float:
        """The `TOKEN_TERMS` part of a prediction (before the `min_s` floor):
        per new token and prefill pair, and a step's chunk prices."""
        _, _, d, e, g, x, h, lay = self._c
        return (d * f.new_tokens + e * f.prefill_pairs + ((g + x * f.extend_rows) if f.extend_rows > 0 else 0.0)
                + h * f.chunk_step + lay * f.layered_step)

    @classmethod
    def from_dict(cls, d: dict) -> "LinearLatencyModel":
        coef = [float(x) for x in d["coef"]]
        terms = d.get("terms")
        if d["form"] == "segmented" and terms:
            if "prefill_step" not in terms:
                # a profile written before the segmented form priced a step's first chunk apart: every
                # chunk at one price is the same model with no once-a-step price
                coef.insert(terms.index("extend_rows"), 0.0)
            if "chunk_step" not in terms:
                # ... or before it priced the prompt work that folding does not save: no such prices
                coef += [0.0, 0.0]
        return cls(d["form"], coef, knots=tuple(d.get("knots") or ()))

    @classmethod
    def fit(
        cls,
        feats: list[StepFeatures],
        times: list[float] | np.ndarray,
        form: str = "linear",
        prior: "LinearLatencyModel | None" = None,
        ridge: float = 0.0,
        nonneg: bool = False,
        knots: tuple[int, ...] | None = None,
        smooth: float = 0.0,
    ) -> "LinearLatencyModel":
        """Least squares on relative error; `ridge` > 0 pulls towards `prior`
        (or towards zero), scaled per term by that term's own magnitude.
        `nonneg`: every coefficient >= 0 (each term is a cost; a window of
        steps that spans little of a term's range can otherwise fit it
        negative and extrapolate nonsense outside it). The segmented form is
        always fitted so (its slopes make a cost that never falls as rows
        grow), on `knots`, by default `row_knots` of the largest batch seen;
        `smooth` > 0 pulls its neighbouring slopes together (`solve`)."""
        if len(feats) == 0:
            raise ValueError("no samples to fit")
        knots = (tuple(knots) if knots else row_knots(max(f.rows for f in feats))) if form == "segmented" else ()
        w0 = None
        if prior is not None and prior.form == form and tuple(prior.knots) == knots:
            w0 = np.asarray(prior.coef, dtype=np.float64)
        coef = cls.solve(design(feats, form, knots), times, form, knots, ridge=ridge, nonneg=nonneg, prior=w0,
                         smooth=smooth)
        return cls(form, [float(x) for x in coef], knots=knots)

    @staticmethod
    def solve(X: np.ndarray, times, form: str, knots: tuple[int, ...] = (), *, ridge: float = 0.0,
              nonneg: bool = False, prior: np.ndarray | None = None, smooth: float = 0.0) -> np.ndarray:
        """`fit`'s coefficients from its design matrix (`design`), so that a
        cross-validation builds the matrix once.

        `smooth` (segmented form): a penalty on the differences of
        neighbouring row slopes, sqrt(smooth) times the slope columns' mean
        norm per difference; 0 leaves every segment free, a large value
        gives one slope. On a 2-core CPU server's sweeps the free slopes
        moved from 18 to 95 us per row between four profiles of one engine
        while one slope for all held out within 1% as well: the rows term
        and the new-token term are nearly collinear on decode steps, and the
        free fit spends that freedom on noise. `calibrate.fit_steps` picks
        it by held-out error."""
        X = np.asarray(X, dtype=np.float64)
        y = np.asarray(times, dtype=np.float64)
        w = 1.0 / np.maximum(y, 1e-9)
        Xw = X * w[:, None]
        yw = y * w
        k = X.shape[1]
        w0 = np.zeros(k) if prior is None else np.asarray(prior, dtype=np.float64)
        if form == "segmented":
            nonneg = True
            nseg = len(knots)
            if smooth > 0 and nseg > 1:
                # the penalty as extra rows of the system: s (slope[i+1] - slope[i]) ~ 0
                s = np.sqrt(smooth) * float(np.linalg.norm(Xw[:, 1:1 + nseg], axis=0).mean())
                P = np.zeros((nseg - 1, k))
                idx = np.arange(nseg - 1)
                P[idx, 1 + idx], P[idx, 2 + idx] = -s, s
                Xw, yw = np.vstack([Xw, P]), np.concatenate([yw, np.zeros(nseg - 1)])
        if ridge > 0:
            n = len(y)  # the data rows (ridge's scale leaves any penalty rows out)
            A = Xw[:n].T @ Xw[:n]
            if nonneg:
                # ridge as extra rows of the system: sqrt(D) (coef - w0) ~ 0
                d = np.sqrt(np.maximum(np.diag(A), 1e-12) * ridge)
                return nnls(np.vstack([Xw, np.diag(d)]), np.concatenate([yw, d * w0]))
            D = np.diag(np.maximum(np.diag(A), 1e-12)) * ridge
            return np.linalg.solve(A + D, Xw.T @ yw + D @ w0)
        if nonneg:
            return nnls(Xw, yw)
        coef, *_ = np.linalg.lstsq(Xw, yw, rcond=None)
        return coef


def design(feats: list[StepFeatures], form: str, knots: tuple[int, ...] = ()) -> np.ndarray:
    """The fit's design matrix: one row of `form`'s terms per step."""
    return np.array([f.vector(form, knots) for f in feats], dtype=np.float64).reshape(len(feats), -1)


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
            feats.append(shape_features(b, b * c, []))
    for b in (1, 2, 4):
        for n in (128, 512, 2048):
            for start in (0, 1024):
                if start + n <= max_context:
                    feats.append(shape_features(0, 0, [(start, n)] * b))
    return feats


def linear_fit_of(model, form: str = "linear", max_rows: int = 256, max_context: int = 32768) -> LinearLatencyModel:
    """A linear model of `form` fitted to another model's predictions over an
    offline sweep (`sweep_features`): what a policy that plans with the linear
    form starts from when the profile is a roofline model."""
    feats = sweep_features(max_rows, max_context)
    times = [model.predict_features(f) for f in feats]
    return LinearLatencyModel.fit(feats, times, form)


def relative_errors(model, feats: list[StepFeatures], times) -> np.ndarray:
    pred = np.array([model.predict_features(f) for f in feats])
    y = np.asarray(times, dtype=np.float64)
    return np.abs(pred - y) / np.maximum(y, 1e-12)


def error_summary(model, feats: list[StepFeatures], times) -> dict:
    """Absolute percentage error of the predictions: median, p90, mean (fractions)."""
    e = relative_errors(model, feats, times)
    if e.size == 0:
        return {"n": 0, "median_ape": None, "p90_ape": None, "mean_ape": None}
    return {"n": int(e.size), "median_ape": float(np.median(e)), "p90_ape": float(np.percentile(e, 90)),
            "mean_ape": float(e.mean())}


def _scale_fit(base: LinearLatencyModel, feats: list[StepFeatures], times: list[float],
               cold: list[tuple[float, float]] | None = None) -> float:
    """The alpha whose alpha * base adds up to the steps' measured time (the
    ratio of the sums); with `cold`, each step's (a, b) of its cold extra
    a + b * t on the model's t (`ServingCosts.cold_terms`), the alpha whose
    alpha * base plus that extra adds up to it. Not the least relative
    squared error, which the
    offline fit minimises across shapes: for one scale under a multiplicative
    scatter of the steps it comes out low (e^(-3 s^2 / 2) of the median for
    a log-normal scatter s, lower still against the mean), and TAPER's
    budget check then admits rows into steps that run past it: on the 2-core
    CPU server a TAPER server's rescaled predictions were 7-12% below the
    steps' measured time over whole runs."""
    total = float(sum(times))
    if cold:
        t = [base.predict_features(f) for f in feats]
        p = float(sum(x * (1.0 + b) for x, (_, b) in zip(t, cold)))
        fixed = float(sum(a for a, _ in cold))
        if p > 0 and total > fixed:
            return (total - fixed) / p
        return total / (p + fixed) if p + fixed > 0 else 1.0
    p = float(sum(base.predict_features(f) for f in feats))
    return total / p if p > 0 else 1.0


class OnlineLatencyModel:
    """Refits a linear model on the last `window` observed steps.

    Until `min_samples` steps are in, it answers with `base` (the offline fit),
    or -- without one -- reports itself uncalibrated (`calibrated` False; TAPER
    runs eager until then). Refits when the minimum is first reached, then
    every `refit_period_s` of `clock` time (the simulator passes its virtual
    clock) or every `refit_every_steps` observed steps, whichever comes first.
    `lazy`: a refit that falls due waits until the model is next read
    (`predict`, `current`), on the window as it is then, so an owner that
    reads it on few steps (speculation prices only mixed steps with it) does
    not pay a fit every `refit_every_steps` steps for nothing.
    `costs`: the profile's serving costs; where they price cold decode steps
    (`ServingCosts.cold`), the rescaling of `base` counts each observed
    step's cold extra in (by its `StepPlan.after_prompt`), so the scale is
    the steady steps' and `cold_extra` prices the next ones on top. (Without
    `base` the window is fitted as it is: a profile brings both.)
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
        lazy: bool = False,
        costs: "ServingCosts | None" = None,
    ):
        self.base = base
        self.costs = costs if costs is not None and costs.cold else None
        self.form = form or (base.form if base is not None else "linear")
        self.window: deque[tuple[StepFeatures, float]] = deque(maxlen=window)
        self._after: deque[tuple[int, int]] = deque(maxlen=window)  # each window step's (j, P)
        self.min_samples = min_samples
        self.refit_period_s = refit_period_s
        self.refit_every_steps = refit_every_steps
        self.target = target
        self.clock = clock
        self.model: LinearLatencyModel | None = None
        self.num_refits = 0
        self._last_refit_t: float | None = None
        self._since_refit = 0
        self.lazy = lazy
        self._due: float | None = None  # lazy: the clock when a refit fell due, until it runs

    @property
    def calibrated(self) -> bool:
        return self.model is not None or self.base is not None or self._due is not None

    def current(self) -> LinearLatencyModel | None:
        if self._due is not None:
            self.refit(self._due)
        return self.model if self.model is not None else self.base

    def predict(self, rows: int, context_tokens: int, new_tokens: int, prefill_pairs: float = 0.0,
                extend_rows: int = 0, chunk_rows: int = 0, layered: bool = False) -> float:
        m = self.current()
        if m is None:
            raise RuntimeError("latency model not calibrated yet (fewer than min_samples steps, no offline profile)")
        return m.predict(rows, context_tokens, new_tokens, prefill_pairs, extend_rows, chunk_rows, layered)

    def cold_terms(self, after: tuple[int, int]) -> tuple[float, float]:
        """(a, b): a step that is `after` (`StepPlan.after_prompt`) takes
        a + (1 + b) t for the model's t (`ServingCosts.cold_terms`)."""
        return self.costs.cold_terms(*after) if self.costs is not None else (0.0, 0.0)

    # -- StepPolicy ------------------------------------------------------------
    def plan(self, plan, view):
        return plan

    def observe(self, plan, record) -> None:
        if getattr(record, "cold", False):
            # a shape the runner had not run before: one-off work (kernels built for it) in its time, no
            # steady-state price. A first refit on the 32 steps after a server's start took such steps in
            # and priced every step 1.75x its time until the next refit, 600 s later.
            return
        f = plan_features(plan) if plan is not None else record_features(record)
        self.add(f, getattr(record, self.target), plan.after_prompt if plan is not None else (0, 0))

    def add(self, f: StepFeatures, t: float, after: tuple[int, int] = (0, 0)) -> None:
        """Observes a step of features `f` that took `t`, and was `after`
        (`StepPlan.after_prompt`)."""
        self.window.append((f, t))
        self._after.append(after)
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
            if self.lazy:
                self._due = now
            else:
                self.refit(now)

    def refit(self, now: float | None = None) -> LinearLatencyModel:
        feats = [f for f, _ in self.window]
        times = [t for _, t in self.window]
        if self.base is not None:
            cold = [self.cold_terms(jp) for jp in self._after] if self.costs is not None else None
            self.model = self.base.rescaled(_scale_fit(self.base, feats, times, cold))
        else:  # a whisker of ridge keeps a rank-deficient window solvable, too little to bias a well-posed one
            self.model = LinearLatencyModel.fit(feats, times, self.form, ridge=1e-9, nonneg=True)
        self.num_refits += 1
        self._last_refit_t = self.clock() if now is None else now
        self._since_refit = 0
        self._due = None
        return self.model


# -- profiles -------------------------------------------------------------------


@dataclass(frozen=True)
class ServingCosts:
    """What a request and a step cost beyond the step's forward pass, as
    explicit terms (all seconds; 0 = not measured):

    entry_s     from a request's arrival to its reaching the scheduler (HTTP,
                validation, the pipe to the engine loop). Step logs of a
                2-core server measured 1.8-2.5 ms p50 into an idle engine.
    delivery_s  from the end of the step that made a stream's first token to
                the client holding it (output batch, pipe, the response's
                start and its first SSE event, the client's parsing).
    token_delivery_s
                the same for a later token of the stream, with nothing
                queued on the host (0: not measured, delivery_s): the
                response's start is behind it.
    end_delivery_s
                the same for the token that ends the stream (0: as a
                later one): the last event, the usage, the stream's close.
                Replays at 16-48 req/s on a 2-core EPYC: a stream's first
                token reached the client 0.7-0.9 ms after its step, the
                second 0.3 (it waits behind the first's host work, below),
                the third 0.15, the middle one 0.1, the last 0.3-0.4.
                Delivered like its first, a stream's later tokens came late
                against it: the client saw the first two 0.12-0.21 ms apart
                where the engine made them 0.6-0.8 ms apart, and the
                simulator read 0.8 ms. TPOT, from the first token to the
                last, depends on the two ends.
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
    loop_s      the engine loop's own time between two iterations of a busy
                engine, outside either: the poll for new commands, the loop's
                bookkeeping, the step log's line. A busy engine pays it before
                every step; one that woke from idle pays the wake-up instead
                (its wait ends where the poll returns). Step logs of a 2-core
                server: 0.07 ms after a one-row step to 0.27 ms after 64 rows
                or more, 4-7% of a small decode step.
    loop_row_s  more of it per row of the step before (the loop lets go of
                that step's outputs at its top): a busy step starts
                loop_s + loop_row_s * (rows of the step before) after the
                one before ended. Fitted there: 0.08 ms + 3 us per row.
                Both from the gaps before steps that took in no request.
    intake_s    more of it per request a busy loop takes in before a step:
                the poll reads and unpickles each new request from the
                front end's pipe while the front end, which has just handled
                the request's HTTP call, competes for the same cores. (Into
                an idle engine a request comes with its entry_s instead: the
                blocking poll returns with it.) Step logs of a 2-core server:
                0.09-0.16 ms per request, more for longer prompts.
    host_request_s, host_token_s, host_prompt_token_s, host_batch_s
                the host's work outside the engine per stream started (a
                request's first token: the response, the client taking it
                up; with the request's own HTTP handling), per token
                streamed, per prompt token of a request as it arrives (the
                prompt's text, its tokenization, before the engine sees it:
                a request reaches the engine entry_s after the work queued
                ahead of it) and per output batch (an engine
                iteration's outputs, which the front end reads as one message
                and spreads over its streams): the front end's and, on a
                machine that runs it too, the load generator's, on the one
                core the engine leaves them. Per batch is what a light load
                pays per token: one token a batch. It queues, first in,
                first out: a step's tokens wait,
                on top of their delivery, for the work queued before the
                step ended, and its i-th new stream for the i - 1 before it.
                A host that keeps up adds nothing; past the knee on the
                2-core Xeon a step that started 20 streams held the last by
                ~20 ms, and first tokens took 13-19 ms from the engine to the
                client at 144-160 req/s of the Azure trace (1.4 ms at 16).
                `profile --url` measures both from CPU time
                (`profile_http.host_work`).
    cold        extra time of the first decode steps after a step that ran
                prompt tokens (a prefill or extend chunk, or a verification):
                ((a_1, b_1), (a_2, b_2), ...), the j-th such step taking
                sqrt(P) * (a_j + b_j * t) longer than the model's t, for
                the P prompt tokens of that step (`cold_extra`). The chunk's
                activations push the weights and the KV out of the caches,
                and the decode steps after it read them back: on the 2-core
                Xeon the first ran 1.3-2.1x the model's time after a chunk
                of 50-400 tokens, the second 1.2-1.7x, the third 1.0-1.2x,
                growing with the chunk, where a long run of decode steps
                runs at 0.96x. A model fitted on every busy step priced the
                steady steps a few percent high and the cold ones far low,
                and at a light load, where every request's first decode
                steps follow its prompt's, TPOT came out 14% low.

    The step policies (TAPER, speculation) choose between plans of one step
    of a busy engine: delivery does not change a step's time, a busy engine
    does not wake, and loop_s is the same for every plan of a step (TAPER's
    budget, slack less the baseline step, moves by it: 0.1-0.3 ms against
    TPOT SLOs of 10 ms and more; loop_row_s follows the rows of the step
    before, which every plan of this one shares, and intake_s the requests
    that arrived, which every plan of the step takes in). The real engine's
    policies measure steps without it, too, so the simulated ones see what
    the real ones see. `cold` does change a plan's time: TAPER prices it
    (`OnlineLatencyModel.cold_terms`, from the scheduler's count of the
    steps since a prompt chunk, `EngineView.since_prompt`), and its refits
    count it in. The speculation policy measures plain steps and leaves the
    first ones after drafting or a prefill untimed on a CPU (`quiet`).
    """

    entry_s: float = 0.0
    delivery_s: float = 0.0
    stream_s: float = 0.0
    wake_s: float = 0.0
    wake_curve: tuple[tuple[float, float], ...] = ()
    loop_s: float = 0.0
    loop_row_s: float = 0.0
    intake_s: float = 0.0
    host_request_s: float = 0.0
    host_token_s: float = 0.0
    host_prompt_token_s: float = 0.0
    host_batch_s: float = 0.0
    token_delivery_s: float = 0.0
    end_delivery_s: float = 0.0
    cold: tuple[tuple[float, float], ...] = ()
    # quantiles (p0, p5, ..., p100) of a stream's first token's delivery over `delivery`'s: how it scatters
    # (the front end's event loop, the client's); the simulator draws each first token's from them. Empty:
    # every one as `delivery` says
    delivery_scatter: tuple[float, ...] = ()

    SCALARS = ("entry_s", "delivery_s", "stream_s", "wake_s", "loop_s", "loop_row_s", "intake_s", "host_request_s",
               "host_token_s", "host_prompt_token_s", "host_batch_s", "token_delivery_s", "end_delivery_s")
    KEYS = SCALARS + ("wake_curve", "cold", "delivery_scatter")

    def __post_init__(self):
        xs = [x for x, _ in self.wake_curve]
        if any(b <= a for a, b in zip(xs, xs[1:])) or any(x <= 0 for x in xs):
            raise ValueError(f"wake_curve: idle times must be positive and increasing, got {xs}")
        if any(len(c) != 2 or c[0] < 0 or c[1] < 0 for c in self.cold):
            raise ValueError(f"cold: (a, b) pairs of non-negative numbers, got {self.cold}")
        q = self.delivery_scatter
        if q and (len(q) < 2 or any(x < 0 for x in q) or any(b < a for a, b in zip(q, q[1:]))):
            raise ValueError(f"delivery_scatter: non-decreasing non-negative quantiles, got {list(q)}")

    @classmethod
    def from_engine(cls, engine: dict) -> "ServingCosts":
        """From a profile's `engine` section. Profiles written before the split
        hold one `request_overhead_s`, fitted from TTFTs: delivery, by the
        same reasoning as above."""
        kw = {k: float(engine[k]) for k in cls.SCALARS if engine.get(k) is not None}
        if "delivery_s" not in kw and engine.get("request_overhead_s") is not None:
            kw["delivery_s"] = float(engine["request_overhead_s"])
        if engine.get("wake_curve"):
            kw["wake_curve"] = tuple((float(x), float(y)) for x, y in engine["wake_curve"])
        if engine.get("cold"):
            kw["cold"] = tuple((float(a), float(b)) for a, b in engine["cold"])
        if engine.get("delivery_scatter"):
            kw["delivery_scatter"] = tuple(float(x) for x in engine["delivery_scatter"])
        return cls(**kw)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.SCALARS}
        d["wake_curve"] = [list(p) for p in self.wake_curve]
        d["cold"] = [list(c) for c in self.cold]
        d["delivery_scatter"] = list(self.delivery_scatter)
        return d

    def cold_extra(self, j: int, tokens: int, step_s: float) -> float:
        """Extra time of the j-th decode step (1, 2, ...) after a step that ran
        `tokens` prompt tokens, whose model time is `step_s` (`cold`)."""
        a, b = self.cold_terms(j, tokens)
        return a + b * step_s

    def cold_terms(self, j: int, tokens: int) -> tuple[float, float]:
        """`cold_extra` as (a, b): a + b * step_s."""
        if not 0 < j <= len(self.cold) or tokens <= 0:
            return 0.0, 0.0
        a, b = self.cold[j - 1]
        r = math.sqrt(tokens)
        return r * a, r * b

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

    def loop(self, rows_before: int, taken: int = 0) -> float:
        """The busy loop's time before a step, after a step of `rows_before`
        rows, taking in `taken` new requests."""
        return self.loop_s + self.loop_row_s * rows_before + self.intake_s * taken

    def delivery(self, tokens: int) -> float:
        """Delay from a step's end to its client holding a stream's first
        token, for a step that made `tokens`."""
        return self.delivery_s + self.stream_s * tokens

    def first_extra(self) -> float:
        """How much later than a later token a stream's first token reaches
        its client, from steps alike (`token_delivery_s`)."""
        return self.delivery_s - self.token_delivery_s if self.token_delivery_s else 0.0

    def end_delivery(self, tokens: int) -> float:
        """Delay from a step's end to its client holding the token that ends a
        stream (not its first), for a step that made `tokens`."""
        return self.delivery(tokens) - self.first_extra() + self.end_extra()

    def end_extra(self) -> float:
        """How much later than a later token the token that ends a stream
        (not its first) reaches its client (`end_delivery_s`)."""
        return self.end_delivery_s - self.token_delivery_s if self.token_delivery_s and self.end_delivery_s else 0.0


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
    """`name`: where `d` came from (a file), for the messages and as the
    profile's name where `d` has none. A profile that is not one -- a JSON list,
    a latency model without its form -- is a ValueError naming the part."""
    where = f"{name}: " if name else ""
    if not isinstance(d, dict):
        raise ValueError(f"{where}not a stepserve latency profile (a JSON {type(d).__name__}, not an object)")
    if d.get("kind") != PROFILE_KIND:
        raise ValueError(f"{where}not a stepserve latency profile (kind={d.get('kind')!r})")
    lat = d.get("latency")
    if not isinstance(lat, dict) or not isinstance(lat.get("form"), str):
        raise ValueError(f"{where}the profile's latency must be an object with a form, got {lat!r:.80}")
    if not isinstance(d.get("engine", {}), dict):
        raise ValueError(f"{where}the profile's engine must be an object, got {d['engine']!r:.80}")
    if lat["form"] != "roofline" and not isinstance(lat.get("coef"), list):
        raise ValueError(f"{where}the profile's latency form {lat['form']!r} needs a list of coef")
    try:
        if lat["form"] == "roofline":
            from stepserve.scheduler.roofline import RooflineLatencyModel

            model = RooflineLatencyModel.from_dict(lat)
        else:
            model = LinearLatencyModel.from_dict(lat)
    except (TypeError, ValueError) as e:  # a coefficient that is not a number, an unknown form, ...
        raise ValueError(f"{where}the profile's latency: {e}") from None
    return Profile(name=d.get("name") or name, source=d.get("source", "measured"), model=model,
                   engine=dict(d.get("engine", {})), data=d)


def load_profile(spec: str) -> Profile:
    """A profile JSON path, or a built-in roofline profile `DEVICE[xN]:MODEL`."""
    if os.path.isfile(spec):
        with open(spec) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{spec}: not JSON ({e})") from None
        return profile_from_dict(d, name=spec)
    from stepserve.scheduler.roofline import is_builtin_name, roofline_profile

    if is_builtin_name(spec):
        return profile_from_dict(roofline_profile(spec), name=spec)
    raise FileNotFoundError(
        f"profile {spec!r}: no such file, and not a built-in roofline profile DEVICE[xN]:MODEL "
        "(see `stepserve simulate --list-profiles`)")
