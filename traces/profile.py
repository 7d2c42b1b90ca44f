"""`stepserve profile`: time engine steps over a sweep of batch shapes, fit the
step-latency model, report its error on held-out points, write a profile JSON.

Three scenarios, each run on the real engine (its own `StepRecord`s, captured
with the plan's per-row shape by an observing step policy):
  decode   B sequences decoding at context L, for B x L over the grid
  prefill  one prompt prefilled in chunks of C tokens (chunk index j: start j*C)
  mixed    B sequences decoding at L while a C-token prompt prefills alongside
A point is one measured shape: a (B, L) decode, a (B, L, C) mixed step, or one
chunk index j of a C-token prefill. Each round walks the grid once, one
scenario run per grid entry: a decode or mixed run measures its one point, a
prefill run one point per chunk of its prompt, so a round has fewer runs than
points. Each visit of a point runs `--warmup` untimed steps then `--repeats`
timed ones, and the rounds add samples to the same points (never new points).
A point's time is the median of all its timed steps over the rounds, its
features the median of theirs: the machine is shared, and interleaving the
repeats spreads a stretch of outside load thinly over many points, where the
median shrugs it off.

Held-out error: K-fold cross-validation over points (K = 1/`--holdout`): each
point is predicted by a fit that never saw it; the profile gives the median and
p90 absolute percentage error over points, and over every raw step inside them.
Every form's errors are recorded, so the chosen form is justified by residuals.

`--url` runs the sweep through a live server instead (traces/profile_http.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from stepserve.scheduler.latency_model import (
    FORMS, PROFILE_KIND, LinearLatencyModel, ServingCosts, StepFeatures, plan_features, term_names,
)
from stepserve.scheduler.plan import FoldRule
from stepserve.traces.options import open_fraction
from stepserve.traces.progress import log_line, progress_bar
from stepserve.traces.report import write_report

# the forms a sweep's few dozen points can fit (the segmented one needs a step log)
POINT_FORMS = ("taper", "linear", "linear+attn")


def add_profile_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("profile sweep")
    g.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    g.add_argument("--context-lens", default="16,64,128,256,448")
    g.add_argument("--chunk-sizes", default="32,128,256", help="prefill chunk sizes (tokens)")
    g.add_argument("--mixed-batch-sizes", default="4,16", help="decode batch sizes of the mixed scenario")
    g.add_argument("--repeats", type=int, default=2, help="timed steps per point and round")
    g.add_argument("--rounds", type=int, default=6, help="passes over the whole grid (interleaved repeats)")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps per point")
    g.add_argument("--holdout", type=open_fraction, default=0.25,
                   help="share of points held out per fold (0.25: 4-fold cross-validation)")
    g.add_argument("--target", default="wall_s", choices=["wall_s", "forward_s"],
                   help="which step time to model (wall_s: the whole step, what a request waits for)")
    g.add_argument("--form", default="auto", choices=["auto", *FORMS],
                   help="model form; auto = linear, or linear+attn when it is > 0.5 pt better held out; from a "
                        "step log (--url --step-log), the simplest of linear, linear+attn and segmented whose "
                        "held-out error in time is within 0.5%% of the least (segmented only a step log's "
                        "thousands of exact steps can fit)")
    g.add_argument("--sweep-seed", type=int, default=0)
    g.add_argument("--out", default="profile.json")
    g.add_argument("--url", default=None,
                   help="profile a running server over HTTP instead (client-observed step times; its KV pool, "
                        "batch limits and schedule are read off its /get_server_info, or, where it has no such "
                        "route, the engine flags must describe it: --max-batched-tokens, --kv-memory-gb, ...)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--step-log", default=None, metavar="PATH",
                   help="with --url: the server's step log (`stepserve serve --step-log PATH`, same machine); the "
                        "step model and serving costs are then measured from the engine's own steps")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (the per-round lines remain)")


class StepRecorder:
    """Observing policy: (plan features, StepRecord) for every step."""

    name = "profile-recorder"

    def __init__(self):
        self.samples: list[tuple[StepFeatures, object]] = []
        self.on = False

    def plan(self, plan, view):
        return plan

    def observe(self, plan, record) -> None:
        if self.on:
            self.samples.append((plan_features(plan), record))


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


class Sweep:
    """Runs the scenarios; every point accumulates raw steps over all rounds."""

    def __init__(self, engine, recorder: StepRecorder, warmup: int, repeats: int, target: str, seed: int):
        self.eng = engine
        self.rec = recorder
        self.warmup = warmup
        self.repeats = repeats
        self.target = target
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.raw: dict[tuple, list[tuple[StepFeatures, float]]] = {}
        self.keys: dict[tuple, dict] = {}

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]

    def _params(self, max_tokens: int):
        from stepserve.engine.sampling_params import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def _long(self, ctx: int) -> int:
        # decode rows must not finish while the others are still prefilling or being timed
        return self.eng.max_model_len - ctx - 1

    def _reset(self) -> None:
        eng = self.eng
        for rid in list(eng.requests):
            eng.abort_request(rid)
        tree = eng.scheduler.kv.tree
        tree.evict(tree.evictable_size())  # every point computes its own prefill

    def _add(self, key: dict, raw: list) -> None:
        k = tuple(sorted(key.items()))
        self.keys[k] = key
        self.raw.setdefault(k, []).extend(raw)

    def _timed(self, key: dict, step_fn, n: int) -> None:
        for _ in range(self.warmup):
            step_fn()
        self.rec.samples.clear()
        self.rec.on = True
        for _ in range(n):
            step_fn()
        self.rec.on = False
        self._add(key, [(f, getattr(r, self.target)) for f, r in self.rec.samples])

    def _settle(self) -> None:
        sched = self.eng.scheduler
        while sched.waiting or any(s.pending > 1 for s in sched.running):
            self.eng.step()

    def decode(self, bs: int, ctx: int) -> None:
        eng = self.eng
        for _ in range(bs):
            eng.add_request(self._prompt(ctx), self._params(self._long(ctx)))
        self._settle()
        self._timed({"scenario": "decode", "batch": bs, "context": ctx}, eng.step, self.repeats)
        self._reset()

    def prefill(self, chunk: int, prompt_len: int, max_batched: int) -> None:
        """One point per chunk index j, timed over `repeats` prompts."""
        eng = self.eng
        sched = eng.scheduler
        sched.cfg.max_batched_tokens = chunk
        try:
            for rep in range(self.warmup + self.repeats):
                eng.add_request(self._prompt(prompt_len), self._params(1))
                self.rec.samples.clear()
                self.rec.on = rep >= self.warmup
                while eng.has_unfinished():
                    eng.step()
                self.rec.on = False
                for j, (f, r) in enumerate(self.rec.samples):
                    key = {"scenario": "prefill", "chunk": chunk, "prompt": prompt_len, "index": j}
                    self._add(key, [(f, getattr(r, self.target))])
                self._reset()
        finally:
            sched.cfg.max_batched_tokens = max_batched

    def mixed(self, bs: int, ctx: int, chunk: int, max_batched: int) -> None:
        eng = self.eng
        sched = eng.scheduler
        for _ in range(bs):
            eng.add_request(self._prompt(ctx), self._params(self._long(ctx)))
        self._settle()
        sched.cfg.max_batched_tokens = bs + chunk  # room for the decode rows plus one chunk
        try:
            def step():
                eng.add_request(self._prompt(chunk), self._params(1))
                eng.step()

            self._timed({"scenario": "mixed", "batch": bs, "context": ctx, "chunk": chunk}, step, self.repeats)
        finally:
            sched.cfg.max_batched_tokens = max_batched
        self._reset()

    def points(self) -> list[dict]:
        """One point per key: median time, median features, over every round's raw steps."""
        out = []
        for k, raw in self.raw.items():
            if not raw:
                continue
            fs = [f for f, _ in raw]
            med = statistics.median
            feats = StepFeatures(
                rows=round(med([f.rows for f in fs])),
                context_tokens=round(med([f.context_tokens for f in fs])),
                new_tokens=round(med([f.new_tokens for f in fs])),
                prefill_pairs=float(med([f.prefill_pairs for f in fs])),
                extend_rows=round(med([f.extend_rows for f in fs])),
                chunk_rows=round(med([f.chunk_rows for f in fs])),
                layered=med([f.layered for f in fs]) >= 0.5,
            )
            out.append({**self.keys[k], "features": feats, "time": med([t for _, t in raw]), "raw": raw})
        return out


