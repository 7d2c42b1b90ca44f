"""Prometheus metrics, one registry per app (tests run several servers).

Engine-side totals (tokens, finished sequences, prefix-cache counters,
retractions, queue sizes, KV usage) live in the engine; they are read with one
`AsyncEngine.stats` per scrape and exported by a custom collector, so the engine
hot path does no extra work. Step times come from the engine's `records` ring,
pulled on every scrape and by a background task once a second (so the ring's
trimming never drops unseen steps under load). Per-request latencies (TTFT,
ITL, TPOT, E2E) are measured here, from the output deltas as the server sees
them.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from stepserve.engine.engine import EngineStats

log = logging.getLogger("stepserve.server")

P = "stepserve:"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.5, 1.0, 2.0)


# the step policies' counters (`EngineStats.policy`) that are exported, with their kind and help
_POLICY_METRICS = {
    "branch_steps": ("counter", "Steps that had a request with more than one branch decoding"),
    "branch_rows_candidate": ("counter", "Decode rows of requests with several branches, summed over steps"),
    "branch_rows_deferred": ("counter", "Of those, branch rows the branch-admission policy deferred a step"),
    "taper_calibrated": ("gauge", "1 when TAPER has a step-latency model to plan with; 0 while it runs eager"),
    "taper_uncalibrated_steps": ("counter", "Branching steps TAPER ran eager for lack of a calibrated model"),
    "taper_refits": ("counter", "Online refits of TAPER's step-latency model"),
    "taper_plan_seconds": ("counter", "Time spent in TAPER's per-step planning"),
    "taper_planned_steps": ("counter", "Steps TAPER planned with its step-latency model"),
    "taper_predicted_seconds": ("counter", "Of those steps, the step time TAPER predicted for the plans it chose"),
    "taper_measured_seconds": ("counter", "Of those steps, the step time measured"),
    "taper_after_prompt_steps": ("counter", "Of those steps, the first three decode steps after a step with "
                                 "prompt tokens (their caches emptied by its chunk)"),
    "taper_after_prompt_predicted_seconds": ("counter", "Of those, the step time TAPER predicted"),
    "taper_after_prompt_measured_seconds": ("counter", "Of those, the step time measured"),
    "taper_last_slack_seconds": ("gauge", "The batch's SLO slack at TAPER's last plan (negative: a request is "
                                          "late; absent: no deadline counted)"),
    "taper_last_budget_seconds": ("gauge", "The step-time budget of TAPER's last plan"),
    "spec_verify_steps": ("counter", "Steps in which some row decoded speculatively"),
    "spec_draft_tokens": ("counter", "Draft tokens proposed and verified"),
    "spec_accepted_tokens": ("counter", "Of those, draft tokens accepted"),
    "spec_emitted_tokens": ("counter", "Tokens emitted by verify rows (accepted drafts plus one per row)"),
    "spec_mean_accepted_length": ("gauge", "Mean accepted draft tokens per verify row, since start"),
    "spec_last_k": ("gauge", "The draft length the speculation-length policy chose last"),
    "spec_k_steps": ("counter", "Steps by the draft length chosen (label k; 0: plain decoding)"),
    "spec_cost_pairs": ("counter", "Pairs of steps (one at k drafts, one at none) the adaptive length measured"),
    "spec_cost_probes": ("counter", "Probes the adaptive length measured (a step at a draft length next to its "
                                    "choice, timed against the steps at the choice around it)"),
    "spec_row_spread": ("gauge", "How much requests differ in draft acceptance: the weight, in tries, of the "
                                 "spread of their own rates (smaller: they differ more; absent: they look alike)"),
}


def _policy_metrics(stats: dict):
    for key, (kind, doc) in _POLICY_METRICS.items():
        value = stats.get(key.replace("_seconds", "_s"))
        if value is None:
            continue
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        if isinstance(value, dict):  # one sample per label value
            fam = cls(P + key, doc, labels=["k"])
            for label, v in value.items():
                fam.add_metric([str(label)], float(v))
            yield fam
        else:
            yield cls(P + key, doc, value=float(value))


class _EngineCollector:
    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        s = self.metrics.snapshot
        fin = CounterMetricFamily(P + "requests", "Finished sequences (one per choice), by finish reason",
                                  labels=["finished_reason"])
        for reason in sorted(set(s.finished) | {"stop", "length", "abort"}):
            fin.add_metric([reason], s.finished.get(reason, 0))
        yield fin
        ok = CounterMetricFamily(P + "request_success", "Finished sequences by finish reason (vLLM's name for "
                                 "requests)", labels=["finished_reason"])
        for reason in sorted(set(s.finished) | {"stop", "length", "abort"}):
            ok.add_metric([reason], s.finished.get(reason, 0))
        yield ok
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens of requests added to the engine", s.prompt_tokens),
            ("generation_tokens", "Tokens generated", s.generation_tokens),
            ("prefix_cache_queried_tokens", "Prompt tokens looked up in the radix cache", s.prefix_queried_tokens),
            ("prefix_cache_hit_tokens", "Prompt tokens found in the radix cache", s.prefix_hit_tokens),
            ("retractions", "Sequences retracted (KV freed, requeued) for lack of KV slots", s.retractions),
            # vLLM's names for the same counters, so that its dashboards read them
            ("prefix_cache_queries", "Prompt tokens looked up in the radix cache", s.prefix_queried_tokens),
            ("prefix_cache_hits", "Prompt tokens found in the radix cache", s.prefix_hit_tokens),
            ("num_preemptions", "Sequences preempted (retracted)", s.retractions),
        ):
            yield CounterMetricFamily(P + name, doc, value=value)
        yield GaugeMetricFamily(P + "num_requests_running", "Requests with a sequence in the running batch",
                                value=s.running)
        yield GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting for admission", value=s.waiting)
        yield from _policy_metrics(s.policy)
        info = GaugeMetricFamily(P + "cache_config_info", "The KV cache's size, as vLLM's family: KV is kept per "
                                 "token (a block is one token), num_gpu_blocks is the pool's slots",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric(["1", str(s.kv_capacity)], 1.0)
        yield info
        yield GaugeMetricFamily(P + "kv_cache_usage_perc", "Fraction of KV slots in use (cached and evictable "
                                "slots count as free)", value=s.kv_used / s.kv_capacity)


class ServerMetrics:
    def __init__(self, async_engine):
        self.engine = async_engine
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        ProcessCollector(registry=r)  # the front end's own process (CPU seconds, memory), as vLLM's /metrics has it
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1)",
                              registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between successive output deltas",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Request latency, arrival to last token",
                             registry=r, buckets=_LATENCY_BUCKETS)
        self.step_time = Histogram(P + "step_time_seconds", "Engine step wall time", registry=r,
                                   buckets=_STEP_BUCKETS)
        self.iteration_tokens = Histogram(P + "iteration_tokens_total",
                                          "Tokens per engine step, as vLLM counts them: generated, plus the whole "
                                          "prompt of each sequence that got its first token",
                                          registry=r, buckets=_TOKEN_BUCKETS)
        self.request_prompt_tokens = Histogram(P + "request_prompt_tokens", "Prompt tokens per request",
                                               registry=r, buckets=_TOKEN_BUCKETS)
        self.request_generation_tokens = Histogram(P + "request_generation_tokens",
                                                   "Generated tokens per request (all its choices)", registry=r,
                                                   buckets=_TOKEN_BUCKETS)
        self.request_params_n = Histogram(P + "request_params_n", "The n of each request", registry=r,
                                          buckets=(1, 2, 5, 10, 20))
        self.request_params_max_tokens = Histogram(P + "request_params_max_tokens", "The max_tokens of each request",
                                                   registry=r, buckets=_TOKEN_BUCKETS)
        # vLLM's per-phase request times, from the engine's own stamps of each request
        self.request_queue_time = Histogram(P + "request_queue_time_seconds",
                                            "Arrival at the engine to first admitted into the batch", registry=r,
                                            buckets=_LATENCY_BUCKETS)
        self.request_prefill_time = Histogram(P + "request_prefill_time_seconds",
                                              "First admitted to first token", registry=r, buckets=_LATENCY_BUCKETS)
        self.request_decode_time = Histogram(P + "request_decode_time_seconds", "First token to finished",
                                             registry=r, buckets=_LATENCY_BUCKETS)
        self.request_inference_time = Histogram(P + "request_inference_time_seconds",
                                                "First admitted to finished", registry=r, buckets=_LATENCY_BUCKETS)
        self.rejected = Counter(P + "requests_rejected", "Requests refused with 429 (admission queue full)",
                                registry=r)
        self.snapshot = EngineStats()
        self._lock = asyncio.Lock()
        r.register(_EngineCollector(self))

    async def refresh(self, timeout: float = 5.0) -> None:
        async with self._lock:  # one pull at a time, so no step is counted twice
            snap = await asyncio.wait_for(self.engine.stats(self.snapshot.last_step), timeout)
            for t in snap.step_times:
                self.step_time.observe(t)
            for n in snap.step_tokens:
                self.iteration_tokens.observe(n)
            self.snapshot = snap

    async def render(self) -> bytes:
        try:
            await self.refresh()
        except Exception as e:  # the engine is gone or stuck: still export what we have
            log.warning("metrics refresh failed: %r", e)
        return generate_latest(self.registry)

    async def poll_steps(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                pass

    def observe_request(self, start: float, first: float | None, end: float, max_branch_tokens: int,
                        prompt_tokens: int, generated_tokens: int) -> None:
        self.e2e.observe(end - start)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated_tokens)
        if first is not None and max_branch_tokens > 1:
            self.tpot.observe((end - first) / (max_branch_tokens - 1))

    def observe_phases(self, m) -> None:
        """A finished request's phases (`RequestMetrics`, the engine's clock):
        waiting, prefill (to its first token), decode and the two together."""
        sched, first, done = m.first_scheduled_time, m.first_token_time, m.finished_time
        if sched is not None:
            self.request_queue_time.observe(max(sched - m.arrival_time, 0.0))
            if done is not None:
                self.request_inference_time.observe(max(done - sched, 0.0))
            if first is not None:
                self.request_prefill_time.observe(max(first - sched, 0.0))
        if first is not None and done is not None:
            self.request_decode_time.observe(max(done - first, 0.0))
