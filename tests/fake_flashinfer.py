"""A stand-in for the `flashinfer` module on machines without CUDA: the two
wrappers stepserve's flashinfer backend uses, with flashinfer 0.6's plan/run
contract, computed naively row by row in float32.

It checks the metadata the backend plans with: int32 indptr and page
indices, page size 1, one-token last pages, indptr starting at 0 and rising,
exactly indptr[-1] page indices, the query dtype planned. In CUDA-graph mode
(`use_cuda_graph=True`) the batch size is fixed at construction and `run`
reads the plan only from the buffers given there, as the real kernels do
inside a graph, so a plan that does not reach those buffers gives wrong
attention rather than passing unnoticed."""

from __future__ import annotations

import torch


def _check_plan(indptr, indices, last_page_len, page_size):
    assert indptr.dtype == torch.int32 and indices.dtype == torch.int32 and last_page_len.dtype == torch.int32
    assert page_size == 1, "stepserve's pool is paged with one token per page"
    ip = indptr.cpu()
    assert int(ip[0]) == 0 and bool((ip[1:] >= ip[:-1]).all()), f"indptr {ip.tolist()} is not an indptr"
    assert len(indices) == int(ip[-1]), f"{len(indices)} page indices for an indptr ending at {int(ip[-1])}"
    assert len(last_page_len) == len(ip) - 1 and bool((last_page_len.cpu() == 1).all())


def _attend(q, k, v, scale, causal_offset=None):
    """q [n, Hq, D] over k, v [L, Hkv, D]; query i sees keys j <= causal_offset + i."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if causal_offset is not None:
        n, L = q.shape[0], k.shape[0]
        allowed = torch.arange(L)[None, :] <= torch.arange(n)[:, None] + causal_offset
        s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


class _Wrapper:
    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "NHD"
        assert workspace.dtype == torch.uint8
        self.planned = None

    def _planned(self, heads, head_dim, q_data_type, kv_data_type, sm_scale):
        self.heads, self.head_dim = heads, head_dim
        self.q_dtype, self.kv_dtype = q_data_type, kv_data_type or q_data_type
        self.scale = sm_scale if sm_scale is not None else head_dim**-0.5

    def _check_run(self, q, paged_kv_cache, out):
        k, v = paged_kv_cache
        assert k.dim() == 4 and k.shape[1] == 1 and tuple(k.shape[2:]) == (self.heads[1], self.head_dim)
        assert q.dtype == self.q_dtype and k.dtype == self.kv_dtype, "run with other dtypes than planned"
        assert q.shape[1:] == (self.heads[0], self.head_dim)
        assert q.stride(-1) == 1, "flashinfer takes a query with row and head strides, but a contiguous last dim"
        assert out is None or (out.shape == q.shape and out.is_contiguous())
        return k[:, 0], v[:, 0]


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto"):
        super().__init__(workspace, kv_layout)
        assert backend in ("auto", "fa2", "fa3")
        self.use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            assert paged_kv_indptr_buffer.dtype == torch.int32 and paged_kv_indices_buffer.dtype == torch.int32
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
            self.fixed_batch_size = len(paged_kv_last_page_len_buffer)
            self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", q_data_type="float16", kv_data_type=None, sm_scale=None, **kw):
        assert pos_encoding_mode == "NONE" and not kw
        _check_plan(indptr, indices, last_page_len, page_size)
        self._planned((num_qo_heads, num_kv_heads), head_dim, q_data_type, kv_data_type, sm_scale)
        if self.use_cuda_graph:
            assert len(last_page_len) == self.fixed_batch_size, "graph wrappers keep their batch size"
            ib, xb = self.buffers
            assert len(indices) <= len(xb)
            ib.copy_(indptr)
            xb[: len(indices)].copy_(indices)
        else:
            self.indptr, self.indices = indptr.clone(), indices.clone()

    def run(self, q, paged_kv_cache, out=None):
        k, v = self._check_run(q, paged_kv_cache, out)
        indptr, indices = self.buffers if self.use_cuda_graph else (self.indptr, self.indices)
        indptr = indptr.tolist()
        assert len(indptr) == q.shape[0] + 1, f"{q.shape[0]} queries for a plan of {len(indptr) - 1} rows"
        res = torch.empty_like(q) if out is None else out
        for b in range(q.shape[0]):
            idx = indices[indptr[b] : indptr[b + 1]].long()
            res[b] = _attend(q[b : b + 1], k[idx], v[idx], self.scale)[0].to(q.dtype)
        return res


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, causal=False, q_data_type="float16", kv_data_type=None,
             sm_scale=None, **kw):
        assert not kw
        _check_plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        assert qo_indptr.dtype == torch.int32 and len(qo_indptr) == len(paged_kv_indptr)
        self._planned((num_qo_heads, num_kv_heads), head_dim_qk, q_data_type, kv_data_type, sm_scale)
        self.causal = causal
        self.qo, self.kv, self.indices = qo_indptr.tolist(), paged_kv_indptr.tolist(), paged_kv_indices.clone()

    def run(self, q, paged_kv_cache, out=None):
        k, v = self._check_run(q, paged_kv_cache, out)
        assert q.shape[0] == self.qo[-1], f"{q.shape[0]} query tokens for a plan of {self.qo[-1]}"
        res = torch.empty_like(q) if out is None else out
        for r in range(len(self.qo) - 1):
            a, b = self.qo[r], self.qo[r + 1]
            idx = self.indices[self.kv[r] : self.kv[r + 1]].long()
            offset = len(idx) - (b - a) if self.causal else None  # the chunk ends the row's context
            res[a:b] = _attend(q[a:b], k[idx], v[idx], self.scale, offset).to(q.dtype)
        return res


# -- the fused small ops (flashinfer.norm, .activation, .rope), with flashinfer's in-place contracts ------------
def _launch(rows: int, op: str) -> None:
    """The real kernels launch one block per row: over no rows the launch fails
    (CUDA's invalid argument, as the H200 reported for RMSNorm)."""
    if rows == 0:
        raise RuntimeError(f"Check failed: (status == cudaSuccess) is false: {op} failed with error code invalid argument")


def rmsnorm(input, weight, eps=1e-6, out=None):
    assert input.dim() == 2 and input.is_contiguous() and weight.dtype == input.dtype
    _launch(input.shape[0], "RMSNorm")
    x = input.float()
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6):
    """residual += input; input = rmsnorm(residual), both in place."""
    assert input.shape == residual.shape and input.is_contiguous() and residual.is_contiguous()
    _launch(input.shape[0], "FusedAddRMSNorm")
    residual.add_(input)
    input.copy_(rmsnorm(residual, weight, eps))


def silu_and_mul(input, out=None):
    _launch(input.numel() // input.shape[-1], "SiLUAndMul")
    h = input.shape[-1] // 2
    y = torch.nn.functional.silu(input[..., :h]) * input[..., h:]
    if out is None:
        return y
    out.copy_(y)
    return out


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """Rotates query [T, Hq * D] and key [T, Hkv * D] in place (neox halves);
    cos_sin_cache [max_pos, D]: cos of each frequency, then sin."""
    assert cos_sin_cache.dtype == torch.float32 and is_neox
    _launch(positions.numel(), "BatchQKApplyRotaryPosIdsCosSinCache")
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions, :half][:, None, :]
    sin = cos_sin_cache[positions, half:][:, None, :]
    for x in (query, key):
        v = x.view(x.shape[0], -1, head_size)
        x1, x2 = v[..., :half].float(), v[..., half:].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        v.copy_(rotated.to(x.dtype))
