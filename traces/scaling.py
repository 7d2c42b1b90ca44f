"""Fitting a trace to the machine that serves it: a window, a request limit,
an arrival-rate multiplier, length scales and caps. Every run writes what was
applied (`ScalingInfo.to_dict()`), so a figure is never read without its scaling.

Order: window (on the trace's own clock) -> limit -> time scale -> lengths.
Arrivals are then counted from the window's start. A prompt + output over
`max_context` loses output tokens first; a prompt that alone overflows keeps
its start (shared prefixes survive) and one output token.
Lengths scale segment by segment, each segment rounded on its own, so blocks
that a trace shares stay identical after scaling (a 512-token Mooncake block
becomes the same 26-token block everywhere at 0.05).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from stepserve.traces.request_spec import RequestSpec, Segment


@dataclass
class Scaling:
    time_scale: float = 1.0  # arrival-rate multiplier: 2.0 = arrivals twice as fast
    rate: float | None = None  # target mean arrival rate (req/s); sets time_scale from the trace's own rate
    input_scale: float = 1.0
    output_scale: float = 1.0
    max_input: int | None = None  # prompt cap (keeps the start, so shared prefixes survive)
    max_output: int | None = None
    max_context: int | None = None  # prompt + output cap (the server's context length)
    start_s: float = 0.0  # window start: seconds after the trace's first request (trace clock)
    duration_s: float | None = None  # window length, trace seconds
    limit: int | None = None  # at most this many requests (the first ones of the window)

    def __post_init__(self):
        for name in ("time_scale", "input_scale", "output_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")


@dataclass
class ScalingInfo:
    applied: dict  # the Scaling, with time_scale resolved
    trace_requests: int  # in the whole trace
    window_requests: int  # in the window, before the limit
    requests: int  # after the limit
    native_rate_rps: float | None  # the window's own mean arrival rate
    rate_rps: float | None  # after time scaling
    clipped_input: int = 0  # prompts cut by max_input / max_context
    clipped_output: int = 0  # outputs cut by max_output / max_context
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def mean_rate(specs: list[RequestSpec]) -> float | None:
    """(n - 1) / span: the rate estimate that does not depend on where the window cuts."""
    if len(specs) < 2:
        return None
    span = specs[-1].arrival_s - specs[0].arrival_s
    return (len(specs) - 1) / span if span > 0 else None


def _scale_len(n: int, s: float) -> int:
    # a scaled length keeps at least one token; an empty one (a fork branch with no suffix) stays empty
    return n if s == 1.0 or n == 0 else max(1, round(n * s))


def _cap(n: int, cap: int | None) -> int:
    return n if cap is None else min(n, cap)


def _truncate(segments: tuple[Segment, ...], cap: int) -> tuple[Segment, ...]:
    out = []
    left = cap
    for seg in segments:
        if left <= 0:
            break
        out.append(seg if seg.length <= left else Segment(seg.key, left))
        left -= seg.length
    return tuple(out)


def apply_scaling(specs: list[RequestSpec], sc: Scaling) -> tuple[list[RequestSpec], ScalingInfo]:
    specs = sorted(specs, key=lambda s: s.arrival_s)
    total = len(specs)
    t0 = (specs[0].arrival_s if specs else 0.0) + sc.start_s
    end = t0 + sc.duration_s if sc.duration_s is not None else float("inf")
    win = [s for s in specs if t0 <= s.arrival_s < end]
    if specs and not win:  # a run of nothing reports nothing: the window is the user's to mend
        raise ValueError(f"no request of the trace falls in the window (--start {sc.start_s:g} s"
                         + (f", --duration {sc.duration_s:g} s" if sc.duration_s is not None else "")
                         + f"; the trace spans {specs[-1].arrival_s - specs[0].arrival_s:g} s)")
    n_window = len(win)
    if sc.limit is not None:
        win = win[: sc.limit]
    native = mean_rate(win)
    time_scale = sc.time_scale
    notes = []
    if sc.rate is not None:
        if native is None:
            notes.append("rate ignored: fewer than two requests or no time span")
        else:
            time_scale = sc.rate / native
    out = []
    clipped_in = clipped_out = 0
    for s in win:
        segs = tuple(Segment(g.key, _scale_len(g.length, sc.input_scale)) for g in s.segments)
        plen = sum(g.length for g in segs)
        olen = _scale_len(s.output_len, sc.output_scale)
        if sc.max_output is not None and olen > sc.max_output:
            olen, clipped_out = sc.max_output, clipped_out + 1
        cap_in = sc.max_input
        if sc.max_context is not None:
            if plen + olen > sc.max_context:
                # Keep the prompt whole where possible (its prefix is what the
                # cache sees); cut the output first, then the prompt.
                new_olen = max(1, min(olen, sc.max_context - plen))
                if new_olen < olen:
                    olen, clipped_out = new_olen, clipped_out + 1
            room = sc.max_context - olen
            cap_in = room if cap_in is None else min(cap_in, room)
        if cap_in is not None and plen > cap_in:
            segs = _truncate(segs, max(1, cap_in))
            clipped_in += 1
        stages = s.stages
        if stages:  # a fork/join request's later stages scale like its prompt and output (not clipped to the
            # context: one whose stages cannot fit is refused, as the engine would)
            stages = tuple(tuple((None if g is None else Segment(g.key, _scale_len(g.length, sc.input_scale)),
                                  _cap(_scale_len(o, sc.output_scale), sc.max_output)) for g, o in st)
                           for st in stages)
        out.append(dataclasses.replace(
            s, arrival_s=(s.arrival_s - t0) / time_scale, segments=segs, output_len=olen, meta=dict(s.meta),
            stages=stages))
    applied = dataclasses.asdict(sc)
    applied["time_scale"] = time_scale
    info = ScalingInfo(
        applied=applied,
        trace_requests=total,
        window_requests=n_window,
        requests=len(out),
        native_rate_rps=native,
        rate_rps=native * time_scale if native is not None else None,
        clipped_input=clipped_in,
        clipped_output=clipped_out,
        notes=notes,
    )
    return out, info
