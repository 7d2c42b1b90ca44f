"""The flat ragged batch one forward pass runs over.

Rows are ordered decode-first: the first `num_decode` rows contribute exactly one
token each (tokens [0, num_decode)), the remaining rows are *extend* rows (prefill
chunks, or multi-token verify rows) whose tokens follow contiguously. Every row
reads its whole context -- cached prefix, earlier tokens and the tokens of this
step -- through KV slot indices; the new tokens' K/V are written to `out_slots`
before attention runs, so a row attends to itself through the same index list.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """The token tensors live on the model's device; the KV bookkeeping a
    backend plans from -- the req->token table, the decode rows' table rows
    and context lengths, the extend rows' slot lists -- on the host, where the
    scheduler keeps it (`kvcache/pool.py`): a backend on a device sends what
    it reads of it."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    out_slots: torch.Tensor  # int64 [T]: KV slot each new token writes
    # decode part: rows [0, num_decode), one token each; row b's context is
    # req_to_token[decode_rows[b], :decode_kv_lens[b]] (incl. the new token)
    num_decode: int
    req_to_token: torch.Tensor  # int64 [max_rows, max_context], host
    decode_rows: torch.Tensor | None  # int64 [B], host
    decode_kv_lens: torch.Tensor | None  # int64 [B], host
    # extend part, per row: (first token index in the flat batch, number of new
    # tokens, KV slot indices of the whole context [prefix_len + n], host)
    extend_rows: list[tuple[int, int, torch.Tensor]]
    logits_indices: torch.Tensor  # int64 [R]: flat token index whose logits are sampled
    # flat token indices whose final hidden states the model returns beside the
    # logits (prompt logprobs: their logits are computed in chunks)
    hidden_indices: torch.Tensor | None = None
    # trailing padding tokens (id 0, position 0, written to the padding slot 0)
    # that round the token count up to a shape bucket; no row reads them
    num_padding: int = 0
    # the output head runs on the logits rows rounded up to a bucket (`logits_rows`; copies of the last row, dropped
    # after): set where the tokens are padded too (a verify row has k + 1 logits rows, so their count would
    # otherwise be a new matmul shape at each k and batch size)
    pad_logits: bool = False


def to_device(parts: list, device: torch.device, host_parts: list = ()) -> list[torch.Tensor]:
    """int64 tensors of each sequence of ints in `parts` on `device`, then of
    each in `host_parts` on the host, through one host array: on the CPU one
    tensor cut in pieces, and off it one copy for `parts`: a step's index
    tensors cost one transfer, not one each (~15 us apiece on a GPU)."""
    flat: list[int] = []
    for p in (*parts, *host_parts):
        flat.extend(p if isinstance(p, list) else p.tolist())
    sizes = [len(p) for p in parts]
    host_sizes = [len(p) for p in host_parts]
    host = torch.from_numpy(np.array(flat, dtype=np.int64))  # (from a list: 3x faster than torch.tensor at 300)
    if device.type == "cpu":
        return list(host.split_with_sizes(sizes + host_sizes))
    # on a GPU, from pinned memory without blocking: the host goes on (overlap schedule) while the copy waits
    # for the step before it (torch's pinned allocator keeps the block until the copy is done)
    n = sum(sizes)
    flat_dev = host[:n].pin_memory().to(device, non_blocking=True)
    return list(flat_dev.split_with_sizes(sizes)) + list(host[n:].split_with_sizes(host_sizes))


class ShapeLog:
    """The forward shapes a model has run, (tokens, output head rows): a
    forward of a new one pays one-off work on top (oneDNN's kernel builds for
    each new row count of a bf16 matmul on the CPU: 0.4-0.5 ms per shape
    against 0.04 ms warm, measured on the 2-core Xeon with AMX; both counts
    are padded to buckets where that applies)."""

    def __init__(self):
        self._seen: set[tuple[int, int]] = set()

    def first_run(self, fb: "ForwardBatch") -> bool:
        """Whether `fb`'s shape is new (and it is logged as run)."""
        shape = (fb.input_ids.numel(), logits_rows(fb.logits_indices.numel(), fb.pad_logits))
        if shape in self._seen:
            return False
        self._seen.add(shape)
        return True

    def clear(self) -> None:
        self._seen.clear()


def logits_rows(n: int, padded: bool) -> int:
    """The rows the output head runs on for n logits rows (`ForwardBatch.pad_logits`): up to 8, the next power
    of two (a plain decode step of one row keeps its one: the embedded model's head costs 140 us at 1 row
    and 158 at 8 on the 2-core Xeon), beyond, the `token_bucket`."""
    if not padded or n <= 2:
        return n
    return 1 << (n - 1).bit_length() if n <= 8 else token_bucket(n)


def pads(n: int, pads_from: int | None) -> bool:
    """Whether a forward of n tokens (or an output head of n rows) is padded
    to a `token_bucket`, for a model that pads from `pads_from` tokens
    (`LlamaForCausalLM.pads_from`; None: never)."""
    return pads_from is not None and n >= pads_from


def token_bucket(n: int) -> int:
    """Token count rounded up to one of ~50 shapes up to 2,048: multiples of 8
    up to 64, of 16 up to 256, of 64 up to 2,048, and beyond, 16 per doubling
    (CPU bf16 matmuls build a kernel per shape, and oneDNN keeps the last
    1,024: a bf16 model's runner and draft pad their batches to these, and a
    float32 model's bf16 products of many rows their rows, `SmallBatchLinear`)."""
    step = 8 if n <= 64 else 16 if n <= 256 else 64 if n <= 2048 else 1 << (n.bit_length() - 5)
    return -(-n // step) * step