def describe_points(points: list[dict]) -> str:
    """What `points` holds, e.g. '62 points (35 decode, 9 prefill, 18 mixed)
    from 744 timed samples': a point is one measured shape (its time the
    median of its samples), a sample one timed step of the engine sweep, or
    for the HTTP sweep one decode stream's mean time per token or one request's
    TTFT. The per-round lines and the final line both say it this way."""
    scenarios: dict[str, int] = {}
    for p in points:
        scenarios[p["scenario"]] = scenarios.get(p["scenario"], 0) + 1
    by_scenario = ", ".join(f"{n} {name}" for name, n in scenarios.items())
    samples = sum(len(p["raw"]) for p in points)
    return f"{len(points)} points ({by_scenario}) from {samples} timed samples"


class SweepProgress:
    """Progress of a sweep, for the engine and the HTTP sweep alike: a bar over
    its scenario runs (rounds x runs per round), and after each round a line
    with the points measured so far (`describe_points` of `sweep.points()`)."""

    def __init__(self, sweep, rounds: int, runs_per_round: int, enabled: bool):
        self.sweep = sweep
        self.rounds = rounds
        self.runs_per_round = runs_per_round
        self.bar = progress_bar(rounds * runs_per_round, "profile", "run", enabled)
        self.t0 = time.perf_counter()

    def run_done(self) -> None:
        self.bar.update(1)

    def round_done(self, rnd: int) -> None:
        log_line(f"round {rnd + 1}/{self.rounds} ({time.perf_counter() - self.t0:.0f} s): "
                 f"{self.runs_per_round} scenario runs; so far {describe_points(self.sweep.points())}")

    def close(self) -> None:
        self.bar.close()


