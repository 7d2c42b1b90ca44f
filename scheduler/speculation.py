"""Speculation length: how many tokens each decode row drafts this step.

Source idea: Su, Giannoula and Pekhimenko, "The Synergy of Speculative
Decoding and Batching in Serving Large Language Models" (2023). A small batch
is memory-bound, so verifying k + 1 tokens per row costs little more than one;
a large batch is compute-bound, so long drafts waste work. The best k falls as
the batch grows, so it is chosen per step.

Modes (`SpecLengthSpec.parse`, `--spec-length`):

  none       no row drafts (speculation off; the proposer stays loaded)
  fixed:K    every eligible decode row drafts K tokens
  adaptive   each step, the k in [0, kmax] (0: plain decoding) that makes
             the step worth most. A step whose rows all decode exists for
             them, so the k that maximises its expected committed tokens per
             second wins:

               rate(k) = (tokens without speculation + R_k * (E[k] - 1)) / C_b[k]

             A step with prefill chunks in it, while more prompt is queued
             after it, runs (and so do the next ones) whatever its decode
             rows do, so there a decode row's next token costs only what a
             decode row adds to such a step (m0, from the step-latency
             model), and the k that saves most time wins:

               gain(k) = R_k * (E[k] - 1) * m0
                         - T_spec * (C_b[k] - 1) - (T(+R_k * k tokens) - T)

             (T_spec: a decode step of the drafting rows alone; the last term,
             what the step model says the verify tokens add on top of the
             chunks, where the chunks make the step compute-bound). A step
             with the last of the prompt in it scores its decode rows as a
             decode step of their own, R_k * E[k] over T_spec plus the same
             added time. Pricing a mixed step by its own tokens per second
             instead drafts long where the chunks dominate it (the drafts
             look cheap beside the chunks) and slows the prefill near
             saturation (simulated Azure conversations on an 8B H100
             profile at 20 req/s: goodput 2.8 req/s against 16.0).

             E[k] = 1 + sum_j prod_{i <= j} alpha_i, the expected tokens a
             verify row emits, from a running estimate of the per-position
             acceptance rate alpha_i (the probability that draft i is accepted
             when every draft before it was), updated from every
             verification (decayed counts, so it follows the workload).
             C_b[k]: the step time with k drafts per row, drafting included,
             over the time with none, measured in the batch-size range b of
             the drafting rows (1, 2-3, 4-7, ...; `DraftCostTable`) from
             pairs of back-to-back decode steps, one at 0 and one at k, each
             after steps like itself (`_Pair`; on a CPU the step at 0 comes
             6 plain steps after drafting, once the caches the draft model
             disturbed have settled); a cell stands for
             the median of its last 8 pairs, so a pair that a hiccup of the
             machine lengthened does not decide. A pair sees the
             same contexts and the same machine, so it needs no step model,
             and neither a growing context nor a drifting machine moves it; a
             line through the measured k prices the others. A range starts
             with pairs at k = 1 and 4; after, one step in 32 starts a pair
             next to the range's choice (at 1 and 2 next to plain decoding;
             one in 256 for a length priced under
             0.9x the choice's rate once it has 3 pairs; later, while the pairs
             lose more than 1% of the time to the choice), so the costs keep
             following the machine even where k = 0 wins, a length chosen
             on fewer than 3 pairs is paired at once, and every length
             measured on fewer than 3 (nor tied to one by probes), or last
             paired 32 turns ago or more, is paired in its turn; starting
             to draft cold
             is priced (the draft model's catch-up, from the pairs' priming
             steps); past the longest length measured the line
             is not trusted to stay flat (it never prices below the extra time
             grown in proportion to k). The step model of mixed steps is fitted
             online on the steps that drafted nothing (until it has enough of
             them, a mixed step is priced as if its chunks were free).

             Per row (`per_row=1`, the default; decode steps with a draft
             model): each row's drafts are priced at its own acceptance rate,
             and the step's k is how far the draft model runs, each row
             drafting as far as its drafts are worth their verify tokens
             (`_per_row`).
             With a draft model, the lengths next to a drafting choice k
             are priced by probes (`_Probe`): in a run of steps whose rows
             all drafted k, one step in `probe` (16) runs k + 1 or k - 1 on
             every row between two steps at k, and its time over theirs is
             the ratio of the two costs; the table fits its prices to pairs
             and probes together (`DraftCostTable._fit`), and the pairs are
             taken at k alone.

             Options: `adaptive:kmax=8,per_row=1,settle=N,probe=16` (probe=0:
             none).

             A proposer whose proposal is a function of the tokens alone (the
             n-gram lookup) gets E[k] from the sequences' history instead
             (`ReplayedLength`): one step in `replay_every`, after the step
             (outside its timed work), one decode row's output tokens not
             replayed yet, and as a row finishes its last ones, are replayed
             (each position of a request once) as speculation at every k
             would have run over them (a step at k proposes after the tokens so far, emits the
             agreeing prefix of its proposal and one token more, and the
             next step starts there), and E[k] is tokens per
             replayed step. The tokens that came are what verification would
             have accepted: a greedy or seeded row's tokens are the ones
             drawn whatever k ran (a draft is accepted exactly when it equals
             the token drawn at its position), and another sampled row's next
             token equals a one-hot draft d with probability p(d), the
             probability the rejection rule accepts d with
             (`engine/speculative.py`). So every k is priced,
             k = 0's neighbours or not,
             with the correlation between positions that prompt lookup has (a
             lookup that is right once tends to stay right) and with where
             steps start under k (a run of right guesses is crossed in a few
             steps, a stretch of wrong ones one token a step), which
             per-position rates from verifications at one k cannot give for
             another.

A deterministic proposer also drafts here, before the step's slots are
reserved (`propose`): a row its lookup finds nothing for stays a plain decode
row, since a verify row with nothing to verify costs more than a decode row
(+19% on a batch-1 step of the embedded model), and a shorter proposal
reserves only its own slots. The pairs then see fewer drafts than asked for;
each pair is scaled to k drafts on every row (and kept only when at least
half of them came), and asking for k is priced at the share of drafts the
proposer delivers (`DraftFill`): 1 + fill * (C_b[k] - 1).

A row is eligible when it decodes (not a prefill chunk, not forking), its
request allows speculation (`Seq.speculative`), and at least two tokens are
left to generate. Its k is capped so that every emitted token fits its
max_tokens and the context; the step's drafts together fit the token budget
and the free KV. The KV of drafts that are not accepted is freed in the same
step, so drafting never holds memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from stepserve.scheduler.latency_model import (LinearLatencyModel, OnlineLatencyModel, linear_fit_of, plan_features,
                                                record_features)
from stepserve.scheduler.plan import StepPlan, StepRecord
from stepserve.scheduler.policy import EngineView

MODES = ("none", "fixed", "adaptive")
PROPOSERS = ("none", "draft", "ngram")  # what drafts: nothing, a draft model, an n-gram lookup (`engine/speculative.py`)
REPLAY_FULL = 512  # replayed positions (decayed) from which only one request in REPLAY_SHARE is replayed
REPLAY_SHARE = 2
MIN_REPLAY = 8  # a running row is replayed once this many of its positions are new (`SpecLengthPolicy._replay`)
FAR = 0.9  # an exploration candidate below this share of the chosen k's rate is measured 8x less often
TRUSTED = 3  # ... once its cost cell holds this many pairs
EXPLORE_SHARE = 0.01  # exploration pairs may lose at most this share of a range's step time to the choice
EXPLORE_TURNS = 32  # ... and come at least once in this many exploration turns (`explore_every` steps each)
STALE_TURNS = 32  # a length last paired this many exploration turns ago takes its turn again, wherever it is priced
LEARNED = 32.0  # ... once the first draft position has been tried this many times (decayed)
DECIDE_EVERY = 4  # a decode step's choice is made afresh once in this many verification steps (`_decision_key`)
PROBE_EVERY = 16  # in a drafting run of a draft model, one step in this many starts a probe (`_Probe`)
MIN_FILL = 0.5  # a pair whose verify step got fewer of the drafts asked for is not kept
SETTLE = 2  # a pair from drafting runs this many steps at 0 and times the last (`_Pair`; `adaptive:settle=N`)
CPU_SETTLE = 6  # ... the engine's default on a CPU, whose caches the draft model's work disturbs
CPU_QUIET = 3  # on a CPU, the plain decode steps after drafting or a prefill that are not timed as steady
# (`SpecLengthPolicy.quiet`); elsewhere 0
RUN = 3  # a pair's step is timed as the median of the last this many steady steps like it (`_run_wall`)
MIN_SPREAD = 2.0  # the least weight `RowSpread` gives the rows' spread
SMALL_BATCH = 16  # up to this many rows, the per-row choice is worked out in plain floats
PAIR_SLACK = 16  # a pair's steps may differ in rows by 1/PAIR_SLACK of its own (and its step at k may have as
# many rows capped short of k) once the step model can rescale a step to the pair's rows: at large batches
# rows finish nearly every step, and pairs that asked for the same rows throughout never completed


@dataclass(frozen=True)
class SpecLengthSpec:
    mode: str = "none"
    k: int = 0  # fixed:K
    kmax: int = 8  # adaptive: the longest draft considered
    per_row: bool = True  # adaptive: each row's drafts follow its own acceptance (`SpecLengthPolicy._per_row`)
    settle: int | None = None  # adaptive: steps at 0 of a pair from drafting (`_Pair`; None: the policy's default)
    probe: int | None = None  # adaptive: one drafting step in this many starts a probe (`_Probe`; 0: none; None:
    # the policy's default)

    @classmethod
    def parse(cls, text: str) -> "SpecLengthSpec":
        text = (text or "none").strip()
        head, _, rest = text.partition(":")
        if head == "none" and not rest:
            return cls("none")
        if head == "fixed":
            return cls("fixed", k=_draft_length(rest, "fixed:K"))
        if head == "adaptive":
            kmax, per_row, settle, probe = 8, True, None, None
            for opt in filter(None, rest.split(",")):
                key, _, val = opt.partition("=")
                if key == "kmax":
                    kmax = _draft_length(val, "kmax")
                elif key == "per_row":
                    if val not in ("0", "1"):
                        raise ValueError(f"adaptive per_row takes 0 or 1, got {val!r}")
                    per_row = val == "1"
                elif key == "settle":
                    if not val.isdigit() or not 1 <= int(val) <= 16:
                        raise ValueError(f"adaptive settle takes a step count in [1, 16], got {val!r}")
                    settle = int(val)
                elif key == "probe":
                    if not val.isdigit() or int(val) > 1024:
                        raise ValueError(f"adaptive probe takes a step count in [0, 1024] (0: none), got {val!r}")
                    probe = int(val)
                else:
                    raise ValueError(f"unknown adaptive option {key!r} (kmax, per_row, settle, probe)")
            return cls("adaptive", kmax=kmax, per_row=per_row, settle=settle, probe=probe)
        raise ValueError(f"unknown speculation length {text!r} "
                         "(none, fixed:K, adaptive[:kmax=K,per_row=0|1,settle=N,probe=N])")


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
    *tried* when drafts 1..j-1 were accepted and a j-th was asked for, and
    *accepted* when it was too. Each position's rate leans on the one before
    it with the weight of `prior_weight` tries (the first on `prior`), so a
    position seldom tried (drafts rarely run that long) reads like the
    positions before it rather than like a fixed prior.

    `priced` (and `expected(priced=True)`) takes the first position's rate
    at its mean plus `optimism` standard errors, the others at their means:
    the price at which the policy asks, where plain decoding wins at the
    mean rates, whether drafting would win on a read that is not yet sure
    (`SpecLengthPolicy._choose`). The optimism fades as the tries come:
    0.04 at 100 tries of a rate of 0.8.

    The rates, and what is derived from them, are worked out when read
    and kept until the next update: with E[k] from the replayed history (the
    n-gram proposer) only the statistics read them."""

    def __init__(self, kmax: int, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.995,
                 tolerance: float = 0.005, optimism: float = 1.0):
        self.kmax = kmax
        # the decayed counts are kept as raw sums in which the newest verification weighs `_g` (1 / decay
        # more each update) and read divided by it: an update touches only the positions it tried
        self._tried = [0.0] * kmax
        self._accepted = [0.0] * kmax
        self._g = 1.0
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.tolerance = tolerance
        self.optimism = optimism
        self._expected: list[float] | None = None  # `expected` at the priced rates
        self._expected_mean: list[float] | None = None  # ... and at the mean rates
        self._rates: list[float] | None = None
        self._priced: list[float] | None = None

    def update(self, drafted: list[int], accepted: list[int]) -> None:
        """One verification step: per verify row, the draft length asked for
        and how many drafts were accepted."""
        kmax = self.kmax
        g = self._g = self._g / self.decay
        tried, acc = self._tried, self._accepted
        for d, a in zip(drafted, accepted):
            d = min(d, kmax)
            a = min(a, d)
            # positions tried: each accepted one, and the first rejected; accepted: the accepted ones
            for j in range(min(a + 1, d)):
                tried[j] += g
            for j in range(a):
                acc[j] += g
        if g > 1e100:  # rescaled long before a float could overflow
            self._tried = [x / g for x in tried]
            self._accepted = [x / g for x in acc]
            self._g = 1.0
        self._expected = self._expected_mean = self._rates = self._priced = None

    @property
    def tried(self) -> list[float]:
        """Per position, the decayed count of drafts tried there."""
        g = self._g
        return [x / g for x in self._tried]

    def tried_first(self) -> float:
        """`tried[0]`, without the other positions."""
        return self._tried[0] / self._g

    @property
    def accepted(self) -> list[float]:
        """Per position, the decayed count of drafts accepted there."""
        g = self._g
        return [x / g for x in self._accepted]

    @property
    def alpha(self) -> np.ndarray:
        return np.array(self._alpha())

    def _alpha(self) -> list[float]:
        """The rates per position (kept until the next update)."""
        if self._rates is None:
            out = []
            prev, w = self.prior, self.prior_weight * self._g  # (the raw sums over `_g`: the prior's weight times it)
            for acc, tried in zip(self._accepted, self._tried):
                prev = (acc + w * prev) / (tried + w)
                out.append(prev)
            self._rates = out
        return self._rates

    def first(self) -> float:
        """The first position's rate (`_alpha()[0]`, without the others)."""
        if self._rates is not None:
            return self._rates[0]
        w = self.prior_weight * self._g
        return (self._accepted[0] + w * self.prior) / (self._tried[0] + w)

    def priced(self) -> list[float]:
        """The rates lengths are priced at: the first position's mean rate
        plus `optimism` standard errors of it (its tries and its prior's
        weight counted, at most 1), the others' means (kept until the next
        update)."""
        if self._priced is None:
            rates = list(self._alpha())
            if rates:
                a = rates[0]
                n = self.tried_first() + self.prior_weight
                rates[0] = min(a + self.optimism * math.sqrt(a * (1.0 - a) / n), 1.0)
            self._priced = rates
        return self._priced

    def unsure(self) -> bool:
        """Whether the optimism moves the first rate by more than `tolerance`
        (relative)."""
        return self.priced()[0] > self._alpha()[0] * (1.0 + self.tolerance)

    def expected_tokens(self, k: int) -> float:
        """E[tokens a verify row emits] with k drafts: 1 + the expected accepted prefix."""
        return float(self.expected(k)[k]) if k > 0 else 1.0

    def expected(self, kmax: int, priced: bool = True) -> list[float]:
        """`expected_tokens(k)` for every k in [0, kmax] at the `priced`
        rates (or at the mean rates), in one pass (kept until the next
        update, in plain floats)."""
        if not priced:
            if self._expected_mean is None:
                self._expected_mean = self._expected_at(self._alpha())
            return self._expected_mean[: kmax + 1]
        if self._expected is None:
            self._expected = self._expected_at(self.priced())
        return self._expected[: kmax + 1]

    @staticmethod
    def _expected_at(rates: list[float]) -> list[float]:
        out, run, total = [1.0], 1.0, 1.0
        for a in rates:
            run *= a
            total += run
            out.append(total)
        return out


