"""Per-request latency records and the figures every benchmark reports.

Shared by the replay client and the simulator, so their reports have one shape.

Definitions (DESIGN, "Figures every benchmark reports"):
- TTFT: first token time - the time the request was sent (replay) or arrived (simulator).
- E2E: last token time - that same start.
- TPOT = (E2E - TTFT) / (output tokens - n), per request: the time per token
  the request received after its first delivery (which carries each of its n
  branches' first token), over all its branches. For n = 1 that is the usual
  (E2E - TTFT) / (output tokens - 1); a request whose n branches decode side by
  side gets n tokens a step, so its TPOT is the step time over n, and one that
  decodes one branch a step has the step time. This is the request-level rate
  that branch admission trades (TAPER's goodput counts requests meeting it);
  a client reading one choice's stream sees that choice's own gaps, in ITL.
  Requests with no token after the first delivery have no TPOT.
- Victim TPOT: the TPOT of serial requests (n = 1, one stage) that ran at the
  same time as some branching request (n > 1, or a fork/join request): what
  branches cost their neighbours. A fork/join request's first delivery is its
  first stage's one token; its TPOT counts every later token of every stage.
- ITL: the gaps between successive token deliveries of one branch, pooled over
  all requests (a delivery may carry several tokens when a client reads late).
- Percentiles: linear interpolation between order statistics (numpy's default);
  mean, p50, p90, p99 over requests (ITL: over gaps).
- Throughput: completed requests and their output tokens per second of the
  run's duration (t = 0, the window start, to the last completion).
- SLO attainment: the share of *all* requests (failed ones count as misses)
  that completed and met every given SLO; a TPOT SLO is met vacuously by a
  single-token answer (it has no TPOT). Without any SLO, attainment is the
  completion rate.
- Goodput: requests per second (and their output tokens per second) that met
  every SLO, over the same duration.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

import numpy as np


@dataclass
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float  # scheduled arrival, seconds from the run's start
    prompt_tokens: int
    n: int = 1  # branches of the first stage (its first delivery carries one token of each)
    stages: int = 1  # a fork/join request's stages (more than one: it branches later)
    start_s: float | None = None  # actually sent (replay) / entered the engine (simulator)
    first_token_s: float | None = None
    end_s: float | None = None
    output_tokens: int = 0  # all branches together
    branch_tokens: int = 0  # tokens of the longest branch
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache, when known
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    server_id: str | None = None  # the server's id of the request (a streamed chunk's `id`), where known
    # (simulator) when the engine loop took the request in, and when the step that made its first token ended:
    # with start_s and first_token_s, a TTFT's way in, its time in the engine and its way out (`validate`
    # reads the same of a real run from the server's step log)
    engine_in_s: float | None = None
    first_out_s: float | None = None

    @property
    def branching(self) -> bool:
        return self.n > 1 or self.stages > 1

    @property
    def completed(self) -> bool:
        return self.error is None and self.end_s is not None and self.first_token_s is not None

    @property
    def ttft(self) -> float | None:
        return self.first_token_s - self.start_s if self.completed else None

    @property
    def e2e(self) -> float | None:
        return self.end_s - self.start_s if self.completed else None

    @property
    def tpot(self) -> float | None:
        n = max(self.n, 1)
        if not self.completed or self.output_tokens <= n:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - n)

    def meets(self, slo: SLO) -> bool:
        if not self.completed:
            return False
        if slo.ttft_s is not None and self.ttft > slo.ttft_s:
            return False
        if slo.e2e_s is not None and self.e2e > slo.e2e_s:
            return False
        tpot = self.tpot
        if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
            return False
        return True

    def to_dict(self, with_itl: bool = True) -> dict:
        d = {
            "request_id": self.request_id, "arrival_s": self.arrival_s, "start_s": self.start_s,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens, "n": self.n,
            "stages": self.stages,
            "cached_tokens": self.cached_tokens, "ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e,
            "first_token_s": self.first_token_s, "end_s": self.end_s, "error": self.error,
        }
        if self.server_id is not None:
            d["server_id"] = self.server_id
        if self.engine_in_s is not None:
            d["engine_in_s"] = self.engine_in_s
        if self.first_out_s is not None:
            d["first_out_s"] = self.first_out_s
        if with_itl:
            d["itl_s"] = list(self.itl_s)
        return d


def percentiles(values, ps=(50, 90, 99)) -> dict:
    """{mean, p50, p90, p99}; all None when there are no values."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": None, **{f"p{p}": None for p in ps}}
    q = np.percentile(a, ps)
    return {"mean": float(a.mean()), **{f"p{p}": float(v) for p, v in zip(ps, q)}}