def folds(n: int, holdout: float, seed: int) -> list[list[int]]:
    """K-fold split of point indices, K = round(1 / holdout): every point is
    held out exactly once, so the held-out error uses all the data."""
    k = max(2, min(n, round(1 / holdout))) if holdout > 0 else 1
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    return [idx[i::k] for i in range(k)]


# Serving-cost columns of a client-timed fit: (point key, ServingCosts field).
# A point's value in the column is p[key] (True counts 1).
COST_COLUMNS = (("from_request", "delivery_s"), ("streams", "stream_s"), ("from_idle", "wake_s"))


@dataclass
class Fitted:
    """A step model, plus -- for sweeps timed by a client -- the serving costs
    in the points timed from a request's start (TTFT points, `from_request`):
    the request's way in and its first token's way out (stored as
    `ServingCosts.delivery_s`), growing with the streams the front end is
    delivering alongside (`streams`: `stream_s` each), and for those sent to an
    engine that sat idle (`from_idle`) the engine's wake-up (`wake_s`)."""

    model: LinearLatencyModel
    costs: ServingCosts = ServingCosts()

    def predict_point(self, p: dict) -> float:
        t = sum(w * self.model.predict_features(f) for w, f in terms(p))
        return t + sum(float(p.get(key) or 0) * getattr(self.costs, name) for key, name in COST_COLUMNS)


def terms(p: dict) -> list[tuple[float, StepFeatures]]:
    """What a point's time is made of: by default one step (its features); a
    TTFT measured under load is, e.g., half a decode step of waiting plus the
    mixed step that prefills it (weights and steps in `p["terms"]`)."""
    return p.get("terms") or [(1.0, p["features"])]


