"""Offline throughput: stepserve against transformers on the same prompts, in one run.

Paths compared (same model weights, same prompts, greedy, EOS ignored so the
output lengths are exactly the workload's):
  stepserve            continuous batching, `--concurrency` sequences at once
  hf-static            transformers `generate`, static batches of `--concurrency`
                       prompts (left-padded), one batch after another
  hf-continuous        transformers `generate_batch` (its own continuous batching),
                       where the installed version has it
Two workloads: `fixed` (every request generates `--output-len` tokens: the
per-step efficiency of each path, static batching's best case) and `mixed`
(per-request lengths uniform in [1, 2*output_len-1], same mean: what requests
that stop at different times look like, where a static batch runs until its
longest member ends and only the requested tokens count as output).
Repeats are interleaved (A, B, C, A, B, C, ...) and the median is reported, so
drift in machine load hits every path alike. Also measured: the scheduler's CPU
time per step (everything in a step but the model forward and sampling) with
`--overhead-rows` sequences decoding.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time

from stepserve.traces.options import positive_int
from stepserve.traces.report import command_line, versions, write_report


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark")
    g.add_argument("--num-prompts", type=positive_int, default=128)
    g.add_argument("--concurrency", type=positive_int, default=64)
    g.add_argument("--input-len-min", type=positive_int, default=16)
    g.add_argument("--input-len-max", type=positive_int, default=96)
    g.add_argument("--output-len", type=positive_int, default=64, help="(mean) output tokens per request")
    g.add_argument("--workloads", default="fixed,mixed", help="comma list of fixed, mixed")
    g.add_argument("--repeats", type=positive_int, default=3)
    g.add_argument("--overhead-rows", type=positive_int, default=256)
    g.add_argument("--overhead-steps", type=positive_int, default=40)
    g.add_argument("--skip-hf", action="store_true", help="measure stepserve only")
    g.add_argument("--skip-hf-continuous", action="store_true",
                   help="leave out transformers' generate_batch (slow on large models)")
    g.add_argument("--bench-seed", type=int, default=0)
    g.add_argument("--out", default=None, help="write the report as JSON here")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    import torch  # (here and below: when the benchmark runs, not when the CLI builds its arguments)

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    # ids from the ordinary part of the vocabulary (specials sit at the start)
    return [torch.randint(16, vocab, (k,), generator=g).tolist() for k in lens]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Unsupported(Exception):
    """This path cannot express the workload (the run is skipped, with the reason)."""


def output_lengths(kind: str, n: int, mean: int, seed: int) -> list[int]:
    if kind == "fixed":
        return [mean] * n
    if kind == "mixed":
        import torch

        g = torch.Generator().manual_seed(seed + 7)
        return torch.randint(1, 2 * mean, (n,), generator=g).tolist()
    raise ValueError(f"unknown workload {kind!r} (fixed, mixed)")


class StepserveRunner:
    name = "stepserve"

    def __init__(self, cfg, concurrency: int):
        from stepserve.engine.engine import Engine

        cfg.max_running = concurrency
        self.engine = Engine(cfg)

    def run(self, prompts, out_lens) -> int:
        from stepserve.engine.sampling_params import SamplingParams

        eng = self.engine
        reqs = [
            eng.add_request(x, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for x, n in zip(prompts, out_lens)
        ]
        while eng.has_unfinished():
            eng.step()
        # drop the cache so every repeat does the same prefill work
        eng.scheduler.kv.tree.evict(eng.scheduler.kv.tree.evictable_size())
        return sum(len(r.branches[0].seq.output_ids) for r in reqs)


class HFStaticRunner:
    name = "hf-static"

    def __init__(self, model, concurrency: int, pad_id: int):
        self.model, self.bs, self.pad = model, concurrency, pad_id
        self.device = next(model.parameters()).device

    def run(self, prompts, out_lens) -> int:
        """Each batch runs until its longest request is done; only each
        request's own tokens count (the rest is what static batching wastes)."""
        import torch

        total = 0
        for i in range(0, len(prompts), self.bs):
            batch = prompts[i : i + self.bs]
            lens = out_lens[i : i + self.bs]
            out_len = max(lens)
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(batch):
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=out_len,
                    min_new_tokens=out_len, do_sample=False, pad_token_id=self.pad, eos_token_id=None,
                )
            assert out.shape[1] - width == out_len
            total += sum(lens)
        return total