class ReplayedLength:
    """E[k] of a deterministic proposer from its proposals replayed on the
    history (see the module docstring): each `add` is one row's window of
    positions, each with how many of the kmax proposed tokens agreed with the
    tokens that came; speculation at each k is walked over the window (from
    its first position, a step at p emits min(match[p], k) + 1 tokens and the
    next starts after them; a step across the window's end counts for its
    share inside, or the last step's tokens past the end would read high),
    and E[k] = the windows' tokens over their steps,
    in counts decayed by `decay` per `window` positions so that it follows
    the workload. It is used once `min_positions` positions are counted.
    `version` counts the windows added."""

    def __init__(self, kmax: int, window: int = 32, decay: float = 0.95, min_positions: int = 128):
        self.kmax = kmax
        self.window = window
        self.decay = decay
        self.min_positions = min_positions
        self.positions = 0.0  # replayed positions (each a token emitted), decayed
        self.steps = np.zeros(kmax + 1)  # per k, the steps speculation at k took over them, decayed
        self.total = 0  # positions replayed
        self.version = 0
        self._expected: list[float] | None = None

    @property
    def ready(self) -> bool:
        return self.positions >= self.min_positions

    def add(self, matches: list[int]) -> None:
        w = len(matches)
        steps = np.empty(self.kmax + 1)
        steps[0] = w
        for k in range(1, self.kmax + 1):
            p, n = 0, 0.0
            while p < w:
                e = min(matches[p], k) + 1
                n += 1.0 if p + e <= w else (w - p) / e  # a step across the window's end: its share inside
                p += e
            steps[k] = n
        keep = self.decay ** (w / self.window)
        self.positions = self.positions * keep + w
        self.steps = self.steps * keep + steps
        self.total += w
        self.version += 1
        self._expected = None

    def expected(self, kmax: int, priced: bool = True) -> list[float]:
        """E[tokens a verify row emits] for every k in [0, kmax] (counted, not
        estimated per position: priced as measured)."""
        if self._expected is None:
            self._expected = (self.positions / np.maximum(self.steps, 1e-12)).tolist()
        return self._expected[: kmax + 1]


class DraftFill:
    """The share of the drafts asked for that the proposer delivers, from
    every step that asks for drafts (decayed counts). A draft model delivers every one;
    a prompt lookup that finds no earlier occurrence delivers none, and that
    row's step is a plain decode step. Its verify cost is paid only for the
    drafts delivered, so asking k costs 1 + fill * (C[k] - 1), with C[k] the
    cost of k drafts delivered to every row (`DraftCostTable`). `version`
    moves when the share moved by more than `tolerance` (absolute) since the
    last move."""

    def __init__(self, decay: float = 0.995, tolerance: float = 0.01):
        self.asked = 0.0
        self.got = 0.0
        self.decay = decay
        self.tolerance = tolerance
        self.version = 0
        self.value = 1.0  # nothing seen: every draft delivered
        self._published = 1.0

    def update(self, asked: int, got: int) -> None:
        if asked <= 0:
            return
        self.asked = self.asked * self.decay + asked
        self.got = self.got * self.decay + got
        self.value = self.got / self.asked
        if abs(self.value - self._published) > self.tolerance:
            self._published = self.value
            self.version += 1


def row_bucket(rows: int) -> int:
    """The batch-size range of `rows` decode-shaped rows: 1, 2-3, 4-7, ... (0, 1, 2, ...)."""
    return max(int(rows), 1).bit_length() - 1