def fit_points(points: list[dict], form: str) -> Fitted:
    """Relative least squares over each point's (weighted) step terms, plus one
    column per serving cost the points hold (`COST_COLUMNS`): with TTFT points,
    the per-request overhead; with TTFTs sent beside different numbers of
    streams, the cost per stream; with TTFTs sent to an idle engine as well as
    to a busy one, the wake-up. A column the points cannot tell from the
    others (all TTFTs from idle, say) is left out, and its cost stays 0."""
    base = []
    for p in points:
        v = np.zeros(len(FORMS[form]))
        for w, f in terms(p):
            v += w * np.asarray(f.vector(form))
        base.append(v)
    X = np.array(base)
    used = []
    for key, name in COST_COLUMNS:
        col = np.array([float(p.get(key) or 0) for p in points])
        if not col.any():
            continue
        trial = np.column_stack([X, col])
        if np.linalg.matrix_rank(trial) > np.linalg.matrix_rank(X):
            X = trial
            used.append(name)
    y = np.array([p["time"] for p in points])
    w = 1.0 / np.maximum(y, 1e-9)
    coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    k = len(FORMS[form])
    costs = ServingCosts(**{name: max(0.0, float(c)) for name, c in zip(used, coef[k:])})
    return Fitted(LinearLatencyModel(form, [float(c) for c in coef[:k]]), costs)


def _ape_summary(errs: list[float]) -> dict:
    if not errs:
        return {"n": 0, "median_ape": None, "p90_ape": None, "mean_ape": None}
    errs = sorted(errs)
    return {"n": len(errs), "median_ape": statistics.median(errs),
            "p90_ape": errs[min(len(errs) - 1, int(0.9 * (len(errs) - 1) + 0.5))], "mean_ape": sum(errs) / len(errs)}


def fit_and_evaluate(points: list[dict], holdout: float, seed: int, form: str = "auto") -> dict:
    """Cross-validates every form (each point predicted by a fit that did not
    see it); picks one; refits it on all points. Errors are reported per point
    and per raw step inside the held-out points."""
    parts = folds(len(points), holdout, seed)
    forms = {}
    for name in POINT_FORMS:
        pt_err: list[float] = []
        raw_err: list[float] = []
        for test in parts if len(parts) > 1 else [[]]:
            held = set(test)
            train = [p for i, p in enumerate(points) if i not in held] or points
            m = fit_points(train, name)
            for i in test or range(len(points)):
                p = points[i]
                pred = m.predict_point(p)
                pt_err.append(abs(pred - p["time"]) / p["time"])
                raw_err.extend(abs(pred - t) / t for _, t in p["raw"] if t > 0)
        full = fit_points(points, name)
        train_err = [abs(full.predict_point(p) - p["time"]) / p["time"] for p in points]
        forms[name] = {"fit": full, "model": full.model,
                       "errors": {"points": _ape_summary(pt_err), "steps": _ape_summary(raw_err),
                                  "train_points": _ape_summary(train_err)}}
    if form == "auto":
        # Only forms with a new_tokens term can price a prefill chunk, which the
        # simulator needs; among them the linear form wins unless the
        # attention term beats it by more than half a point.
        form = "linear"
        if forms["linear+attn"]["errors"]["points"]["median_ape"] < forms["linear"]["errors"]["points"]["median_ape"] - 0.005:
            form = "linear+attn"
    return {"form": form, "fit": forms[form]["fit"], "model": forms[form]["model"], "heldout": forms[form]["errors"],
            "forms": forms, "num_train": len(points) - (len(parts[0]) if len(parts) > 1 else 0),
            "num_test": len(parts[0]) if len(parts) > 1 else 0, "folds": len(parts)}