class HFContinuousRunner:
    name = "hf-continuous"

    def __init__(self, model, concurrency: int):
        from transformers import GenerationConfig

        self.model = model
        self.gen = GenerationConfig(
            max_new_tokens=None, do_sample=False, eos_token_id=-1, pad_token_id=0,
        )
        self.concurrency = concurrency

    def run(self, prompts, out_lens) -> int:
        if len(set(out_lens)) != 1:
            raise Unsupported("generate_batch takes one max_new_tokens for all requests")
        out_len = out_lens[0]
        # no inference_mode here: generate_batch updates its cache from a worker
        # thread, which inference tensors made on this thread would forbid
        self.gen.max_new_tokens = out_len
        out = self.model.generate_batch(inputs=prompts, generation_config=self.gen, progress_bar=False)
        n = sum(len(o.generated_tokens) for o in out.values())
        if n < len(prompts) * out_len:
            raise RuntimeError(f"generate_batch returned {n} of {len(prompts) * out_len} tokens")
        return n


def measure_overhead(cfg, rows: int, steps: int, vocab: int, seed: int) -> dict:
    """Scheduler CPU time per step with `rows` sequences decoding."""
    from stepserve.engine.engine import Engine
    from stepserve.engine.sampling_params import SamplingParams

    cfg.max_running = rows
    eng = Engine(cfg)
    prompts = make_prompts(rows, 8, 24, vocab, seed + 1)
    p = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for x in prompts:
        eng.add_request(x, p)
    while eng.scheduler.waiting or any(s.pending > 1 for s in eng.scheduler.running):
        eng.step()  # admit and prefill everything first
    first = eng.step_id  # (by step id: the record list is trimmed as it grows)
    for _ in range(steps):
        eng.step()
    recs = [r for r in eng.records if r.step >= first and r.decode_rows == rows]
    for req in list(eng.requests):
        eng.abort_request(req)
    sched = [r.schedule_s * 1e3 for r in recs]
    outside = [(r.schedule_s + r.prep_s) * 1e3 for r in recs]
    fwd = [r.forward_s * 1e3 for r in recs]
    return {
        "rows": rows,
        "steps": len(recs),
        "schedule_ms_median": statistics.median(sched),
        "schedule_ms_p90": sorted(sched)[int(0.9 * (len(sched) - 1))],
        "outside_forward_ms_median": statistics.median(outside),
        "forward_ms_median": statistics.median(fwd),
    }