class DraftCostTable:
    """What drafting k tokens per row costs, measured per batch-size range
    (`row_bucket`): the step time with k drafts per row (drafting included)
    over the step time without, from *pairs* of back-to-back decode steps of
    the same range, one at 0 and one at k (`_Pair`). A pair sees
    the same context lengths and the same machine, so neither a growing
    context nor a drifting machine speed moves the ratio, and no step model is
    needed.

    Each (range, k) cell keeps its last `window` pairs and stands for their
    median: a pair that a hiccup of the machine lengthened (seen: one pair at
    5x the others on a shared 2-core VM) moves it little, where a mean would
    hold a wrong choice until many pairs more. Between and beyond the
    measured k, a line through the cells stands in: ratio(k) = 1 + a + b * k
    (a, b >= 0; the draft model's fixed cost per step and its cost per draft,
    with the verify tokens'), so two measured lengths price them all; a
    cell's own median is pulled toward the line by `line_weight` pairs'
    worth, so one noisy pair does not decide alone. Past the longest length
    measured, the price never falls below the extra time at that length
    grown in proportion to k: an extrapolation that errs dear, so a longer
    length is chosen only once exploration next to the choice has measured
    it. A range with nothing measured borrows the nearest measured range's
    line.

    Probes refine it: `add_probe` takes one step at a
    length next to the one a drafting run holds, timed against that run's
    steps before and after it (`_Probe`), as the log of the ratio of two
    neighbouring lengths' costs. Once a range has any, its prices are the
    least-squares fit of the log costs to the cells' medians (each with its
    pair count as weight), the neighbour ratios' medians (each with its
    count) and the line (weight `prior_weight`), so a cost that is not a
    line in k is priced as measured where the runs go: on the 2-core Xeon at
    batch 1 a step at k = 5 cost 1.11x one at 4 and one at 4 1.08x one at 3
    (the native kernels' row panels), where the line through pairs at 1 and
    4 priced 5 at 1.03x 4, and the adaptive length drafted 5 on most steps
    (fixed:5 ran 6% slower than fixed:4)."""

    def __init__(self, kmax: int, window: int = 8, line_weight: float = 3.0, probe_window: int = 16,
                 prior_weight: float = 1.0, smooth_weight: float = 4.0, probe_batch: int = 4):
        self.kmax = kmax
        self.window = window
        self.line_weight = line_weight
        self.probe_window = probe_window
        self.prior_weight = prior_weight
        self.smooth_weight = smooth_weight
        self.probe_batch = probe_batch
        self._pending: dict[int, int] = {}  # bucket -> probes added since its prices last moved
        self.cells: dict[int, list[list[float]]] = {}  # bucket -> per k, its last pairs' ratios
        self.probes: dict[int, list[list[float]]] = {}  # bucket -> per k < kmax, log(C[k + 1] / C[k]) of its
        # last probes (`add_probe`)
        self._solved: dict[int, list[float]] = {}  # bucket -> C[1..kmax] fitted (ranges with probes)
        self._trusted: dict[tuple[int, int], set[int]] = {}  # (bucket, least) -> `trusted`, until the next move
        self._probe_medians: dict[int, list[float]] = {}  # bucket -> per k < kmax, the median of its probes
        self._medians: dict[int, list[float]] = {}  # bucket -> per k, the median of its cell (read every step)
        self._lines: dict[int, tuple[float, float]] = {}
        self._ratios: dict[tuple[int, int], float | None] = {}  # (bucket, k) -> ratio, until the next pair
        self._switches: dict[int, list[float]] = {}  # bucket -> its last priming steps' extra time
        self.switch: dict[int, float] = {}  # bucket -> the median of those (`add_switch`)
        self.version = 0  # counts pairs added

    def add(self, bucket: int, k: int, ratio: float) -> None:
        cells = self.cells.setdefault(bucket, [[] for _ in range(self.kmax + 1)])
        cell = cells[k]
        cell.append(float(ratio))
        del cell[: -self.window]
        self._medians.setdefault(bucket, [0.0] * (self.kmax + 1))[k] = _median(cell)
        self._lines.pop(bucket, None)
        self._moved()

    def _moved(self) -> None:
        self._ratios.clear()  # a range without pairs borrows another's line: every cached price may move
        self._solved.clear()
        self._trusted.clear()
        self.version += 1

    def add_probe(self, bucket: int, k: int, to: int, ratio: float) -> bool:
        """A step at `to` drafts per row (a neighbour of k) took `ratio` of
        the steps at k around it (`_Probe`). The prices move with it (True)
        while its neighbouring lengths have at most 3 probes, else with every
        `probe_batch`-th probe of the range: each move makes the fit and the
        next choice be worked out afresh (about 0.1 ms between them at batch 1
        on the 2-core Xeon, one probe in 16 steps), and one more probe of 16
        moves a median little."""
        if abs(to - k) != 1 or not 1 <= min(k, to) < self.kmax or ratio <= 0.0:
            raise ValueError(f"a neighbouring step is one length from its run's, within [1, kmax]: {k} -> {to}")
        cells = self.probes.setdefault(bucket, [[] for _ in range(self.kmax)])
        lo = min(k, to)
        cell = cells[lo]
        cell.append(math.log(ratio) if to > k else -math.log(ratio))
        del cell[: -self.probe_window]
        self._probe_medians.setdefault(bucket, [0.0] * self.kmax)[lo] = _median(cell)
        pending = self._pending.get(bucket, 0) + 1
        if len(cell) > 3 and pending < self.probe_batch:
            self._pending[bucket] = pending
            return False
        self._pending[bucket] = 0
        self._moved()
        return True

    def probe_count(self, bucket: int, k: int) -> int:
        """The neighbouring steps kept between k and k + 1."""
        cells = self.probes.get(bucket)
        return 0 if cells is None or not 1 <= k < self.kmax else len(cells[k])

    def trusted(self, bucket: int, least: int) -> set[int]:
        """The lengths priced on at least `least` measurements: their own
        pairs, or probes against a length that is (kept until the next
        measurement)."""
        out = self._trusted.get((bucket, least))
        if out is not None:
            return out
        out = self._trusted[(bucket, least)] = {k for k in range(1, self.kmax + 1) if self.count(bucket, k) >= least}
        grew = bool(out) and bucket in self.probes
        while grew:
            grew = False
            for k in range(1, self.kmax):
                if self.probe_count(bucket, k) >= least and (k in out) != (k + 1 in out):
                    out |= {k, k + 1}
                    grew = True
        return out

    def add_switch(self, bucket: int, extra: float) -> None:
        """What starting to draft costs in this range, once, in steps at k = 0:
        a pair's priming step (its rows did not draft the step before, so a
        draft model first catches up on every token since they last did)
        over the same length's step once primed. The median of the last
        `window`."""
        cell = self._switches.setdefault(bucket, [])
        cell.append(float(extra))
        del cell[: -self.window]
        self.switch[bucket] = _median(cell)
        self.version += 1

    def count(self, bucket: int, k: int) -> int:
        """The pairs kept for (range, k)."""
        cells = self.cells.get(bucket)
        return 0 if cells is None else len(cells[k])

    def measured(self, bucket: int) -> list[int]:
        """The draft lengths with pairs in this range."""
        return [k for k in range(1, self.kmax + 1) if self.count(bucket, k)]

    def _median(self, bucket: int, k: int) -> float:
        return self._medians[bucket][k]

    def line(self, bucket: int) -> tuple[float, float, int] | None:
        """(a, b, the longest length measured) of this range's line (or the
        nearest measured range's); None: nothing measured anywhere."""
        if bucket not in self.cells:
            if not self.cells:
                return None
            bucket = min(self.cells, key=lambda b: (abs(b - bucket), b))
        got = self._lines.get(bucket)
        if got is None:
            ks = self.measured(bucket)
            y = [self._median(bucket, k) - 1.0 for k in ks]
            if len(ks) == 1:  # through the origin
                got = (0.0, max(y[0] / ks[0], 0.0), ks[0])
            else:
                a, b = _line_nonneg(ks, y, [self.count(bucket, k) for k in ks])
                got = (a, b, ks[-1])
            self._lines[bucket] = got
        return got

    def ratio(self, bucket: int, k: int) -> float | None:
        """Step time at k drafts per row over the time at none (1.0 for k = 0;
        None while nothing is measured)."""
        if k == 0:
            return 1.0
        key = (bucket, k)
        if key in self._ratios:
            return self._ratios[key]
        if bucket in self.probes and bucket in self.cells:
            got = self._ratios[key] = self._fit(bucket)[k - 1]
            return got
        ln = self.line(bucket)
        if ln is None:
            got = None
        else:
            a, b, top = ln
            est = 1.0 + a + b * k
            if k > top:  # past the longest length measured, never below the extra time grown in
                # proportion to k: two noisy cells can lay the line flat, and a flat line makes the
                # longest drafts look free (measured: k = 8 chosen at 1.37x priced, 2.75x paid)
                est = max(est, 1.0 + (a + b * top) * k / top)
            n = self.count(bucket, k)
            got = est if not n else float((n * self._median(bucket, k) + self.line_weight * est) / (n + self.line_weight))
        self._ratios[key] = got
        return got

    def _line_price(self, bucket: int, k: int) -> float:
        """The line's price of k (its extrapolation rule past the longest
        length measured kept), without the cell's own pairs."""
        a, b, top = self.line(bucket)
        est = 1.0 + a + b * k
        return max(est, 1.0 + (a + b * top) * k / top) if k > top else est

    def _fit(self, bucket: int) -> list[float]:
        """C[1..kmax] of a range with probes: the weighted least-squares fit
        of the log costs (see the class docstring). Its normal equations are
        banded (a probe links neighbouring lengths, a second difference three
        in a row): solved within the band, in plain floats (numpy's solver
        and medians took 60 us, at every probe and pair)."""
        got = self._solved.get(bucket)
        if got is None:
            kmax, pw, sw = self.kmax, self.prior_weight, self.smooth_weight
            a = [[0.0] * kmax for _ in range(kmax)]
            y = [0.0] * kmax
            for k in range(1, kmax + 1):
                i = k - 1
                a[i][i] += pw
                y[i] += pw * math.log(max(self._line_price(bucket, k), 1e-9))
                n = self.count(bucket, k)
                if n:
                    a[i][i] += n
                    y[i] += n * math.log(max(self._median(bucket, k), 1e-9))
            cells, medians = self.probes[bucket], self._probe_medians[bucket]
            for k in range(1, kmax):  # log C[k + 1] - log C[k] = the probes' median, with their count as weight
                c = float(len(cells[k]))
                if c:
                    _add_term(a, y, ((k - 1, -1.0), (k, 1.0)), medians[k], c)
            for k in range(2, kmax):  # second differences near 0: neighbouring probes share their noise
                _add_term(a, y, ((k - 2, 1.0), (k - 1, -2.0), (k, 1.0)), 0.0, sw)
            got = self._solved[bucket] = [math.exp(v) for v in _solve_banded(a, y, 2)]
        return got

    def to_dict(self) -> dict:
        return {f"rows {1 << b}-{(2 << b) - 1}": [round(self.ratio(b, k), 4) for k in range(self.kmax + 1)]
                for b in sorted(self.cells)}


def _add_term(a: list[list[float]], y: list[float], coef, target: float, weight: float) -> None:
    """Add weight * (sum c x_i - target)^2 to normal equations a x = y."""
    for i, ci in coef:
        y[i] += weight * ci * target
        row = a[i]
        for j, cj in coef:
            row[j] += weight * ci * cj


def _solve_banded(a: list[list[float]], y: list[float], bw: int) -> list[float]:
    """x with a x = y for a small symmetric positive definite a whose
    entries more than `bw` off the diagonal are 0 (Gaussian elimination
    within the band, no pivoting needed), in plain floats."""
    n = len(y)
    a = [row[:] for row in a]
    y = y[:]
    for p in range(n):
        rp, d = a[p], a[p][p]
        end = min(n, p + bw + 1)
        for i in range(p + 1, end):
            m = a[i][p] / d
            if m:
                ri = a[i]
                for j in range(p, end):
                    ri[j] -= m * rp[j]
                y[i] -= m * y[p]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        ri = a[i]
        x[i] = (y[i] - sum(ri[j] * x[j] for j in range(i + 1, min(n, i + bw + 1)))) / ri[i]
    return x


def _median(xs: list[float]) -> float:
    """The median of a short list, in plain floats."""
    v = sorted(xs)
    h = len(v) // 2
    return v[h] if len(v) % 2 else 0.5 * (v[h - 1] + v[h])


