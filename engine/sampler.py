"""Batched, batch-invariant token sampler.

Randomness
----------
All randomness comes from a counter-based hash, never from a stateful RNG.
A row is identified by ``(seed, counter)`` (``counter`` = output position of
the token being sampled).  ``uniform(seeds, counters, n, stream)[r, j]`` is

    u = ((murmur3_32(words, seed=HASH_SEED) >> 9) + 0.5) / 2**23        in (0, 1)

where ``murmur3_32`` is the standard MurmurHash3 x86_32 over the 24-byte
little-endian key ``words = [seed_lo, seed_hi, counter_lo, counter_hi,
stream, j]`` (32-bit words of the int64 seed/counter, two's complement).  All
arithmetic is done exactly in int64 torch ops on values < 2**49 (32x32-bit
products are split into 16-bit halves), so CPU and CUDA give bit-identical
uniforms and a row's draws do not depend on which other rows share the batch
or on their order. On the CPU the per-element part runs as one native pass
in uint32 arithmetic where the native kernels are built (`cpu_kernels`):
the same bits.

Token sampling uses ``stream = STREAM_SAMPLE`` (0) and ``j`` = token index:
``token = argmax_j(processed_logits[j] / T - log(-log(u_j)))`` over the allowed
tokens (Gumbel-max, i.e. exact categorical sampling).  Other consumers (e.g.
speculative decoding's accept/reject) must use a different ``stream``.

Processing order (per row)
--------------------------
1. logit_bias (added), then min_tokens masking (``stop_ids_to_mask`` -> -inf)
2. repetition penalty over prompt+output tokens (logit > 0: divided, else
   multiplied)
3. presence/frequency over output tokens: ``logit -= freq*count + pres*(count>0)``
4. greedy rows: argmax (ties -> lowest index)
5. other rows: temperature, top-k, top-p, min-p, Gumbel-max.

top-k/top-p/min-p are applied as value thresholds, so tokens tied with the
last kept token are kept too (deterministic, independent of sort stability).
Logprobs are the raw model distribution: ``log_softmax(logits)`` as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .sampling_params import SamplingParams

__all__ = [
    "uniform",
    "gumbel_argmax",
    "derive_seed",
    "RowInput",
    "SamplingBatch",
    "PenaltyCounts",
    "SamplerOutput",
    "Sampler",
    "apply_logit_processors",
    "apply_sampling_transforms",
    "STREAM_SAMPLE",
    "HASH_SEED",
]

# ----------------------------------------------------------------------------
# Counter-based hash -> uniforms
# ----------------------------------------------------------------------------

STREAM_SAMPLE = 0  # stream used by Sampler for token sampling (and speculative decoding's coupled draws)
# speculative decoding's rejection rule (engine/speculative.py, requests without a seed): the draft model's draws,
# the accept/reject test of each drafted token, and the draw from the residual
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RESIDUAL = 3
HASH_SEED = 0x5EED5A3D  # murmur3 seed of the hash (fixed forever: changing it changes outputs)

_M32 = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_N = 0xE6546B64
_F1 = 0x85EBCA6B
_F2 = 0xC2B2AE35
_KEY_BYTES = 24  # six 32-bit words
_INT64_MASK = (1 << 64) - 1


def _mul32(h: Tensor, c: int) -> Tensor:
    """``(h * c) mod 2**32`` for int64 ``h`` in [0, 2**32), exact and overflow-free.

    May reuse ``h``'s storage.  For ``c >= 2**31`` the product is split as
    ``h*(c - 2**31) + (h & 1) * 2**31`` (both terms and their sum < 2**63), so
    no int64 intermediate overflows on any device.
    """
    if c < (1 << 31):
        return h.mul_(c).bitwise_and_(_M32)
    t = (h & 1).bitwise_left_shift_(31)
    return torch.add(t, h, alpha=c - (1 << 31)).bitwise_and_(_M32)


def _rotl(h: Tensor, r: int) -> Tensor:
    t = h >> (32 - r)
    return h.bitwise_left_shift_(r).bitwise_and_(_M32).bitwise_or_(t)


def _k_mix(k: Tensor) -> Tensor:
    """murmur3's per-word scramble of k (may reuse k's storage)."""
    return _mul32(_rotl(_mul32(k, _C1), 15), _C2)


def _fmix32(h: Tensor) -> Tensor:
    h.bitwise_xor_(h >> 16)
    h = _mul32(h, _F1)
    h.bitwise_xor_(h >> 13)
    h = _mul32(h, _F2)
    return h.bitwise_xor_(h >> 16)


def _row_state(seeds: Tensor, counters: Tensor, stream: int) -> Tensor:
    """murmur3 state [R] after the first five words (seed, counter, stream)."""
    s = seeds.to(torch.int64)
    c = counters.to(torch.int64)
    h = torch.full_like(s, HASH_SEED)
    words = (
        s & _M32,
        (s >> 32) & _M32,  # arithmetic shift, masked: two's complement high word
        c & _M32,
        (c >> 32) & _M32,
        torch.full_like(s, stream & _M32),
    )
    for w in words:
        h = _rotl(h.bitwise_xor_(_k_mix(w)), 13).mul_(5).add_(_N).bitwise_and_(_M32)
    return h


_NATIVE_MIN_ELEMS = 4096  # below, the torch ops' own cost is small


def _native(device: torch.device, elems: int):
    """The native CPU kernels' module (`cpu_kernels`) for a pass over `elems`
    elements on `device`, or None: not on the CPU, too small, or not built."""
    if device.type != "cpu" or elems < _NATIVE_MIN_ELEMS:
        return None
    from stepserve.engine.cpu_kernels import paged_decode_module

    return paged_decode_module()


def _hash_parts(seeds: Tensor, counters: Tensor, n: int, stream: int, offset: int = 0) -> tuple[Tensor, Tensor]:
    """The small vectors behind `uniform`: each row's murmur3 state after its
    five words, and each column's mixed word, both rotated (int64 [R], [n]).
    Last murmur3 block: h = rotl(h_row ^ k_j, 13) * 5 + N; rotl distributes
    over xor, so both rotations are done on the small vectors."""
    cols = torch.arange(offset, offset + n, dtype=torch.int64, device=seeds.device).bitwise_and_(_M32)
    return _row_hash(seeds, counters, stream), _rotl(_k_mix(cols), 13)


def _row_hash(seeds: Tensor, counters: Tensor, stream: int) -> Tensor:
    """`_hash_parts`' row part: each row's murmur3 state after its five words, rotated (int64 [R])."""
    return _rotl(_row_state(seeds, counters.to(seeds.device, non_blocking=True), stream), 13)


def uniform(seeds: Tensor, counters: Tensor, n: int, stream: int = 0, offset: int = 0) -> Tensor:
    """Counter-based uniforms in (0, 1): float32 tensor [R, n].

    ``out[r, j]`` depends only on ``(seeds[r], counters[r], stream, offset + j)``
    (see the module docstring for the exact definition), never on the other
    rows, the batch size, or the device.  ``seeds``/``counters`` are 1-D
    integer tensors of equal length (int64; any value).  ``stream`` (an int in
    [0, 2**32)) separates independent uses of the same (seed, counter);
    ``STREAM_SAMPLE`` (0) is the one ``Sampler`` uses for tokens.  ``offset``
    shifts the column index (to compute a slice of a wide row).
    """
    if seeds.dim() != 1 or counters.shape != seeds.shape:
        raise ValueError("seeds and counters must be 1-D tensors of the same length")
    if not 0 <= stream <= _M32:
        raise ValueError(f"stream must be in [0, 2**32), got {stream}")
    device = seeds.device
    h_row, k_col = _hash_parts(seeds, counters, n, stream, offset)
    native = _native(device, h_row.numel() * n)
    if native is not None:  # the [R, n] part in uint32, the same bits (256 x 4,096: 15-16 ms to 0.4-0.6 ms)
        return native.hash_uniform(h_row, k_col)
    h = h_row[:, None] ^ k_col[None, :]
    h.mul_(5).add_(_N).bitwise_and_(_M32).bitwise_xor_(_KEY_BYTES)
    h = _fmix32(h)
    # top 23 bits -> (x + 0.5) / 2**23: exact in float32, strictly inside (0, 1)
    u = h.bitwise_right_shift_(9).to(torch.float32)
    return u.mul_(2.0 ** -23).add_(2.0 ** -24)


def _to_int64(x: int) -> int:
    """Map any Python int onto the signed int64 range (mod 2**64)."""
    x &= _INT64_MASK
    return x - (1 << 64) if x >= (1 << 63) else x


def derive_seed(seed: int, index: int) -> int:
    """A well-mixed int64 seed for child ``index`` of a request seeded ``seed``.

    Use it for ``n > 1`` (each child sequence needs its own seed, otherwise all
    children draw the same tokens).  splitmix64 of the pair; pure Python.
    """
    x = (_to_int64(seed) & _INT64_MASK) ^ ((index + 1) * 0x9E3779B97F4A7C15 & _INT64_MASK)
    for _ in range(2):
        x = (x + 0x9E3779B97F4A7C15) & _INT64_MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _INT64_MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _INT64_MASK
        x ^= x >> 31
    return _to_int64(x)


# ----------------------------------------------------------------------------
# Batch description
# ----------------------------------------------------------------------------


@dataclass
class RowInput:
    """One row to sample this step.

    ``seed``: the sequence's seed (``params.seed`` or one the engine drew;
    use ``derive_seed`` for the children of ``n > 1``).  ``counter``: output
    position of the token being sampled (``len(output_ids)`` normally).
    ``stop_ids_to_mask``: EOS/stop ids to forbid this step because
    ``min_tokens`` is not yet reached (the caller decides).  Token id
    sequences may be lists, tuples, numpy arrays or CPU tensors.  All token
    ids (these and ``params.logit_bias``'s keys) must lie in
    ``[0, vocab_size)``; ``SamplingBatch.build`` does not check them (the
    engine checks a request's ids once, as it enters).
    """

    params: SamplingParams
    seed: int
    counter: int
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids_to_mask: Sequence[int] = ()
    # an output constraint (a grammar) already masked this row's logits: where `stop_ids_to_mask` would
    # leave none of its tokens, the constraint's stand (`apply_logit_processors`)
    constrained: bool = False
    # the sequence sampled (with `token_ids`, `prompt_len`, `seq_id` and `finished`), where a
    # `PenaltyCounts` keeps its penalties' counts from step to step instead of `output_ids`/`prompt_ids`
    seq: object = None


def row_input(seq, ahead: Sequence[int] = (), counts: bool = False) -> RowInput:
    """The row that samples `seq`'s next token, or -- `ahead`: tokens drafted
    after its last one (speculative decoding) -- the token after those: its
    counter, penalties and min_tokens masking count them as output.
    `counts`: the batch is built with a `PenaltyCounts`, which counts the
    row's tokens itself (not with `ahead`)."""
    params = seq.sampling
    n_out = seq.num_output + len(ahead)
    mask = ()
    constrained = False
    if n_out < seq.min_tokens:
        mask = tuple(seq.stop_token_ids) + (() if seq.ignore_eos else tuple(seq.eos_token_ids))
        constrained = getattr(seq, "logits_processor", None) is not None
    output = ()
    prompt = ()
    if params.needs_penalties:
        if not ahead and counts:
            return RowInput(params=params, seed=seq.seed, counter=n_out, stop_ids_to_mask=mask,
                            constrained=constrained, seq=seq)
        output = seq.output_ids + list(ahead) if ahead else seq.output_ids
        if params.repetition_penalty != 1.0:
            prompt = seq.token_ids[: seq.prompt_len]
    return RowInput(
        params=params,
        seed=seq.seed,
        counter=n_out,
        prompt_ids=prompt,
        output_ids=output,
        stop_ids_to_mask=mask,
        constrained=constrained,
    )


def fill_placeholders(ids: Tensor, prev: Tensor) -> None:
    """Replaces, in place, each placeholder -1 - k in `ids` by `prev[k]` (the
    step in flight's k-th sampled token, on the same device): no host sync."""
    if prev.numel() == 0:
        return
    src = (-ids - 1).clamp_(0, prev.numel() - 1)
    torch.where(ids < 0, prev[src], ids, out=ids)


def _ids_array(ids) -> np.ndarray:
    if isinstance(ids, Tensor):
        return ids.detach().to("cpu", torch.int64).numpy().reshape(-1)
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def _padded_ids(seqs: list[np.ndarray], pad: int) -> np.ndarray:
    width = max((len(s) for s in seqs), default=0)
    out = np.full((len(seqs), max(width, 1)), pad, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


class PenaltyCounts:
    """The penalties' counts of the sequences being sampled, kept on the
    device from step to step: per sequence, how often each token occurs in
    its output, and (for a repetition penalty) which tokens its prompt holds.
    A step adds only the tokens a sequence gained since its last (one,
    normally), so the host's work per step grows with the rows, not with
    their outputs: rebuilding every row's counts from its whole output took
    1.9 ms of host time per step at 64 rows of 1,000 output tokens (8 ms at
    256 rows), and cost the CPU engine 15% of its throughput at 64 rows of
    512 tokens. An output token that is still a placeholder (the overlap
    schedule's, -1 - k) is read from the step in flight on the device.

    A sequence takes a row of `counts` the first time it is sampled with
    penalties and gives it back once it has finished (`rows` looks each
    step). Outputs only grow while a sequence runs (the scheduler cuts one
    only as it ends it); one seen shorter than it was counted, or with
    another prompt, is counted again from the start."""

    def __init__(self, vocab_size: int, device, capacity: int = 16):
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.counts = torch.zeros(capacity, self.vocab_size, dtype=torch.float32, device=self.device)
        self.prompt: Optional[Tensor] = None  # bool [capacity, V], made when a repetition penalty first asks
        self._slot: dict[int, int] = {}  # seq_id -> its row
        self._seq: dict[int, object] = {}  # seq_id -> the sequence (to see it finish)
        self._counted: list[int] = [0] * capacity  # per row: output tokens counted
        self._prompt_len: list[int] = [-1] * capacity  # per row: the prompt length counted (-1: free)
        self._has_prompt: list[bool] = [False] * capacity  # per row: its prompt mask is written
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def live(self) -> int:
        """Sequences holding a row."""
        return len(self._slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        if self.prompt is not None:
            self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
        self._counted += [0] * old
        self._prompt_len += [-1] * old
        self._has_prompt += [False] * old
        self._free = list(range(2 * old - 1, old - 1, -1))

    def _release_finished(self) -> None:
        for sid, seq in [(sid, seq) for sid, seq in self._seq.items() if seq.finished]:
            slot = self._slot.pop(sid)
            del self._seq[sid]
            self._prompt_len[slot] = -1
            self._free.append(slot)

    def rows(self, seqs: list, prompts: bool, prev_tokens: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        """For `seqs`, in order: their output counts [P, V] (float32) and,
        with `prompts`, which tokens their prompt or output holds [P, V]
        (bool; else None)."""
        self._release_finished()
        slots, new_rows, new_toks, fresh = [], [], [], []
        for seq in seqs:
            sid = seq.seq_id
            slot = self._slot.get(sid)
            plen = seq.prompt_len
            n_out = len(seq.token_ids) - plen
            if slot is None:
                if not self._free:
                    self._grow()
                slot = self._free.pop()
                self._slot[sid] = slot
                self._seq[sid] = seq
                fresh.append(slot)
                self._counted[slot] = 0
                self._has_prompt[slot] = False
            elif self._prompt_len[slot] != plen or self._counted[slot] > n_out:
                fresh.append(slot)  # counted against another prompt, or a longer output: again
                self._counted[slot] = 0
                self._has_prompt[slot] = False
            self._prompt_len[slot] = plen
            done = self._counted[slot]
            if done < n_out:
                new_toks.extend(seq.token_ids[plen + done :])
                new_rows.extend([slot] * (n_out - done))
                self._counted[slot] = n_out
            slots.append(slot)
        dev = self.device
        if fresh:
            self.counts.index_fill_(0, torch.tensor(fresh, dtype=torch.int64).to(dev), 0.0)
        if new_toks:
            toks = torch.tensor(new_toks, dtype=torch.int64)
            has_placeholder = int(toks.min()) < 0
            toks = toks.to(dev, non_blocking=True)
            if has_placeholder:
                if prev_tokens is None:
                    raise ValueError("output ids hold placeholders for a step's tokens, but no prev_tokens")
                fill_placeholders(toks, prev_tokens)
            where = torch.tensor(new_rows, dtype=torch.int64).to(dev, non_blocking=True)
            self.counts.index_put_((where, toks), torch.ones((), dtype=torch.float32, device=dev), accumulate=True)
        idx = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        counts = self.counts.index_select(0, idx)
        if not prompts:
            return counts, None
        if self.prompt is None:
            self.prompt = torch.zeros(self.counts.shape, dtype=torch.bool, device=dev)
        todo = [(slot, seq) for slot, seq in zip(slots, seqs) if not self._has_prompt[slot]]
        if todo:
            rows = torch.tensor([slot for slot, _ in todo], dtype=torch.int64).to(dev)
            self.prompt.index_fill_(0, rows, False)
            ids = [_ids_array(seq.token_ids[: seq.prompt_len]) for _, seq in todo]
            pad = torch.from_numpy(_padded_ids(ids, pad=self.vocab_size)).to(dev, non_blocking=True)
            mask = torch.zeros(len(todo), self.vocab_size + 1, dtype=torch.bool, device=dev)
            mask.scatter_(1, pad, True)
            self.prompt.index_copy_(0, rows, mask[:, : self.vocab_size])
            for slot, _ in todo:
                self._has_prompt[slot] = True
        return counts, self.prompt.index_select(0, idx) | (counts > 0)


@dataclass
class SamplingBatch:
    """Device tensors describing R rows, plus host-side flags for fast paths.

    Per-row tensors ([R]): temperature (1.0 on greedy rows), top_p, top_k
    (int64, ``vocab_size`` when off), min_p, seeds, counters, greedy (bool).

    Penalties are stored only for the rows that need them: ``penalty_rows``
    [P] (``None`` when every row needs them, meaning rows 0..R-1), with
    per-penalty-row ``repetition_penalty``/``presence_penalty``/
    ``frequency_penalty`` [P], ``seen_mask`` [P, V] bool (token occurs in
    prompt or output; only when some row has a repetition penalty) and
    ``output_counts`` [P, V] float32 (only when some row has presence or
    frequency penalties).

    Sparse extras: logit bias as (``bias_rows``, ``bias_tokens``,
    ``bias_values``) triples; min_tokens masks as (``mask_rows``,
    ``mask_tokens``) pairs.

    ``random_rows``: indices of non-greedy rows (``None`` when all rows are
    non-greedy).  Flags (``all_greedy``, ``any_top_k`` ...) are Python bools so
    the sampler never syncs with the device to decide what to run.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    min_p: Tensor
    seeds: Tensor
    counters: Tensor
    greedy: Tensor
    random_rows: Optional[Tensor] = None
    all_greedy: bool = False
    any_temperature: bool = False  # some non-greedy row has temperature != 1
    any_top_k: bool = False  # some non-greedy row has 1 < top_k < V
    max_top_k: int = 0  # max effective top_k over those rows
    any_top_p: bool = False  # some non-greedy row has top_p < 1
    any_min_p: bool = False  # some non-greedy row has min_p > 0
    # penalties
    any_penalties: bool = False
    any_repetition_penalty: bool = False
    any_presence_frequency: bool = False
    penalty_rows: Optional[Tensor] = None
    repetition_penalty: Optional[Tensor] = None
    presence_penalty: Optional[Tensor] = None
    frequency_penalty: Optional[Tensor] = None
    seen_mask: Optional[Tensor] = None
    output_counts: Optional[Tensor] = None
    # logit bias / min_tokens
    any_logit_bias: bool = False
    bias_rows: Optional[Tensor] = None
    bias_tokens: Optional[Tensor] = None
    bias_values: Optional[Tensor] = None
    any_masked: bool = False
    mask_rows: Optional[Tensor] = None
    mask_tokens: Optional[Tensor] = None
    masked_constrained: Optional[Tensor] = None  # rows both masked and constrained (`RowInput.constrained`)
    # logprobs
    max_num_logprobs: Optional[int] = None  # None: nobody asked; else max over rows

    @property
    def needs_processing(self) -> bool:
        """Whether logits must be modified before the greedy argmax."""
        return self.any_logit_bias or self.any_masked or self.any_penalties

    @classmethod
    def build(cls, rows: list[RowInput], vocab_size: int, device=None,
              prev_tokens: Optional[Tensor] = None, counts: "PenaltyCounts | None" = None) -> "SamplingBatch":
        """`prev_tokens` (overlap schedule): the tokens of the step still in
        flight, on `device`. An output id -1 - k (`Scheduler.advance`'s
        placeholder for its k-th sample) counts as `prev_tokens[k]`, read on
        the device, so penalties need no host sync. `counts`: where the rows
        that carry their `seq` have their penalties' counts kept (every
        penalty row must, then)."""
        device = torch.device(device if device is not None else "cpu")
        R, V = len(rows), int(vocab_size)
        if V < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        greedy = [r.params.greedy for r in rows]
        temperature, top_p, top_k, min_p = [], [], [], []
        for r, g in zip(rows, greedy):
            p = r.params
            if g:  # sampling knobs are irrelevant for greedy rows
                temperature.append(1.0)
                top_p.append(1.0)
                top_k.append(V)
                min_p.append(0.0)
            else:
                temperature.append(float(p.temperature))
                top_p.append(float(p.top_p))
                top_k.append(min(p.top_k, V) if p.top_k > 0 else V)
                min_p.append(float(p.min_p))
        floats = torch.tensor([temperature, top_p, min_p], dtype=torch.float32).reshape(3, R)
        ints = torch.tensor(
            [top_k, [_to_int64(r.seed) for r in rows], [int(r.counter) for r in rows]],
            dtype=torch.int64,
        ).reshape(3, R)
        floats = floats.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        rand_idx = [i for i, g in enumerate(greedy) if not g]
        batch = cls(
            num_rows=R,
            vocab_size=V,
            device=device,
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            top_k=ints[0],
            seeds=ints[1],
            counters=ints[2],
            greedy=torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True),
            all_greedy=len(rand_idx) == 0,
        )
        if rand_idx and len(rand_idx) < R:
            batch.random_rows = torch.tensor(rand_idx, dtype=torch.int64).to(device, non_blocking=True)
        batch.any_temperature = any(temperature[i] != 1.0 for i in rand_idx)
        ks = [top_k[i] for i in rand_idx if top_k[i] < V]
        batch.any_top_k = bool(ks)
        batch.max_top_k = max(ks, default=0)
        batch.any_top_p = any(top_p[i] < 1.0 for i in rand_idx)
        batch.any_min_p = any(min_p[i] > 0.0 for i in rand_idx)

        # ---- penalties: one padded id tensor + scatter, only for rows needing them
        pen_idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
        if pen_idx:
            P = len(pen_idx)
            ps = [rows[i].params for i in pen_idx]
            batch.any_penalties = True
            batch.any_repetition_penalty = any(p.repetition_penalty != 1.0 for p in ps)
            batch.any_presence_frequency = any(
                p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in ps
            )
            if P < R:
                batch.penalty_rows = torch.tensor(pen_idx, dtype=torch.int64).to(device, non_blocking=True)
            pen = torch.tensor(
                [
                    [float(p.repetition_penalty) for p in ps],
                    [float(p.presence_penalty) for p in ps],
                    [float(p.frequency_penalty) for p in ps],
                ],
                dtype=torch.float32,
            ).reshape(3, P).to(device, non_blocking=True)
            batch.repetition_penalty, batch.presence_penalty, batch.frequency_penalty = pen
            if counts is not None:
                seqs = [rows[i].seq for i in pen_idx]
                if any(seq is None for seq in seqs):
                    raise ValueError("with PenaltyCounts every penalty row carries its seq (row_input(counts=True))")
                out_counts, seen = counts.rows(seqs, batch.any_repetition_penalty, prev_tokens)
                if batch.any_presence_frequency:
                    batch.output_counts = out_counts
                batch.seen_mask = seen
                pen_idx = ()  # done
        if pen_idx:
            outs = [_ids_array(rows[i].output_ids) for i in pen_idx]
            out_np = _padded_ids(outs, pad=V)
            out_pad = torch.from_numpy(out_np).to(device, non_blocking=True)
            if out_np.size and out_np.min() < 0:
                if prev_tokens is None:
                    raise ValueError("output ids hold placeholders for a step's tokens, but no prev_tokens")
                fill_placeholders(out_pad, prev_tokens)
            cnt = torch.zeros(P, V + 1, dtype=torch.float32, device=device)
            cnt.scatter_add_(1, out_pad, torch.ones(out_pad.shape, dtype=torch.float32, device=device))
            cnt = cnt[:, :V]
            if batch.any_presence_frequency:
                batch.output_counts = cnt.contiguous()
            if batch.any_repetition_penalty:
                prompts = [_ids_array(rows[i].prompt_ids) for i in pen_idx]
                pr_pad = torch.from_numpy(_padded_ids(prompts, pad=V)).to(device, non_blocking=True)
                seen = torch.zeros(P, V + 1, dtype=torch.bool, device=device)
                seen.scatter_(1, pr_pad, True)
                batch.seen_mask = seen[:, :V] | (cnt > 0)

        # ---- logit bias (sparse triple)
        b_rows, b_toks, b_vals = [], [], []
        for i, r in enumerate(rows):
            if r.params.logit_bias:
                for tok, val in r.params.logit_bias.items():
                    b_rows.append(i)
                    b_toks.append(tok)
                    b_vals.append(float(val))
        if b_rows:
            batch.any_logit_bias = True
            batch.bias_rows = torch.tensor(b_rows, dtype=torch.int64).to(device, non_blocking=True)
            batch.bias_tokens = torch.tensor(b_toks, dtype=torch.int64).to(device, non_blocking=True)
            batch.bias_values = torch.tensor(b_vals, dtype=torch.float32).to(device, non_blocking=True)

        # ---- min_tokens masks (sparse pairs)
        m_rows, m_toks = [], []
        for i, r in enumerate(rows):
            if len(r.stop_ids_to_mask) == 0:
                continue
            ids = _ids_array(r.stop_ids_to_mask)
            if ids.size:
                m_rows.extend([i] * ids.size)
                m_toks.extend(ids.tolist())
        if m_rows:
            batch.any_masked = True
            batch.mask_rows = torch.tensor(m_rows, dtype=torch.int64).to(device, non_blocking=True)
            batch.mask_tokens = torch.tensor(m_toks, dtype=torch.int64).to(device, non_blocking=True)
            held = [i for i, r in enumerate(rows) if r.constrained and len(r.stop_ids_to_mask)]
            if held:
                batch.masked_constrained = torch.tensor(held, dtype=torch.int64).to(device, non_blocking=True)

        # ---- logprobs
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        batch.max_num_logprobs = min(max(asked), V) if asked else None
        return batch


# ----------------------------------------------------------------------------
# Logit processing
# ----------------------------------------------------------------------------


def gumbel_argmax(s: Tensor, seeds: Tensor, counters: Tensor, stream: int = STREAM_SAMPLE,
                  max_chunk_elems: int = 1 << 24) -> Tensor:
    """Per row of the scores `s` [R, V], the first column maximising
    s - log(-log u), u = uniform(seeds, counters, V, stream): a draw from
    softmax(s) keyed on each row's (seed, counter) alone (int64 [R]). On CUDA
    one Triton kernel (`triton_sampling`), on the CPU one native pass (the
    same uniforms; the logs musl's, within an ulp of torch's), else torch ops
    in chunks of `max_chunk_elems` // V rows (the [rows, V] temporaries)."""
    n, V = s.shape
    if s.is_cuda:
        from . import triton_sampling

        if triton_sampling.available(s):  # (before the row hashes: torch ops the fallback would not use)
            got = triton_sampling.gumbel_argmax(s, _row_hash(seeds, counters, stream))
            if got is not None:
                return got
    native = _native(s.device, n * V) if s.dtype == torch.float32 else None
    if native is not None:
        h_row, k_col = _hash_parts(seeds, counters, V, stream)
        return native.gumbel_argmax(s if s.stride(1) == 1 else s.contiguous(), h_row, k_col)
    step = max(1, max_chunk_elems // max(V, 1))
    outs = []
    for start in range(0, n, step):
        end = min(n, start + step)
        w = uniform(seeds[start:end], counters[start:end], V, stream)
        w.log_().neg_().log_()  # -w is Gumbel(0, 1) = -log(-log u)
        outs.append(argmax_rows(torch.sub(s[start:end], w)))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def argmax_rows(x: Tensor) -> Tensor:
    """Row-wise argmax of a 2-D tensor; ties and NaNs resolve as in torch (the
    first maximum, a NaN counting as the maximum). On CPU in float32 numpy's
    vectorised argmax does it: 4-20x faster than torch's for 64 rows of 4k to
    128k logits (measured: 757 -> 35 us at 4k, 22.8 -> 5.2 ms at 128k)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(x.numpy().argmax(axis=1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


def apply_logit_processors(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 1-3: logit bias, min_tokens masking, repetition, presence/frequency.

    Returns a new float32 [R, V] tensor (``logits`` is never modified); the
    result is what greedy rows take the argmax of, before temperature.
    """
    x = logits.to(torch.float32, copy=True)
    if batch.any_logit_bias:
        x.index_put_((batch.bias_rows, batch.bias_tokens), batch.bias_values, accumulate=True)
    if batch.any_masked:
        held = batch.masked_constrained  # a constraint outranks min_tokens: where the mask leaves none of its
        before = x.index_select(0, held) if held is not None else None  # tokens, they stay (on the device)
        x.index_put_((batch.mask_rows, batch.mask_tokens), torch.tensor(-math.inf, device=x.device))
        if held is not None:
            sub = x.index_select(0, held)
            dead = ~(sub > -math.inf).any(dim=1, keepdim=True)
            x.index_copy_(0, held, torch.where(dead, before, sub))
    if batch.any_penalties:
        rows = batch.penalty_rows
        sub = x if rows is None else x.index_select(0, rows)
        if batch.any_repetition_penalty:
            rp = batch.repetition_penalty[:, None]
            penalised = torch.where(sub > 0, sub / rp, sub * rp)
            sub = torch.where(batch.seen_mask, penalised, sub)
        if batch.any_presence_frequency:
            c = batch.output_counts
            sub = sub - batch.frequency_penalty[:, None] * c - batch.presence_penalty[:, None] * (c > 0)
        if rows is None:
            x = sub
        else:
            x.index_copy_(0, rows, sub)
    return x


def apply_sampling_transforms(
    x: Tensor,
    temperature: Tensor,
    top_k: Optional[Tensor],
    top_p: Optional[Tensor],
    min_p: Optional[Tensor],
    max_top_k: int = 0,
) -> Tensor:
    """Step 5 minus the draw: temperature, top-k, top-p, min-p.

    ``x`` [N, V] (not modified), per-row parameter tensors [N] (pass ``None``
    to skip a transform).  Returns ``x / T`` with disallowed tokens at -inf;
    its softmax is the exact distribution the Gumbel-max draw samples from.
    ``max_top_k`` > 0 lets top-k alone use ``topk`` instead of a full sort.
    """
    s = x / temperature[:, None]
    V = s.shape[-1]
    if top_p is not None:
        s = _top_k_top_p(s, top_k, top_p)
    elif top_k is not None:
        sorted_vals = s.topk(min(max_top_k, V), dim=-1).values if max_top_k > 0 else s.sort(dim=-1, descending=True).values
        s = s.masked_fill(s < _kth(sorted_vals, top_k, V), -math.inf)
    if min_p is not None:
        # p_i < min_p * p_max  <=>  s_i < s_max + log(min_p)   (log 0 = -inf: no-op)
        thr = s.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
        s = s.masked_fill(s < thr, -math.inf)
    return s


TOP_P_CANDIDATES = 256  # the sorted candidates top-p looks at before it sorts a whole row


def _kth(sorted_vals: Tensor, top_k: Tensor, V: int) -> Tensor:
    """Each row's top-k threshold [N, 1] from its values sorted descending
    (all V of them, or at least its k); -inf where top-k is off (k >= V)."""
    kk = (top_k.clamp(1, sorted_vals.shape[-1]) - 1)[:, None]
    return sorted_vals.gather(1, kk).masked_fill(top_k[:, None] >= V, -math.inf)


def _nucleus_cutoff(sorted_vals: Tensor, probs: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """(the top-p threshold [N, 1], how many sorted positions it keeps
    [N, 1]) from values sorted descending and their probabilities: position
    i is kept iff the mass before it is under top_p; -inf where top_p >= 1."""
    cum = probs.cumsum(dim=-1)
    cum_excl = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)
    n_keep = (cum_excl < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    cutoff = sorted_vals.gather(1, n_keep - 1)
    return torch.where(top_p[:, None] < 1.0, cutoff, torch.full_like(cutoff, -math.inf)), n_keep


def _top_k_top_p_sorted(s: Tensor, top_k: Optional[Tensor], top_p: Tensor) -> Tensor:
    """Top-k (if given), then top-p over whole rows sorted."""
    V = s.shape[-1]
    sorted_vals = s.sort(dim=-1, descending=True).values
    if top_k is not None:
        kth = _kth(sorted_vals, top_k, V)
        s = s.masked_fill(s < kth, -math.inf)
        sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, -math.inf)
    cutoff, _ = _nucleus_cutoff(sorted_vals, sorted_vals.softmax(dim=-1), top_p)
    return s.masked_fill(s < cutoff, -math.inf)


def _top_k_top_p(s: Tensor, top_k: Optional[Tensor], top_p: Tensor, candidates: int = 0) -> Tensor:
    """Top-k, then top-p, without sorting whole rows where it can: each row's
    `TOP_P_CANDIDATES` largest values (`topk`: 5x less than a sort of 256
    rows of 4,096, 15x of 32,000, on the CPU) settle its nucleus when the
    nucleus ends inside them, with its probabilities over the whole row (or
    over its top k, which the candidates then hold: k <= the candidates and
    the last candidate below the k-th value, ties included). The other rows
    (flatter distributions, a larger k) try 4x as many candidates, and so
    on, until that reaches the row's length and the row is sorted whole.
    Which way a row goes depends on the row alone, so a row's result does
    not depend on its batch; the ways keep the same tokens but for rounding
    of the cumulative mass at the cutoff."""
    N, V = s.shape
    K = min(V, candidates or TOP_P_CANDIDATES)
    if K >= V or N == 0:
        return _top_k_top_p_sorted(s, top_k, top_p)
    cand = s.topk(K, dim=-1).values  # sorted descending
    m = cand[:, :1]
    if top_k is not None:
        kth = _kth(cand, top_k, V)
        k_on = top_k[:, None] < V
        settled = ~k_on | ((top_k[:, None] <= K) & (cand[:, -1:] < kth))
        cand = cand.masked_fill(cand < kth, -math.inf)
        # the mass over the row's top k (all among the candidates where settled), or over the whole row
        denom = torch.where(k_on, torch.exp(cand - m).sum(-1, keepdim=True), torch.exp(s - m).sum(-1, keepdim=True))
    else:
        kth, settled = None, torch.ones_like(m, dtype=torch.bool)
        denom = torch.exp(s - m).sum(-1, keepdim=True)
    cutoff, n_keep = _nucleus_cutoff(cand, torch.exp(cand - m) / denom, top_p)
    settled &= (n_keep < K) | (top_p[:, None] >= 1.0)  # the first position past the nucleus is a candidate
    out = s if kth is None else s.masked_fill(s < kth, -math.inf)
    out = out.masked_fill(out < cutoff, -math.inf)
    rest = (~settled).flatten().nonzero().flatten()
    if rest.numel():
        out.index_copy_(0, rest, _top_k_top_p(s.index_select(0, rest), None if top_k is None else
                                              top_k.index_select(0, rest), top_p.index_select(0, rest), 4 * K))
    return out


# ----------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------


@dataclass
class SamplerOutput:
    """``token_ids`` [R] int64.  ``logprobs`` [R] float32: raw-model logprob of
    the chosen token (``None`` unless some row asked for logprobs).
    ``top_ids``/``top_logprobs`` [R, K]: the K most likely tokens, sorted
    descending, K = max logprobs asked by any row (``None`` when K == 0).
    Rows that asked for fewer (or none) should slice/ignore."""

    token_ids: Tensor
    logprobs: Optional[Tensor] = None
    top_ids: Optional[Tensor] = None
    top_logprobs: Optional[Tensor] = None


class Sampler:
    """Stateless batched sampler: ``Sampler()(logits [R, V], batch)``.

    ``max_chunk_elems`` bounds the [rows, V] int64 temporaries of the Gumbel
    draw: random rows are drawn in chunks of ``max_chunk_elems // V`` rows
    (per-row results do not depend on the chunking).
    """

    def __init__(self, max_chunk_elems: int = 1 << 24):
        self.max_chunk_elems = int(max_chunk_elems)

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows or logits.shape[1] != batch.vocab_size:
            raise ValueError(
                f"logits shape {tuple(logits.shape)} does not match the batch "
                f"({batch.num_rows}, {batch.vocab_size})"
            )
        want_logprobs = batch.max_num_logprobs is not None

        # Fast path: all greedy, nothing to modify, no logprobs -> one argmax.
        if batch.all_greedy and not batch.needs_processing and not want_logprobs:
            return SamplerOutput(token_ids=argmax_rows(logits))

        x = apply_logit_processors(logits, batch) if batch.needs_processing else logits.float()
        if batch.all_greedy:
            tokens = argmax_rows(x)
        else:
            tokens = self.draw(x, batch)

        out = SamplerOutput(token_ids=tokens)
        if want_logprobs:
            logp = torch.log_softmax(logits.float(), dim=-1)
            out.logprobs = logp.gather(1, tokens[:, None]).squeeze(1)
            k = batch.max_num_logprobs
            if k > 0:
                out.top_logprobs, out.top_ids = logp.topk(k, dim=-1)
        return out

    def draw(self, x: Tensor, batch: SamplingBatch) -> Tensor:
        """Each row's token from its processed logits `x`: greedy rows' argmax,
        random rows' Gumbel-max sample keyed on (seed, counter) in
        STREAM_SAMPLE. Speculative verification draws each position with it
        too (`speculative.verify_rows`), so its tokens are plain decoding's."""
        rr = batch.random_rows  # None: every row is random
        sub = x if rr is None else x.index_select(0, rr)

        def pick(t: Optional[Tensor], flag: bool) -> Optional[Tensor]:
            if not flag:
                return None
            return t if rr is None else t.index_select(0, rr)

        temperature = batch.temperature if rr is None else batch.temperature.index_select(0, rr)
        if batch.any_temperature or batch.any_top_k or batch.any_top_p or batch.any_min_p:
            sub = apply_sampling_transforms(
                sub,
                temperature,
                pick(batch.top_k, batch.any_top_k),
                pick(batch.top_p, batch.any_top_p),
                pick(batch.min_p, batch.any_min_p),
                max_top_k=batch.max_top_k,
            )
        seeds = pick(batch.seeds, True)
        counters = pick(batch.counters, True)
        rand_tokens = self._gumbel_argmax(sub, seeds, counters)
        if rr is None:
            return rand_tokens
        tokens = argmax_rows(x)  # greedy rows
        return tokens.index_copy_(0, rr, rand_tokens)

    def _gumbel_argmax(self, s: Tensor, seeds: Tensor, counters: Tensor) -> Tensor:
        return gumbel_argmax(s, seeds, counters, STREAM_SAMPLE, self.max_chunk_elems)
