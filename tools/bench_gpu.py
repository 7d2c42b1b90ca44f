"""Decode and prefill throughput on a GPU, against the memory-bandwidth roofline.

    python tools/bench_gpu.py --model DIR [--make llama3-8b] --batches 1,8,64,256 --out report.json

`--make SHAPE` first writes a random-weight bf16 checkpoint of that shape to
DIR (made on the GPU, no download; the tokenizer is the tests' tiny BPE, which
serves only text -- the benchmark sends token ids).

Decode: for each batch size B, B requests with `--context`-token prompts are
prefilled, then `--steps` decode steps are timed (engine.step() wall time:
scheduling, batch building, the forward, sampling and the update, all of
it; with the overlap schedule a call launches one step and finishes the one
before, so its median is the period of back-to-back steps).
`--overlap-schedules on,off` runs each batch size with each setting. Reported: the
median step, tok/s = B / step, and the roofline -- the bytes a decode step
must read (every weight, the embedding table's B rows only unless it is also
the LM head, plus every row's KV) over the GPU's copy bandwidth measured in
the same run (a device-to-device copy, bytes read + written). With
`--compare-eager` each batch size also runs with `enforce_eager` (no CUDA graphs).

Where a step's time goes (graph steps): the GPU time of the forward alone
(the step's graph replayed back to back between CUDA events), and the host
time of each part of the step -- scheduling and output handling, building the
batch, copying it into the graph's buffers, planning attention, the replay
call itself, and sampling up to the tokens on the host. The step's wall time
minus the forward's GPU time is what the GPU waits for the host.

Prefill: `--prefill-prompts` prompts of `--context` tokens with max_tokens=1;
prompt tokens per second over the whole run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

SHAPES = {
    # Llama-3-8B
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    # Qwen2.5-1.5B (head_dim 128, like the 8B: one set of attention kernels serves both)
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
}


def make_checkpoint(path: str, shape: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from checkpoints import make_tokenizer

    spec = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec, eos_token_id=0, bos_token_id=0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)
    del model
    torch.cuda.empty_cache()
    print(f"made {shape} at {path} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Bytes per second a device-to-device copy moves (read + written), median of `reps`."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 3):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times[3:])


def weight_bytes_per_step(model, batch: int) -> int:
    """Weights one decode step reads: all of them, but only `batch` rows of an
    embedding table that is not also the LM head."""
    emb = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def engine(args, **kw):
    from stepserve.engine.engine import Engine, EngineConfig

    # the engine before is unreferenced only once its caller returned: free its memory now, or this one's KV pool,
    # sized from what the GPU has free, finds the old pool's blocks still cached
    gc.collect()
    torch.cuda.empty_cache()
    return Engine(EngineConfig(model=args.model, dtype="bfloat16", device="cuda", max_model_len=args.max_model_len,
                               kv_memory_gb=args.kv_memory_gb, max_batched_tokens=args.max_batched_tokens, **kw))


class HostTimes:
    """Host seconds spent in wrapped callables, a list per name."""

    def __init__(self):
        self.calls: dict[str, list[float]] = {}

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        calls = self.calls.setdefault(name, [])

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                calls.append(time.perf_counter() - t0)

        setattr(obj, attr, timed)

    def median_ms(self, name: str, since: int = 0) -> float:
        xs = self.calls.get(name, [])[since:]
        return statistics.median(xs) * 1e3 if xs else 0.0


def graph_gpu_ms(graphs, batch: int, reps: int = 20) -> float:
    """GPU time of one replay of the graph serving `batch` rows: `reps` replays
    back to back between two CUDA events (they rewrite the last step's KV
    with the same values)."""
    from stepserve.engine.cuda_graph import bucket_for

    g = graphs.graphs[bucket_for(graphs.buckets, batch)]
    g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def decode_point(args, batch: int, eager: bool, bandwidth: float, overlap: str = "auto",
                 temperature: float = 0.0) -> dict:
    from stepserve.engine.sampling_params import SamplingParams

    eng = engine(args, max_running=batch, enforce_eager=eager, overlap_schedule=overlap)
    graphs = eng.runner.graphs
    host = HostTimes()
    host.wrap(eng.runner, "build_batch", "build")
    if graphs is not None:
        for attr in ("run", "_plan"):
            host.wrap(graphs, attr, attr)
        for w in getattr(eng.runner.backend, "_graph_wrappers", {}).values():
            host.wrap(w, "plan", "fi_plan")
        for bs, gr in graphs.graphs.items():
            host.wrap(gr, "replay", "replay")
    g = torch.Generator().manual_seed(batch)
    vocab = eng.model_config.vocab_size
    # enough tokens that every row decodes through the timed and the profiled steps
    for i in range(batch):  # greedy, or sampled at `temperature` with a seed per row
        p = SamplingParams(max_tokens=args.steps + 32, temperature=temperature, ignore_eos=True,
                           seed=i if temperature > 0 else None)
        eng.add_request(torch.randint(16, vocab, (args.context,), generator=g).tolist(), p)
    while eng.scheduler.waiting or any(s.pending > 1 for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):  # warm-up decode steps
        eng.step()
    times = []
    first = eng.step_id
    since = {k: len(v) for k, v in host.calls.items()}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    recs = [r for r in eng.records if r.step >= first]
    parts = {k: statistics.median(getattr(r, k) for r in recs) * 1e3 for k in ("schedule_s", "prep_s", "forward_s")}
    rows = statistics.median(r.rows for r in recs)
    ctx = statistics.median(r.context_tokens for r in recs)
    breakdown = {}
    if graphs is not None and not eager:
        run, plan, fi_plan, replay = (host.median_ms(k, since.get(k, 0)) for k in ("run", "_plan", "fi_plan", "replay"))
        breakdown = {"graph_gpu_ms": graph_gpu_ms(graphs, batch), "host_copy_ms": run - plan - replay,
                     "host_plan_ms": plan, "host_flashinfer_plan_ms": fi_plan, "host_replay_call_ms": replay,
                     "sample_and_sync_ms": parts["forward_s"] - run}
    if batch in args.profile_batches and not eager:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(8):
                eng.step()
        print(f"--- profile: 8 decode steps at batch {batch} ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    step = statistics.median(times)
    kv = ctx * eng.model_config.kv_bytes_per_token(eng.dtype)
    wbytes = weight_bytes_per_step(eng.model, batch)
    roof = (wbytes + kv) / bandwidth
    out = {"batch": batch, "temperature": temperature, "rows_median": rows, "context_tokens_median": ctx, "mode": "eager" if eager else "graphs",
           "backend": eng.attention_backend, "overlap_schedule": eng.overlap_schedule,
           "step_ms_median": step * 1e3, "step_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
           "tok_per_s": batch / step, "weight_gb": wbytes / 1e9, "kv_gb": kv / 1e9,
           "roofline_ms": roof * 1e3, "x_roofline": step / roof,
           "graph_replays": graphs.replays if graphs is not None else 0,
           **{k.replace("_s", "_ms_median"): v for k, v in parts.items()}, **breakdown}
    for r in list(eng.requests):
        eng.abort_request(r)
    return out


def prefill_point(args) -> dict:
    from stepserve.engine.sampling_params import SamplingParams

    eng = engine(args, max_running=args.prefill_prompts)
    g = torch.Generator().manual_seed(1)
    vocab = eng.model_config.vocab_size
    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    res = []
    for rep in range(2):  # the first pass compiles and warms; the second is timed
        for _ in range(args.prefill_prompts):
            eng.add_request(torch.randint(16, vocab, (args.context,), generator=g).tolist(), p)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        res.append(time.perf_counter() - t0)
        eng.scheduler.kv.tree.evict(eng.scheduler.kv.tree.evictable_size())
    n = args.prefill_prompts * args.context
    return {"prompts": args.prefill_prompts, "context": args.context, "max_batched_tokens": args.max_batched_tokens,
            "seconds": res[-1], "tok_per_s": n / res[-1]}


def entry_point(args, mixed: str = "auto") -> dict:
    """An idle engine given `entry_rows` new prompts at once: a prefill-only
    step that nothing overlaps, as after every idle spell in serving. In a
    server on an H200 (qwen2.5-1.5b shape) such steps took 12-24 ms; under the
    overlap schedule the decode step before a request's first chunk was
    charged 10.5 ms (median) against 1.75 ms for other decode steps: the
    chunk's step, launched eagerly from Python, was charged to the step
    before (records now charge each step its own launch). `mixed`: the
    engine's `mixed_step_graphs` (auto: those steps as CUDA graph pieces
    between eager attention calls; off: eager). Times the first tokens
    (median of `entry_repeats`), splits the host's part (launch, schedule,
    finish's own work) from the wait, and with --profile-entry prints a
    torch profile of one entry."""
    from stepserve.engine.sampling_params import SamplingParams

    eng = engine(args, max_running=max(8, args.entry_rows), mixed_step_graphs=mixed)
    host = HostTimes()
    for obj, attr in ((eng.runner, "launch"), (eng.runner, "finish"), (eng.runner, "build_batch"),
                      (eng.runner.backend, "prepare"), (eng.scheduler, "schedule")):
        if hasattr(obj, attr):
            host.wrap(obj, attr, attr)
    g = torch.Generator().manual_seed(7)
    vocab = eng.model_config.vocab_size
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def one():
        reqs = [eng.add_request(torch.randint(16, vocab, (args.context,), generator=g).tolist(), p)
                for _ in range(args.entry_rows)]
        torch.cuda.synchronize()
        since = {k: len(v) for k, v in host.calls.items()}
        t0 = time.perf_counter()
        steps = 0
        while any(b.seq.first_token_time is None for r in reqs for b in r.branches):
            eng.step()
            steps += 1
        t1 = time.perf_counter()
        parts = {k: sum(v[since.get(k, 0):]) * 1e3 for k, v in host.calls.items()}
        while eng.has_unfinished():
            eng.step()
        eng.scheduler.kv.tree.evict(eng.scheduler.kv.tree.evictable_size())
        return (t1 - t0) * 1e3, steps, parts

    for _ in range(3):
        one()
    runs = [one() for _ in range(args.entry_repeats)]
    if args.profile_entry:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one()
        print(f"--- profile: an idle engine given {args.entry_rows} prompts of {args.context} tokens ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    out = {"rows": args.entry_rows, "context": args.context, "overlap_schedule": eng.overlap_schedule,
           "mixed_step_graphs": mixed, "mixed_graphs_captured": eng.runner.mixed_graphs is not None,
           "first_tokens_ms_median": statistics.median(r[0] for r in runs),
           "steps_median": statistics.median(r[1] for r in runs),
           "host_ms_median": {k: statistics.median(r[2].get(k, 0.0) for r in runs) for k in host.calls}}

    # a request joining a batch that decodes (the server's step log: the step() that admits it took 11-28 ms,
    # one without a new request ~2 ms): that step() and a plain one, alternated
    busy = [eng.add_request(torch.randint(16, vocab, (args.context,), generator=g).tolist(),
                            SamplingParams(max_tokens=eng.max_model_len - args.context, temperature=0.0,
                                           ignore_eos=True)) for _ in range(8)]
    for _ in range(8):
        eng.step()

    def joined(add: bool):
        since = {k: len(v) for k, v in host.calls.items()}
        if add:
            eng.add_request(torch.randint(16, vocab, (64,), generator=g).tolist(), p)
        t0 = time.perf_counter()
        eng.step()
        t = (time.perf_counter() - t0) * 1e3
        for _ in range(4):  # its tokens, so the next join starts from a decoding batch again
            eng.step()
        return t, {k: sum(v[since.get(k, 0):]) * 1e3 for k, v in host.calls.items()}

    for _ in range(3):
        joined(True)
    pairs = [(joined(True), joined(False)) for _ in range(args.entry_repeats)]
    out["join_step_ms_median"] = statistics.median(a[0] for a, _ in pairs)
    out["plain_step_ms_median"] = statistics.median(b[0] for _, b in pairs)
    out["join_host_ms_median"] = {k: statistics.median(a[1].get(k, 0.0) for a, _ in pairs) for k in host.calls}
    out["mixed_graph_replays"] = getattr(eng.runner.mixed_graphs, "replays", 0)
    if args.profile_entry:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            joined(True)
        print("--- profile: a request of 64 tokens joining 8 decoding rows, and 4 steps after ---")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for r in busy:
        eng.abort_request(r.request_id)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--make", choices=sorted(SHAPES), default=None, help="write a random checkpoint of this shape first")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    p.add_argument("--compare-eager", action="store_true")
    p.add_argument("--overlap-schedules", default="auto",
                   help="comma list of overlap_schedule settings (auto, on, off) to run each batch size with")
    p.add_argument("--tensor-core-groups", default=None,
                   help="comma list of TENSOR_CORE_MIN_GROUP values: each batch size runs with each (an A/B of "
                        "flashinfer's tensor-core decode against its CUDA-core one)")
    p.add_argument("--tensor-core-backends", default=None,
                   help="comma list of TENSOR_CORE_BACKEND values (auto, fa2, fa3): the tensor-core decode's kernels, "
                        "each batch size with each")
    p.add_argument("--temperatures", default="0",
                   help="comma list: each batch size decodes greedy (0) and sampled at each temperature given")
    p.add_argument("--sampler-kernels", default="on",
                   help="comma list of on/off: sampled rows drawn by the Triton kernel or by torch ops (an A/B)")
    p.add_argument("--prefill-prompts", type=int, default=64, help="prompts of the prefill measurement (0: skip)")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-memory-gb", type=float, default=None)
    p.add_argument("--make-only", action="store_true", help="with --make: write the checkpoint and stop")
    p.add_argument("--profile-batches", default="", help="comma list: print a torch profile of 8 steps at these")
    p.add_argument("--entry-rows", type=int, default=4, help="prompts given to an idle engine at once (0: skip)")
    p.add_argument("--entry-repeats", type=int, default=10)
    p.add_argument("--profile-entry", action="store_true", help="print a torch profile of one entry")
    p.add_argument("--entry-mixed", default="auto,off",
                   help="the entry and join measurements for each of these mixed_step_graphs settings")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.profile_batches = {int(x) for x in args.profile_batches.split(",") if x}
    if args.make_only:
        if not args.make:
            p.error("--make-only needs --make SHAPE")
        make_checkpoint(args.model, args.make)
        return 0
    if args.make and not os.path.isfile(os.path.join(args.model, "config.json")):
        # in a process of its own: the model it builds on the GPU must be gone before the engines load
        import subprocess

        subprocess.run([sys.executable, __file__, "--model", args.model, "--make", args.make, "--make-only"],
                       check=True)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    from stepserve.engine import attention_flashinfer, triton_sampling

    groups = [int(x) for x in args.tensor_core_groups.split(",")] if args.tensor_core_groups else [None]
    tc_backends = args.tensor_core_backends.split(",") if args.tensor_core_backends else [None]
    default_group = attention_flashinfer.TENSOR_CORE_MIN_GROUP
    default_tc_backend = attention_flashinfer.TENSOR_CORE_BACKEND
    points = []
    for b in [int(x) for x in args.batches.split(",")]:
        temps = [float(x) for x in args.temperatures.split(",")]
        kernels = args.sampler_kernels.split(",")
        for eager, group, tcb, ov, temp, kern in [
                (e, g, t, o, tt, k) for e in ([False, True] if args.compare_eager else [False]) for g in groups
                for t in tc_backends for o in args.overlap_schedules.split(",") for tt in temps
                for k in (kernels if tt > 0 else kernels[:1])]:
            if group is not None:
                attention_flashinfer.TENSOR_CORE_MIN_GROUP = group
            if tcb is not None:
                attention_flashinfer.TENSOR_CORE_BACKEND = tcb
            triton_sampling.ENABLED = kern == "on"
            pt = decode_point(args, b, eager, bw, ov, temp)
            pt["tensor_core_min_group"] = attention_flashinfer.TENSOR_CORE_MIN_GROUP
            pt["tensor_core_backend"] = attention_flashinfer.TENSOR_CORE_BACKEND
            pt["sampler_kernel"] = triton_sampling.ENABLED and temp > 0
            points.append(pt)
            print(f"decode batch {b:4d} {pt['mode']:6s} {pt['backend']} tc>={pt['tensor_core_min_group']} "
                  f"({pt['tensor_core_backend']}) T={temp:g}{' kernel' if pt['sampler_kernel'] else ''} "
                  f"overlap {'on' if pt['overlap_schedule'] else 'off'}: "
                  f"{pt['step_ms_median']:7.2f} ms/step "
                  f"{pt['tok_per_s']:9.1f} tok/s  roofline {pt['roofline_ms']:6.2f} ms ({pt['x_roofline']:.2f}x)  "
                  f"[schedule {pt['schedule_ms_median']:.2f} prep {pt['prep_ms_median']:.2f} "
                  f"forward+sample {pt['forward_ms_median']:.2f} ms]", flush=True)
            if "graph_gpu_ms" in pt:
                print(f"    graph GPU {pt['graph_gpu_ms']:.2f} ms; host: copies {pt['host_copy_ms']:.3f} plan "
                      f"{pt['host_plan_ms']:.3f} (flashinfer's {pt['host_flashinfer_plan_ms']:.3f}) replay call {pt['host_replay_call_ms']:.3f} sample+sync "
                      f"{pt['sample_and_sync_ms']:.2f} ms; rows {pt['rows_median']}, context "
                      f"{pt['context_tokens_median']} tokens", flush=True)
    attention_flashinfer.TENSOR_CORE_MIN_GROUP = default_group
    attention_flashinfer.TENSOR_CORE_BACKEND = default_tc_backend
    triton_sampling.ENABLED = True
    pre = prefill_point(args) if args.prefill_prompts else None
    if pre:
        print(f"prefill {pre['prompts']} x {pre['context']} tokens: {pre['tok_per_s']:.0f} tok/s", flush=True)
    entry = {}
    for mixed in (args.entry_mixed.split(",") if args.entry_rows else []):
        e = entry[mixed] = entry_point(args, mixed)
        print(f"entry (mixed-step graphs {mixed}): an idle engine given {e['rows']} x {e['context']} tokens: first "
              f"tokens in {e['first_tokens_ms_median']:.2f} ms over {e['steps_median']:g} steps; host ms "
              + ", ".join(f"{k} {v:.2f}" for k, v in e["host_ms_median"].items()), flush=True)
        print(f"join (mixed-step graphs {mixed}): the step() that admits a request into 8 decoding rows "
              f"{e['join_step_ms_median']:.2f} ms, a plain one {e['plain_step_ms_median']:.2f} ms; host ms "
              + ", ".join(f"{k} {v:.2f}" for k, v in e["join_host_ms_median"].items()), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "shape": args.make, "copy_bandwidth_tb_s": bw / 1e12, "decode": points, "prefill": pre, "entry": entry,
              "command": " ".join(sys.argv)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
