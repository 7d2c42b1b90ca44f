"""Command-line options shared by `replay` and `simulate`: the trace, its
scaling, the SLOs, rate sweeps and the outputs."""

from __future__ import annotations

import argparse
import math

from stepserve.traces.metrics import SLO
from stepserve.traces.scaling import Scaling


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (a time, a rate, a scale)."""
    v = float(text)
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return v


def non_negative_float(text: str) -> float:
    """argparse type: a finite number of at least 0 (an offset)."""
    v = float(text)
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0, not {text}")
    return v


def int_at_least(least: int):
    """argparse type: an integer of at least `least`."""
    def parse(text: str) -> int:
        v = int(text)
        if v < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {v}")
        return v
    parse.__name__ = f"integer of at least {least}"
    return parse


positive_int = int_at_least(1)  # argparse type: an integer of at least 1
positive_int.__name__ = "positive_int"  # (argparse's "invalid positive_int value" as before)


def open_fraction(text: str) -> float:
    """argparse type: a share strictly between 0 and 1."""
    v = float(text)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1, not {text}")
    return v


def add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace")
    g.add_argument("--trace", default=None,
                   help="Azure 2023 CSV, Mooncake JSONL, stepserve JSONL, or synthetic:key=value,... "
                        "(e.g. synthetic:num=200,rate=4,input=uniform:32:128,output=fixed:32,prefix_groups=4,"
                        "prefix_len=64,turns=3,burstiness=0.5,arrival=gamma,branch_fraction=0.2)")
    g.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens")
    g.add_argument("--save-trace", default=None, help="also write the scaled requests as stepserve JSONL here")
    g.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                   help="keep at most N requests in flight: one arriving beyond that is sent when one completes, "
                        "and its latencies count from then (vLLM's benchmark option; with a --rate far above what the "
                        "server sustains, a closed loop at N)")
    g.add_argument("--vocab-size", type=int_at_least(17), default=None,
                   help="prompt token ids come from [16, VOCAB) (default: the server's vocab_size, or the profile's "
                        "model vocabulary; else 256)")

    s = p.add_argument_group("scaling (always written into the report)")
    s.add_argument("--time-scale", type=positive_float, default=1.0, help="arrival-rate multiplier (2 = twice as fast)")
    s.add_argument("--rate", type=positive_float, default=None, help="target mean request rate (req/s); sets the time scale")
    s.add_argument("--rates", default=None, help="comma list of rates to sweep (req/s), e.g. 1,2,4,8")
    s.add_argument("--length-scale", type=positive_float, default=1.0, help="multiplies prompt and output lengths")
    s.add_argument("--input-scale", type=positive_float, default=None, help="prompt lengths only (overrides --length-scale)")
    s.add_argument("--output-scale", type=positive_float, default=None, help="output lengths only (overrides --length-scale)")
    s.add_argument("--max-input", type=positive_int, default=None, help="cap on prompt tokens (keeps the start)")
    s.add_argument("--max-output", type=positive_int, default=None, help="cap on output tokens")
    s.add_argument("--max-context", type=int_at_least(2), default=None,
                   help="cap on prompt + output (default: the server's / the profile's context length)")
    s.add_argument("--start", type=non_negative_float, default=0.0,
                   help="window start, seconds after the trace's first request")
    s.add_argument("--duration", type=positive_float, default=None, help="window length in trace seconds")
    s.add_argument("--limit", type=positive_int, default=None, help="at most this many requests")

    o = p.add_argument_group("SLOs and output")
    o.add_argument("--slo-ttft", type=positive_float, default=None, help="TTFT SLO, seconds")
    o.add_argument("--slo-tpot", type=positive_float, default=None, help="TPOT SLO, seconds")
    o.add_argument("--slo-e2e", type=positive_float, default=None, help="end-to-end latency SLO, seconds")
    o.add_argument("--out", default=None, help="write the JSON report here")
    o.add_argument("--plot", nargs="?", const="", default=None,
                   help="write a PNG (default path: the report's, with .png)")
    o.add_argument("--no-itl-records", action="store_true", help="leave per-request ITL lists out of the report")
    o.add_argument("--no-progress", action="store_true")


def scaling_from_args(args, max_context: int | None = None) -> Scaling:
    ctx = args.max_context
    if max_context is not None:
        ctx = max_context if ctx is None else min(ctx, max_context)
    return Scaling(
        time_scale=args.time_scale,
        rate=args.rate,
        input_scale=args.input_scale if args.input_scale is not None else args.length_scale,
        output_scale=args.output_scale if args.output_scale is not None else args.length_scale,
        max_input=args.max_input,
        max_output=args.max_output,
        max_context=ctx,
        start_s=args.start,
        duration_s=args.duration,
        limit=args.limit,
    )


def slo_from_args(args) -> SLO:
    return SLO(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot, e2e_s=args.slo_e2e)


def rates_from_args(args) -> list[float | None]:
    if args.rates:
        if getattr(args, "rate", None) is not None:
            raise SystemExit("stepserve: give --rate or --rates, not both")
        try:
            rates = sorted(float(x) for x in args.rates.split(",") if x.strip())
        except ValueError:
            rates = []
        if not rates or not all(0 < r < math.inf for r in rates):  # (NaN fails the test too)
            raise SystemExit("stepserve: --rates: give positive finite numbers, e.g. 1,2,4,8")
        return rates
    return [args.rate]


def plot_path(args) -> str | None:
    if args.plot is None:
        return None
    if args.plot:
        return args.plot
    if args.out:
        return args.out.rsplit(".", 1)[0] + ".png"
    return "report.png"
