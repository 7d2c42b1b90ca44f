"""A speculative token map for a draft model: the N tokens the target model
emits most often, as a JSON list (most frequent first) for
`--speculative-token-map` (or, saved as `speculative_token_map.json` in the
draft's directory, used by default).

The frequencies come from the target model's own samples (temperature 1,
from its BOS token, `--samples` of `--tokens` each, seeded), so the map
follows the text the model writes and needs no corpus; `--text FILE` counts
a text file's tokens instead. The draft then proposes only those tokens (a
draft over the frequent tokens, FR-Spec: Zhao et al., 2025): its output head
reads N rows of the vocabulary's instead of all. Output stays exact; the map
only decides what can be drafted.

    python tools/make_token_map.py --size 1024 --out engine/assets/kjv-llama-draft/speculative_token_map.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the target model's directory (default: the embedded model)")
    p.add_argument("--size", type=int, default=1024, help="tokens in the map")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=None, metavar="FILE", help="count this text's tokens instead of samples")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.size < 1:
        p.error("--size must be at least 1")

    from stepserve import LLM, SamplingParams

    llm = LLM(model=args.model) if args.model else LLM()
    if args.text:
        with open(args.text) as f:
            tokens = llm.tokenizer.encode(f.read())
    else:
        bos = llm.tokenizer.bos_token_id
        if bos is None:
            bos = llm.tokenizer.eos_token_id or 0
        params = [SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=args.seed + i, ignore_eos=True)
                  for i in range(args.samples)]
        tokens = [t for o in llm.generate([[bos]] * args.samples, params) for t in o.outputs[0].token_ids]
    counts = collections.Counter(tokens)
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][: args.size]
    covered = sum(counts[t] for t in ranked) / max(len(tokens), 1)
    with open(args.out, "w") as f:
        json.dump(ranked, f)
    print(f"{len(ranked)} tokens of {len(counts)} seen ({len(tokens)} counted) cover {covered:.1%} of them: {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
