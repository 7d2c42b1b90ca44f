"""`stepserve replay`: replay a trace against a server, or compare reports."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from stepserve.traces.options import (
    add_trace_args, int_at_least, plot_path, positive_float, rates_from_args, scaling_from_args, slo_from_args,
)


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (without /v1)")
    g.add_argument("--served-model", default=None, help="model name to send (default: the server's)")
    g.add_argument("--api-key", default=None)
    g.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed requests before the run")
    g.add_argument("--request-timeout", type=positive_float, default=3600.0, help="seconds a request may take")
    g.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="empty the server's prefix cache before each run (POST /flush_cache, or vLLM's "
                        "/reset_prefix_cache), so that no run finds an earlier run's or invocation's prompts "
                        "cached, as a simulation does not (default: on)")


def add_replay_args(p: argparse.ArgumentParser) -> None:
    add_trace_args(p)
    add_server_args(p)
    p.add_argument("--compare", nargs="+", metavar="REPORT", default=None,
                   help="print these reports side by side and exit (with --slo-ttft/--slo-tpot/--slo-e2e: "
                        "their goodput and SLO attainment scored at those SLOs, from their request records)")


def run_replay(args) -> int:
    if args.compare:
        from stepserve.traces.compare import run_compare

        if args.trace:
            raise SystemExit("stepserve: replay --compare prints saved reports; --trace does not apply to it")

        return run_compare(args.compare, args.plot or ("compare.png" if args.plot == "" else None),
                           slo=slo_from_args(args))
    if not args.trace:
        raise SystemExit("stepserve replay: --trace is required (or --compare A.json B.json ...)")
    from stepserve.traces.load import load_trace, save_trace
    from stepserve.traces.replay import server_info
    from stepserve.traces.report import finish_runs, format_summary
    from stepserve.traces.scaling import apply_scaling

    info = server_info(args.url, args.api_key)
    trace = load_trace(args.trace)
    slo = slo_from_args(args)
    rates = rates_from_args(args)
    runs = []
    for k, rate in enumerate(rates):
        sc = dataclasses.replace(scaling_from_args(args, info.max_model_len), rate=rate)
        specs, sinfo = apply_scaling(trace.specs, sc)
        if args.save_trace and k == 0:
            save_trace(specs, args.save_trace)
        report = replay_one(args, info, trace, slo, specs, sinfo, k)
        runs.append(report)
        if len(rates) > 1:
            print(format_summary(report), file=sys.stderr)
    finish_runs(runs, rates, args.out, plot_path(args))
    return 0


def replay_one(args, info, trace, slo, specs, sinfo, k: int) -> dict:
    """The report of one replay of `specs`, the k-th of a sweep: its own prompt
    seed, and (`--flush-cache`) the server's prefix cache emptied first, so
    that it serves no run the prompts of another, of this sweep or an earlier
    one against the same server."""
    from stepserve.traces.metrics import percentiles
    from stepserve.traces.profile_http import front_end_cpu_s
    from stepserve.traces.replay import ReplayConfig, replay
    from stepserve.traces.report import build_report

    cfg = ReplayConfig(url=args.url, model=args.served_model, api_key=args.api_key, vocab_size=args.vocab_size,
                       seed=args.seed + k, warmup=args.warmup if k == 0 else 0,
                       timeout_s=args.request_timeout, progress=not args.no_progress,
                       max_concurrency=args.max_concurrency, flush_cache=args.flush_cache)
    print(f"replaying {len(specs)} requests at {sinfo.rate_rps or 0:.3f} req/s against {args.url} ...",
          file=sys.stderr)
    fe0, c0 = front_end_cpu_s(args.url), time.process_time()
    records, duration, t0_epoch, flushed = replay(specs, cfg, info)
    c1, fe1 = time.process_time(), front_end_cpu_s(args.url)
    # the host's work beside the engine over the run (with the cache flush before it): the front end's CPU
    # seconds (its /metrics; None where it reports none) and this client's
    host = {"front_end": None if fe0 is None or fe1 is None else fe1 - fe0, "client": c1 - c0}
    lag = [r.start_s - r.arrival_s for r in records if r.start_s is not None]
    return build_report(
        mode="replay", records=records, duration_s=duration, slo=slo, trace=trace.info(),
        scaling=sinfo.to_dict(),
        config={"url": args.url, "model": cfg.model or info.model, "server_max_model_len": info.max_model_len,
                "vocab_size": cfg.vocab_size or info.vocab_size, "prompt_seed": cfg.seed,
                "temperature": cfg.temperature, "ignore_eos": True, "warmup": cfg.warmup,
                "max_concurrency": args.max_concurrency, "cache_flush": flushed},
        extra={"client_lag_s": percentiles(lag), "t0_epoch": t0_epoch, "host_cpu_s": host},
        with_itl=not args.no_itl_records,
    )