def run(args) -> int:
    import torch

    from stepserve.cli import engine_config
    from stepserve.engine.defaults import DEFAULT_MODEL

    if args.input_len_min > args.input_len_max:
        raise ValueError(f"--input-len-min ({args.input_len_min}) is above --input-len-max ({args.input_len_max})")
    cfg = engine_config(args)
    model_dir = cfg.model or DEFAULT_MODEL
    ours = StepserveRunner(cfg, args.concurrency)
    vocab = ours.engine.model_config.vocab_size
    prompts = make_prompts(args.num_prompts, args.input_len_min, args.input_len_max, vocab, args.bench_seed)
    runners = [ours]
    notes = {}
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=ours.engine.dtype).to(ours.engine.device).eval()
        pad = ours.engine.tokenizer.pad_token_id or 0
        runners.append(HFStaticRunner(hf, args.concurrency, pad))
        if args.skip_hf_continuous:
            notes["hf-continuous"] = "left out (--skip-hf-continuous)"
        elif hasattr(hf, "generate_batch"):
            runners.append(HFContinuousRunner(hf, args.concurrency))
        else:
            notes["hf-continuous"] = "transformers has no generate_batch in this version"
    # Warm-up, untimed: one full pass of the first workload per path. Kernel
    # libraries (oneDNN for bf16 on CPU) build a primitive per matmul shape on
    # first sight, and every step has a different token count; a short warm-up
    # would leave that cost inside the first timed repeat.
    warm_lens = output_lengths(args.workloads.split(",")[0], len(prompts), args.output_len, args.bench_seed)
    for r in list(runners):
        try:
            _progress(f"warm-up: {r.name}")
            r.run(prompts, warm_lens)
        except Unsupported:
            pass
        except Exception as e:  # an optional comparison path must not kill the run; ours must say why it failed
            if r is ours:
                raise SystemExit(f"stepserve bench offline: the engine failed on this workload: {e}") from e
            notes[r.name] = f"failed: {e!r}"
            runners.remove(r)
    workloads = {}
    for kind in args.workloads.split(","):
        lens = output_lengths(kind, len(prompts), args.output_len, args.bench_seed)
        times: dict[str, list[float]] = {r.name: [] for r in runners}
        tokens: dict[str, int] = {}
        for rep in range(args.repeats):
            for r in runners:
                if r.name in times and not times[r.name] and rep > 0:
                    continue  # unsupported on this workload
                t0 = time.perf_counter()
                try:
                    n = r.run(prompts, lens)
                except Unsupported as e:
                    notes[f"{r.name}/{kind}"] = f"not run: {e}"
                    times.pop(r.name, None)
                    continue
                dt = time.perf_counter() - t0
                times[r.name].append(dt)
                tokens[r.name] = n
                _progress(f"[{kind} {rep + 1}/{args.repeats}] {r.name:14s} {n} tokens in {dt:6.2f}s = {n / dt:8.1f} tok/s")
        results = {}
        for name, ts in times.items():
            if not ts:
                continue
            med = statistics.median(ts)
            results[name] = {"output_tokens": tokens[name], "seconds": ts, "median_s": med,
                             "output_tok_per_s": tokens[name] / med}
        base = results["stepserve"]["output_tok_per_s"]
        others = {k: v["output_tok_per_s"] for k, v in results.items() if k != "stepserve"}
        workloads[kind] = {
            "output_tokens_total": sum(lens),
            "results": results,
            "speedup_vs": {k: base / v for k, v in others.items()},
            "speedup_vs_best_hf": base / max(others.values()) if others else None,
        }
    # free every model before the overhead engine loads its own (an 8B model twice, plus a
    # transformers copy and a GPU-sized KV pool, do not fit on one GPU)
    device, dtype = ours.engine.device, ours.engine.dtype
    runners.clear()
    del ours, hf
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _progress(f"measuring scheduler overhead at {args.overhead_rows} running sequences ...")
    overhead = measure_overhead(engine_config(args), args.overhead_rows, args.overhead_steps, vocab, args.bench_seed)
    report = {
        "command": command_line(),
        "model": model_dir,
        "versions": versions(),
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "workload": {"num_prompts": args.num_prompts, "concurrency": args.concurrency,
                     "input_len": [args.input_len_min, args.input_len_max], "output_len_mean": args.output_len,
                     "repeats": args.repeats, "dtype": str(dtype)},
        "workloads": workloads,
        "scheduler_overhead": overhead,
        "notes": notes,
    }
    for kind, w in workloads.items():
        print(f"\n[{kind}] {'path':16s} {'tok/s':>10s} {'stepserve x':>12s}")
        base = w["results"]["stepserve"]["output_tok_per_s"]
        for name, v in w["results"].items():
            print(f"[{kind}] {name:16s} {v['output_tok_per_s']:10.1f} {base / v['output_tok_per_s']:12.2f}")
    for k, v in notes.items():
        print(f"{k}: {v}")
    print(f"at {overhead['rows']} running: scheduler (schedule+update+outputs) median "
          f"{overhead['schedule_ms_median']:.2f} ms/step (p90 {overhead['schedule_ms_p90']:.2f}); all CPU work "
          f"outside the forward {overhead['outside_forward_ms_median']:.2f} ms; forward+sample "
          f"{overhead['forward_ms_median']:.2f} ms")
    if args.out:
        write_report(report, args.out)
        print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    from stepserve.cli import main

    sys.exit(main(["bench", "offline", *sys.argv[1:]]))
