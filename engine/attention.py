"""Attention backends over the token-slot KV pool.

A backend is planned once per step (`prepare`, where index tensors and masks are
built) and then run once per layer (`forward`). This mirrors flashinfer's
plan/run split so that the GPU backend slots in behind the same interface.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.nn.functional as F

from stepserve.engine.forward_batch import ForwardBatch
from stepserve.kvcache import TokenKVPool


class AttentionBackend(Protocol):
    def prepare(self, fb: ForwardBatch) -> None: ...

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's tokens -> [T, Hq, D]
        (into `out` where given: a static buffer of `MixedGraphs`).

        Writes k/v into the pool at `fb.out_slots` first.
        """
        ...


def _gather_rows(buf: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """buf[idx] for a [slots, Hkv, D] pool, as [len(idx), Hkv * D].

    The embedding kernel on a 2-D view is the fastest row gather torch has on
    CPU (measured ~3x faster than index_select on the 3-D tensor and ~10x
    faster than advanced indexing).
    """
    return F.embedding(idx, buf.view(buf.shape[0], -1))


def _sdpa_cuda(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """SDPA on CUDA without cuDNN: torch dispatches new shapes to cuDNN, which
    builds an execution plan per shape (~2 ms of host time per call, measured
    on an H100), and a serving step's shapes are new every step. The
    memory-efficient kernel builds nothing per shape and takes a mask; GQA heads
    are expanded for it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None):
    if q.is_cuda:
        return _sdpa_cuda(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=True)


def fold_pairs() -> int:
    """`TorchAttention.FOLD_PAIRS`, or STEPSERVE_FOLD_PAIRS where it is set."""
    env = os.environ.get("STEPSERVE_FOLD_PAIRS")
    if env is None or not env.strip():
        return TorchAttention.FOLD_PAIRS
    try:
        pairs = int(env)
    except ValueError:
        raise ValueError(f"STEPSERVE_FOLD_PAIRS must be a count of query-key pairs, got {env!r}") from None
    if pairs < 0:
        raise ValueError(f"STEPSERVE_FOLD_PAIRS must be at least 0, got {pairs}")
    return pairs


class TorchAttention:
    """Reference backend: gathers each row's KV by slot index and calls SDPA.

    Decode rows go through one batched SDPA over a padded [B, Lmax] index table
    -- or, on CPU (float32 or bfloat16 KV), through the native paged kernel
    (`cpu_kernels`), which reads the pool in place; extend rows (prefill chunks)
    run one SDPA each with a causal mask offset by the row's cached prefix.
    Works on CPU and CUDA (where it is the fallback when flashinfer is missing:
    correct, not fast, and never through cuDNN, see `_sdpa_cuda`).
    """

    # bf16_extend: a prompt chunk of more than this many tokens attends in bfloat16
    BF16_EXTEND_MIN = 32
    # A prompt chunk of at most this many query-key pairs attends faster through the paged kernel, its
    # tokens as decode-shaped queries (`ModelRunner.folded_chunks`), than through gather + SDPA: the
    # extend path's gathers, mask and SDPA call cost more than the kernel's reads of the context once
    # per query. Measured on the 2-core Zen 5 EPYC (AVX-512, no AMX), the embedded model, one layer's
    # attention: 33 tokens 4.8 us against 26 (no prefix), 84 against 136 past 700 cached tokens; 128
    # tokens 46 against 88 (no prefix), 348 against 446 past 700; whole lone-prompt steps 1.09-1.46x
    # faster folded up to 275k pairs (two threads), 1.08-1.19x inside the budget with one (a server's
    # engine). On the Zen 3 EPYC (AVX2) a 100-token chunk past 900 cached tokens (95k pairs) ran slower
    # folded (34.4 ms against 28.1), so the default stops well short of that.
    # STEPSERVE_FOLD_PAIRS sets it (0: never).
    FOLD_PAIRS = 32_768

    def __init__(self, pool: TokenKVPool, num_heads: int, num_kv_heads: int, head_dim: int,
                 native: bool | None = None, bf16_extend: bool = False):
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        if native is None:
            native = pool.device.type == "cpu" and pool.dtype in (torch.float32, torch.bfloat16)
        self.kernel = None
        if native:
            from stepserve.engine.cpu_kernels import paged_decode_module

            self.kernel = paged_decode_module()
        # a float32 model may run a batch of few decode-shaped tokens as one native call over this pool
        # (`LlamaForCausalLM._forward_native`)
        self.native_decode_ok = self.kernel is not None and pool.dtype == torch.float32
        self.fold_pairs = fold_pairs() if self.native_decode_ok else 0
        self._decode_idx: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._extend_idx: list[torch.Tensor] = []
        self._extend_masks: list[torch.Tensor | None] = []
        # A float32 model whose products of many rows run in bf16 (`loader.bf16_large_steps`) runs the
        # attention of a chunk of more than BF16_EXTEND_MIN tokens in bf16 too: torch's CPU flash
        # attention multiplies bf16 on the CPU's bf16 units (AMX, AVX512_BF16) and accumulates in float32,
        # and the chunk's attention output goes on into a bf16 product (o_proj) anyway. Measured on the
        # 2-core Xeon with AMX, one thread: a causal 384-token chunk of the embedded model's heads
        # 0.69 ms against 1.53 per layer, casts included (2.1-2.2x from 384 to 1,000 tokens, 1.6x at 128).
        # With AVX512_BF16 alone it is slower: on the 2-core Zen 5 EPYC, lone prompts of 48-1,000 tokens
        # ran 1.03-1.16x faster with float32 attention (two threads; 0.99-1.06x with one, as a server's
        # engine runs), so the engine asks for it only with AMX
        # (`cpu_features.has_amx`).
        self.bf16_extend = bf16_extend and pool.device.type == "cpu" and pool.dtype == torch.float32

    def prepare(self, fb: ForwardBatch) -> None:
        """The decode rows' padded slot table and mask, and the extend rows'
        slot lists and masks, built from the host's bookkeeping and sent to
        the pool's device (on the CPU, used as they are)."""
        dev = self.pool.device
        self._decode_idx = self._decode_mask = None
        if fb.num_decode and self.kernel is None:
            lens = fb.decode_kv_lens
            lmax = int(lens.max())
            idx = fb.req_to_token.index_select(0, fb.decode_rows)[:, :lmax]
            valid = torch.arange(lmax)[None, :] < lens[:, None]
            # positions past a row's length hold stale slots: point them at the
            # padding slot so the gather stays in bounds (they are masked anyway)
            self._decode_idx = idx.masked_fill(~valid, 0).to(dev)
            self._decode_mask = valid[:, None, None, :].to(dev)
        self._extend_idx = [kv_idx.to(dev) for _, _, kv_idx in fb.extend_rows]
        masks = []
        for (_, n, _), kv_idx in zip(fb.extend_rows, self._extend_idx):
            prefix = kv_idx.shape[0] - n
            if prefix == 0:
                masks.append(None)  # plain causal
            else:
                qpos = torch.arange(n, device=dev)[:, None] + prefix
                kpos = torch.arange(kv_idx.shape[0], device=dev)[None, :]
                masks.append(kpos <= qpos)
        self._extend_masks = masks

    def forward(self, layer, q, k, v, fb, out=None):
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        nd = fb.num_decode
        if self.kernel is not None and k.dtype == k_buf.dtype and v.dtype == v_buf.dtype:
            self.kernel.store_kv(k_buf, v_buf, fb.out_slots, k, v)  # one native call for both
            if nd == q.shape[0] and out is None:  # decode-shaped queries only: the kernel's output is it
                return self.kernel.paged_decode(q.contiguous(), k_buf, v_buf, fb.req_to_token, fb.decode_rows,
                                                fb.decode_kv_lens, self.scale)
        else:
            self.pool.write(layer, fb.out_slots, k, v)
        if out is None:
            out = torch.empty_like(q)
        if fb.num_padding:
            out[-fb.num_padding :].zero_()  # belongs to no row; keep it finite
        if nd and self.kernel is not None:
            out[:nd] = self.kernel.paged_decode(
                q[:nd].contiguous(), k_buf, v_buf, fb.req_to_token, fb.decode_rows, fb.decode_kv_lens, self.scale
            )
        elif nd:
            idx = self._decode_idx
            b, lmax = idx.shape
            kk = _gather_rows(k_buf, idx.view(-1)).view(b, lmax, *k_buf.shape[1:]).transpose(1, 2)  # [B, Hkv, L, D]
            vv = _gather_rows(v_buf, idx.view(-1)).view(b, lmax, *v_buf.shape[1:]).transpose(1, 2)
            qq = q[:nd].unsqueeze(2)  # [B, Hq, 1, D]
            o = _sdpa(qq, kk, vv, attn_mask=self._decode_mask, scale=self.scale)
            out[:nd] = o.squeeze(2)
        for (start, n, _), kv_idx, mask in zip(fb.extend_rows, self._extend_idx, self._extend_masks):
            qq = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kk = _gather_rows(k_buf, kv_idx).view(-1, *k_buf.shape[1:]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vv = _gather_rows(v_buf, kv_idx).view(-1, *v_buf.shape[1:]).transpose(0, 1).unsqueeze(0)
            if self.bf16_extend and n > self.BF16_EXTEND_MIN:
                qq, kk, vv = qq.bfloat16(), kk.bfloat16(), vv.bfloat16()
            o = _sdpa(qq, kk, vv, attn_mask=mask, is_causal=mask is None and n > 1, scale=self.scale)
            out[start : start + n] = o[0].transpose(0, 1)  # (back to the output's dtype)
        return out
