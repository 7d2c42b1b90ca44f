"""Speculative decoding on this machine: output tokens per second over batch
sizes x draft lengths, for a proposer, in one run.

For each batch size B, B requests run to completion together (greedy, EOS
ignored, `--output-len` tokens each) under every configuration: no
speculation, fixed:K for each K of `--fixed`, and adaptive. One engine per
configuration lives through the whole run (adaptive learns its acceptance and
step costs online, as in a server). Repeats are interleaved (every
configuration once, then again) and the median is reported; a warm-up pass
per batch size is not counted.

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
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    configs = ["none"] + [f"fixed:{k}" for k in args.fixed.split(",")] + ["adaptive"]
    engines = {c: LLM(speculative="none" if c == "none" else args.proposer, spec_length=None if c == "none" else c)
               for c in configs}
    prompts_all = make_prompts(engines["none"], max(sizes), args.workload, args.seed)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for b in sizes:
        prompts = prompts_all[:b]
        tput = {c: [] for c in configs}
        full = {c: [] for c in configs}
        spec = {}
        for rep in range(args.repeats + 1):
            for c, llm in engines.items():
                before = llm.engine.stats().policy
                records = llm.engine.core.records
                n0 = len(records)
                t = time.perf_counter()
                outs = llm.generate(prompts, sp)
                dt = time.perf_counter() - t
                after = llm.engine.stats().policy
                if rep == 0:
                    continue  # warm-up
                tput[c].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                # the steps with all b rows in the batch (before the first request finishes): the rate a
                # batch of b sustains, without the ragged finish (verify rows finish at different steps)
                steps = [r for r in records[n0:] if r.rows == b]
                full[c].append(sum(r.rows + r.accepted_tokens for r in steps) / sum(r.wall_s for r in steps))
                if c != "none":
                    d = spec.setdefault(c, {"draft": 0, "accepted": 0, "rows": 0, "k": {}})
                    d["draft"] += after["spec_draft_tokens"] - before["spec_draft_tokens"]
                    d["accepted"] += after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                    d["rows"] += (after["spec_emitted_tokens"] - before["spec_emitted_tokens"]) - (
                        after["spec_accepted_tokens"] - before["spec_accepted_tokens"])
                    for k, n in after["spec_k_steps"].items():
                        d["k"][k] = d["k"].get(k, 0) + n - before["spec_k_steps"].get(k, 0)
        row = {"batch": b, "tok_s": {c: statistics.median(v) for c, v in tput.items()},
               "full_batch_tok_s": {c: statistics.median(v) for c, v in full.items()},
               "runs": tput, "full_batch_runs": full,
               "accepted_per_row": {c: d["accepted"] / d["rows"] if d["rows"] else 0.0 for c, d in spec.items()},
               "adaptive_k_steps": {k: n for k, n in sorted(spec["adaptive"]["k"].items()) if n}}
        rows.append(row)
        print(json.dumps({"batch": b, **{c: round(v, 1) for c, v in row["tok_s"].items()},
                          "full_batch": {c: round(v, 1) for c, v in row["full_batch_tok_s"].items()},
                          "adaptive_k": row["adaptive_k_steps"]}), file=sys.stderr, flush=True)
    print("Full batch (steps with all B requests decoding), output tok/s:")
    print(table(rows, configs, "full_batch_tok_s"))
    print("\nEnd to end (the whole generate call, the ragged finish included), output tok/s:")
    print(table(rows, configs, "tok_s"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"proposer": args.proposer, "workload": args.workload, "output_len": args.output_len,
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