def _line_nonneg(x: list[int], y: list[float], w: list[int]) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum w (a + b x - y)^2, in closed form: the
    unconstrained fit if it is nonnegative, else the better of the fits with
    one of them held at 0 (for two unknowns the optimum is one of these).
    `nnls` gives the same at 100x the time (280 us at 2-4 points on a Zen 1
    core), paid by the step after every pair, which made the pair after it
    look cheap."""
    sw = float(sum(w))
    sx = sum(wi * xi for wi, xi in zip(w, x))
    sy = sum(wi * yi for wi, yi in zip(w, y))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    sxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y))
    det = sw * sxx - sx * sx
    if det > 0.0:
        a = (sxx * sy - sx * sxy) / det
        b = (sw * sxy - sx * sy) / det
        if a >= 0.0 and b >= 0.0:
            return a, b
    best, out = None, (0.0, 0.0)
    for a, b in ((0.0, max(sxy / sxx, 0.0)), (max(sy / sw, 0.0), 0.0)):
        err = sum(wi * (a + b * xi - yi) ** 2 for wi, xi, yi in zip(w, x, y))
        if best is None or err < best:
            best, out = err, (a, b)
    return out


class _Steady:
    """A pure decode step's choice of plain decoding, kept for the steps
    after it that would make it again (`SpecLengthPolicy._choose`): the same
    rows (the same sequences, in order, none of which drafted the step
    before), the same versions of everything the choice is priced from
    (`SpecLengthPolicy._versions`) and the same R of the price of starting
    to draft (`_switch_price`: tokens left per row, rounded down to a power
    of two). Such a step's choice, made afresh, is the remembered one
    (`_decision_key`, `_recall`) twice over; this asks for it with one list
    comparison, on the sequences and tokens left that `plan` gathers in its
    pass over the rows. (At batch 1 on a 2-core AVX2 EPYC the policy's plan
    took 21 us of a 0.58 ms plain step; a loop of its own over the rows,
    reading `Seq.remaining_tokens`, took 25 us of the plan's 57 at batch 16.)"""

    __slots__ = ("seqs", "versions", "left")

    def __init__(self, seqs: list, left: int, versions: tuple):
        self.seqs = seqs  # (the step's own list, which nothing changes after)
        self.versions = versions
        self.left = _per_row_left(left, len(seqs))

    def holds(self, seqs: list, left: int, versions: tuple) -> bool:
        # (`Seq` compares by identity: the list comparison is a pass in C)
        return versions == self.versions and seqs == self.seqs and _per_row_left(left, len(seqs)) == self.left


def _per_row_left(left: int, n: int) -> int:
    """`left` tokens over n rows: their mean, at least 1, rounded down to a
    power of two, so that a choice priced with it holds while it stays."""
    per_row = max(left // n, 1)
    return 1 << (per_row.bit_length() - 1)


@dataclass
class _Pair:
    """An exploration pair in flight: back-to-back decode steps of `rows`
    rows, one step at k and one at 0 measured, each after steps like itself,
    so that each is what a steady run at its length costs (`pair_steps`).
    From plain decoding, (0, k, k): the first measured, the second priming
    the proposer (a draft model catches up on every token decoded since its
    rows last drafted, up to the whole prompt of a new request), the third
    measured. From drafting, k and then `settle` steps at 0: the first and
    the last measured. A plain step soon after drafting runs slow where the
    draft model's work evicts the target's weights and KV from the cache: at
    batch 1 on the 2-core EPYC (fixed:4 drafting 15 steps, then 15 plain,
    interleaved), the 1st plain step after drafting took 1.30x a steady one,
    the 2nd 1.08x, the 3rd 1.04x, from the 4th on 1.00x (in a slow phase of
    the machine 1.64, 1.43, 1.38, 1.29x, within 5% from the 7th). With the 2nd as the
    reference (`settle` 2, the default), k = 4 (3.12 plain steps measured,
    3.38 steady) tied with plain decoding at a 0.74 first-position rate, and
    the adaptive length drafted on half the steps at batch 1, where every
    fixed length lost to plain decoding; the engine on a CPU takes 6
    (`CPU_SETTLE`). Where the weights stream from memory every step anyway
    (a GPU, the simulator) there is nothing to settle."""

    bucket: int
    rows: int
    k: int  # the draft length measured
    steps: tuple[int, ...] = (0, 0, 0)  # the length of each of its steps (`pair_steps`)
    done: int = 0  # steps of the pair observed
    ref: float = 0.0  # wall time of the measured step at 0
    at_k: tuple[float, float] = (0.0, 1.0)  # ... and of the one at k, with the share of its drafts delivered
    prime: float = 0.0  # wall time of its priming step (0: it started drafting, or the step was cold)
    cold: bool = False  # a measured step ran a shape the engine had not run before (`StepRecord.cold`)
    rate: float = 0.0  # the range's choice: expected tokens per step time at k = 0, when the pair began
    spent: float = 0.0  # wall time of the pair's steps so far
    tokens: int = 0  # tokens they emitted
    paid: bool = False  # it has run a step at 0 (dropped now, it held plain decoding for nothing)

    @property
    def next_k(self) -> int:
        return self.steps[self.done]

    @property
    def last(self) -> int:
        return len(self.steps) - 1

    def measured(self, i: int) -> bool:
        """Whether its i-th step is timed: the first and the last (from
        plain decoding the middle one primes the proposer; from drafting the
        middle ones settle the cache)."""
        return i == 0 or i == self.last


@dataclass
class _Probe:
    """A probe in flight: in a run of decode steps drafting k per row, one
    step at a neighbouring length `to`, between two steps at k (the run's
    steps before and after it, each forced to k on every row). Its time
    over the mean of theirs is the ratio of the two lengths' costs
    (`DraftCostTable.add_probe`): every step of it drafts, so none waits for
    the caches to settle, as a pair's step at 0 after drafting must, and it
    costs only what `to` loses to k in one step. Kept only when all three
    steps ran the same rows at their lengths."""

    bucket: int
    rows: int
    k: int  # the run's length
    to: int  # the length probed
    done: int = 0  # steps observed
    walls: tuple[float, ...] = ()

    @property
    def next_k(self) -> int:
        return self.to if self.done == 1 else self.k


def pair_steps(k: int, primed: bool, settle: int = SETTLE, lead: int = 1) -> tuple[int, ...]:
    """An exploration pair's lengths (`_Pair`): from drafting (`primed`: the
    rows drafted last step), k then `settle` steps at 0; else 0, then `lead`
    steps at k (the first primes the proposer) and the one measured: (0, k,
    k) where `lead` is 1."""
    return (k,) + (0,) * settle if primed else (0,) + (k,) * (lead + 1)


def _least_left(rows) -> int:
    """The fewest tokens a row of these has left to generate."""
    return min(r.seq.remaining_tokens for r in rows)


def _remember(memo: list[tuple], key: tuple, out) -> list[tuple]:
    """A memo of the last 4 choices, with (key, out) the newest."""
    return memo[-3:] + [(key, out)]


class RowSpread:
    """How much requests differ in acceptance, as the weight w of a Beta
    distribution of their own rates (w tries' worth: the smaller, the more
    they differ), measured as what it is used for: how far a row's past
    tries predict its next ones.

    Each row's tries are cut into blocks of `block` (`add_row`, after each
    verification), and every two consecutive blocks of a row are a pair
    (x, y) of rates. Across rows, cov(x, y) is the variance of the rows' own
    rates: a block's own noise (a binomial count's, and whatever runs of
    easy and hard tokens add inside it) is shared by neither neighbour. For
    rates a ~ Beta(w r, w (1 - r)), var a = r (1 - r) / (w + 1). The
    covariance is taken net of one standard error of it, so that rows that
    are alike read as such (None) rather than as a spread from noise, and w
    is at least `MIN_SPREAD`; None also until `min_pairs` (decayed) pairs.

    (The former reading, from how much the pooled second-position rate rises
    over the first, takes position effects for rows that differ: on the
    embedded pair's text the draft's hits follow the text's own pattern, so
    the second position's rate is not the first's even for one row, and
    under per-row lengths which rows reach it is the policy's choice. It read
    w = 2 where consecutive halves of 64-token requests showed w = 25-60,
    and rows whose first 7 tries went badly (a correlation of 0.08 with
    their later rate) were priced out of drafting for the rest of their
    request.)"""

    def __init__(self, block: int = 8, decay: float = 0.998, min_pairs: float = 32.0):
        self.block = block
        self.decay = decay
        self.min_pairs = min_pairs
        self.n = self.sx = self.sy = self.sxx = self.syy = self.sxy = 0.0
        self._weight: float | None = None
        self._fresh = True  # `_weight` is current

    def add_row(self, seq) -> None:
        """A row's record moved: if its current block is full, it becomes the
        row's last block, and a pair with the one before it."""
        t0, a0 = seq.spec_block
        t = seq.spec_tried
        if t - t0 < self.block:
            return
        a = seq.spec_accepted
        rate = (a - a0) / (t - t0)
        prev = seq.spec_prev_rate
        seq.spec_block = (t, a)
        seq.spec_prev_rate = rate
        if prev >= 0.0:
            self.add(prev, rate)

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.syy = self.syy * d + y * y
        self.sxy = self.sxy * d + x * y
        self._fresh = False

    def weight(self) -> float | None:
        """w (kept until the next pair), or None: the rows look alike."""
        if self._fresh:
            return self._weight
        self._fresh = True
        n = self.n
        w = None
        if n >= self.min_pairs:
            mx, my = self.sx / n, self.sy / n
            cov = self.sxy / n - mx * my
            vx, vy = max(self.sxx / n - mx * mx, 0.0), max(self.syy / n - my * my, 0.0)
            var = cov - math.sqrt(vx * vy / n)
            r = 0.5 * (mx + my)
            if var > 0.0 and 0.0 < r < 1.0:
                w = max(r * (1.0 - r) / var - 1.0, MIN_SPREAD)
        self._weight = w
        return w


class SpecLengthPolicy:
    """The step policy that turns decode rows into verify rows (`draft_len`)."""

    name = "spec-length"

    def __init__(self, spec: str | SpecLengthSpec, latency_model=None,
                 min_samples: int = 32, explore_every: int = 32, replay=None, replay_every: int = 16,
                 propose=None, settle: int = SETTLE, probe_every: int = PROBE_EVERY, quiet: int = 0,
                 decide_every: int = DECIDE_EVERY):
        """`replay(seq, start, stop, k)`: for each position p in
        [start, stop), how many of the k tokens a deterministic proposer
        proposes after seq.token_ids[:p] agree with seq.token_ids[p:]
        (`NgramProposer.matches_for`), or None; one step in `replay_every`, one
        decode row is replayed (see the module docstring). `propose(seq, k)`:
        that proposer's proposal for a sequence (`NgramProposer.propose_for`),
        or None: with it the rows draft here, before the step's slots are reserved, and a
        row it proposes nothing for stays a plain decode row (a verify row
        with nothing to verify costs more than a decode row: measured +19%
        on a batch-1 step). `settle`: the steps at 0 of a pair from drafting
        (`_Pair`), where the spec does not name them. `probe_every`: one
        step in this many of a draft model's drafting run starts a probe of
        a neighbouring length (`_Probe`; 0: none). `quiet`: the plain steps
        after drafting or a prefill that are not steady (`CPU_QUIET` on a
        CPU): a pair from plain decoding waits for them, and a pair's
        reference is the median of its steady plain steps (`_run_wall`).
        `decide_every`: a pure decode step's choice is remembered for this
        many verification steps while nothing else it depends on moves
        (`_decision_key`)."""
        self.quiet = quiet
        self.decide_every = max(int(decide_every), 1)
        self.propose = propose
        self._asked: tuple[int, list[int], int | None] = (0, [], None)  # this step: drafts asked for, the
        # asks that got no proposal, and the k every eligible row was asked for (None: not all alike)
        self.spec = SpecLengthSpec.parse(spec) if isinstance(spec, str) else spec
        self.settle = self.spec.settle or settle
        kmax = self.spec.kmax if self.spec.mode == "adaptive" else max(self.spec.k, 1)
        self.acceptance = AcceptanceEstimate(kmax)
        self.spread = RowSpread()  # how much the rows differ in acceptance (`_per_row`)
        self.costs = DraftCostTable(kmax)
        self.fill = DraftFill()
        # a step's time without drafting (for steps that mix prefill chunks with the drafting rows):
        # the profile's model rescaled online, or fitted online, on the steps that drafted nothing
        if latency_model is not None and not isinstance(latency_model, LinearLatencyModel):
            latency_model = linear_fit_of(latency_model)  # a roofline estimate: its linear fit, rescaled online
        self.target = OnlineLatencyModel(base=latency_model, min_samples=min_samples, target="wall_s",
                                         refit_every_steps=64, lazy=True)  # read on mixed steps only
        self.explore_every = explore_every
        self.replay = replay if self.spec.mode == "adaptive" else None
        self.replay_every = max(int(replay_every), 1)
        self.replayed = ReplayedLength(kmax)
        self._replay_turn = 0  # rotates which row is replayed
        # the rows to replay after this step: the replay runs in `observe`, after the step's time is
        # taken, or an exploration pair whose step also replayed would price the other step too low
        self._replay_rows = None
        self.steps = 0
        self.verify_steps = 0
        self.k_hist: dict[int, int] = {}  # chosen k -> steps
        self.row_k_hist: dict[int, int] = {}  # in the steps that drafted: drafts asked of a row -> rows (0: none)
        self.drafted = 0
        self.accepted = 0
        self.emitted = 0
        self.last_k = 0
        self.pairs = 0  # exploration pairs measured
        self._pair: _Pair | None = None
        self.probe_every = probe_every if self.spec.probe is None else self.spec.probe
        self.probes = 0  # probes measured
        self._probe: _Probe | None = None
        self._probe_turn: dict[int, int] = {}  # per bucket: probes up, then down, in turn
        self._explore_k: dict[int, int] = {}  # per bucket, the exploration turn
        self._paired_at: dict[tuple[int, int], int] = {}  # (bucket, k): the step its last pair completed at
        self._started: set[int] = set()  # the buckets whose first pairs are measured
        self._best: dict[int, int] = {}  # per bucket, the last k chosen (not exploring)
        self._explore_at: dict[int, int] = {}  # per bucket, the step before which no pair starts (`_pair_step`)
        self._held: dict[int, int] = {}  # per bucket, the step before which no pair starts (`_start_pair`), after
        # one dropped
        self._last_rows = (0, 0)  # (drafting rows, rows) of the last step
        # the run of steps like the last (`_track_run`): its kind (k drafts on every row, 0: plain decoding,
        # None: neither), rows, and the wall times of its last RUN steady steps
        self._run_kind: int | None = None
        self._run_rows = 0
        self._run: list[float] = []
        self._calm = 0  # plain decode steps in a row, whatever their rows (`_track_run`)
        self._last_alike: int | None = None  # the k every row of the last step was asked for (None: not alike)
        self._memo: list[tuple] = []  # the last few (what a pure decode step's choice depends on, the choice)
        self._steady: _Steady | None = None  # the last pure decode step's plain decoding, while it holds
        self.steady_steps = 0  # the steps that took it (`_Steady`)
        self._records = 0  # counts the steps that moved the acceptance estimate and some row's own record
        self._warm: int | None = None  # the range whose prices a pair has just moved
        self._cost_rows: dict[int, tuple] = {}  # bucket -> (the versions of the costs and the fill, `_cost` of k = 1..kmax)

    # -- planning ---------------------------------------------------------------
    def plan(self, plan: StepPlan, view: EngineView) -> StepPlan:
        if self.spec.mode == "none":
            return plan
        rows, seqs, left = [], [], 0
        for r in plan.rows:  # decoding rows with an output token and room for a draft (the `Seq` properties
            # inlined: every step, over every row; at batch 64 they took 21 us of 28), their sequences
            # and the tokens left to them (`_Steady`)
            seq = r.seq
            if r.num_new == 1 and r.sample and seq.speculative and not seq.fork_children:
                out = len(seq.token_ids) - seq.prompt_len
                more = seq.max_tokens - out
                if out > 0 and more >= 2:
                    rows.append(r)
                    seqs.append(seq)
                    left += more
        self.steps += 1
        self._last_alike = self._asked[2]
        self._asked = (0, [], None)
        if not rows:
            self._drop_pair()
            self._probe = None
            self._steady = None
            return plan
        caps = None  # per row, the most it drafts (None: k for every row)
        if self.spec.mode == "fixed":
            k = self.spec.k
        else:
            if self.replay is not None and self.steps % self.replay_every == 0:
                self._replay_rows = rows  # replayed after the step (`observe`), outside the step's time
            k, caps = self._choose(plan, rows, view, seqs, left)
        self.last_k = k
        self._last_rows = (len(rows), len(plan.rows))
        self.k_hist[k] = self.k_hist.get(k, 0) + 1
        if k <= 0:
            return plan
        planned = plan.num_new_tokens
        room = view.kv_available - planned
        if view.max_batched_tokens:
            room = min(room, view.max_batched_tokens - planned)
        max_ctx = view.max_context or 1 << 62
        any_set = False
        propose = self.propose
        asked, empty, alike = 0, [], len(rows) == len(plan.rows)
        row_k = self.row_k_hist
        for i, r in enumerate(rows):
            seq = r.seq
            kr = min(k if caps is None else caps[i], seq.remaining_tokens - 1, max_ctx - seq.num_tokens - 1, room)
            kr = max(kr, 0)
            row_k[kr] = row_k.get(kr, 0) + 1
            if kr == 0:
                alike = False
                continue
            alike = alike and kr == k
            asked += kr
            r.draft_asked = kr
            if propose is not None:
                draft = propose(seq, kr)
                if not draft:
                    empty.append((kr, seq))
                    continue  # nothing to verify: the row decodes as it is
                r.draft = draft
                kr = len(draft)
            r.draft_len = kr
            r.num_new = 1 + kr
            room -= kr
            any_set = True
            seq.spec_last = self.steps
        self._asked = (asked, empty, k if alike else None)
        if any_set:
            self.verify_steps += 1
        return plan

    def _choose(self, plan: StepPlan, rows, view: EngineView, seqs: list | None = None,
                left: int | None = None) -> tuple[int, list[int] | None]:
        """The adaptive k for this step: the k that maximises expected tokens
        per second, with the cost of k drafts per row from `DraftCostTable`.
        A batch-size range with fewer than two draft lengths measured runs
        exploration pairs (`_Pair`: a step at k and one at 0 measured) at k = 1 and k = min(4, kmax) first; after, one step in
        `explore_every` starts a pair at a length next to the range's last
        choice (or at it; at 1 and 2 next to 0), in turn, so the costs keep following the machine
        and the batch where it matters, k = 0 included. `seqs` and `left`:
        the rows' sequences and the sum of their tokens left, as `plan`
        gathers them (worked out here where not given)."""
        if seqs is None:
            seqs = [r.seq for r in rows]
            left = sum(s.remaining_tokens for s in seqs)
        kmax = self.spec.kmax
        n = len(rows)
        pure = n == len(plan.rows)  # every row decodes and may draft: what a pair measures
        pair = self._pair
        steady = self._steady
        if steady is not None:
            # the last pure decode step's plain decoding, for the same rows, none of which drafted, with
            # nothing moved since and no exploration turn (`_Steady`); any other step chooses afresh
            self._steady = None
            if (pure and pair is None and self._probe is None and not self.last_k
                    and self.steps % self.explore_every and steady.holds(seqs, left, self._versions())):
                self._steady = steady
                self.steady_steps += 1
                return 0, None
        bucket = row_bucket(n)
        if pair is not None:
            if pure and 0 < pair.done <= pair.last and self._pair_fits(pair, n):
                if not pair.next_k:
                    pair.paid = True
                return pair.next_k, None
            self._drop_pair()  # the batch changed under it
        probe = self._probe
        if probe is not None:
            if pure and n == probe.rows:
                return probe.next_k, None
            self._probe = None
        source = self._source()
        expected = None  # E[k] at the mean rates, worked out where read (a per-row choice reads the rows' own)
        # tokens without drafts (`plan.samples` is frozen at commit, after the policies); in a pure
        # step every row samples one
        base = n if pure else len(plan.sampling())
        if pure:
            k = None
            if bucket not in self._started:  # the first pairs of this range, at k = 1 and min(4, kmax)
                todo = [k for k in dict.fromkeys((1, min(4, kmax))) if not self.costs.count(bucket, k)]
                if todo:
                    k = todo[0]
                else:
                    self._started.add(bucket)
            elif self.steps % self.explore_every == 0 and self.steps >= self._explore_at.get(bucket, 0):
                best = self._best.get(bucket, 0)
                # next to plain decoding, k = 1 and 2: the first draft of a step carries the draft model's
                # catch-up on the row's last tokens, so 2 can win where 1 loses (batch 1 on the 2-core
                # EPYC: fixed:1 0.96-1.07x plain decoding, fixed:2 1.05-1.14x), and its price must not
                # rest on the line through k = 1 and one early pair at k = 4
                near = {min(max(best + d, 1), kmax) for d in ((1, 2) if best == 0 else (-1, 0, 1))}
                # and every length measured on fewer than TRUSTED pairs (or probes against a trusted one): the
                # line through the longest prices every length past the others, and a range's first pairs may
                # have been taken cold (at batch 2 on the 2-core Xeon one first pair at k = 1 read 2.2 plain
                # steps against 1.6 measured by fixed:1, and, left alone, priced the short lengths out)
                # and every length last paired STALE_TURNS turns ago or more: a length priced out once (its pairs
                # taken in a slow phase of the machine, or cold) is otherwise never paired again where it is not
                # next to the choice (at batch 1 on the 2-core Zen 4 EPYC, where fixed:4 ran 1.25x plain
                # decoding and fixed:1 0.99x, one run's adaptive length decoded plainly on 91% of its steps,
                # 0.72x the best fixed length)
                trusted = self.costs.trusted(bucket, TRUSTED)
                stale = self.steps - STALE_TURNS * self.explore_every
                near.update(k for k in self.costs.measured(bucket)
                            if k not in trusted or self._paired_at.get((bucket, k), stale) <= stale)
                if best and self._probing():
                    # the lengths next to a drafting choice are priced by probes against it, a step each:
                    # its pairs (a step at 0 after `settle` more) are only what holds the range to plain decoding
                    near -= {best - 1, best + 1}
                near = sorted(near)
                turn = self._explore_k.get(bucket, -1) + 1
                self._explore_k[bucket] = turn
                k = near[turn % len(near)]
                # a length priced well below the choice is measured 8x less often: its pairs cost
                # most there, and only a large change in the machine or the acceptance would flip it;
                # not before its cell has TRUSTED pairs, so that one slow pair cannot shelve a length
                if expected is None:
                    expected = source.expected(kmax, priced=False)
                if (k in trusted
                        and self._rate(base, n, expected, bucket, k)
                        < FAR * self._rate(base, n, expected, bucket, best)
                        and self.steps % (8 * self.explore_every)):
                    k = None
            if k is not None:
                started = self._start_pair(plan, bucket, n, k, base)
                if started is not None:
                    return started
            elif self._probing() and self.steps % self.probe_every == 0 and bucket in self._started:
                started = self._start_probe(bucket, n)
                if started is not None:
                    return started
        if not (pure and bucket in self._started) and self.costs.ratio(bucket, 1) is None:
            return 0, None  # nothing measured yet (a step with prefill in it: no pair to start)
        busy = None
        if not pure and self.target.calibrated:
            # more prompt left after this step (a chunk that does not end its prompt, a request waiting):
            # the next steps run for it too
            busy = view.num_waiting > 0 or any(r.num_new > 1 and not r.sample for r in plan.rows)
        memo = None
        if pure:  # the same rows, records, estimates, costs and fill give the same choice (`_decision_key`)
            memo = self._decision_key(rows, bucket, source)
            got = self._recall(memo)
        if memo is None or got is None:
            got = self._decision(plan, rows, base, bucket, busy, source, expected)
            if memo is not None:
                self._memo = _remember(self._memo, memo, got)
        k, caps, per_row, optimistic, expected = got
        if k and pure:
            # rows that did not draft last step pay the draft model's catch-up first (`_switch_price`):
            # looked at only when drafting wins without it, so a batch that stays at k = 0 never does
            switch = self._switch_price(rows, bucket, left)
            if switch[0]:
                key = (memo, switch)
                again = self._recall(key)
                if again is None:
                    again = self._decide(plan, rows, base, bucket, busy, expected, per_row, switch, optimistic)
                    self._memo = _remember(self._memo, key, again)
                k, caps = again
        k, caps = self._chosen(plan, bucket, n, base, k, caps)
        if not k and memo is not None and not self.last_k and bucket in self._started and self._pair is None:
            self._steady = _Steady(seqs, left, self._versions())
        return k, caps

    def _versions(self) -> tuple:
        """The versions of what a pure decode step's choice is priced from,
        beyond its rows (`_decision_key`'s, with both sources')."""
        replayed = self.replayed
        return self.costs.version, self.fill.version, self._records, replayed.version, replayed.ready

    def _recall(self, key):
        for known, out in self._memo:
            if known == key:
                return out
        return None

    def _decision_key(self, rows, bucket: int, source) -> tuple:
        """What a pure decode step's choice (`_decision`) depends on: the
        versions of the costs and the fill, and of what E[k] comes from
        (`source`, `_source`): the
        replayed E[k]'s version once it is the source; before, the steps that
        moved the acceptance estimate and the rows' records (`_records`),
        with the rows themselves where each is priced at its own record
        (`_per_row`), else only their number. The step model's price of a
        verify token (`_token_cost`), which moves only with the contexts and
        its online rescale, is read again whenever one of those changes. At
        batch 1 the whole choice had cost 9 us a step, 3% of a plain step,
        on the 2-core EPYC; keyed on the rows' records while E[k] came from
        the replay, the n-gram proposer's choice was made afresh on 97% of
        its steps (31-43 us a step against 12-13 for a fixed length).

        After a step that drafted, the records are counted in epochs of
        `decide_every` verification steps: one more verification moves a
        row's rate by a try in its record and the pooled rates by less, and a
        choice made afresh after each (a draft model at batch 1, where every
        step verifies) cost 20 us of a 0.7 ms step on the 2-core Xeon. After a
        plain step each counts: there the verifications are the exploration
        pairs', the only news of the acceptance."""
        costs = (bucket, self.costs.version, self.fill.version)
        if source is self.replayed:
            return costs + ("replayed", len(rows), source.version)
        epoch = self._records // self.decide_every if self.last_k else self._records
        if not self.spec.per_row:
            return costs + ("pooled", len(rows), epoch)
        return costs + ("per row", tuple([r.seq for r in rows]), epoch)

    def _decision(self, plan: StepPlan, rows, base: int, bucket: int, busy: bool | None, source,
                  expected: list[float] | None) -> tuple:
        """(k, caps, per_row, optimistic, expected): the step's k and caps
        from the prices as they stand, before any price of starting to draft:
        at the mean acceptance, then, where plain decoding wins there on a
        rate not yet sure, at the optimistic one; and what they were priced
        with (per row or not, optimistic or not, E[k])."""
        pure = len(rows) == len(plan.rows)
        kmax = self.spec.kmax
        per_row = self.spec.per_row and source is self.acceptance and (pure or busy is not None)
        if expected is None and not per_row:
            expected = source.expected(kmax, priced=False)
        k, caps = self._decide(plan, rows, base, bucket, busy, expected, per_row, (0.0, 1), False)
        optimistic = False
        if not k and source is self.acceptance and self.acceptance.unsure():
            # plain decoding wins at the mean acceptance, but its first rate rests on few tries: priced one
            # standard error up (`AcceptanceEstimate.priced`), does drafting win? Acceptance is learned only
            # by drafting: a first rate read low on a few tries priced drafting out, and from there only the
            # exploration pairs drafted, a try or two every 32 steps (at batch 1 on the 2-core Xeon: 0.58-0.63
            # on the first 9-10 tries against about 0.8 over a run; whole 64-token requests decoded plainly,
            # where drafting one token a step was 1.15x faster). Only here: among the lengths that draft, the
            # choice at an optimistic first rate leans long (E[k] - 1 scales with it), and in steps that draft
            # the tries come anyway. (A row's own rate is not taken up too: a request with no record would be
            # priced up by the rows' whole spread, step after step, in a batch whose pooled rate is known.)
            optimistic = True
            expected = source.expected(kmax)
            k, caps = self._decide(plan, rows, base, bucket, busy, expected, per_row, (0.0, 1), True)
        return k, caps, per_row, optimistic, expected

    def _chosen(self, plan: StepPlan, bucket: int, n: int, base: int, k: int,
                caps: list[int] | None) -> tuple[int, list[int] | None]:
        """The step's (k, caps) once decided: a pure decode step's choice is
        the range's last, and a length chosen on fewer than `TRUSTED` pairs
        is paired at once (`_start_pair`)."""
        if n == len(plan.rows):
            self._best[bucket] = k
            if 0 < k and k not in self.costs.trusted(bucket, TRUSTED):
                started = self._start_pair(plan, bucket, n, k, base)
                if started is not None:
                    return started
        return k, caps

    def _decide(self, plan: StepPlan, rows, base: int, bucket: int, busy: bool | None, expected: list[float],
                per_row: bool, switch: tuple[float, int], optimistic: bool) -> tuple[int, list[int] | None]:
        """The step's k (and each row's cap, or None) from the prices as they
        stand: per row (`_per_row`) or with one pooled E[k] for every row.
        `optimistic`: `expected` is at the optimistic first rate, and so is a
        row's prior (`AcceptanceEstimate.priced`)."""
        if per_row:
            return self._per_row(plan, rows, base, bucket, busy, switch, optimistic)
        n = len(rows)
        if busy is None:
            # (prefill chunks in the step and no step model yet: priced as if the chunks were free)
            scores = self._rates(base, n, expected, bucket, switch)
        else:
            score = self._mixed_score(plan, rows, bucket, busy, expected)
            scores = [score(k) for k in range(self.spec.kmax + 1)]
        best_k, best = 0, scores[0]
        for k in range(1, len(scores)):
            v = scores[k]
            if v > best + 1e-9 * abs(best):
                best_k, best = k, v
        return best_k, None

    def _start_pair(self, plan: StepPlan, bucket: int, n: int, k: int, base: int) -> tuple[int, None] | None:
        """Start an exploration pair at k (`_Pair`) and return this step's
        length. Besides the turns of `_choose`, a length is paired as soon as
        it is chosen while its cell holds fewer than `TRUSTED` pairs: such a
        choice rests on the line through other lengths (or on one pair taken
        while the engine was still cold), and a line laid flat by one cheap
        pair had priced k = 4 at 2.2 steps against 3.2 paid, and drafted it
        at batch 1 where every length loses.

        None (no pair) within `explore_every // 4` steps of a pair of the
        range that was dropped after it had run a step at 0 (`_drop_pair`):
        at a large batch under load, prefill chunks break up the runs of
        decode steps, and restarting at once paid a step at k = 0 for each
        try (simulated Azure conversations, 8B + 1B H100 profiles, 21 req/s:
        175 tries at 128-255 rows, none completed). That holds for a pair
        that starts at the length its rows drafted anyway, (k, 0, ..., 0), too:
        in runs of 3 decode steps, one started on a run's second step ran its
        step at 0 on the third and was dropped by the chunk after, run after
        run, so a third of the decode steps ran plain and its length was never
        priced. One dropped after its first step (at k) cost nothing, and
        holds nothing back."""
        # where these rows all drafted last step the proposer is current: the pair starts at k; rows may only
        # have left since (any that joined came through a prefill chunk, in a step where they did not draft)
        last_drafting, last_rows = self._last_rows
        primed = self.last_k > 0 and last_drafting == last_rows and len(plan.rows) == n and n <= last_rows
        if self.steps < self._held.get(bucket, 0):
            return None
        if not primed and self.quiet and self._calm < self.quiet:
            # from plain decoding, the pair's first step is its step at 0, measured at once: it must follow
            # `quiet` plain decode steps, or it runs on caches that drafting or a prefill disturbed (on
            # the 2-core Xeon such steps took up to 2x a settled one at batch 1, and pairs started on a
            # request's first decode steps priced k = 4 at 1.0-1.2 plain steps against 2.0)
            return None
        # on a CPU the step right after the priming one runs slow too (the draft model's catch-up on whole
        # prompts evicted the target's caches): at batch 2 on the 2-core Xeon it took 0.98-1.21 ms at k = 4
        # against 0.67-0.84 in a drafting run, and pairs timing it priced k = 2-4 25% dear; one more step
        # at k leads the measured one there
        steps = pair_steps(k, primed, self.settle, lead=2 if self.quiet else 1)
        if n < PAIR_SLACK and _least_left(plan.rows) <= sum(steps) + len(steps):
            # a row would finish inside it (a pair of fewer rows is dropped as one leaves): in the last steps of
            # a batch of 2, pairs started on the one row left ran their steps at 0 and were dropped as it ended
            return None
        # what the choice would emit in the pair's steps, at the mean acceptance (not the optimistic price):
        # the pair's loss against it spaces the range's next pair (`_pair_step`)
        expected = self._source().expected(self.spec.kmax, priced=False)
        rate = self._rate(base, n, expected, bucket, self._best.get(bucket, 0)) if bucket in self._started else 0.0
        self._pair = pair = _Pair(bucket, n, k, steps=steps, rate=rate)
        pair.paid = not pair.next_k
        return pair.next_k, None

    def _probing(self) -> bool:
        """Whether probes run: a draft model's (a lookup's proposals come
        short of the length asked, by how much varies step to step), with a
        neighbour to probe."""
        return self.probe_every > 0 and self.propose is None and self.spec.kmax > 1

    def _start_probe(self, bucket: int, n: int) -> tuple[int, None] | None:
        """Start a probe (`_Probe`) next to the range's choice, in a run of
        steps whose rows all drafted it (the same rows as the last step, none
        capped shorter: where rows draft lengths of their own, three steps
        with every row at one length would price another step than the
        run's), and return this step's length: the choice, on every row."""
        best = self._best.get(bucket, 0)
        last_drafting, last_rows = self._last_rows
        if not best or self._last_alike != best or not last_drafting == last_rows == n:
            return None
        turn = self._probe_turn.get(bucket, 0)
        self._probe_turn[bucket] = turn + 1
        to = best + 1 if turn % 2 == 0 else best - 1
        if not 1 <= to <= self.spec.kmax:
            to = 2 * best - to
        self._probe = _Probe(bucket, n, best, to)
        return best, None

    def _probe_step(self, probe: _Probe, plan: StepPlan, record: StepRecord) -> None:
        """One step of the probe in flight: kept when its rows are the
        probe's, each asked for the step's length, in a shape run before."""
        if record.cold or len(plan.rows) != probe.rows or self._asked[2] != probe.next_k:
            self._probe = None
            return
        probe.walls += (record.wall_s,)
        probe.done += 1
        if probe.done == 3:
            before, at, after = probe.walls
            if self.costs.add_probe(probe.bucket, probe.k, probe.to, 2.0 * at / max(before + after, 1e-12)):
                self._warm = probe.bucket
            self.probes += 1
            self._probe = None

    def _drop_pair(self) -> None:
        """The pair in flight, if any, is dropped: if it has run a step at 0,
        its range's next pair waits (`_start_pair`)."""
        pair = self._pair
        if pair is not None:
            if pair.paid:
                self._held[pair.bucket] = self.steps + self.explore_every // 4
            self._pair = None

    def _source(self):
        """Where E[k] comes from: the replayed proposals once there are
        enough of them (a deterministic proposer), else the verifications."""
        return self.replayed if self.replayed.ready else self.acceptance

    def _switch_price(self, rows, bucket: int, left: int) -> tuple[float, int]:
        """What starting to draft costs these rows, with `left` tokens left
        to them in all: (S, R), S steps at k = 0, paid once (0.0: nothing to
        pay, the rows drafted the step before), and R tokens left per row
        (`_switch_added`).

        Rows that did not draft last step make a draft model catch up first
        on every token since they last did: `DraftCostTable.add_switch`
        measures that for a whole range's batch, and u of n rows pay u / n
        of it. R is rounded down to a power of two, so a decode step's choice
        can be reused while it stays."""
        price = self.costs.switch.get(bucket, 0.0)
        if price <= 0.0:
            return 0.0, 1
        last = self.steps - 1
        u = 0
        for r in rows:
            u += r.seq.spec_last != last
        if not u:
            return 0.0, 1
        n = len(rows)
        return price * u / n, _per_row_left(left, n)

    def _switch_added(self, switch: tuple[float, int], n: int, tokens: float) -> float:
        """The step time that starting to draft adds to a decode step of n
        rows emitting `tokens`, in steps at k = 0: S spread over the steps it buys, R / E of them at E = tokens
        / n per row, but over no more than `explore_every` (the choice may
        not outlive the next pair). So a length that only ties with plain
        decoding is not started cold for a few steps, and one that wins by
        less than S / 32 waits for a pair to prime the rows (measured at
        batch 1 on the 2-core EPYC, 64-token requests: a catch-up cost 2-3
        steps, and drafting stretches of a few steps lost 3% against plain
        decoding)."""
        price, left = switch
        return price * max(tokens / (n * left), 1.0 / self.explore_every)

    def _per_row(self, plan: StepPlan, rows, base: int, bucket: int, busy: bool | None,
                 switch: tuple[float, int] = (0.0, 1), optimistic: bool = False) -> tuple[int, list[int] | None]:
        """The step's k (the draft model runs k steps) and each row's own
        length (at most k).

        Requests differ in how often their drafts are accepted: on the
        embedded pair, a request's rate per position spans 0.66-0.99 from its
        5th to its 95th percentile. Pooled over requests, the per-position
        rates rise with the position (the later positions are reached mostly
        by the requests whose drafts are accepted most), and a pooled E[k]
        prices every row as the mix: too long a draft for the rows that
        seldom keep one, too short for the others. Here a row's drafts are
        accepted at its own rate a, the same at every position, drawn as the
        rows' rates are (a Beta of weight w, `RowSpread`, around the pooled
        first-position rate) and narrowed by the row's record
        (`Seq.spec_tried`, `spec_accepted`): its mean is the record with w
        tries at the pooled rate, its weight w + tried. So a record counts
        as much as rows are seen to differ: where they barely do, a row's
        unlucky first tries do not price it out of drafting. Its j-th draft
        is worth E[a^j] tokens, the product over i < j of
        (mean (w + tried) + i) / (w + tried + i): more than mean^j, by more
        the less the row has shown, so a row with no record is priced as the
        mix of rows. (At mean^j such rows drafted 1-4 shorter than the
        pooled choice in half of 150 random cases.) Until rows are seen to
        differ (`RowSpread.weight` None), every row's drafts are worth the
        pooled first rate to the j-th power, whatever its record.

        The step's k maximises the score of `_rate` (a decode step) or of
        `_mixed_score` (a step with prefill chunks, `busy` not None) with
        the step's expected drafts accepted summed over its rows' own rates.
        Then each row stops where its next draft is worth less than the
        verify token it costs at the step's exchange rate of time for tokens
        (the step's score): t_tok of a decode step of the drafting rows (the
        target's step model, `_token_cost`, no more than the measured cost of
        a draft), plus, beside prefill chunks, what the step model says a
        token adds on top of them. The draft model's own work for a row that
        stops early is not counted as saved: its steps run for the others.
        Pricing each subset of drafts exactly (sorted, every k) chose no
        better in the simulator (Azure conversations, 16 and 20 req/s: goodput
        within 1% either way) at 2-10x the planning time.

        `optimistic` (where plain decoding wins at the means, `_choose`): the
        rows' prior is the pooled first rate one standard error up
        (`AcceptanceEstimate.priced`).

        Only for a proposer priced by its verifications (a draft model): a
        prompt lookup's drafts are right in runs (one right guess tends to be
        followed by more), which no per-row constant rate describes; its rows
        share the replayed E[k]."""
        kmax = self.spec.kmax
        n = len(rows)
        est = self.acceptance
        seqs = [r.seq for r in rows]
        first = est.priced()[0] if optimistic else est.first()
        spread = self.spread.weight()
        # each row's worth of its j-th draft, E[a^j] for its own rate a ~ Beta: the rows' spread (`RowSpread`)
        # around the pooled first-position rate, narrowed by the row's record (mean (accepted + prior) /
        # (tried + spread), weight spread + tried). Then the step's expected accepted drafts at k = 1..kmax
        # (the sums over the rows); up to SMALL_BATCH rows in plain floats, where numpy's calls cost more
        # than the arithmetic. Rows not seen to differ: every one at the pooled rate, its record unread
        if spread is None:
            row = [first ** (j + 1) for j in range(kmax)]
            worth = [row] * n if n <= SMALL_BATCH else np.tile(np.array(row), (n, 1))
            sums = [x * n for x in row]
        elif n <= SMALL_BATCH:
            prior = spread * first
            worth = []
            sums = [0.0] * kmax
            for q in seqs:
                a, t = q.spec_accepted, q.spec_tried
                c = spread + t
                oc = min((a + prior) / c, 1.0 - 1e-9) * c  # (its own rate, times its weight)
                p = 1.0
                row = []
                for j in range(kmax):
                    p *= (oc + j) / (c + j)
                    row.append(p)
                    sums[j] += p
                worth.append(row)
        else:
            c = np.array([q.spec_tried for q in seqs], dtype=np.float64)[:, None] + spread
            own = np.minimum((np.array([q.spec_accepted for q in seqs], dtype=np.float64)[:, None] + spread * first) / c,
                             1.0 - 1e-9)
            j = np.arange(kmax)
            worth = np.cumprod((own * c + j) / (c + j), axis=1)
            sums = worth.sum(axis=0).tolist()
        w = list(accumulate(sums))
        cost = self._costs_of(bucket)
        t_tok = self._token_cost(rows)
        if busy is None:
            if switch[0]:
                v = [t / (c + self._switch_added(switch, n, t)) for t, c in zip([base + x for x in w], cost)]
            else:
                v = [(base + x) / c for x, c in zip(w, cost)]
            baseline = float(base)  # k = 0: base tokens at cost 1
        else:
            m0, t_spec, on_top = self._mixed_terms(plan, rows)
            per_token = on_top * self.fill.value * n
            added = [t_spec * (c - 1.0) + per_token * (j + 1) for j, c in enumerate(cost)]
            if busy:
                v = [x * m0 - a for x, a in zip(w, added)]
                baseline = 0.0
            else:
                v = [(n + x) / (t_spec + a) for x, a in zip(w, added)]
                baseline = n / t_spec
        i = max(range(kmax), key=v.__getitem__)  # (the first of equal maxima, as argmax)
        if not v[i] > baseline + 1e-9 * abs(baseline):
            out = (0, None)
        else:
            k = i + 1
            # each row's drafts past the point where the next is worth less than the verify token it
            # costs, at the step's exchange rate of time for tokens (one pass of the threshold)
            tok = min(t_tok, (cost[i] - 1.0) / (n * k))
            if busy is None:
                threshold = tok * v[i]
            else:
                per_draft = t_spec * tok + on_top * self.fill.value
                threshold = per_draft / m0 if busy else per_draft * v[i]
            caps = None
            if threshold > 0.0:
                # a row's worth falls with j: its cap is how many of its first k drafts are worth the threshold
                if n <= SMALL_BATCH:
                    caps = [sum(1 for x in row[:k] if x >= threshold) for row in worth]
                    top, low = max(caps), min(caps)
                else:
                    caps = (worth[:, :k] >= threshold).sum(axis=1)
                    top, low = int(caps.max()), int(caps.min())
                if not top:
                    k = 0  # no row's first draft is worth its token: plain decoding
                caps = None if not k or low >= k else list(map(int, caps))
            out = (k, caps)
        return out

    def _costs_of(self, bucket: int) -> list[float]:
        """`_cost(bucket, k)` for k = 1..kmax, kept until a pair or the fill moves them."""
        got = self._cost_rows.get(bucket)
        if got is None or got[0] != self.costs.version or got[1] != self.fill.version:
            got = self._cost_rows[bucket] = (self.costs.version, self.fill.version,
                                             [self._cost(bucket, k) for k in range(1, self.spec.kmax + 1)])
        return got[2]

    def _token_cost(self, rows) -> float:
        """One more query token in a decode step of these rows, relative to
        the step: from the target's step model when it rests on an offline
        profile, whose sweep of prefill shapes sets the cost of a token apart
        from that of a row. Fitted online alone it has mostly seen decode
        steps, where a row and a token come together and their costs cannot
        be told apart: 0 then (no draft is left out to save its token)."""
        model = self.target
        if model.base is None:
            return 0.0
        n = len(rows)
        ctx = sum(r.start for r in rows) + n
        t0 = model.predict(n, ctx, n)
        return max(model.predict(n, ctx + 1, n + 1) - t0, 0.0) / t0 if t0 > 0 else 0.0

    def _replay(self, rows) -> None:
        """One decode row (rotating through them) with at least `MIN_REPLAY`
        positions not yet replayed, up to `kmax` before its end (a
        proposal there is still being answered), replays them as
        speculation at every k (`ReplayedLength`)."""
        kmax = self.spec.kmax
        n = len(rows)
        for i in range(n):
            seq = rows[(self._replay_turn + i) % n].seq
            if self._replay_seq(seq, seq.num_tokens - kmax, MIN_REPLAY):
                self._replay_turn += i + 1
                return

    def _replay_seq(self, seq, stop: int, least: int = 1) -> bool:
        """Replay one sequence's positions from where it was last replayed
        (from its second output token, the first a step could have drafted)
        to `stop`. Every position of a request is replayed once: its last
        ones when it finishes (`observe`), where the running replay cannot
        reach them. Those are where it ends, often in a loop a lookup
        predicts well; left out (the running replay saw each request's
        tokens only up to kmax before its end, and then only every
        `replay_every` steps), they read E[8] at 1.5-1.6 where whole
        requests gave 1.9 (the n-gram proposer on the repetitive workload,
        64-token requests), and k = 4 was chosen at batch 1 where fixed:8
        ran 1.16x faster. Nothing (False) if fewer than `least` are new.

        Once the history holds `REPLAY_FULL` positions (decayed), only one
        request in `REPLAY_SHARE` is replayed (by its id), whole, so the
        history still weighs every position of the requests it takes: the
        lookups of a replay cost ~10 us a position inside the engine's loop
        (36 us a step at batch 2 on the 2-core Xeon, 4% of a step)."""
        if seq.seq_id % REPLAY_SHARE and self.replayed.positions >= REPLAY_FULL and not seq.spec_replayed:
            return False  # (a request begun is replayed to its end)
        start = max(seq.spec_replayed, seq.prompt_len + 1)
        if stop - start < least:
            return False
        self.replayed.add(self.replay(seq, start, stop, self.spec.kmax))
        seq.spec_replayed = stop
        return True

    def _rate(self, base_tokens: int, n: int, expected: list[float], bucket: int, k: int,
              switch: tuple[float, int] = (0.0, 1)) -> float:
        """Expected tokens per step time (in units of the step without drafts)
        at k drafts for each of n rows, for a step whose rows all decode
        (`base_tokens` sampled without drafts; `expected`, E[k] per k): every
        step of such a batch exists for its decode rows, so fewer, dearer
        steps win when they commit more tokens per second. `switch`: what
        starting to draft costs (`_switch_price`)."""
        return self._rates(base_tokens, n, expected, bucket, switch)[k]

    def _rates(self, base_tokens: int, n: int, expected: list[float], bucket: int,
               switch: tuple[float, int] = (0.0, 1)) -> list[float]:
        """`_rate` at every k in [0, kmax], in one pass."""
        costs = self._costs_of(bucket)  # (cached until a pair or the fill moves them)
        out = [float(base_tokens)]
        for k in range(1, len(costs) + 1):
            tokens = base_tokens + n * (expected[k] - 1.0)
            out.append(tokens / (costs[k - 1] + (self._switch_added(switch, n, tokens) if switch[0] else 0.0)))
        return out

    def _cost(self, bucket: int, k: int) -> float:
        """Step time when k drafts per row are asked for, over the time
        without: the cost of k delivered (`DraftCostTable`) for the share of
        them the proposer delivers (`DraftFill`). The part of it any drafting
        step pays whatever it verifies (`_jump`) is paid whenever a row gets
        a draft (each row alike, at the share: all but (1 - share)^rows of
        the steps, at the range's fewest rows); the rest in proportion to
        the share."""
        c = self.costs.ratio(bucket, k)
        f = self.fill.value
        if f == 1.0:  # (a draft model: every draft asked for delivered)
            return c
        j = self._jump(bucket, c)
        return 1.0 + j * (1.0 - (1.0 - f) ** (1 << bucket)) + f * (c - 1.0 - j)

    def _jump(self, bucket: int, full: float) -> float:
        """What a step with drafts pays over a plain one before the drafts'
        own cost, in plain steps: the intercept of the range's cost line
        (`DraftCostTable.line`), at most `full` - 1. A step where one row
        verifies leaves the native decode path for the ragged one, whatever
        the other rows do: at batch 2 on the 2-core EPYC, n-gram steps at
        fills 0.62-0.73 cost about 0.2 plain steps plus 0.2 per drafted
        token. Scaled by the fill with the rest, it made long drafts, whose
        lookups run out first, look up to 18% cheap."""
        ln = self.costs.line(bucket)
        return min(ln[0], full - 1.0) if ln is not None and full > 1.0 else 0.0

    def _mixed_score(self, plan: StepPlan, rows, bucket: int, busy: bool, expected: list[float]):
        """k -> the score of k drafts per row in a step with prefill chunks.

        While more prompt is left after this step (`busy`), this step and
        the next ones run for it whatever the decode rows do, so a decode
        row's next token costs only the row's share of such a step (m0, from
        the step model): the score is the time the drafts save, their tokens
        at m0 less the time they add. When this step ends the last prompt,
        the next steps exist for the decode rows, so they are scored as a
        decode step of their own (tokens per second), the chunks' time being
        spent either way. The time k drafts add, both ways: the drafting and
        the verify tokens' pure-decode cost (`DraftCostTable`, relative to a
        decode step of the drafting rows alone), plus what the step model
        says the extra tokens cost on top of the chunks (which make the step
        compute-bound: there verify tokens are no longer nearly free)."""
        n = len(rows)
        m0, t_spec, on_top = self._mixed_terms(plan, rows)

        def added(k: int) -> float:
            extra = n * k * self.fill.value  # the verify tokens expected
            return t_spec * (self._cost(bucket, k) - 1.0) + on_top * extra

        def saved(k: int) -> float:
            return n * (expected[k] - 1.0) * m0 - added(k) if k else 0.0

        def rate(k: int) -> float:
            return n * expected[k] / (t_spec + (added(k) if k else 0.0))

        return saved if busy else rate

    def _mixed_terms(self, plan: StepPlan, rows) -> tuple[float, float, float]:
        """For a step with prefill chunks, from the step model: a decode row's
        share of such a step (m0), a decode step of the drafting rows alone
        (t_spec), and what one more verify token adds to the step on top of
        the chunks (the step model is linear in tokens at fixed rows)."""
        n = len(rows)
        f = plan_features(plan)
        starts = sum(r.start for r in rows)
        predict = self.target.predict
        chunks = (f.prefill_pairs, f.extend_rows, f.chunk_rows, f.layered)  # (the drafting rows are no chunks)
        t0 = predict(f.rows, f.context_tokens, f.new_tokens, *chunks)
        t_spec = predict(n, starts + n, n)
        without = predict(f.rows - n, f.context_tokens - starts - n, f.new_tokens - n, *chunks)
        one = predict(f.rows, f.context_tokens + 1, f.new_tokens + 1, *chunks)
        return max(t0 - without, 0.0) / n, t_spec, max(one - t0, 0.0)

    # -- observing ---------------------------------------------------------------
    def observe(self, plan: StepPlan, record: StepRecord) -> None:
        if self.spec.mode == "none":
            return
        if self._replay_rows is not None:
            self._replay(self._replay_rows)
            self._replay_rows = None
        self._track_run(plan, record)
        if self._probe is not None:
            self._probe_step(self._probe, plan, record)
        if self.replay is not None:
            for r in plan.rows:  # a finished row's positions not replayed yet (`_replay_seq`)
                seq = r.seq
                if seq.finished and r.sample and seq.speculative:
                    self._replay_seq(seq, seq.num_tokens)
        if not plan.num_verify and self.target is not None:
            if not record.cold:  # a step without drafts, whatever its shape, once the shape is warm
                self.target.add(record_features(record), record.wall_s)
            if self._pair is None and not self._asked[0]:
                return  # nothing drafted, asked for or measured
        asked, empty, _ = self._asked
        vr = plan.verify_rows
        drafted = [len(r.draft) if r.draft is not None else 0 for r in vr]
        delivered = sum(drafted)
        accepted = [r.num_accepted for r in vr]
        pair = self._pair
        if pair is not None:
            self._pair_step(pair, plan, record, delivered, len(plan.rows) + sum(accepted))
        self.fill.update(asked, delivered)
        if self._warm is not None:
            # a pair moved the table: its prices are worked out now, outside any step's time (in the
            # next plan they fell on the next pair's first step, whose time they lengthened)
            self._costs_of(self._warm)
            self._warm = None
        if not vr and not empty:
            return
        # per position asked for: a proposer that offered fewer drafts than asked (an n-gram lookup
        # that found nothing) failed the position after its last, as a rejected draft would; the
        # tokens expected are priced at what is asked, so they must be measured at it too
        asked_k = [r.draft_asked or r.draft_len for r in vr]
        self.acceptance.update(asked_k + [kr for kr, _ in empty], accepted + [0] * len(empty))
        spread = self.spread
        for r, d, a in zip(vr, asked_k, accepted):  # each row's own record, counted as the estimate counts
            seq = r.seq
            seq.spec_tried += min(a + 1, d)
            seq.spec_accepted += a
            spread.add_row(seq)
        for _, seq in empty:
            seq.spec_tried += 1
            spread.add_row(seq)
        self._records += 1
        self.drafted += delivered
        self.accepted += sum(accepted)
        self.emitted += sum(accepted) + len(vr) + len(empty)  # (a row whose ask found nothing decoded one)

    def _track_run(self, plan: StepPlan, record: StepRecord) -> None:
        """The run of steps like this one: the same rows, each decoding
        plainly or each drafting the same length (a cold step ends it). Its
        steady steps are kept: a drafting run's all, a plain run's once more
        than `quiet` plain decode steps in a row have run (`_calm`: a row
        that finishes or joins between them leaves the caches alone, a
        drafting step or a prefill chunk does not)."""
        n = len(plan.rows)
        kind = None
        if not record.cold:
            if plan.num_decode == n:
                kind = 0
            elif plan.num_verify == n and self._asked[2]:
                kind = self._asked[2]
        self._calm = self._calm + 1 if kind == 0 else 0
        if kind != self._run_kind or n != self._run_rows:
            self._run_kind, self._run_rows = kind, n
            self._run = []
        if kind is not None and (kind or self._calm > self.quiet):
            self._run = self._run[1 - RUN:] + [record.wall_s]

    def _run_wall(self, record: StepRecord, kind: int, rows: int) -> float:
        """What a step of `kind` just measured for a pair takes: the median
        of the run's last steady steps where this one ends a steady run of
        that kind and rows (on the 2-core Xeon single decode steps vary by
        10-20%, with one in 5-10 up to 2x slow: pairs of single steps read
        k = 4 at 0.85-3.6 plain steps), else its own time. A plain step
        where nothing is quiet (`quiet` 0: a GPU, the simulator) is its own
        time, as a pair from drafting times only its last."""
        if (self._run_kind == kind and self._run_rows == rows and self._run and self._run[-1] == record.wall_s
                and (kind or self.quiet)):
            return _median(self._run)
        return record.wall_s

    def _pair_step(self, pair: _Pair, plan: StepPlan, record: StepRecord, delivered: int, emitted: int) -> None:
        """One step of the exploration pair: kept when every row ran at the
        pair's k for this step (no row capped, none left out), else the pair
        is dropped. `delivered`: the drafts the step's verify rows got;
        `emitted`: the tokens the step emitted. A pair whose measured step
        ran a shape the engine had not run before (`StepRecord.cold`: one-off
        work on top of the step) runs to its end but prices nothing: its
        range's next pair is not held back by it, and a length's first pair
        is taken again (at batch 1 with the n-gram proposer on the 2-core Xeon,
        the first pair at k = 4, its step the first of its shape, priced k = 4
        at 1.53 plain steps where warm steps put it at 1.1-1.15; with one or
        two pairs in the cell, k = 2 was chosen where fixed:4 ran 1.15x
        faster).

        A whole pair also prices itself: its steps' time against what the
        range's choice would have emitted in it (`_Pair.rate`), in steps at
        k = 0. Once the acceptance is learned (`LEARNED` tries of the first
        position: where k = 0 runs, the pairs are also what it is learned
        from), the range's next pair waits until that loss is at most
        `EXPLORE_SHARE` of the steps between (and at most `EXPLORE_TURNS`
        turns): where the lengths tie, a pair costs about its priming step,
        in which the draft model catches up on every token since its rows
        last drafted (measured at batch 1 on the 2-core EPYC: pairs every 32
        steps cost the adaptive length 7% against plain decoding, every 128
        steps 2.5%; at batch 2, where plain decoding won by 5-8%, a pair
        cost 3-10 plain steps, the draft catching up on two rows' histories,
        and 8 turns apart the pairs cost 3.5%)."""
        k = pair.next_k
        n = len(plan.rows)
        if k == 0:
            ok = plan.num_decode == n and self._pair_fits(pair, n)
        else:  # every row asked for k (what it got is `fill`, below), or at a large batch all but a few, whose
            # max_tokens capped them short of k
            asked, _, alike = self._asked
            ok = self._pair_fits(pair, n) and (alike == k or (
                n >= PAIR_SLACK and self._rescales() and asked * PAIR_SLACK >= (PAIR_SLACK - 1) * n * k))
        if not ok:
            self._drop_pair()
            return
        scale = self._to_pair_rows(plan, pair.rows)
        wall = record.wall_s * scale
        pair.spent += wall
        pair.tokens += emitted
        if pair.measured(pair.done) and not (k and pair.done):  # a pair's step at k after its priming step
            # is the first primed one: the run before it is not like it
            wall = self._run_wall(record, k, n) * scale
        if not pair.measured(pair.done):  # priming the proposer, or settling back to plain decoding
            if k and pair.done == 1 and not record.cold:  # the priming step (a cold one prices no switch: the
                # draft model's catch-up on a whole prompt runs shapes of its own, and at batch 2 such steps had
                # priced starting to draft at 1.5 plain steps, where warm ones put it at 0.15, and held k = 0 on
                # most steps)
                pair.prime = wall
        elif k:
            # the cost of k drafts delivered to every row: a row the proposer gave fewer (a lookup
            # that found nothing) verified less, so the extra time is scaled to what was asked
            fill = delivered / (n * k)
            if fill < MIN_FILL:
                self._drop_pair()
                return
            pair.at_k = (wall, fill)
        else:
            pair.ref = wall
        if pair.measured(pair.done):
            pair.cold |= record.cold
        if pair.done == pair.last:
            if pair.cold:
                self._pair = None
                return
            unit = max(pair.ref, 1e-12)
            at_k, fill = pair.at_k
            r = at_k / unit  # scaled to k drafts delivered on every row, the jump kept whole (`_cost`)
            j = self._jump(pair.bucket, r)
            self.costs.add(pair.bucket, pair.k, 1.0 + j + (r - 1.0 - j) / fill)
            self._paired_at[pair.bucket, pair.k] = self.steps
            self._warm = pair.bucket
            if pair.prime > 0.0:  # the priming step over the same step primed: what starting to draft costs
                self.costs.add_switch(pair.bucket, max(pair.prime - at_k, 0.0) / unit)
            self.pairs += 1
            if pair.rate > 0.0 and self.acceptance.tried_first() >= LEARNED:
                loss = pair.spent / unit - pair.tokens / pair.rate
                wait = min(max(loss, 0.0) / EXPLORE_SHARE, (EXPLORE_TURNS - 1) * self.explore_every)
                self._explore_at[pair.bucket] = self.steps + int(wait)
            self._pair = None
            return
        pair.done += 1

    def _rescales(self) -> bool:
        """Whether the step model can rescale a step to another row count."""
        return self.target.calibrated

    def _pair_fits(self, pair: _Pair, n: int) -> bool:
        """Whether a step of n rows may be one of the pair's (`_near_rows`)."""
        return self._near_rows(n, pair.rows)

    def _near_rows(self, n: int, rows: int) -> bool:
        """Whether a step of n rows may stand for one of `rows`: the same
        rows, or (from `PAIR_SLACK` rows up, with a step model to rescale it,
        `_to_pair_rows`) rows in the same range within 1/PAIR_SLACK of them."""
        if n == rows:
            return True
        return row_bucket(n) == row_bucket(rows) and abs(n - rows) * PAIR_SLACK <= rows and self._rescales()

    def _to_pair_rows(self, plan: StepPlan, rows: int) -> float:
        """What a step of this plan's rows takes, times this, is what it
        would have taken with `rows` rows of the same mean context (1.0 at
        the pair's own rows): the step model's decode step at each, without
        drafts, over the other."""
        n = len(plan.rows)
        if n == rows:
            return 1.0
        ctx = sum(r.start for r in plan.rows) + n
        predict = self.target.predict
        here = predict(n, ctx, n)
        return predict(rows, ctx * rows / n, rows) / here if here > 0 else 1.0

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
            "spec_row_k": dict(sorted(self.row_k_hist.items())),
            "spec_acceptance": [round(float(a), 4) for a in alpha],
            "spec_cost_pairs": self.pairs,
            "spec_cost_probes": self.probes,
            "spec_replayed_positions": self.replayed.total,
            "spec_cost_ratio": self.costs.to_dict(),
            "spec_draft_fill": round(self.fill.value, 4),
            "spec_row_spread": self._spread(),
        }

    def _spread(self) -> float | None:
        w = self.spread.weight()
        return round(w, 2) if w is not None else None
