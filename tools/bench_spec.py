"""Speculative decoding on this machine: output tokens per second over batch
sizes x draft lengths, for a proposer, in one run.

For each batch size B, B requests run to completion together (greedy, EOS
ignored, `--output-len` tokens each) under every configuration: no
speculation, fixed:K for each K of `--fixed`, and adaptive. One engine per
configuration lives through the whole run (adaptive learns its acceptance and
step costs online, as in a server). Repeats are interleaved (every
configuration once, then again, each pass starting one configuration later)
and the median is reported; a warm-up pass
per batch size is not counted. Each pass decodes prompts of its own (the
same ones under every configuration), in batches of B one after another, at
least `--pass-requests` of them: a greedy request decodes the same text each
time, so with one set of prompts the small batches would measure the
acceptance of one or two texts, at the positions each length happens to draft
at; and with one request a pass at batch 1, passes differed by 20% in one
length's speed over another with the text alone.

Two rates per configuration: full batch, the output tokens of the steps in
which all B requests decode over those steps' time (what a batch of B
sustains, as in a server that keeps it full), and end to end, over the
whole generate call. They differ by the ragged finish: with speculation
the requests of a batch finish at different steps, and the last steps run
a few rows at nearly the cost of a full batch.

Workloads (prompts are the embedded model's own samples, so the text is in
its distribution; no corpus is needed):
  text        a 24-token sample as the prompt: the draft model's case
  repetitive  a 48-token sample given twice and the start of a third time:
              the continuation copies, the n-gram proposer's case

    python tools/bench_spec.py --proposer draft --workload text --out spec-draft.json
    python tools/bench_spec.py --proposer ngram --workload repetitive --out spec-ngram.json

With --simulate PROFILE the same sweep runs in the simulator instead: the real
scheduler and the same policies on PROFILE's step model (a roofline name such
as h100:llama3-8b, or a profile file), the draft model's steps priced by
--draft-profile, accepted runs drawn from --acceptance, --prompt-len-token
prompts; repeats differ in their seeds.

    python tools/bench_spec.py --simulate h100:llama3-8b --draft-profile h100:llama3.2-1b \
        --acceptance 0.8 --batch-sizes 1,2,4,8,16,32,64,128,256 --output-len 256

With --acceptance-spread-of-engine N it measures instead how much requests
differ in acceptance on this engine (the draft model on the text workload):
N requests decode greedily with fixed:4 drafts; each request's rate per
position is its accepted drafts over the positions it tried (each accepted
one and the first rejected), and the spread is the standard deviation of
the requests' own log-odds: the square root of the covariance, across
requests, of the log-odds of each request's first and second half (the
counts' noise does not carry from one half to the other), the value for
`stepserve simulate --acceptance-spread`.

    python tools/bench_spec.py --acceptance-spread-of-engine 128 --output-len 256
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

from stepserve import LLM, SamplingParams


def make_prompts(llm: LLM, n: int, workload: str, seed: int) -> list[list[int]]:
    eos = llm.tokenizer.eos_token_id or 0
    length = 24 if workload == "text" else 48
    params = [SamplingParams(temperature=1.0, max_tokens=length, seed=seed + i, ignore_eos=True) for i in range(n)]
    samples = [o.outputs[0].token_ids for o in llm.generate([[eos]] * n, params)]
    if workload == "text":
        return [[eos] + s for s in samples]
    return [[eos] + s + s + s[:8] for s in samples]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proposer", choices=["draft", "ngram"], default="draft")
    p.add_argument("--workload", choices=["text", "repetitive"], default="text")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--fixed", default="1,2,4,8", help="the fixed draft lengths to compare")
    p.add_argument("--also", action="append", default=[], metavar="SPEC",
                   help="another speculation length to compare (repeatable), e.g. adaptive:per_row=0")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pass-requests", type=int, default=8,
                   help="each pass decodes at least this many requests, in batches of B one after another")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--acceptance-spread-of-engine", type=int, default=0, metavar="N",
                   help="measure how much N requests differ in acceptance on this engine, and exit")
    g = p.add_argument_group("in the simulator")
    g.add_argument("--simulate", default=None, metavar="PROFILE",
                   help="run the sweep in the simulator on this target profile (roofline name or file)")
    g.add_argument("--draft-profile", default=None, metavar="PROFILE", help="the draft model's step latency")
    g.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"],
                   help="plain decoding (none) under the engine's overlap schedule (auto: on a roofline profile, "
                        "as the engine on CUDA; speculation cannot overlap)")
    g.add_argument("--acceptance", default="0.8", metavar="A[,A2,...]",
                   help="per-position acceptance rates of the simulated drafts")
    g.add_argument("--acceptance-spread", type=float, default=0.0, metavar="S",
                   help="the requests' spread in acceptance: log-odds standard deviation (stepserve simulate's)")
    g.add_argument("--prompt-len", type=int, default=1024, help="simulated prompt tokens per request")
    args = p.parse_args(argv)
    if args.acceptance_spread_of_engine:
        return acceptance_spread_of_engine(args)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    configs = ["none"] + [f"fixed:{k}" for k in args.fixed.split(",")] + ["adaptive"] + args.also
    if args.simulate:
        rows = simulated_sweep(args, sizes, configs)
        return report(args, rows, configs)
    engines = {c: LLM(speculative="none" if c == "none" else args.proposer, spec_length=None if c == "none" else c)
               for c in configs}
    passes = args.repeats + 1  # a warm-up pass and the repeats, each with prompts of its own
    # sampled by an engine of their own: one that sampled them holds them in its prefix cache, and would
    # skip their prefill that the others pay
    per_pass = {b: b * max(-(-args.pass_requests // b), 1) for b in sizes}
    prompts_all = make_prompts(LLM(), max(per_pass.values()) * passes, args.workload, args.seed)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for b in sizes:
        tput = {c: [] for c in configs}
        full = {c: [] for c in configs}
        spec = {}
        for rep in range(passes):
            m = per_pass[b]
            prompts = prompts_all[rep * m:(rep + 1) * m]
            # each pass starts one configuration later, so that none always runs first or after the same one
            # (in a fixed order, plain decoding ran first in every pass and read 10-20% slow at batches 8-64)
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for c in order:
                llm = engines[c]
                before = llm.engine.stats().policy
                core = llm.engine.core
                first = core.step_id  # (by step id: the record list is trimmed as it grows)
                t = time.perf_counter()
                outs = [o for i in range(0, m, b) for o in llm.generate(prompts[i:i + b], sp)]
                dt = time.perf_counter() - t
                after = llm.engine.stats().policy
                if rep == 0:
                    continue  # warm-up
                tput[c].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                # the steps with all b rows in the batch (before the first request finishes): the rate a
                # batch of b sustains, without the ragged finish (verify rows finish at different steps)
                full[c].append(full_batch_rate([r for r in core.records if r.step >= first], b))
                if c != "none":
                    count_spec(spec.setdefault(c, {"draft": 0, "accepted": 0, "rows": 0, "k": {}}), before, after)
        rows.append(batch_row(b, tput, full, spec))
        rows[-1]["adaptive_state"] = adaptive_state(engines["adaptive"].engine.stats().policy)
    return report(args, rows, configs)


def acceptance_spread_of_engine(args) -> int:
    import math

    import numpy as np

    n = args.acceptance_spread_of_engine
    llm = LLM(speculative="draft", spec_length="fixed:4", max_running=min(n, 64))
    prompts = make_prompts(llm, n, "text", args.seed)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    reqs = [llm.engine.add_request(p, sp) for p in prompts]
    half: dict[int, tuple[int, int]] = {}  # request -> its counts when half its output was out
    while llm.engine.has_unfinished():
        llm.engine.step()
        for i, r in enumerate(reqs):
            s = r.seqs[0]
            if i not in half and s.num_output >= args.output_len // 2:
                half[i] = (s.spec_tried, s.spec_accepted)
    tried = np.array([r.seqs[0].spec_tried for r in reqs], dtype=np.float64)
    acc = np.array([r.seqs[0].spec_accepted for r in reqs], dtype=np.float64)
    t1 = np.array([half[i][0] for i in range(n)], dtype=np.float64)
    a1 = np.array([half[i][1] for i in range(n)], dtype=np.float64)

    def logit(a, t):
        r = (a + 0.5) / (t + 1.0)
        return np.log(r / (1.0 - r))

    whole = logit(acc, tried)
    first, second = logit(a1, t1), logit(acc - a1, tried - t1)
    # A request's own rate persists from its first half into its second, while the noise of its counts does
    # not: the covariance of the halves' log-odds across requests is the spread's variance. (Taking the counts'
    # noise out of the whole-request variance as binomial, as if tries were independent, overstates it: a
    # request's hits come in runs.)
    cov = float(np.cov(first, second)[0, 1])
    spread = math.sqrt(max(cov, 0.0))
    pct = np.percentile((acc + 0.5) / (tried + 1.0), [5, 25, 50, 75, 95])
    out = {"requests": n, "output_len": args.output_len, "pooled_rate": float(acc.sum() / tried.sum()),
           "mean_tries": float(tried.mean()), "rate_percentiles_5_25_50_75_95": [round(float(x), 3) for x in pct],
           "logit_sd": float(whole.std()), "halves_correlation": float(np.corrcoef(first, second)[0, 1]),
           "acceptance_spread": spread, "machine": platform.processor() or platform.machine(),
           "command": " ".join(sys.argv)}
    print(f"{n} requests, {out['mean_tries']:.0f} positions tried each: pooled rate {out['pooled_rate']:.3f}; "
          f"per request (5/25/50/75/95%) {', '.join(f'{x:.3f}' for x in pct)}; log-odds sd {out['logit_sd']:.3f}; "
          f"halves correlate {out['halves_correlation']:.2f}, so the requests' own spread is {spread:.3f} "
          f"(--acceptance-spread)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def full_batch_rate(records, b: int) -> float:
    """Output tokens per second of the decode steps with all b requests in
    the batch (before the first request finishes; no prefill chunk in them)."""
    steps = [r for r in records if r.rows == b and r.chunk_rows == 0]
    return sum(r.rows + r.accepted_tokens for r in steps) / sum(r.wall_s for r in steps)


def count_spec(d: dict, before: dict, after: dict) -> None:
    """Adds the drafted/accepted tokens, verify rows and k histogram between two policy stats to `d`."""
    d["draft"] += after["spec_draft_tokens"] - before.get("spec_draft_tokens", 0)
    acc = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
    d["accepted"] += acc
    d["rows"] += (after["spec_emitted_tokens"] - before.get("spec_emitted_tokens", 0)) - acc
    for k, n in after["spec_k_steps"].items():
        d["k"][k] = d["k"].get(k, 0) + n - before.get("spec_k_steps", {}).get(k, 0)


def batch_row(b: int, tput: dict, full: dict, spec: dict) -> dict:
    row = {"batch": b, "tok_s": {c: statistics.median(v) for c, v in tput.items()},
           "full_batch_tok_s": {c: statistics.median(v) for c, v in full.items()},
           "runs": tput, "full_batch_runs": full,
           "accepted_per_row": {c: d["accepted"] / d["rows"] if d["rows"] else 0.0 for c, d in spec.items()},
           "adaptive_k_steps": {k: n for k, n in sorted(spec["adaptive"]["k"].items(), key=lambda kv: int(kv[0]))
                                if n}}
    print(json.dumps({"batch": b, **{c: round(v, 1) for c, v in row["tok_s"].items()},
                      "full_batch": {c: round(v, 1) for c, v in row["full_batch_tok_s"].items()},
                      "adaptive_k": row["adaptive_k_steps"]}), file=sys.stderr, flush=True)
    return row


def simulated_sweep(args, sizes, configs) -> list[dict]:
    """The sweep in the simulator: per configuration one simulated engine whose
    policies live through the whole run, as the real sweep's engines do; per
    batch size, b requests sent at once (a closed batch), a warm-up pass and
    `--repeats` passes with different seeds."""
    import dataclasses

    from stepserve.scheduler.latency_model import load_profile
    from stepserve.scheduler.policies import speculation_policy
    from stepserve.traces.request_spec import RequestSpec, Segment
    from stepserve.traces.simulate_cli import parse_acceptance
    from stepserve.traces.simulator import SimConfig, Simulator

    if args.proposer == "draft" and args.draft_profile is None:
        raise SystemExit("bench_spec: --simulate with the draft proposer needs --draft-profile")
    prof = load_profile(args.simulate)
    draft = load_profile(args.draft_profile).model if args.proposer == "draft" else None
    base = SimConfig.from_profile(prof.engine, noise=prof.data.get("noise"), acceptance=parse_acceptance(args.acceptance),
                                  acceptance_spread=args.acceptance_spread, max_running=max(max(sizes), 1))
    # plain decoding under the engine's overlap schedule (`simulate --overlap-schedule`; auto: on a roofline
    # profile, as the engine on CUDA); speculation runs the plain schedule, as in the engine
    overlap = args.overlap_schedule == "on" or (args.overlap_schedule == "auto" and prof.source == "roofline")
    sims = {c: Simulator(prof.model, dataclasses.replace(base, overlap_schedule=overlap) if c == "none" else base,
                         [] if c == "none" else [speculation_policy(c, latency_model=prof.model)], draft_model=draft)
            for c in configs}
    rows = []
    for b in sizes:
        specs = [RequestSpec(f"b{b}-{i}", 0.0, args.output_len, (Segment(f"p{b}-{i}", args.prompt_len),))
                 for i in range(b)]
        tput = {c: [] for c in configs}
        full = {c: [] for c in configs}
        spec = {c: {"draft": 0, "accepted": 0, "rows": 0, "k": {}} for c in configs if c != "none"}
        for rep in range(args.repeats + 1):
            for c, sim in sims.items():
                sim.cfg = dataclasses.replace(sim.cfg, seed=args.seed + rep, noise_seed=args.seed + rep)
                pol = sim.policies[0] if sim.policies else None
                before = pol.stats() if pol else {}
                res = sim.run(specs)
                if rep == 0:
                    continue
                tput[c].append(b * args.output_len / res.duration_s)
                full[c].append(full_batch_rate(sim.core.records, b))
                if pol:
                    count_spec(spec[c], before, pol.stats())
        rows.append(batch_row(b, tput, full, spec))
        rows[-1]["adaptive_state"] = adaptive_state(sims["adaptive"].policies[0].stats())
    return rows


def adaptive_state(stats: dict) -> dict:
    """What the adaptive length priced with at the end of a batch size."""
    return {key: stats[key] for key in ("spec_cost_ratio", "spec_acceptance", "spec_draft_fill", "spec_cost_pairs",
                                        "spec_cost_probes", "spec_row_spread")}


def report(args, rows, configs) -> int:
    print("Full batch (steps with all B requests decoding), output tok/s:")
    print(table(rows, configs, "full_batch_tok_s"))
    print("\nEnd to end (the whole generate call, the ragged finish included), output tok/s:")
    print(table(rows, configs, "tok_s"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"proposer": args.proposer, "workload": args.workload, "output_len": args.output_len,
                       "simulate": args.simulate, "draft_profile": args.draft_profile,
                       "acceptance": args.acceptance if args.simulate else None,
                       "acceptance_spread": args.acceptance_spread if args.simulate else None,
                       "repeats": args.repeats, "machine": platform.processor() or platform.machine(),
                       "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


def table(rows, configs, key: str) -> str:
    fixed = [c for c in configs if c.startswith("fixed")]
    head = ["batch"] + configs + ["adaptive / best fixed", "adaptive / none", "adaptive's k (steps)"]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    for r in rows:
        t = r[key]
        best = max(t[c] for c in fixed)
        cells = [str(r["batch"])]
        for c in configs:
            acc = r["accepted_per_row"].get(c)
            cells.append(f"{t[c]:,.0f}" + (f" ({acc:.2f})" if acc is not None else ""))
        cells += [f"{t['adaptive'] / best:.2f}x", f"{t['adaptive'] / t['none']:.2f}x",
                  ", ".join(f"{k}: {n}" for k, n in r["adaptive_k_steps"].items())]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
