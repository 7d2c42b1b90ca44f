"""Cost of one step's output deltas on the engine-process pipe.

Builds a realistic decode step (64 requests, one token each, a short text,
a few with logprobs; optionally some first deltas, with token-id or text
prompts) and measures, median over many repeats:

- child:  encode_batch + pickle.dumps of the batch as `emit` sends it
          (and the two apart);
- parent: pickle.loads + decode_batch, the `RequestOutput`s the front end
          dispatches (and loads apart).

    .venv/bin/python tools/bench_wire.py [--repeats 5000] [--first 4] [--text-prompts]

`--baseline FILE` also measures an engine_process.py from before the typed
wire (plain tuples: `to_wire`/`from_wire`), interleaved with the current one
so that both see the same machine load, e.g.

    git show 8afc8fc:engine/engine_process.py > /tmp/engine_process_before.py
    .venv/bin/python tools/bench_wire.py --baseline /tmp/engine_process_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import pickle
import random
import statistics
import time

from stepserve.engine import engine_process as ep
from stepserve.engine.request import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

WORDS = [" the", " of", "ing", " and", ",", " a", " to", "ed", " in", " is", ".", " that", "\n", " it", " model"]


def make_step(n: int = 64, with_logprobs: int = 4, top: int = 2, first: int = 0, text_prompts: bool = False,
              prompt_len: int = 512, seed: int = 0) -> tuple[list[tuple[str, RequestOutput]], dict[str, object]]:
    """(the loop's outputs for one step, the prompts as the front end sent them).
    The first `first` requests are on their first delta, the last one finishes."""
    rng = random.Random(seed)
    outputs, sent = [], {}
    for i in range(n):
        rid = f"cmpl-{rng.getrandbits(128):032x}"
        ids = [rng.randrange(32000) for _ in range(prompt_len)]
        text = " ".join(rng.choice(WORDS).strip() or "x" for _ in range(prompt_len)) if text_prompts else None
        sent[rid] = text if text_prompts else ids
        tok = rng.randrange(32000)
        lp = i < with_logprobs
        done = i == n - 1
        o = CompletionOutput(
            index=0, text=rng.choice(WORDS), token_ids=[tok], finish_reason="length" if done else None,
            stop_reason=None,
            logprobs=[TokenLogprob(tok, -0.25, [(tok, -0.25)] + [(rng.randrange(32000), -2.0)] * (top - 1))]
            if lp else None,
            cumulative_logprob=-12.5 if lp else None,
        )
        arrival = 1000.0 + i
        out = RequestOutput(rid, text, ids, [o], done, 128 * (i % 4), RequestMetrics(
            arrival, arrival + 0.05, arrival + 2.0 if done else None))
        outputs.append((rid, out))
    return outputs, {"sent": sent, "first": {rid for rid, _ in outputs[:first]}, "text": text_prompts}


class Current:
    name = "typed (OutputBatch)"

    def __init__(self, step, state):
        self.step = step
        self.first = state["first"]
        self.text = state["text"]
        self.sent = state["sent"]

    def child_state(self):  # the ids the parent lacks: first deltas of text prompts
        return set(self.first) if self.text else set()

    def parent_state(self):  # what send() recorded, resolved for the requests past their first delta
        return {rid: self.sent[rid] if rid in self.first else ep.KnownPrompt(out.prompt, out.prompt_token_ids)
                for rid, out in self.step}

    def encode(self, owed):
        return ep.encode_batch(self.step, [], owed)

    def dumps(self, batch):
        return pickle.dumps(batch, ep._PROTO)

    def decode(self, buf, prompts):
        return ep.decode_batch(pickle.loads(buf), prompts)


class Baseline:
    """The plain-tuple wire, driven as its `emit` and `_recv_loop` did."""

    name = "tuples (before)"

    def __init__(self, module, step, state):
        self.m = module
        self.step = step
        self.first = state["first"]
        self.sent = state["sent"]

    def child_state(self):  # `announced`: requests past their first delta
        return {rid for rid, _ in self.step if rid not in self.first}

    def parent_state(self):
        return {rid: (out.prompt, out.prompt_token_ids) for rid, out in self.step if rid not in self.first}

    def encode(self, announced):
        wire = []
        for rid, out in self.step:
            first = rid not in announced
            if out.finished:
                announced.discard(rid)
            elif first:
                announced.add(rid)
            wire.append((rid, self.m.to_wire(out, first)))
        return ("out", wire, [])

    def dumps(self, msg):
        return pickle.dumps(msg, self.m._PROTO)

    def decode(self, buf, prompts):
        _, wire, replies = pickle.loads(buf)
        outputs = []
        for rid, w in wire:
            prompt = w[4] or prompts.get(rid, (None, []))
            out = self.m.from_wire(rid, w, prompt)
            if out.finished:
                prompts.pop(rid, None)
            elif w[4] is not None:
                prompts[rid] = prompt
            outputs.append((rid, out))
        return outputs, replies


def measure(codecs, repeats: int) -> dict[str, dict[str, float]]:
    times = {c.name: {k: [] for k in ("encode", "dumps", "encode+dumps", "loads", "loads+decode")} for c in codecs}
    bufs = {c.name: c.dumps(c.encode(c.child_state())) for c in codecs}
    for _ in range(repeats):
        for c in codecs:  # interleaved: each repeat sees the same machine load for every codec
            t = times[c.name]
            owed = c.child_state()
            t0 = time.perf_counter()
            batch = c.encode(owed)
            t1 = time.perf_counter()
            c.dumps(batch)
            t2 = time.perf_counter()
            t["encode"].append(t1 - t0)
            t["dumps"].append(t2 - t1)
            owed = c.child_state()
            t0 = time.perf_counter()
            c.dumps(c.encode(owed))
            t["encode+dumps"].append(time.perf_counter() - t0)
            buf = bufs[c.name]
            t0 = time.perf_counter()
            pickle.loads(buf)
            t["loads"].append(time.perf_counter() - t0)
            prompts = c.parent_state()
            t0 = time.perf_counter()
            c.decode(buf, prompts)
            t["loads+decode"].append(time.perf_counter() - t0)
    res = {name: {k: statistics.median(v) * 1e6 for k, v in t.items()} for name, t in times.items()}
    for c in codecs:
        res[c.name]["bytes"] = len(bufs[c.name])
    return res


def check_same_outputs(codecs) -> None:
    """Every codec rebuilds the loop's outputs."""
    for c in codecs:
        outputs, _ = c.decode(c.dumps(c.encode(c.child_state())), c.parent_state())
        assert outputs == c.step, f"{c.name}: rebuilt outputs differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--logprobs", type=int, default=4, help="how many requests ask for logprobs")
    ap.add_argument("--first", type=int, default=0, help="how many requests are on their first delta")
    ap.add_argument("--text-prompts", action="store_true", help="prompts sent as text (ids tokenized in the child)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5000)
    ap.add_argument("--baseline", help="an engine_process.py with the old to_wire/from_wire, measured alongside")
    a = ap.parse_args()
    step, state = make_step(a.requests, a.logprobs, first=a.first, text_prompts=a.text_prompts,
                            prompt_len=a.prompt_len)
    codecs: list = []
    if a.baseline:
        spec = importlib.util.spec_from_file_location("engine_process_baseline", a.baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        codecs.append(Baseline(mod, step, state))
    codecs.append(Current(step, state))
    check_same_outputs(codecs)
    res = measure(codecs, a.repeats)
    print(f"{a.requests} requests, {a.logprobs} with logprobs, {a.first} first deltas "
          f"({'text' if a.text_prompts else 'token-id'} prompts of {a.prompt_len}), median of {a.repeats}, us:")
    cols = ["encode", "dumps", "encode+dumps", "loads", "loads+decode", "bytes"]
    print(f"{'':22s}" + "".join(f"{k:>14s}" for k in cols))
    for name, r in res.items():
        print(f"{name:22s}" + "".join(f"{r[k]:14.1f}" if k != "bytes" else f"{r[k]:14d}" for k in cols))


if __name__ == "__main__":
    main()
