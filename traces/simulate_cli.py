"""`stepserve simulate`: the real scheduler on a virtual clock over a trace."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from stepserve.cli import add_branch_policy_arg
from stepserve.traces.options import (
    add_trace_args, int_at_least, plot_path, positive_int, rates_from_args, scaling_from_args, slo_from_args,
)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    add_trace_args(p)
    add_sim_engine_args(p)
    p.add_argument("--list-profiles", action="store_true", help="list the built-in roofline profiles and exit")


def add_sim_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated engine")
    g.add_argument("--profile", default=None,
                   help="latency profile: a JSON from `stepserve profile`, or a built-in roofline DEVICE[xN]:MODEL "
                        "(e.g. h100:llama3-8b, h100x8:qwen3-32b, a10x8:llama2-70b)")
    add_branch_policy_arg(g)
    g.add_argument("--policy", action="append", default=[],
                   help="another step policy by name (repeatable; applied in the order given, after branch "
                        "admission): noop, branch:SPEC")
    g.add_argument("--max-running", type=positive_int, default=None, help="default: the profile's")
    g.add_argument("--max-batched-tokens", type=positive_int, default=None, help="default: the profile's")
    g.add_argument("--kv-slots", type=positive_int, default=None, help="KV pool in tokens (default: the profile's)")
    g.add_argument("--admission", default="fcfs", choices=["fcfs", "lpm"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--online-refit", action="store_true",
                   help="also run the online latency-model refit as an observer (reports its drift)")
    g.add_argument("--check-every", type=int_at_least(0), default=0,
                   help="KV integrity check every N steps (slow; 0: never)")
    g.add_argument("--no-step-noise", action="store_true",
                   help="predicted step times exactly (default: scattered like the profile's measured steps, seeded)")
    g.add_argument("--no-serving-costs", action="store_true",
                   help="steps only: leave out the profile's request entry, token delivery, wake-up and busy-loop costs")
    g.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"],
                   help="the engine's overlap schedule: each step's host part (a roofline profile's per-step "
                        "overhead) runs beside the device's part of the step before, and its tokens are applied "
                        "after the next step is launched (auto: without speculation, as the profile recorded the "
                        "engine or server it measured; on for a roofline profile, as the engine does on CUDA)")
    add_sim_speculative_args(g)


def add_sim_speculative_args(g) -> None:
    from stepserve.cli import _checked
    from stepserve.scheduler.speculation import PROPOSERS, SpecLengthSpec

    g.add_argument("--speculative", default="none", choices=list(PROPOSERS),
                   help="simulate speculative decoding: draft (a draft model whose steps --draft-profile prices) or "
                        "ngram (a proposer that costs nothing); drafts are accepted as --acceptance says")
    g.add_argument("--spec-length", type=_checked(SpecLengthSpec.parse), default=None, metavar="SPEC",
                   help="none, fixed:K or adaptive[:kmax=K,per_row=0|1,settle=N,probe=N] (the default with --speculative)")
    g.add_argument("--draft-profile", default=None, metavar="PROFILE",
                   help="the draft model's step latency: a built-in roofline name (e.g. h100:llama3.2-1b) or a "
                        "`stepserve profile` JSON")
    g.add_argument("--acceptance", type=_checked(parse_acceptance), default=None, metavar="A[,A2,...]",
                   help="the probability that draft position j is accepted when every draft before it was, per "
                        "position (the last repeats), e.g. 0.8 or 0.8,0.75,0.7")
    g.add_argument("--acceptance-spread", type=_checked(parse_spread), default=None, metavar="S",
                   help="how much requests differ in acceptance: each request's rates are --acceptance's shifted "
                        "in log-odds by a normal draw of this standard deviation (default 0: all alike; about 1.2 "
                        "measured on the embedded draft and target)")


def parse_spread(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 10.0:
        raise ValueError(f"--acceptance-spread needs a log-odds standard deviation in [0, 10], got {text!r}")
    return v


def parse_acceptance(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--acceptance needs numbers in [0, 1], got {text!r}") from None
    if not rates or any(not 0.0 <= a <= 1.0 for a in rates):
        raise ValueError(f"--acceptance needs numbers in [0, 1], got {text!r}")
    return rates


def speculation(args):
    """(the speculation-length spec or None, the draft's latency model or None) of the flags."""
    from stepserve.scheduler.latency_model import load_profile

    if args.speculative == "none":
        for flag, v in (("--spec-length", args.spec_length), ("--draft-profile", args.draft_profile),
                        ("--acceptance", args.acceptance), ("--acceptance-spread", args.acceptance_spread)):
            if v is not None:
                raise SystemExit(f"stepserve: {flag} needs --speculative draft or ngram")
        return None, None
    if args.acceptance is None:
        raise SystemExit("stepserve: --speculative needs --acceptance (how often the target accepts a draft)")
    draft = None
    if args.speculative == "draft":
        if args.draft_profile is None:
            raise SystemExit("stepserve: --speculative draft needs --draft-profile (the draft model's step latency)")
        draft = load_profile(args.draft_profile).model
    elif args.draft_profile is not None:
        raise SystemExit("stepserve: --draft-profile is for --speculative draft")
    return args.spec_length or "adaptive", draft


def make_policies(args, latency_model, slo, costs=None) -> list:
    """The simulated engine's step policies: branch admission, then those
    named by --policy (`scheduler.policies.make_policy`), all given the
    profile's step model, the serving costs the simulation runs with and the
    run's SLOs."""
    from stepserve.scheduler.policies import branch_admission_policy, make_policy

    from stepserve.scheduler.policies import speculation_policy

    kw = dict(latency_model=latency_model, slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s, costs=costs)
    try:
        branch = branch_admission_policy(args.branch_policy, **kw)
        named = [make_policy(name, **kw) for name in args.policy]
    except ValueError as e:
        raise SystemExit(f"stepserve: {e}") from None
    spec_length, _ = speculation(args)
    spec = speculation_policy(spec_length, latency_model=latency_model) if spec_length else None
    # the engine's order: branch admission, then speculation length, then the rest
    return ([branch] if branch is not None else []) + ([spec] if spec is not None else []) + named


def run_simulate(args) -> int:
    if args.list_profiles:
        from stepserve.scheduler.roofline import builtin_names

        print("\n".join(builtin_names()))
        return 0
    if not args.trace or not args.profile:
        raise SystemExit("stepserve simulate: --trace and --profile are required")
    from stepserve.scheduler.latency_model import load_profile
    from stepserve.traces.load import load_trace, save_trace
    from stepserve.traces.report import finish_runs, format_summary
    from stepserve.traces.scaling import apply_scaling
    from stepserve.traces.simulator import DEFAULT_MAX_CONTEXT

    prof = load_profile(args.profile)
    cfg = sim_config(args, prof)
    trace = load_trace(args.trace)
    slo = slo_from_args(args)
    rates = rates_from_args(args)
    runs = []
    for k, rate in enumerate(rates):
        sc = dataclasses.replace(scaling_from_args(args, cfg.max_context or DEFAULT_MAX_CONTEXT), rate=rate)
        specs, sinfo = apply_scaling(trace.specs, sc)
        if args.save_trace and k == 0:
            save_trace(specs, args.save_trace)
        report = simulate_one(args, prof, cfg, trace, slo, specs, sinfo)
        runs.append(report)
        if len(rates) > 1:
            print(format_summary(report), file=sys.stderr)
    finish_runs(runs, rates, args.out, plot_path(args))
    return 0


def sim_config(args, prof):
    """The simulated engine: the profile's sizing and serving costs, the flags' overrides."""
    from stepserve.traces.simulator import SimConfig

    cfg = SimConfig.from_profile(
        prof.engine, max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
        kv_slots=args.kv_slots, vocab_size=args.vocab_size, seed=args.seed, admission=args.admission,
        prefix_caching=not args.no_prefix_caching, check_every=args.check_every,
        noise=None if args.no_step_noise else prof.data.get("noise"), noise_seed=args.seed,
        acceptance=parse_acceptance(args.acceptance) if args.acceptance else None,
        acceptance_spread=parse_spread(args.acceptance_spread) if args.acceptance_spread is not None else None,
    )
    if args.no_serving_costs:
        from stepserve.scheduler.latency_model import ServingCosts

        cfg = dataclasses.replace(cfg, **ServingCosts().to_dict())  # every serving cost at 0
    overlap = getattr(args, "overlap_schedule", "auto")
    if overlap == "on" and args.speculative != "none":
        raise SystemExit("stepserve: --overlap-schedule on cannot be combined with --speculative (as in the engine)")
    cfg = dataclasses.replace(cfg, overlap_schedule=overlap == "on" or (
        overlap == "auto" and args.speculative == "none" and profile_overlaps(prof)))
    if cfg.kv_slots is None:
        raise SystemExit("the profile records no KV pool size: pass --kv-slots")
    return cfg


def profile_overlaps(prof) -> bool:
    """Whether the engine a profile models runs the overlap schedule: as the
    profile recorded it of the engine or server it measured; a roofline
    profile models the engine on CUDA, which overlaps."""
    recorded = prof.engine.get("overlap_schedule")
    return recorded if isinstance(recorded, bool) else prof.source == "roofline"


def simulate_one(args, prof, cfg, trace, slo, specs, sinfo) -> dict:
    """The report of one simulation of `specs` (already scaled)."""
    from stepserve.scheduler.latency_model import LinearLatencyModel, OnlineLatencyModel
    from stepserve.traces.progress import progress_bar
    from stepserve.traces.report import build_report
    from stepserve.traces.simulator import Simulator

    policies = make_policies(args, prof.model, slo, cfg.serving())
    online = None
    if args.online_refit:
        base = prof.model if isinstance(prof.model, LinearLatencyModel) else None
        online = OnlineLatencyModel(base=base)
        policies.append(online)
    sim = Simulator(prof.model, cfg, policies, draft_model=speculation(args)[1])
    if online is not None:
        online.clock = sim.clock  # refit periods in virtual seconds
    bar = progress_bar(len(specs), "simulate", "req", not args.no_progress)
    last = [0]

    def progress(n_arrived, t):
        if n_arrived != last[0]:
            bar.update(n_arrived - last[0])
            last[0] = n_arrived

    res = sim.run(specs, progress=progress, max_concurrency=args.max_concurrency)
    bar.close()
    extra = {
        "simulator": res.stats,
        "profile": {"name": prof.name, "source": prof.source, "engine": prof.engine,
                    "notes": prof.data.get("notes", [])},
    }
    if online is not None:
        extra["online_refit"] = {"refits": online.num_refits,
                                 "model": online.current().to_dict() if online.current() else None}
    print(f"simulated {len(specs)} requests, {res.stats['steps']} steps, {res.duration_s:.1f} s of virtual time "
          f"in {res.stats['cpu_s']:.1f} s CPU", file=sys.stderr)
    return build_report(
        mode="simulate", records=res.records, duration_s=res.duration_s, slo=slo, trace=trace.info(),
        scaling=sinfo.to_dict(),
        config={"profile": args.profile, "profile_source": prof.source, "branch_policy": args.branch_policy,
                "policies": args.policy, "speculative": args.speculative,
                "spec_length": str(speculation(args)[0]) if args.speculative != "none" else None,
                "draft_profile": args.draft_profile,
                "max_concurrency": args.max_concurrency,
                **dataclasses.asdict(cfg)},
        itl_values=res.itl_s, extra=extra, with_itl=False,
    )