def victim_tpots(done: list[RequestRecord]) -> list[float] | None:
    """TPOTs of the serial requests whose lifetime overlapped some branching
    request's; None when the run has no branching or no serial requests."""
    branchy = sorted((r.start_s, r.end_s) for r in done if r.branching)
    serial = [r for r in done if not r.branching]
    if not branchy or not serial:
        return None
    starts = np.array([a for a, _ in branchy])
    # the latest end among branching requests started at or before each start
    ends = np.maximum.accumulate(np.array([b for _, b in branchy]))
    out = []
    for r in serial:
        i = int(np.searchsorted(starts, r.end_s, side="right")) - 1  # the branching requests started by r's end
        if i >= 0 and ends[i] > r.start_s and r.tpot is not None:
            out.append(r.tpot)
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO, itl_values=None) -> dict:
    """The figures of one run. `itl_values` overrides the pooled per-record ITLs
    (the simulator keeps its gaps in one array rather than per request)."""
    done = [r for r in records if r.completed]
    good = [r for r in done if r.meets(slo)]
    # a run that completed nothing has no duration; its rates are 0, not NaN (JSON has no NaN)
    dur = duration_s if duration_s > 0 else math.inf
    out_tokens = sum(r.output_tokens for r in done)
    good_tokens = sum(r.output_tokens for r in good)
    if itl_values is None:
        itl_values = [g for r in done for g in r.itl_s]
    n = len(records)
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    prompt_done = sum(r.prompt_tokens for r in done)
    return {
        "num_requests": n,
        "num_completed": len(done),
        "num_failed": n - len(done),
        "duration_s": duration_s,
        "throughput_rps": len(done) / dur,
        "output_tps": out_tokens / dur,
        "input_tps": prompt_done / dur,
        "goodput_rps": len(good) / dur,
        "goodput_tps": good_tokens / dur,
        "slo_attainment": len(good) / n if n else None,
        "slo": slo.to_dict(),
        "total_output_tokens": out_tokens,
        "total_input_tokens": prompt_done,
        "prefix_hit_rate": (sum(cached) / prompt_done) if cached and prompt_done else None,
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles([t for t in (r.tpot for r in done) if t is not None]),
        "itl_s": percentiles(itl_values),
        "e2e_s": percentiles([r.e2e for r in done]),
        **_victims(done),
    }


SLO_FIGURES = ("goodput_rps", "goodput_tps", "slo_attainment", "slo")  # what `summarize` takes from the SLO


def rejudged(report: dict, slo: SLO) -> dict:
    """A stored report's SLO figures under `slo`, from its own per-request
    records: the same run judged by other SLOs. (Its SLO's own figures
    come back as they are.)"""
    if report.get("slo") == slo.to_dict():
        return report
    keys = [f.name for f in fields(RequestRecord) if f.name != "itl_s"]  # (the ITLs: no SLO judges them)
    records = [RequestRecord(**{k: d[k] for k in keys if k in d}) for d in report["requests"]]
    figures = summarize(records, report["duration_s"], slo, itl_values=())
    return {**report, **{k: figures[k] for k in SLO_FIGURES}}


def _victims(done: list[RequestRecord]) -> dict:
    """num_victims is None when the run had no mix of branching and serial requests."""
    v = victim_tpots(done)
    return {"num_victims": None if v is None else len(v), "victim_tpot_s": percentiles(v or [])}


def records_from_report(report: dict) -> list[RequestRecord] | None:
    """The request records a report was summarised from (its `requests`, as
    `RequestRecord.to_dict` wrote them), or None when it kept none."""
    recs = report.get("requests")
    if not recs:
        return None
    names = {f.name for f in RequestRecord.__dataclass_fields__.values()}
    return [RequestRecord(**{k: v for k, v in r.items() if k in names}) for r in recs]


def rescore(report: dict, slo: SLO) -> dict:
    """`report` with its SLO figures (goodput, attainment and the SLO itself)
    recomputed at `slo` from its request records, every other figure as it
    was: which requests met an SLO changes nothing in how the run went, except
    under a policy that reads the SLO (TAPER's branch admission), where the
    result is what the run would have scored, not what a run at `slo` would
    do. Raises ValueError for a report without request records."""
    records = records_from_report(report)
    if records is None:
        raise ValueError("the report has no request records to score again (a sweep: give one rate's report)")
    fresh = summarize(records, report["duration_s"], slo, itl_values=[])
    keys = ("goodput_rps", "goodput_tps", "slo_attainment", "slo")
    return {**report, **{k: fresh[k] for k in keys}}


FIGURE_KEYS = (
    "num_requests", "num_completed", "duration_s", "throughput_rps", "output_tps", "goodput_rps",
    "goodput_tps", "slo_attainment", "ttft_s", "tpot_s", "itl_s", "e2e_s",
)
