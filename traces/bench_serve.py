"""HTTP serving benchmark: the same prompts through the server and through the
offline engine, in one run, to measure what the HTTP path costs.

`stepserve bench serve [--url URL] --num-prompts N --max-concurrency C
[--request-rate R]`. Without `--url` it starts `stepserve serve` itself on a
free loopback port with the engine options given, so that the offline path
(an `Engine` in this process, `--max-running` = C) runs the identical
configuration. Requests are streamed completions (TTFT and ITL measured per
chunk) sent at `--request-rate` (Poisson; `inf` = all at once) with at most C
in flight, on both paths. Repeats are interleaved (HTTP, offline, HTTP, ...)
and medians are reported, so load drift on the machine hits both paths alike.
The client runs on the same machine as the server and its CPU time is part of
what is measured, as it is for any user of this machine.

Two offline paths: `offline` with torch's own thread count (every core: the
best the engine alone does here), and, when it differs, `offline@Nt` with the
N torch threads the server gives its engine process (one core is left to the
HTTP front end). Against the first, the overhead is what serving costs on this
machine; against the second, what the front end costs given its core. The
server's CPU time per request (front-end process, engine process) is reported
as well.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from stepserve.traces.metrics import SLO, RequestRecord, summarize
from stepserve.traces.replay import ReplayConfig, Replayer, server_info, wait_ready
from stepserve.traces.report import command_line, versions, write_report
from stepserve.traces.request_spec import RequestSpec, Segment


def _rate(text: str) -> float:
    """argparse type: a rate above 0 (inf: every request at once)."""
    v = float(text)
    if not v > 0:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"must be a number above 0 (or inf), not {text}")
    return v


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--url", default=None, help="an already running server (then no offline comparison)")
    g.add_argument("--num-prompts", type=int, default=128)
    g.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    g.add_argument("--request-rate", type=_rate, default=math.inf, help="Poisson arrivals per second (inf: all at once)")
    g.add_argument("--input-len-min", type=int, default=16)
    g.add_argument("--input-len-max", type=int, default=96)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--bench-seed", type=int, default=0)
    g.add_argument("--out", default=None, help="write the report as JSON here")


def make_specs(args) -> list[RequestSpec]:
    rng = np.random.default_rng(args.bench_seed)
    lens = rng.integers(args.input_len_min, args.input_len_max + 1, args.num_prompts)
    if math.isinf(args.request_rate):
        arrivals = np.zeros(args.num_prompts)
    else:
        arrivals = np.cumsum(rng.exponential(1.0 / args.request_rate, args.num_prompts))
    # unique segment keys: no two prompts share tokens, so both paths do all the prefill
    return [
        RequestSpec(f"bench-{i}", float(t), args.output_len, (Segment(f"bench:{args.bench_seed}:{i}", int(n)),))
        for i, (t, n) in enumerate(zip(arrivals, lens))
    ]


class _LimitedReplayer(Replayer):
    """The replay client with at most `limit` requests in flight (closed loop
    when every arrival is at 0). TTFT counts from when a request is sent."""

    def __init__(self, cfg, info, limit: int):
        super().__init__(cfg, info)
        self.limit = limit
        self._sem = None

    async def _one(self, spec, rec, t0):
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.limit)
        async with self._sem:
            await super()._one(spec, rec, t0)


def run_http(url: str, specs, limit: int, vocab: int | None) -> dict:
    info = server_info(url)
    cfg = ReplayConfig(url=url, vocab_size=vocab, progress=False, warmup=2)
    records, duration = asyncio.run(_LimitedReplayer(cfg, info, limit).run(specs))
    return summarize(records, duration, SLO())


def run_offline(engine, specs, builder, limit: int) -> dict:
    """The same requests straight into the engine, arriving on the same
    schedule, with at most `limit` in flight (as the HTTP client has)."""
    from stepserve.engine.sampling_params import SamplingParams

    pending = sorted(specs, key=lambda s: s.arrival_s)
    records = {s.request_id: RequestRecord(s.request_id, s.arrival_s, s.prompt_len) for s in specs}
    last: dict[str, float] = {}
    t0 = time.perf_counter()
    i = 0
    in_flight = 0
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i].arrival_s <= now and in_flight < limit:
            s = pending[i]
            p = SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(builder.prompt(s), p, request_id=s.request_id)
            records[s.request_id].start_s = now
            i += 1
            in_flight += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[i].arrival_s - now))
            continue
        for req in engine.step():
            rec = records[req.request_id]
            t = time.perf_counter() - t0
            if rec.first_token_s is None:
                rec.first_token_s = t
            else:
                rec.itl_s.append(t - last[req.request_id])
            last[req.request_id] = t
            if req.finished:
                req.output(delta=False)  # the text, as an offline caller gets it
                in_flight -= 1
                rec.end_s = t
                rec.output_tokens = rec.branch_tokens = len(req.branches[0].seq.output_ids)
    engine.scheduler.kv.tree.evict(engine.scheduler.kv.tree.evictable_size())
    duration = max(r.end_s for r in records.values())
    return summarize(list(records.values()), duration, SLO())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_argv(args) -> list[str]:
    out = []
    for flag, val in [("--model", args.model), ("--dtype", args.dtype), ("--max-model-len", args.max_model_len),
                      ("--max-batched-tokens", args.max_batched_tokens), ("--kv-slots", args.kv_slots),
                      ("--kv-memory-gb", args.kv_memory_gb), ("--admission", args.admission), ("--seed", args.seed),
                      ("--cpu-threads", args.cpu_threads), ("--branch-policy", args.branch_policy),
                      ("--slo-ttft", args.slo_ttft), ("--slo-tpot", args.slo_tpot),
                      ("--latency-profile", args.latency_profile), ("--speculative", args.speculative),
                      ("--draft-model", args.draft_model), ("--spec-length", args.spec_length),
                      ("--speculative-token-map", args.speculative_token_map),
                      ("--gpu-memory-utilization", args.gpu_memory_utilization),
                      ("--attention-backend", args.attention_backend), ("--device", args.device)]:
        if val is not None:
            out += [flag, str(val)]
    if args.no_prefix_caching:
        out.append("--no-prefix-caching")
    if args.enforce_eager:
        out.append("--enforce-eager")
    if args.mixed_step_graphs != "auto":
        out += ["--mixed-step-graphs", args.mixed_step_graphs]
    return out


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the server (front end) and of its child processes (the engine)."""
    try:
        children = set()
        for tid in os.listdir(f"/proc/{pid}/task"):  # a child is listed under the thread that started it
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                children.update(int(c) for c in f.read().split())
        return {"frontend": _cpu_seconds(pid), "engine": sum(_cpu_seconds(c) for c in children)}
    except (OSError, ValueError):
        return {}


