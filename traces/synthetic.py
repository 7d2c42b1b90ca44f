"""Synthetic workloads: arrivals, lengths, shared prefixes, conversations, branches.

Arrivals: Poisson (exponential gaps), gamma (shape = `burstiness`: below 1 is
burstier than Poisson, above 1 smoother; the mean rate stays `rate`), or
constant. Lengths come from small named distributions ("uniform:16:96").

Sharing is expressed with segments (see request_spec): a request of a prefix
group starts with its group's system prompt; turn k of a conversation is the
whole of turn k-1 (prompt and answer) plus a new user message. Open loop: a
turn's arrival is fixed in advance (previous turn's arrival + a gap), and its
"answer" segment is the trace's, not what a server generated -- so a real
server caches the previous *prompt*, not the previous answer, exactly as the
simulator (whose placeholder outputs differ from the answer segment too).

Branching comes in two kinds. `branch_fraction` of the requests ask for
`branches` parallel samples of one answer (OpenAI's n). `fork_fraction` of them
are fork/join requests (map, parallel branches, reduce: TAPER's workload): a
first serial stage of `output` tokens, then `fork_stages` times a parallel
stage of `fork_branches` branches (each a `fork_suffix`-token suffix of its own
and `fork_output` tokens) followed by a serial join of `join_output` tokens.
The TAPER paper's mix, 80% map -> parallel -> reduce and 20% serial, is
`fork_fraction=0.8`.

A spec string selects all this on the command line:
`synthetic:num=200,rate=4,burstiness=0.5,input=uniform:32:128,output=fixed:32,
prefix_groups=4,prefix_len=64,turns=3,branch_fraction=0.2,branches=4,seed=1`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from stepserve.traces.request_spec import RequestSpec, Segment


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | normal | lognormal | exponential
    a: float
    b: float = 0.0
    least: int = 1  # the shortest length it draws (a draw below, a normal's tail, is raised to it)

    @classmethod
    def parse(cls, s: str, least: int = 1) -> "LengthDist":
        """`least`: the shortest length that makes sense (1 for a prompt or an
        output, 0 for a fork branch's suffix)."""
        parts = s.split(":")
        kind = parts[0]
        want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exponential": 1}
        try:
            nums = [float(x) for x in parts[1:]]
        except ValueError:
            nums = []
        if kind not in want or len(nums) != want[kind] or not all(math.isfinite(x) for x in nums):
            raise ValueError(
                f"bad length distribution {s!r}: use fixed:N, uniform:LO:HI, normal:MEAN:STD, "
                "lognormal:MEAN:SIGMA (MEAN of the lengths, SIGMA of their log) or exponential:MEAN")
        a, b = nums[0], nums[1] if len(nums) > 1 else 0.0
        if kind in ("fixed", "uniform") and a < least or kind == "uniform" and b < a:
            raise ValueError(f"bad length distribution {s!r}: lengths from {least} on"
                             + (", LO <= HI" if kind == "uniform" else ""))
        if kind in ("normal", "lognormal") and b < 0 or kind in ("lognormal", "exponential") and a <= 0:
            raise ValueError(f"bad length distribution {s!r}: a positive mean and a spread of 0 or more")
        return cls(kind, a, b, least)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k, a, b = self.kind, self.a, self.b
        if k == "fixed":
            x = np.full(n, a)
        elif k == "uniform":
            x = rng.integers(int(a), int(b) + 1, size=n)
        elif k == "normal":
            x = rng.normal(a, b, size=n)
        elif k == "lognormal":
            # parameterised by the mean of the lengths: mu = ln(mean) - sigma^2/2
            x = rng.lognormal(math.log(a) - b * b / 2, b, size=n)
        else:
            x = rng.exponential(a, size=n)
        return np.maximum(self.least, np.rint(x)).astype(np.int64)

    def __str__(self) -> str:
        return f"{self.kind}:{self.a:g}" + (f":{self.b:g}" if self.kind in ("uniform", "normal", "lognormal") else "")


@dataclass
class SyntheticConfig:
    num: int = 200  # requests (turns of conversations count one each)
    rate: float = 2.0  # mean arrivals per second (of requests, all turns included)
    arrival: str = "poisson"  # poisson | gamma | constant
    burstiness: float = 1.0  # gamma shape (1 = Poisson-like; smaller = burstier)
    input: str = "uniform:32:128"  # prompt length (per turn: the new user message)
    output: str = "uniform:16:64"
    prefix_groups: int = 0  # shared system prompts (0 = none)
    prefix_len: int = 0  # tokens of each system prompt
    turns: int = 1  # turns per conversation; > 1 makes multi-turn conversations
    turn_gap_s: float = 5.0  # mean gap between a conversation's turns (exponential)
    branch_fraction: float = 0.0  # share of requests that branch (n > 1)
    branches: int = 4  # n of a branching request
    fork_fraction: float = 0.0  # share of fork/join requests (stages: serial, then parallel + join, ...)
    fork_stages: int = 1  # parallel stages (each followed by a join) of a fork/join request
    fork_branches: int = 4  # branches of each parallel stage
    fork_suffix: str = "fixed:8"  # tokens of a branch's own suffix prompt
    fork_output: str = ""  # tokens a branch generates (default: as `output`)
    join_output: str = ""  # tokens a join generates (default: as `output`)
    seed: int = 0

    # the shortest length each distribution may draw: a fork branch may have no suffix of its
    # own (the engine takes an empty one), every prompt and output has a token
    LEAST = {"input": 1, "output": 1, "fork_suffix": 0, "fork_output": 1, "join_output": 1}

    def __post_init__(self):
        # Each message names its option: numpy's own ('scale < 0', 'high <= 0') does not.
        if self.arrival not in ("poisson", "gamma", "constant"):
            raise ValueError(f"arrival must be poisson, gamma or constant, not {self.arrival!r}")
        for k in ("rate", "burstiness"):
            v = getattr(self, k)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{k} must be positive, got {v}")
        # branches and fork_* are checked though no request may use them: a 0 there is a mistake
        for k in ("num", "turns", "branches", "fork_stages", "fork_branches"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be at least 1, got {getattr(self, k)}")
        for k in ("prefix_groups", "prefix_len", "seed"):
            if getattr(self, k) < 0:
                raise ValueError(f"{k} must be 0 or more, got {getattr(self, k)}")
        # a NaN or infinite gap puts later turns outside every window of the run: they would vanish
        if not (self.turn_gap_s >= 0 and math.isfinite(self.turn_gap_s)):
            raise ValueError(f"turn_gap_s must be a finite number of seconds, 0 or more, got {self.turn_gap_s}")
        if self.prefix_groups and self.prefix_len < 1:
            raise ValueError("prefix_groups needs prefix_len >= 1")
        for k in self.LEAST:
            if getattr(self, k):
                try:
                    self.dist(k)
                except ValueError as e:
                    raise ValueError(f"{k}: {e}") from None
            elif k not in ("fork_output", "join_output"):  # those two default to `output`
                raise ValueError(f"{k} needs a length distribution")
        if not (0 <= self.branch_fraction <= 1 and 0 <= self.fork_fraction <= 1
                and self.branch_fraction + self.fork_fraction <= 1):
            raise ValueError("branch_fraction and fork_fraction must lie in [0, 1], and so must their sum")

    def dist(self, key: str) -> LengthDist:
        """The length distribution option `key` names (fork_output and
        join_output: `output`'s where not given), with its shortest length."""
        return LengthDist.parse(getattr(self, key) or self.output, self.LEAST[key])

    @classmethod
    def parse(cls, spec: str) -> "SyntheticConfig":
        """'synthetic:key=value,...' (or just the part after the colon). A key given
        twice is refused (which one was meant?), and so is a value of the wrong type."""
        body = spec[len("synthetic:"):] if spec.startswith("synthetic:") else spec
        kw = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for item in filter(None, body.split(",")):
            if "=" not in item:
                raise ValueError(f"bad synthetic option {item!r} (want key=value)")
            k, v = item.split("=", 1)
            k = k.strip()
            if k not in types:
                raise ValueError(f"unknown synthetic option {k!r}; known: {', '.join(types)}")
            if k in kw:
                raise ValueError(f"synthetic option {k!r} is given twice")
            t = types[k]
            try:
                kw[k] = int(v) if t in ("int", int) else float(v) if t in ("float", float) else v
            except ValueError:
                want = "an integer" if t in ("int", int) else "a number"
                raise ValueError(f"synthetic option {k} must be {want}, got {v!r}") from None
        return cls(**kw)


def _gaps(cfg: SyntheticConfig, rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    if cfg.arrival == "constant":
        return np.full(n, 1.0 / rate)
    if cfg.arrival == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    k = cfg.burstiness  # gamma(shape k, scale 1/(k rate)): mean 1/rate, CV 1/sqrt(k)
    return rng.gamma(k, 1.0 / (k * rate), size=n)


def _fork_stages(cfg: SyntheticConfig, rng: np.random.Generator, tag: str) -> tuple:
    suffix_d, branch_d, join_d = cfg.dist("fork_suffix"), cfg.dist("fork_output"), cfg.dist("join_output")
    stages = []
    for j in range(cfg.fork_stages):
        suf = suffix_d.sample(rng, cfg.fork_branches)
        out = branch_d.sample(rng, cfg.fork_branches)
        stages.append(tuple((Segment(f"{tag}:s{j}:b{b}", int(suf[b])), int(out[b]))
                            for b in range(cfg.fork_branches)))
        stages.append(((None, int(join_d.sample(rng, 1)[0])),))
    return tuple(stages)


def generate(cfg: SyntheticConfig) -> list[RequestSpec]:
    rng = np.random.default_rng(cfg.seed)
    tag = f"syn{cfg.seed}"
    in_d, out_d = cfg.dist("input"), cfg.dist("output")
    n_conv = math.ceil(cfg.num / cfg.turns)
    # conversations start at rate/turns so that all turns together arrive at ~rate
    starts = np.cumsum(_gaps(cfg, rng, n_conv, cfg.rate / cfg.turns))
    specs: list[RequestSpec] = []
    for c in range(n_conv):
        group = int(rng.integers(cfg.prefix_groups)) if cfg.prefix_groups else None
        history: list[Segment] = []
        if group is not None:
            history.append(Segment(f"{tag}:sys{group}", cfg.prefix_len))
        t = float(starts[c])
        user = in_d.sample(rng, cfg.turns)
        answer = out_d.sample(rng, cfg.turns)
        for k in range(cfg.turns):
            if k:
                t += float(rng.exponential(cfg.turn_gap_s))
            history.append(Segment(f"{tag}:c{c}:u{k}", int(user[k])))
            n, stages = 1, ()
            if cfg.branch_fraction or cfg.fork_fraction:
                u = rng.random()
                if u < cfg.branch_fraction:
                    n = cfg.branches
                elif u < cfg.branch_fraction + cfg.fork_fraction:
                    stages = _fork_stages(cfg, rng, f"{tag}:c{c}:t{k}")
            meta = {"conversation": c, "turn": k}
            if group is not None:
                meta["group"] = group
            specs.append(RequestSpec(f"{tag}-c{c}-t{k}", t, int(answer[k]), tuple(history), n=n, meta=meta,
                                     stages=stages))
            history.append(Segment(f"{tag}:c{c}:a{k}", int(answer[k])))
    specs.sort(key=lambda s: s.arrival_s)
    return specs[: cfg.num]
