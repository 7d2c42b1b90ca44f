"""flashinfer attention over the token-slot KV pool (CUDA).

With page size 1 the pool already is flashinfer's paged layout: a layer's K
buffer [slots, Hkv, D] viewed as [slots, 1, Hkv, D] is an NHD paged cache whose
page ids are slot ids, so a row's page list is its row of the req->token table
and no copy or conversion is needed.

The backend is planned once per step (`prepare`) and the plan is shared by all
layers (`forward`):
  - decode-shaped queries (decode rows, and each position of a speculative
    verify row, which reads its own prefix length) go through flashinfer's
    batch decode wrapper -- with tensor cores where the GQA group is at least
    `TENSOR_CORE_MIN_GROUP`;
  - extend rows (prefill chunks over a radix-cached prefix) go through the
    batch prefill wrapper, causal with the query aligned to the end of its
    context, which is exactly "prefix + chunk".
Planning reads only host data: the page index list is cut from the host's
req->token table (`kvcache/pool.py`) in numpy, into a pinned buffer, and
copied to the device without blocking the host (`PageListStaging`).

CUDA graphs (`engine/cuda_graph.py`) use a decode wrapper per batch-size bucket
whose index buffers have fixed addresses (`plan_graph`): the graph captures the
kernels once and each replay only re-plans into those buffers.
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

from stepserve.engine.forward_batch import ForwardBatch
from stepserve.kvcache import TokenKVPool

SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace (split-k partial results)
# decode runs flashinfer's tensor-core kernel (its prefill kernel, one query per
# row) when a KV head serves at least this many query heads. On an H200 with
# Llama-3-8B shapes (group 4) that kernel (fa2) beat the CUDA-core decode kernel
# at batch 1, 64 and 256 (5.05 / 6.95 / 13.08 against 5.23 / 7.19 / 14.13 ms a step)
TENSOR_CORE_MIN_GROUP = 4
# ... and its kernel family: fa2. flashinfer's "auto" picks fa3 on Hopper, whose
# paged path is slow with one token a page: on that H200, fa3 decode steps took
# 1.4x (Qwen2.5-1.5B shapes, group 6, batch 64) to 2.6x (batch 256) fa2's, and
# 1.55x with Llama-3-8B shapes at batch 64
TENSOR_CORE_BACKEND = "fa2"


def flashinfer_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the flashinfer backend cannot serve this model here (None: it can)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the KV dtype is {dtype}; flashinfer's kernels take float16 or bfloat16"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of flashinfer's {SUPPORTED_HEAD_DIMS}"
    try:
        importlib.import_module("flashinfer")
    except Exception as e:  # ImportError, or a broken CUDA toolchain found at import
        return f"flashinfer does not import ({type(e).__name__}: {e})"
    return None


def indptr_of(lengths: torch.Tensor | list[int], pad_ones: int = 0) -> torch.Tensor:
    """[0, l0, l0+l1, ...] as int32 on the host (flashinfer's planners read it
    there), then `pad_ones` more rows of length 1 each; numpy arithmetic, a
    few us a call where torch ops cost a few each."""
    lens = lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths, dtype=np.int64)
    n = len(lens)
    out = torch.empty(n + pad_ones + 1, dtype=torch.int32)
    o = out.numpy()
    o[0] = 0
    np.cumsum(lens, dtype=np.int32, out=o[1 : n + 1])
    o[n + 1 :] = np.arange(o[n] + 1, o[n] + pad_ones + 1, dtype=np.int32)
    return out


def paged_indices(table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, pad: int = 0,
                  out: np.ndarray | None = None) -> torch.Tensor:
    """table[rows[b], :lens[b]] for every b, concatenated, then `pad` zeros
    (the padding slot), as int32 on the host -- written into `out[:total + pad]`
    where given: numpy slices of the host table, ~35 us at 64 rows of 576
    tokens on a 2-core EPYC."""
    t = table.numpy()
    lens_np = lens.numpy()
    total = int(lens_np.sum())
    if out is None:
        out = np.empty(total + pad, dtype=np.int32)
    res = out[: total + pad]
    if total:
        np.concatenate([t[r, :n] for r, n in zip(rows.tolist(), lens_np.tolist())], out=res[:total],
                       casting="same_kind")
    res[total:] = 0
    return torch.from_numpy(res)


class PageListStaging:
    """A step's page list on its way to the device: written on the host into
    a pinned buffer (on CUDA) and copied without blocking the host, where
    handing flashinfer's plan a host list costs a synchronous copy from
    pageable memory (~0.3 ms at 256 rows of 540 tokens on an H200). The
    buffer is rewritten only once the last copy out of it has finished."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None
        self._done = None  # a CUDA event after the last copy out of `_host`

    def _buffer(self, n: int) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        if self._host is None or self._host.numel() < n:
            size = max(n, 2 * self._host.numel() if self._host is not None else 1 << 16)
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        return self._host.numpy()

    def send(self, table, rows, lens, pad: int, dest: torch.Tensor | None = None) -> torch.Tensor:
        """`paged_indices(table, rows, lens, pad)` on the device: in `dest`'s
        first entries where given (a graph wrapper's fixed buffer), else in a
        new tensor."""
        n = int(lens.sum()) + pad
        return self._ship(paged_indices(table, rows, lens, pad, out=self._buffer(n)), n, dest)

    def send_pieces(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The host tensors `pieces` (rows of the req->token table),
        concatenated as int32, on the device."""
        n = sum(int(p.shape[0]) for p in pieces)
        out = self._buffer(n)[:n]
        if n:
            np.concatenate([p.numpy() for p in pieces], out=out, casting="same_kind")
        return self._ship(torch.from_numpy(out), n, None)

    def _ship(self, host: torch.Tensor, n: int, dest: torch.Tensor | None) -> torch.Tensor:
        if dest is None:
            dest = torch.empty(n, dtype=torch.int32, device=self.device)
        dev = dest[:n]
        dev.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()
        return dev


class FlashInferAttention:
    def __init__(self, pool: TokenKVPool, num_heads: int, num_kv_heads: int, head_dim: int, flashinfer=None,
                 workspace_bytes: int = WORKSPACE_BYTES):
        fi = flashinfer if flashinfer is not None else importlib.import_module("flashinfer")
        self.fi = fi
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.dtype = pool.dtype
        dev = pool.device
        # one float workspace for every wrapper: they run one after another on one stream
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=dev)
        # tensor-core decode (the prefill kernel with one query per row) pays off for wide GQA groups;
        # its planner also walks the batch's lengths in Python, ~5 us a row
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.decode_backend = TENSOR_CORE_BACKEND
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores,
                                                            backend=self.decode_backend)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        shape = (pool.num_slots, 1, num_kv_heads, head_dim)
        self._kv = [(k.view(shape), v.view(shape)) for k, v in zip(pool.k_buffers, pool.v_buffers)]
        self._graph_wrappers: dict[int, object] = {}
        self._graph_indices: torch.Tensor | None = None  # shared by the graph wrappers: one runs per step
        self._active = None  # the decode wrapper this step's layers run
        self._ones = torch.ones(64, dtype=torch.int32)  # every page holds one token: the last page's length
        self._staging = PageListStaging(dev)  # the decode rows' page list
        self._staging_extend = PageListStaging(dev)  # the extend rows': a buffer of its own, in the same step
        # recorded after a step's plans: flashinfer's plan copies its schedule to the device from a pinned
        # buffer of its own without blocking, so the next plan waits for that copy before rewriting the buffer
        # (with the overlap schedule the host plans a step while the one before still runs)
        self._planned = None
        self._num_extend = 0  # tokens of this step's extend rows

    # -- planning ---------------------------------------------------------------
    def _plan_decode(self, wrapper, table, rows, lens, pad_rows: int = 0, dest: torch.Tensor | None = None) -> None:
        """Plans `wrapper` for rows reading table[rows[b], :lens[b]], then
        `pad_rows` more rows reading the padding slot 0 alone; the page list
        goes to the device through `PageListStaging` (into `dest`, the graph
        wrapper's own buffer, where given: flashinfer's plan then finds it in
        place and copies nothing)."""
        m = len(lens) + pad_rows
        indptr = indptr_of(lens, pad_rows)
        indices = self._staging.send(table, rows, lens, pad_rows, dest)
        if len(self._ones) < m:
            self._ones = torch.ones(max(m, 2 * len(self._ones)), dtype=torch.int32)
        wrapper.plan(indptr, indices, self._ones[:m], self.num_heads, self.num_kv_heads, self.head_dim, 1,
                     q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)
        self._active = wrapper

    def _plans_begin(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()

    def _plans_done(self) -> None:
        if self.pool.device.type == "cuda":
            self._planned = torch.cuda.Event()
            self._planned.record()

    def prepare(self, fb: ForwardBatch) -> None:
        self._plans_begin()
        self._active = None
        if fb.num_decode:
            self._plan_decode(self.decode, fb.req_to_token, fb.decode_rows, fb.decode_kv_lens)
        self._num_extend = 0
        if fb.extend_rows:
            qo = indptr_of([n for _, n, _ in fb.extend_rows])
            kv = indptr_of([idx.shape[0] for *_, idx in fb.extend_rows])
            indices = self._staging_extend.send_pieces([idx for *_, idx in fb.extend_rows])
            self.prefill.plan(qo, kv, indices, torch.ones(len(fb.extend_rows), dtype=torch.int32), self.num_heads,
                              self.num_kv_heads, self.head_dim, 1, causal=True, q_data_type=self.dtype,
                              kv_data_type=self.dtype, sm_scale=self.scale)
            self._num_extend = int(qo[-1])
        self._plans_done()

    def graph_wrapper(self, batch_size: int, max_pages: int):
        """The decode wrapper that a CUDA graph of `batch_size` rows captures:
        its plan lives in buffers of fixed address (`max_pages`: the most page
        indices any step may need)."""
        w = self._graph_wrappers.get(batch_size)
        if w is None:
            dev = self.pool.device
            if self._graph_indices is None or self._graph_indices.numel() < max_pages:
                self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=dev)
            w = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                backend=self.decode_backend,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.ones(batch_size, dtype=torch.int32, device=dev),
            )
            self._graph_wrappers[batch_size] = w
        return w

    def plan_graph(self, batch_size: int, max_pages: int, table, rows, lens) -> None:
        """Plans a pure decode step of len(lens) rows (host tensors), padded to
        `batch_size` rows, into the graph wrapper of that size; `forward` then
        runs it."""
        self._plans_begin()
        self._num_extend = 0
        wrapper = self.graph_wrapper(batch_size, max_pages)  # (makes `_graph_indices` on first use)
        self._plan_decode(wrapper, table, rows, lens, pad_rows=batch_size - len(lens), dest=self._graph_indices)
        self._plans_done()

    # -- per layer ----------------------------------------------------------------
    def forward(self, layer, q, k, v, fb, out=None):
        self.pool.write(layer, fb.out_slots, k, v)
        kv = self._kv[layer]
        # q may be a strided view of the qkv projection (fused rotary works in place there):
        # flashinfer's kernels take a query's row and head strides, so it is not copied
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = fb.num_decode
        if nd:
            self._active.run(q[:nd], kv, out=out[:nd])
        if self._num_extend:
            e = nd + self._num_extend
            self.prefill.run(q[nd:e], kv, out=out[nd:e])
        if fb.num_padding:
            out[-fb.num_padding :].zero_()  # belongs to no row; keep it finite
        return out