def run_profile(args) -> int:
    if args.url:
        return _run_http(args)
    if args.step_log:
        raise SystemExit("stepserve profile: --step-log names the server's step log, to calibrate from; it needs "
                         "--url (the in-process sweep reads its engine's steps directly)")
    if args.form not in ("auto", *POINT_FORMS):
        raise SystemExit(f"stepserve profile: --form {args.form} is fitted from a server's step log "
                         "(--url URL --step-log PATH); a sweep's points fit " + ", ".join(POINT_FORMS))
    import torch

    from stepserve.cli import engine_config
    from stepserve.engine.defaults import DEFAULT_MODEL
    from stepserve.engine.engine import Engine

    cfg = engine_config(args)
    recorder = StepRecorder()
    cfg.policies = [recorder]
    bss, ctxs, chunks = _ints(args.batch_sizes), _ints(args.context_lens), _ints(args.chunk_sizes)
    cfg.max_running = max(cfg.max_running, max(bss))
    eng = Engine(cfg)
    max_len = eng.max_model_len
    # room for the decode rows to keep decoding while the batch's later prompts prefill
    ctxs = sorted({min(c, max_len // 2) for c in ctxs if c >= 1})
    sweep = Sweep(eng, recorder, args.warmup, args.repeats, args.target, args.sweep_seed)
    max_batched = eng.scheduler.cfg.max_batched_tokens
    t0 = time.perf_counter()
    # untimed warm-up of the whole path (lazy init, native kernel build)
    sweep.decode(2, 8)
    sweep.raw.clear()
    plan: list[tuple] = []
    for bs in bss:
        for ctx in ctxs:
            if bs * eng.max_model_len <= eng.kv_capacity:
                plan.append(("decode", bs, ctx))
    for c in chunks:
        if c <= max_batched:
            plan.append(("prefill", c, min(max_len - 2, 2 * c + c // 2)))  # two full chunks and a partial one
    for bs in _ints(args.mixed_batch_sizes):
        for ctx in ctxs[:: max(1, len(ctxs) // 2)]:
            for c in chunks:
                if bs + c <= max_batched and (bs + args.repeats + args.warmup + 1) * eng.max_model_len <= eng.kv_capacity:
                    plan.append(("mixed", bs, ctx, c))
    # Rounds: every point is measured once per round, so a stretch of machine
    # load (the machine is shared) lands on many points a little, not on one a lot.
    progress = SweepProgress(sweep, args.rounds, len(plan), not args.no_progress)
    for rnd in range(args.rounds):
        for item in plan:
            if item[0] == "decode":
                sweep.decode(item[1], item[2])
            elif item[0] == "prefill":
                sweep.prefill(item[1], item[2], max_batched)
            else:
                sweep.mixed(item[1], item[2], item[3], max_batched)
            progress.run_done()
        progress.round_done(rnd)
    progress.close()
    model_dir = cfg.model or DEFAULT_MODEL
    return _write_profile(
        args, sweep.points(), source="measured", target=args.target,
        device={"kind": str(eng.device), "cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        model={"path": model_dir, "dtype": str(eng.dtype), "vocab_size": eng.model_config.vocab_size},
        engine={"kv_slots": eng.kv_capacity, "max_running": args.max_running, "max_batched_tokens": max_batched,
                "max_context": max_len, "vocab_size": eng.model_config.vocab_size,
                "overlap_schedule": eng.overlap_schedule, **eng.runner.fold_rule.to_dict()},
        sweep={"batch_sizes": bss, "context_lens": ctxs, "chunk_sizes": chunks, "repeats": args.repeats,
               "warmup": args.warmup, "rounds": args.rounds, "seconds": time.perf_counter() - t0},
    )


def step_noise(points: list[dict]) -> dict:
    """How single steps scatter around their point's median: 101 quantiles of
    raw / median over every raw step. The simulator can draw from them (seeded)
    so that its latency tails are as wide as the machine's, not a deterministic
    function of the batch shape."""
    from stepserve.traces.calibrate import clipped_quantiles

    ratios = [t / p["time"] for p in points if p["time"] > 0 for _, t in p["raw"]]
    if not ratios:
        return {}
    # the extremes are artefacts (a stream read late, two events at once): clipped to p1..p99
    return {"kind": "raw/median quantiles, clipped to p1..p99", "n": len(ratios), "quantiles": clipped_quantiles(ratios)}


def _server_engine_sizing(args, max_len: int) -> tuple[int, str]:
    """The KV pool a server started with these engine flags has (the engine's formula)."""
    if args.kv_slots is not None:
        return args.kv_slots, "--kv-slots"
    import torch

    from stepserve.engine.config import ModelConfig
    from stepserve.engine.defaults import DEFAULT_MODEL
    from stepserve.engine.loader import resolve_dtype

    dev = torch.device("cpu" if args.device == "auto" and not torch.cuda.is_available() else
                       ("cuda" if args.device == "auto" else args.device))
    mc = ModelConfig.from_pretrained(args.model or DEFAULT_MODEL)
    per_tok = mc.kv_bytes_per_token(resolve_dtype(args.dtype, mc, dev))
    if args.kv_memory_gb is None and dev.type == "cuda":
        raise SystemExit("stepserve profile: on a GPU the server's KV pool depends on its free memory; "
                         "give --kv-slots or --kv-memory-gb as the server was started with")
    gb = 1.0 if args.kv_memory_gb is None else args.kv_memory_gb
    slots = min(int(gb * (1 << 30) // per_tok), args.max_running * max_len)
    return slots, f"--kv-memory-gb {gb} of the model's KV ({per_tok} bytes/token)"


def served_sizing(args, max_len: int) -> dict:
    """The served engine's KV pool, batch limits and schedule: as the server
    reports them (`GET /get_server_info`, under SGLang's names, which an
    SGLang server answers too), else as the engine flags given here say
    (they must then describe the server; its overlap schedule is unknown)."""
    from stepserve.traces.replay import served_engine

    got = served_engine(args.url, args.api_key)
    if got is None:
        slots, how = _server_engine_sizing(args, max_len)
        return {"kv_slots": slots, "kv_slots_from": how, "max_running": args.max_running,
                "max_batched_tokens": args.max_batched_tokens, "overlap_schedule": None,
                "fold_tokens": None, "fold_pairs": None}

    def reported(key, flag_value, least=1):
        v = got.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= least else flag_value

    sizing = {"kv_slots": reported("max_total_num_tokens", None), "kv_slots_from": "the server's /get_server_info",
              "max_running": reported("max_running_requests", args.max_running),
              "max_batched_tokens": reported("chunked_prefill_size", args.max_batched_tokens),
              "overlap_schedule": (not got["disable_overlap_schedule"]
                                   if isinstance(got.get("disable_overlap_schedule"), bool) else None),
              # which prompt chunks the server folds into decode-shaped queries (`FoldRule`; None: not told)
              "fold_tokens": reported("fold_tokens", None, least=0),
              "fold_pairs": reported("fold_pairs", None, least=0)}
    if sizing["kv_slots"] is None:
        sizing["kv_slots"], sizing["kv_slots_from"] = _server_engine_sizing(args, max_len)
    for key, flag, value in (("max_running", "--max-running", args.max_running),
                             ("max_batched_tokens", "--max-batched-tokens", args.max_batched_tokens)):
        if sizing[key] != value:
            print(f"profile: the server runs {key} = {sizing[key]} ({flag} here: {value}); profiling the server's",
                  file=sys.stderr)
    return sizing


def _run_http(args) -> int:
    import asyncio

    from stepserve.traces.profile_http import HTTPSweep, count_batches, fit_host_work, host_work, run_http_sweep
    from stepserve.traces.replay import ReplayConfig, Replayer, server_info

    if args.form not in ("auto", *POINT_FORMS) and not args.step_log:
        raise SystemExit(f"stepserve profile: --form {args.form} is fitted from the server's step log: give "
                         "--step-log PATH")
    info = server_info(args.url, args.api_key)
    max_len = info.max_model_len or args.max_model_len or 2048
    vocab = info.vocab_size or 256
    bss, ctxs = _ints(args.batch_sizes), _ints(args.context_lens)
    ctxs = sorted({min(c, max_len // 2) for c in ctxs if c >= 1})
    sizing = served_sizing(args, max_len)
    max_batched = sizing["max_batched_tokens"]
    # and two long prompts (half and nearly all of the context): long prompts and
    # long cached prefixes put the attention term's cost there, beyond the grid
    plens = sorted({c for c in _ints(args.chunk_sizes) + ctxs + [max_len // 2, max_len - 2]
                    if c <= max_batched and c < max_len})
    plan: list[tuple] = [("decode", b, c) for b in bss for c in ctxs] + [("prefill", p) for p in plens]
    plan += [("mixed", b, c, p) for b in _ints(args.mixed_batch_sizes) for c in ctxs[:: max(1, len(ctxs) // 2)]
             for p in _ints(args.chunk_sizes) if b + p <= max_batched]
    sweep = HTTPSweep(args.warmup, args.repeats, max_batched, args.sweep_seed, max_len=max_len,
                      fold=FoldRule(sizing["fold_tokens"] or 0, sizing["fold_pairs"] or 0))
    progress = SweepProgress(sweep, args.rounds, len(plan), not args.no_progress)
    t0 = time.perf_counter()
    epoch0 = time.time()

    async def go():
        replayer = Replayer(ReplayConfig(url=args.url, api_key=args.api_key, warmup=0, progress=False), info)
        got = await run_http_sweep(sweep, replayer, plan, args.rounds, progress)
        end = time.time()
        try:  # the host's work per request and per token, outside the engine (after the sweep's window)
            host = await host_work(replayer, seed=args.sweep_seed, max_len=max_len)
        finally:
            await replayer.close()
        return got, host, end

    # the step model is fitted on the sweep's steps alone, which were chosen to cover its terms: the host
    # passes' (on a 2-core EPYC 3,617 of 13,767 busy steps, 3,060 of them of 2 rows, 7 times the sweep's own,
    # at 3-4% more time for their shape beside a front end streaming each token) outweighed those in the fit,
    # and its held-out error per step was 15.4% with them, 14.2% without
    points, host, sweep_end = asyncio.run(go())
    untimed = sweep.decode_streams["untimed"]
    if untimed:
        total = untimed + sweep.decode_streams["timed"]
        print(f"profile: {untimed} of {total} decode streams could not be timed: the server sent their tokens "
              "merged into a few events (its front end was short of CPU); the decode points have fewer samples"
              + ("" if args.step_log else ", and without --step-log the step model rests on them"), file=sys.stderr)
    calibration = None
    if args.step_log:
        from stepserve.engine.step_log import SETTLE_S, read_step_log
        from stepserve.traces.calibrate import calibrate

        lines = read_step_log(args.step_log, settle_s=SETTLE_S)
        calibration = calibrate(lines, sweep.probes, epoch0, sweep_end, args.form)
        if host is not None:  # the output batches of each host pass, from the engine's own iterations
            count_batches(host["passes"], lines)
            host.update(fit_host_work(host["passes"]))
    return _write_profile(
        args, points, source="measured-http", target="client-observed step time",
        device={"kind": "server at " + args.url, "platform": platform.platform()},
        model={"served": info.model, "vocab_size": info.vocab_size},
        engine={**sizing, "max_context": max_len, "vocab_size": vocab},
        sweep={"batch_sizes": bss, "context_lens": ctxs, "prefill_lens": plens, "repeats": args.repeats,
               "warmup": args.warmup, "rounds": args.rounds, "seconds": time.perf_counter() - t0,
               "decode_streams": dict(sweep.decode_streams)},
        calibration=calibration, host=host,
    )


def _write_profile(args, points: list[dict], *, source: str, target: str, device: dict, model: dict, engine: dict,
                   sweep: dict, calibration: dict | None = None, host: dict | None = None) -> int:
    from stepserve.traces.report import command_line, versions

    if len(points) < 5:
        raise SystemExit(f"only {len(points)} points measured: widen the sweep")
    fit = fit_and_evaluate(points, args.holdout, args.sweep_seed, args.form if args.form in POINT_FORMS else "auto")
    fitted: Fitted = fit["fit"]
    model_fit: LinearLatencyModel = fitted.model
    noise = step_noise(points)
    extra = {}
    if calibration is not None:
        # the step log measured what the client-timed fit infers: use it, and
        # check it against the client's own points (which it never saw)
        client = fitted
        fitted = Fitted(calibration["model"], calibration["costs"])
        model_fit = fitted.model
        noise = calibration["noise"]
        target = "engine loop iteration (server step log)"
        errs = [abs(fitted.predict_point(p) - p["time"]) / p["time"] for p in points]
        extra = {"calibration": {
            "method": "server step log (traces/calibrate.py)", "step_log": args.step_log,
            "samples": calibration["samples"], **calibration["fit"],
            "client_points": _ape_summary(errs),
            "client_fit": {"latency": client.model.to_dict(), "costs": client.costs.to_dict()},
        }}
    if host is not None:  # measured apart from the sweep (`profile_http.host_work`)
        fitted = Fitted(fitted.model, dataclasses.replace(
            fitted.costs, host_request_s=host["request_s"], host_token_s=host["token_s"],
            host_prompt_token_s=host["prompt_token_s"], host_batch_s=host["batch_s"]))
        extra["host_work"] = host
    if fitted.costs != ServingCosts():
        engine = {**engine, **fitted.costs.to_dict()}
    h = fit["heldout"]
    name = model.get("path") or model.get("served") or "model"
    profile = {
        "kind": PROFILE_KIND,
        "version": 1,
        "name": f"{platform.node() or 'local'}:{str(name).rstrip('/').split('/')[-1]}",
        "source": source,
        "command": command_line(),
        "versions": versions(),
        "device": device,
        "model": model,
        "target": target,
        "latency": model_fit.to_dict(),
        "heldout": {"method": f"{fit['folds']}-fold cross-validation over points", "points": h["points"],
                    "steps": h["steps"], "num_train_points": fit["num_train"], "num_test_points": fit["num_test"],
                    "holdout": args.holdout, "seed": args.sweep_seed},
        "forms": {n: {"coef": f["model"].coef, "heldout_points": f["errors"]["points"],
                      "heldout_steps": f["errors"]["steps"], "train_points": f["errors"]["train_points"]}
                  for n, f in fit["forms"].items()},
        "engine": engine,
        "noise": noise,
        **extra,
        "sweep": sweep,
        "points": [{k: v for k, v in p.items() if k not in ("features", "raw", "terms")}
                   | {"rows": p["features"].rows, "context_tokens": p["features"].context_tokens,
                      "new_tokens": p["features"].new_tokens, "prefill_pairs": p["features"].prefill_pairs,
                      "predicted": fitted.predict_point(p),
                      "raw_times": [t for _, t in p["raw"]]}
                   for p in points],
    }
    write_report(profile, args.out)
    print(f"{describe_points(points)} over {args.rounds} rounds; form {model_fit.form}: "
          + ", ".join(f"{n}={c:.4g}" for n, c in zip(term_names(model_fit.form, model_fit.knots), model_fit.coef))
          + "".join(f"; {name} {getattr(fitted.costs, name) * 1e3:.3f} ms" for name in ServingCosts.SCALARS
                    if getattr(fitted.costs, name))
          + (f"; wake-up after idling {', '.join(f'{x * 1e3:.0f} ms: {y * 1e3:.1f} ms' for x, y in fitted.costs.wake_curve)}"
             if fitted.costs.wake_curve else "")
          + (f"; decode steps after P prompt tokens: sqrt(P) x ({'; '.join(f'{a * 1e6:.1f} us + {b:.4f} t' for a, b in fitted.costs.cold)})"
             if fitted.costs.cold else ""))
    for n, f in fit["forms"].items():
        e = f["errors"]
        print(f"  {n:12s} held-out median APE {e['points']['median_ape']:.1%} (p90 {e['points']['p90_ape']:.1%}) "
              f"on points, {e['steps']['median_ape']:.1%} (p90 {e['steps']['p90_ape']:.1%}) on raw steps")
    if calibration is not None:
        c = extra["calibration"]
        print(f"  from the step log ({c['busy_steps']} busy steps; used): held-out median APE "
              f"{c['heldout_steps']['median_ape']:.1%} per step; on the client's points "
              f"{c['client_points']['median_ape']:.1%} (p90 {c['client_points']['p90_ape']:.1%})")
    print(f"profile written to {args.out}")
    return 0
