"""Speculative decoding, the engine's side: proposers and exact verification.

The speculation-length policy (`scheduler/speculation.py`) turns a decode row
into a *verify row* before slots are allocated: `ScheduledRow.draft_len` = k
and 1 + k KV slots, for the sequence's pending token and up to k drafted
tokens. In the model runner, the proposer fills `row.draft`; the target model
then computes all 1 + len(draft) positions in the one
forward pass of the step, as decode-shaped queries (each attends to its
context through the req->token table, like any decode row, so the native CPU
decode kernel and every backend serve them as they are); `verify_rows`
accepts a prefix of each draft and samples one token more. The scheduler then
keeps the KV of what was accepted and frees the rest (`Scheduler._update_verify`).

Exactness:
- A greedy row accepts the longest prefix of its draft that equals the
  target's argmax at each position, then takes the target's argmax: its output
  is, token for token, the output without speculation.
- A sampled row of a request that gave its `seed` draws each position's
  token exactly as plain decoding draws it: the Gumbel-max sample of the
  target's distribution p with the noise keyed on (seed, output position) in
  the sampler's own stream (`STREAM_SAMPLE`, `sampler.uniform`), and a
  drafted token is accepted when it equals that sample (`accept_test`). So
  its output is, token for token, its output without speculation, whatever
  the draft lengths and so whatever the batch. The draft model draws with the
  same noise (the Gumbel coupling), so it proposes the target's sample
  wherever the two models agree enough: a drafted token is accepted with
  probability P(argmax(log q + g) = argmax(log p + g)), at least
  (1 - TV) / (1 + TV) of the two distributions.
- A sampled row of a request without a seed (whose tokens nobody can
  reproduce anyway) takes the standard rejection rule (Leviathan et al.,
  Chen et al., 2023; `rejection_test`), which accepts the most any rule can,
  1 - TV: a drafted token d, drawn from q (`row.draft_probs`; one-hot for a
  deterministic proposal) with noise of its own (`STREAM_DRAFT`), is
  accepted with probability min(1, p(d) / q(d)) (`STREAM_ACCEPT`); the
  first rejected position draws from the residual max(0, p - q),
  renormalised (`STREAM_RESIDUAL`); after a fully accepted draft the token
  is plain decoding's draw. Its tokens then depend on the draft lengths.
  Measured with the embedded pair at temperature 0.8, fixed:4 (32 requests
  of 64 tokens): 0.49-0.50 of drafted tokens accepted under this rule, 0.43 under
  the coupling. A deterministic proposal d (n-gram) is accepted with
  probability p(d) under either rule.
- Either way each token has the target's distribution p: p after every
  sampling parameter, applied as if the drafts before it were already
  output (logit bias, min_tokens masks, penalties, temperature, top-k,
  top-p, min-p).
- Logprobs are the target model's (the raw distribution, as without
  speculation), for every token emitted.

A constrained request (a logits processor, e.g. a grammar) never speculates:
its processor advances with each token it sees.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from stepserve.engine.cpu_kernels import paged_decode_module
from stepserve.engine.forward_batch import ForwardBatch, ShapeLog, pads, to_device, token_bucket
from stepserve.engine.inference import inference
from stepserve.engine.sampler import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    Sampler,
    SamplingBatch,
    apply_logit_processors,
    apply_sampling_transforms,
    argmax_rows,
    gumbel_argmax,
    row_input,
    uniform,
)
from stepserve.scheduler.plan import ScheduledRow, StepPlan
from stepserve.scheduler.speculation import PROPOSERS
# A draft entry of at most this many tokens runs as decode-shaped queries (one
# per token, in the batched decode attention) rather than as an extend row (an
# attention call per row and layer: at batch 64 with fixed:1, 3,500 calls made
# 30% of the step's time on the 2-core CPU). Each query reads its whole context,
# so a long entry (an unseen prompt) stays an extend row, except in a forward
# of few enough tokens to run as one native call (`native_step_tokens`).
DECODE_SHAPED_MAX = 16


class Proposer(Protocol):
    name: str
    cold: bool  # the last `propose` ran a forward of a shape it had not run before (`ShapeLog`)

    def handed_out(self, slots) -> None:
        """The KV slots every step hands out (`StepPlan.slots`), drafting or
        not: whatever a proposer kept for them is stale."""

    def propose(self, plan: StepPlan) -> None:
        """Sets `draft` (at most `draft_len` tokens) and `draft_probs` (the
        distributions drafts drawn under the rejection rule came from,
        [len(draft), V], else None) on each of `plan.verify_rows`."""


# ---------------------------------------------------------------------------
# n-gram (prompt lookup)
# ---------------------------------------------------------------------------


BULK_NGRAMS = 16  # `NgramProposer._index` adds more new tokens than this per size with zip, fewer one by one


class _NgramIndex:
    """A sequence's n-grams (`NgramProposer.propose_for`): `tables[n - 1]`
    maps each n-gram ending before position `upto` to the latest position it
    ends at, and `prev[n - 1][i]` is the position where the n-gram ending at
    i ended before (-1: nowhere, or no n-gram of that size ends at i), so the
    latest end before any position is a walk back along it
    (`NgramProposer.matches_for`)."""

    __slots__ = ("upto", "tables", "prev")

    def __init__(self, max_n: int):
        self.upto = 0
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n)]
        self.prev: list[list[int]] = [[] for _ in range(max_n)]


class NgramProposer:
    """Prompt lookup: finds the latest earlier occurrence of the sequence's last
    n tokens (n from `max_n` down to `min_n`; the longest match wins, then the
    most recent) and proposes the tokens that followed it, as many as asked
    for: a match closer to the end than that (a loop) is taken to go on
    repeating. No model, no KV."""

    name = "ngram"
    cold = False  # no forwards

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def handed_out(self, slots) -> None:
        pass  # no KV

    def propose(self, plan: StepPlan) -> None:
        for r in plan.verify_rows:
            if r.draft is None:  # (set already when the speculation-length policy drafted, given `propose_for`)
                r.draft = self.propose_for(r.seq, r.draft_len)

    def lookup(self, ids: list[int], k: int) -> list[int]:
        """The proposal after `ids`, searched afresh (`propose_for` keeps an
        index per sequence instead, and proposes the same)."""
        return self._lookup(np.asarray(ids, dtype=np.int64), len(ids), k)

    def propose_for(self, seq, k: int) -> list[int]:
        """`lookup` of the sequence's tokens, from an index of its n-grams
        that it keeps (`seq.ngram_index`) and extends by the tokens added
        since: a few dict reads per step instead of a scan of the whole
        history (58 us a row at 170 tokens on the 2-core Xeon, against a
        2 ms batch-1 step)."""
        ids = seq.token_ids
        last = len(ids) - 1
        if k <= 0 or last < self.min_n:
            return []
        tables = self._index(seq, last).tables
        for n in range(min(self.max_n, last + 1), self.min_n - 1, -1):  # the longest match, its latest occurrence
            i = tables[n - 1].get(tuple(ids[last - n + 1 :]))
            if i is not None:
                period = last - i
                return [ids[i + 1 + j % period] for j in range(k)]
        return []

    def _index(self, seq, last: int) -> _NgramIndex:
        """The sequence's index (`seq.ngram_index`) with every n-gram ending
        before position `last` (built again if the history was cut short)."""
        ids = seq.token_ids
        index = seq.ngram_index
        if index is None or index.upto > last:
            index = seq.ngram_index = _NgramIndex(self.max_n)
        lo, hi = self.min_n, self.max_n
        tables, prev = index.tables, index.prev
        a = index.upto
        if last - a > BULK_NGRAMS:
            # a prompt: per size, the n-grams ending at a..last-1 made by zip in one pass (2x faster than
            # the loop below at a 104-token prompt: 57 us against 118 on the 2-core EPYC), where a step's
            # token or two are cheaper through the loop
            for n in range(1, hi + 1):
                pv = prev[n - 1]
                s = last if n < lo else min(max(a, n - 1), last)  # (an n-gram ends at n - 1 at the earliest)
                pv.extend([-1] * (s - a))
                t = tables[n - 1]
                get = t.get
                for i, g in zip(range(s, last), zip(*[ids[s - n + 1 + j : last - n + 1 + j] for j in range(n)])):
                    pv.append(get(g, -1))  # a later end overwrites, and keeps the one before
                    t[g] = i
        else:
            for i in range(a, last):
                for n in range(1, hi + 1):
                    if lo <= n <= i + 1:
                        g = tuple(ids[i - n + 1 : i + 1])
                        t = tables[n - 1]
                        prev[n - 1].append(t.get(g, -1))
                        t[g] = i
                    else:
                        prev[n - 1].append(-1)
        index.upto = last
        return index

    def matches_for(self, seq, start: int, stop: int, k: int) -> list[int]:
        """For each position p in [start, stop), how many of the k tokens
        `lookup` proposes after the sequence's tokens before p agree with
        its tokens from p (what the speculation length replays on its
        history), from the index `propose_for` keeps: the
        latest end of an n-gram before a position is its latest end now,
        walked back along `_NgramIndex.prev` past the position. A few dict
        and list reads per position, and the index is built once for both,
        where a vectorised scan of the whole history paid numpy's fixed
        costs on every call: 0.29 ms for a replay of 8-16 positions at batch
        1 on the 2-core EPYC."""
        ids = seq.token_ids
        out = [0] * max(stop - start, 0)
        lo, hi = self.min_n, self.max_n
        first = max(start, lo + 1)  # (`lookup` proposes nothing before min_n + 1 tokens)
        if k <= 0 or first >= stop:
            return out
        index = self._index(seq, len(ids) - 1)
        tables, prev = index.tables, index.prev
        end = len(ids)
        # per n-gram met in this call, its ends walked so far from the latest, negated (ascending): the
        # positions come in order, so each chain is walked once and then bisected (walked afresh for each
        # position, a 4,000-token loop of one token took 113 ms to replay)
        walked: dict = {}
        for p in range(first, stop):
            last = p - 1
            for n in range(min(hi, p), lo - 1, -1):  # the longest match, its latest occurrence before last
                g = tuple(ids[p - n : p])
                j = tables[n - 1].get(g)
                if j is None:
                    continue
                if j >= last:
                    neg = walked.get((n, g))
                    if neg is None:
                        neg = walked[(n, g)] = [-j]
                    back = prev[n - 1]
                    while -neg[-1] >= last and back[-neg[-1]] >= 0:  # (-1: the chain ends)
                        neg.append(-back[-neg[-1]])
                    i = bisect.bisect_right(neg, -last)  # the first end below last
                    if i == len(neg):
                        continue  # none: every end of this n-gram is at or past last
                    j = -neg[i]
                period, m = last - j, 0
                while m < k and p + m < end and ids[j + 1 + m % period] == ids[p + m]:
                    m += 1
                out[p - start] = m
                break
        return out

    def _lookup(self, arr: np.ndarray, n_ids: int, k: int) -> list[int]:
        """The proposal after arr[:n_ids]."""
        if n_ids < self.min_n + 1 or k <= 0:
            return []
        last = n_ids - 1
        cand = np.flatnonzero(arr[:last] == arr[last])  # earlier positions holding the last token
        if cand.size == 0:
            return []
        # matched length of each candidate, backwards, up to max_n
        length = np.ones(cand.size, dtype=np.int64)
        alive = np.ones(cand.size, dtype=bool)
        for t in range(1, self.max_n):
            if last - t < 0:
                break
            back = cand - t
            ok = alive & (back >= 0)
            ok[ok] = arr[back[ok]] == arr[last - t]
            alive = ok
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return []
        i = int(cand[np.flatnonzero(length == best)[-1]])  # the most recent of the longest
        # what followed it; where that runs into the end of the history (a match `period` tokens back,
        # fewer than k), the history is taken to go on repeating with that period: a proposal that
        # stopped there would leave a loop shorter than k (a repeated phrase, a list's pattern)
        # drafting its period and no more, and each row's drafts short of what the policy asked for
        period = last - i
        return arr[i + 1 + np.arange(k) % period].tolist()


# ---------------------------------------------------------------------------
# draft model
# ---------------------------------------------------------------------------


class DraftModelProposer:
    """A small model that shares the target's tokenizer drafts k tokens, one
    decode step at a time.

    Its KV lives in a pool of its own indexed by the *same* slot ids as the
    target's (`pool`: same number of slots, the draft's layers and heads), so
    the radix tree, the allocator and the req->token table serve both: a
    prefix-cache hit is a hit for the draft too. The draft's KV is written
    lazily, only when a row speculates, so `valid[slot]` says whether the
    draft's KV of that slot is written: it is cleared when the slot is handed
    out (every slot of every step's plan, drafting or not: `handed_out`), and
    set when the draft writes it. A row's first draft step starts at its first
    position without draft KV (its prompt, the first time; the tokens decoded
    while it did not speculate; or the last token of a fully accepted draft)
    and ends at its pending token.
    """

    name = "draft"

    def __init__(self, model, backend, pool, req_pool, device: torch.device, token_map: torch.Tensor | None = None):
        self.model = model
        self.backend = backend
        self.pool = pool
        self.req_pool = req_pool
        self.device = device
        self.vocab_size = model.config.vocab_size
        # the speculative token map (`load_token_map`): the tokens the draft may propose, or None (all). Its
        # one-call greedy steps score only those (an output head of their rows: `head_rows`); elsewhere the
        # draft's other logits are masked, so that both propose the same tokens
        self.token_map = token_map
        self._head = self._outside = None
        if token_map is not None:
            self._outside = torch.ones(self.vocab_size, dtype=torch.bool, device=device)
            self._outside[token_map.to(device)] = False
            if model.native_step_tokens(backend):
                pad = -len(token_map) % 16  # (panels of 16 columns: the last id again, never the first maximum)
                self._head = model.head_rows(torch.cat([token_map, token_map[-1:].expand(pad)]))
        # on the host, with the slots and the req->token table it is read through (`kvcache/pool.py`)
        self._valid = torch.zeros(pool.num_slots, dtype=torch.bool)
        self._stale: list[torch.Tensor] = []  # slots handed out since the flags were last brought up to date
        self.pads_from = model.pads_from()  # forwards of this many tokens are padded to a bucket (None: never)
        self.fold_tokens = model.fold_step_tokens(backend)  # a forward of at most this many: one native call
        self.forwards = 0  # draft forward passes run
        self.shapes = ShapeLog()  # the draft's forward shapes (`cold`: the last `propose` ran a new one)
        self.cold = False
        native = paged_decode_module() if device.type == "cpu" else None
        self._native = native if hasattr(native, "first_unmarked") else None

    def handed_out(self, slots) -> None:
        """Every step's new slots, whether it drafts or not: the draft KV they
        held belongs to whoever had them before. (Cleared only in steps that
        drafted, a slot taken again by a prompt's prefill or by a request that
        does not speculate still read as written: the draft then attended to
        another sequence's KV, and drafted worse.) The flags are read and
        written only while drafting, so the slots are kept until then (or
        until 64 steps' worth) and cleared in one call: a call per step cost
        as much as the rest of a plain step's speculation bookkeeping."""
        self._stale.append(slots)
        if len(self._stale) >= 64:
            self._clear_stale()

    def _clear_stale(self) -> None:
        if self._stale:
            stale = self._stale[0] if len(self._stale) == 1 else torch.cat(self._stale)
            self._stale = []
            self._valid.index_fill_(0, stale, False)

    @property
    def valid(self) -> torch.Tensor:
        """Per slot: whether the draft's KV of it is written."""
        self._clear_stale()
        return self._valid

    @inference
    def propose(self, plan: StepPlan) -> None:
        self._clear_stale()
        self.cold = False
        rows = plan.verify_rows
        for r in rows:
            r.draft, r.draft_probs = [], None
        first = self._first_unwritten(rows)
        entries = [(r.seq.row, p, r.seq.token_ids[p : r.start + 1]) for r, p in zip(rows, first)]
        if self._native_greedy(rows, entries):
            return
        active = list(range(len(rows)))
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        step = 0
        while active:
            logits = self._forward(entries)
            step += 1
            drafted, q = self._sample([rows[i] for i in active], logits)
            still = []
            for j, i in enumerate(active):
                r = rows[i]
                r.draft.append(drafted[j])
                if q is not None and q[j] is not None:
                    probs[i].append(q[j])
                if step < r.draft_len:
                    still.append(i)
            active = still
            entries = [(rows[i].seq.row, rows[i].start + step, [rows[i].draft[-1]]) for i in active]
        for r, pr in zip(rows, probs):
            if pr:
                r.draft_probs = torch.stack(pr)

    def _first_unwritten(self, rows: list[ScheduledRow]) -> list[int]:
        """Each row's first position without draft KV (its pending token's
        slot is new this step, so one is always found)."""
        table = self.req_pool.table
        host = torch.from_numpy(np.array([r.seq.row for r in rows] + [r.start + 1 for r in rows], dtype=np.int64))
        if self._native is not None:  # one scan in C++, not six torch ops (~0.4 ms a step at batch 1)
            return self._native.first_unmarked(self._valid, table, host[: len(rows)], host[len(rows) :]).tolist()
        seq_rows, lens = host.view(2, -1)
        lmax = int(lens.max())
        idx = table[seq_rows, :lmax]
        ok = self._valid[idx] & (torch.arange(lmax)[None, :] < lens[:, None])
        return (~ok).to(torch.int8).argmax(dim=1).tolist()

    def _native_greedy(self, rows: list[ScheduledRow], entries: list[tuple[int, int, list[int]]]) -> bool:
        """All of `propose`'s draft steps as one native call
        (`greedy_draft_steps`), where every row is plain greedy and every
        entry decode-shaped, on the one-call CPU decode path; False (nothing
        done) otherwise. Same forwards and argmax as the step loop, so the
        same drafts."""
        if self.device.type != "cpu" or not all(r.seq.plain_greedy for r in rows):
            return False
        n = sum(len(e[2]) for e in entries)
        if not self.model.native_greedy_steps_ok(n, self.backend):  # (any entry: every query is decode-shaped)
            return False
        ids, pos, tok_rows, last = _flatten(entries, range(len(entries)))
        steps = [r.draft_len for r in rows]
        R = len(rows)
        parts = torch.from_numpy(np.array(ids + pos + tok_rows + last + steps, dtype=np.int64)).split_with_sizes(
            [n, n, n, R, R])
        out = self.model.greedy_draft_steps(*parts, self.req_pool.table, self._valid, self.backend, head=self._head)
        for r, toks in zip(rows, out.tolist()):
            r.draft = toks[: r.draft_len]
        self.forwards += max(steps)
        return True

    def _forward(self, entries: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """One draft forward over (req->token row, first position, tokens)
        entries, writing their draft KV; logits at each entry's last token, in
        entry order. An entry of up to `DECODE_SHAPED_MAX` tokens (a row
        catching up on the tokens its last verify accepted) runs as that many
        decode-shaped queries, each reading its context through the table, as
        a verify row does in the target; only a longer one (a prompt the draft
        has not seen) runs as an extend row, one attention call of its own,
        unless the whole forward is few enough tokens to run as one native
        call (`native_step_tokens`), where every entry is decode-shaped."""
        dev = self.device
        short = DECODE_SHAPED_MAX
        if sum(len(e[2]) for e in entries) <= self.fold_tokens:
            short = 1 << 62  # one native call: every entry decode-shaped
        dec = [k for k, e in enumerate(entries) if len(e[2]) <= short]
        ext = [k for k, e in enumerate(entries) if len(e[2]) > short]
        ids, pos, tok_rows, last = _flatten(entries, dec + ext)
        nd = sum(len(entries[k][2]) for k in dec)  # decode-shaped queries, first
        n = len(ids)
        pad = token_bucket(n) - n if pads(n, self.pads_from) else 0
        # padding: id 0 at position 0 of row 0, written to the padding slot
        zeros = [0] * pad
        positions = torch.tensor(pos + zeros, dtype=torch.long)
        rows = torch.tensor(tok_rows + zeros, dtype=torch.long)
        table = self.req_pool.table
        out_slots = table[rows, positions]
        if pad:
            out_slots[n:] = 0
        self._valid.index_fill_(0, out_slots[:n], True)
        extend_meta = []
        for k in ext:
            row, p, toks = entries[k]
            extend_meta.append((last[k] - len(toks) + 1, len(toks), table[row, : p + len(toks)]))
        input_ids, dev_positions, dev_slots, logits_indices = to_device([ids + zeros, positions, out_slots, last], dev)
        fb = ForwardBatch(
            input_ids=input_ids,
            positions=dev_positions,
            out_slots=dev_slots,
            num_decode=nd,
            req_to_token=table,
            decode_rows=rows[:nd] if nd else None,
            decode_kv_lens=(positions[:nd] + 1) if nd else None,
            extend_rows=extend_meta,
            logits_indices=logits_indices,
            num_padding=pad,
            pad_logits=pads(len(last), self.pads_from),
        )
        self.cold |= self.shapes.first_run(fb)
        logits, _ = self.model(fb, self.backend)
        self.forwards += 1
        return logits

    def _sample(self, rows: list[ScheduledRow], logits: torch.Tensor):
        """Each row's next draft token, drawn as the target draws it (greedy
        rows: argmax; sampled rows: from the draft's distribution after the
        same sampling parameters), and the distributions of the rows under
        the rejection rule (else None). A request that gave its seed draws
        with the noise of the target's draw at that position (the coupling:
        `verify_rows`); one without, with noise of its own (STREAM_DRAFT)."""
        if all(r.seq.plain_greedy for r in rows):
            return argmax_rows(self._in_map(logits)).tolist(), None
        inputs = [row_input(r.seq, r.draft) for r in rows]
        batch = SamplingBatch.build(inputs, self.vocab_size, self.device)
        x = apply_logit_processors(logits, batch) if batch.needs_processing else logits.float()
        x = self._in_map(x)
        std = [j for j, r in enumerate(rows) if _rejection_rule(r.seq)]
        # the target's draw for the coupled rows (seeded, sampled); the rejection rule's rows draw again below
        coupled = sum(not r.seq.sampling.greedy for r in rows) > len(std)
        tokens = _SAMPLER.draw(x, batch) if coupled else argmax_rows(x)
        q: list[torch.Tensor | None] = [None] * len(rows)
        if std:
            idx = torch.tensor(std, dtype=torch.long, device=x.device)
            s = _transformed(x.index_select(0, idx), batch, idx)
            draws = gumbel_argmax(s, batch.seeds.index_select(0, idx), batch.counters.index_select(0, idx), STREAM_DRAFT)
            tokens.index_copy_(0, idx, draws)
            p = torch.softmax(s, dim=-1)
            for j, i in enumerate(std):
                q[i] = p[j]
        return tokens.tolist(), q

    def _in_map(self, x: torch.Tensor) -> torch.Tensor:
        """The draft's logits with the tokens outside its token map masked
        (as they are as is without a map), except in a row where that leaves
        nothing (a request's processors masked every token of the map, as
        min_tokens does its stop tokens): that row keeps every token, so a
        draft distribution is never empty."""
        if self._outside is None:
            return x
        xm = x.masked_fill(self._outside, -math.inf)
        return torch.where(torch.isfinite(xm).any(dim=1, keepdim=True), xm, x)


TOKEN_MAP_FILE = "speculative_token_map.json"  # in a draft model's directory: its token map, used by default


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The speculative token map at `path`: the token ids a draft model may
    propose (as SGLang's `--speculative-token-map`: a draft over the
    vocabulary's frequent tokens, FR-Spec), a JSON list of ints or a `.pt`
    1-D integer tensor. Returned sorted and without repeats (int64). A
    draft's output head costs in proportion to its tokens: on the embedded
    draft, a head of 1,024 of the 4,096 is a quarter of the bytes each draft
    step reads. Output stays exact whatever the map: it only decides what
    can be drafted."""
    if path.endswith(".pt"):
        ids = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"speculative token map {path}: a 1-D integer tensor expected")
        ids = ids.tolist()
    else:
        with open(path) as f:
            ids = json.load(f)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"speculative token map {path}: a JSON list of token ids expected")
    if not ids:
        raise ValueError(f"speculative token map {path} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"speculative token map {path}: token ids {bad[:5]} are outside the vocabulary of {vocab_size}")
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


def _flatten(entries: list[tuple[int, int, list[int]]], order) -> tuple[list[int], list[int], list[int], list[int]]:
    """The tokens of (req->token row, first position, tokens) entries, taken
    in `order`, as flat ids, positions and rows, and per entry (in entry
    order) the flat index of its last token."""
    ids: list[int] = []
    pos: list[int] = []
    tok_rows: list[int] = []
    last = [0] * len(entries)
    for k in order:
        row, p, toks = entries[k]
        ids.extend(toks)
        pos.extend(range(p, p + len(toks)))
        tok_rows.extend([row] * len(toks))
        last[k] = len(ids) - 1
    return ids, pos, tok_rows, last


# ---------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------


def accept_test(target: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """The acceptance rule: a drafted token is accepted when it is the token
    the target draws at its position (-1: a row's last position, no draft)."""
    return target == drafted


def rejection_test(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """The standard rejection rule: a drafted token d is accepted when
    u < p(d) / q(d) (u uniform in (0, 1)), written without dividing by a q of 0."""
    return u * q_d < p_d


def _rejection_rule(seq) -> bool:
    """Whether a row is verified by the rejection rule: it samples, and its
    request gave no seed (so nobody can reproduce its tokens); every other
    row accepts a draft when it equals the token drawn (`accept_test`)."""
    return seq.sampling.seed is None and not seq.sampling.greedy


_SAMPLER = Sampler()


def _transformed(x: torch.Tensor, batch: SamplingBatch, rr: torch.Tensor) -> torch.Tensor:
    """`apply_sampling_transforms` on the rows `rr` of `batch` (x holds those rows)."""

    def pick(t, flag):
        return t.index_select(0, rr) if flag else None

    return apply_sampling_transforms(
        x,
        batch.temperature.index_select(0, rr),
        pick(batch.top_k, batch.any_top_k),
        pick(batch.top_p, batch.any_top_p),
        pick(batch.min_p, batch.any_min_p),
        max_top_k=batch.max_top_k,
    )


@dataclass
class VerifyOutput:
    tokens: list[int]  # per verify row: the token after its accepted drafts
    # per verify row that asked for logprobs (else None): (logprob, [(id, logprob)] top) per emitted token
    logprobs: list[list[tuple[float, list[tuple[int, float]]]] | None]


def verify_rows(rows: list[ScheduledRow], logits: torch.Tensor, vocab_size: int) -> VerifyOutput:
    """Accepts a prefix of each row's draft and picks the token after it.

    `logits` [Q, V]: the target's, row by row, at each of the row's 1 +
    len(draft) positions (position j predicts the token after the pending
    token and j drafts). Sets `row.num_accepted`."""
    offs = []
    o = 0
    for r in rows:
        offs.append(o)
        o += 1 + len(r.draft)
    if all(r.seq.plain_greedy for r in rows):
        target = argmax_rows(logits).tolist()
        tokens = []
        for r, o in zip(rows, offs):
            d = r.draft
            a = 0
            while a < len(d) and d[a] == target[o + a]:
                a += 1
            r.num_accepted = a
            tokens.append(target[o + a])
        return VerifyOutput(tokens, [None] * len(rows))

    device = logits.device
    inputs = [row_input(r.seq, r.draft[:j]) for r in rows for j in range(1 + len(r.draft))]
    batch = SamplingBatch.build(inputs, vocab_size, device)
    x = apply_logit_processors(logits, batch) if batch.needs_processing else logits.float()
    # each position's token as plain decoding draws it there (`Sampler.draw`); a drafted token is accepted when it
    # equals it
    fix = argmax_rows(x) if batch.all_greedy else _SAMPLER.draw(x, batch)
    drafted = torch.tensor([t for r in rows for t in (*r.draft, -1)], dtype=torch.long, device=device)
    accept = accept_test(fix, drafted)
    std = [o + j for r, o in zip(rows, offs) if _rejection_rule(r.seq) for j in range(1 + len(r.draft))]
    if std:  # sampled rows of requests without a seed: the rejection rule
        idx = torch.tensor(std, dtype=torch.long, device=device)
        s = _transformed(x.index_select(0, idx), batch, idx)
        p = torch.softmax(s, dim=-1)
        V = p.shape[1]
        d = drafted.index_select(0, idx)
        has = d >= 0  # positions that check a drafted token (not a row's last)
        # q: the draft's distribution at each checked position; one-hot for deterministic proposals
        q = torch.zeros(len(drafted), V, device=device)
        checked = (drafted >= 0).nonzero().squeeze(1)
        q[checked, drafted[checked]] = 1.0
        for r, o in zip(rows, offs):
            if r.draft_probs is not None:
                q[o : o + len(r.draft)] = r.draft_probs
        q = q.index_select(0, idx)
        seeds, counters = batch.seeds.index_select(0, idx), batch.counters.index_select(0, idx)
        dd = d.clamp(min=0)[:, None]
        pd = p.gather(1, dd).squeeze(1)
        qd = q.gather(1, dd).squeeze(1)
        u = uniform(seeds, counters, 1, STREAM_ACCEPT)[:, 0]
        ok = has & rejection_test(u, pd, qd)
        res_tok = gumbel_argmax((p - q).clamp_(min=0).log_(), seeds, counters, STREAM_RESIDUAL)
        accept.index_copy_(0, idx, ok)
        # a rejected draft's position takes the residual's draw; a row's last position keeps plain decoding's
        fix.index_copy_(0, idx, torch.where(has, res_tok, fix.index_select(0, idx)))
    acc = accept.tolist()
    fixed = fix.tolist()
    tokens = []
    for r, o in zip(rows, offs):
        a = 0
        while a < len(r.draft) and acc[o + a]:
            a += 1
        r.num_accepted = a
        tokens.append(fixed[o + a])
    lps: list = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.seq.sampling.logprobs is not None]
    if want:
        logp = torch.log_softmax(logits.float(), dim=-1)
        kmax = min(max(rows[i].seq.sampling.logprobs for i in want), vocab_size)
        for i in want:
            r, o = rows[i], offs[i]
            n = r.num_accepted + 1
            emitted = r.draft[: r.num_accepted] + [tokens[i]]
            sub = logp[o : o + n]
            chosen = sub.gather(1, torch.tensor(emitted, device=device)[:, None]).squeeze(1).tolist()
            kk = r.seq.sampling.logprobs
            if kk and kmax:
                tv, ti = sub.topk(kmax, dim=-1)
                tops = [list(zip(ti[j, :kk].tolist(), tv[j, :kk].tolist())) for j in range(n)]
            else:
                tops = [[] for _ in range(n)]
            lps[i] = list(zip(chosen, tops))
    return VerifyOutput(tokens, lps)


__all__ = ["PROPOSERS", "Proposer", "NgramProposer", "DraftModelProposer", "VerifyOutput", "verify_rows", "accept_test",
           "rejection_test"]