def run(args) -> int:
    import torch

    from stepserve.cli import engine_config
    from stepserve.engine.engine import Engine
    from stepserve.server.cli import default_engine_threads
    from stepserve.traces.request_spec import PromptBuilder

    specs = make_specs(args)
    server = None
    url = args.url
    engine = None
    limit = args.max_concurrency
    offline_threads: dict[str, int] = {}
    cpu: dict[str, float] = {}
    try:
        if url is None:
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                   "--max-running", str(args.max_concurrency), "--no-access-log", "--enable-prompt-tokens-details",
                   *_engine_argv(args)]
            server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wait_ready(url, timeout=600)
            cfg = engine_config(args)
            cfg.max_running = args.max_concurrency
            engine = Engine(cfg)
            offline_threads["offline"] = torch.get_num_threads()
            served = args.cpu_threads or default_engine_threads()
            if served != offline_threads["offline"]:
                offline_threads[f"offline@{served}t"] = served
        vocab = server_info(url).vocab_size
        builder = PromptBuilder(vocab or 256, 0)  # the replay client's default seed: same prompts
        runs: dict[str, list[dict]] = {"http": [], **{k: [] for k in offline_threads}}
        if engine is not None:  # warm-up: one untimed pass (kernel builds, shape caches)
            for n in offline_threads.values():
                torch.set_num_threads(n)
                run_offline(engine, specs, builder, limit)
            run_http(url, specs, limit, vocab)
        for rep in range(args.repeats):
            before = _server_cpu(server.pid) if server is not None else {}
            runs["http"].append(run_http(url, specs, limit, vocab))
            after = _server_cpu(server.pid) if server is not None else {}
            for k in after:
                cpu[k] = cpu.get(k, 0.0) + after[k] - before.get(k, 0.0)
            _say(f"[{rep + 1}/{args.repeats}] {'http':12s} {runs['http'][-1]['output_tps']:8.1f} tok/s")
            for path, n in offline_threads.items():
                torch.set_num_threads(n)
                runs[path].append(run_offline(engine, specs, builder, limit))
                _say(f"[{rep + 1}/{args.repeats}] {path:12s} {runs[path][-1]['output_tps']:8.1f} tok/s")
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    report = {
        "command": command_line(),
        "versions": versions(),
        "url": args.url or "(started by the benchmark)",
        "workload": {"num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                     "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
                     "input_len": [args.input_len_min, args.input_len_max], "output_len": args.output_len,
                     "repeats": args.repeats},
        "offline_threads": offline_threads,
        "runs": runs,
    }
    if cpu:  # includes the warm-up requests of each repeat (2 tiny ones)
        n_req = args.repeats * len(specs)
        report["server_cpu_ms_per_request"] = {k: 1e3 * v / n_req for k, v in cpu.items()}
    summary = {}
    for path, rs in runs.items():
        if not rs:
            continue
        def med(key, sub=None, rs=rs):
            vals = [r[key] if sub is None else r[key][sub] for r in rs]
            vals = [v for v in vals if v is not None]
            return statistics.median(vals) if vals else None

        summary[path] = {"output_tps": med("output_tps"), "throughput_rps": med("throughput_rps"),
                         "ttft_p50_s": med("ttft_s", "p50"), "ttft_p90_s": med("ttft_s", "p90"),
                         "tpot_p50_s": med("tpot_s", "p50"), "itl_p50_s": med("itl_s", "p50"),
                         "e2e_p50_s": med("e2e_s", "p50"), "e2e_p90_s": med("e2e_s", "p90")}
    report["summary"] = summary
    report["http_overhead"] = {path: 1.0 - summary["http"]["output_tps"] / s["output_tps"]
                               for path, s in summary.items() if path != "http"}
    print(f"\n{'path':12s} {'tok/s':>9s} {'req/s':>7s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'TPOT p50':>9s} "
          f"{'ITL p50':>8s} {'E2E p50':>8s} {'E2E p90':>8s}")
    for path, s in summary.items():
        print(f"{path:12s} {s['output_tps']:9.1f} {s['throughput_rps']:7.2f} {_ms(s['ttft_p50_s'])} "
              f"{_ms(s['ttft_p90_s'])} {_ms(s['tpot_p50_s'])} {_ms(s['itl_p50_s'], 8)} {_ms(s['e2e_p50_s'], 8)} "
              f"{_ms(s['e2e_p90_s'], 8)}")
    for path, o in report["http_overhead"].items():
        print(f"HTTP path throughput vs {path}: {-100 * o:+.1f}% (overhead {100 * o:.1f}%)")
    for k, v in report.get("server_cpu_ms_per_request", {}).items():
        print(f"server CPU per request, {k}: {v:.1f} ms")
    if args.out:
        write_report(report, args.out)
        print(f"report written to {args.out}")
    return 0


def _ms(v, width=9) -> str:
    return f"{'-':>{width}s}" if v is None else f"{1e3 * v:{width - 2}.1f}ms"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
