"""Triton kernels (imported only where Triton is: `triton_sampling` loads
this module on first use)."""

import triton
import triton.language as tl


@triton.jit
def logf(x):
    """log of a positive normal float32: musl's logf (the CPU kernels' `logf_normal`), under 1 ulp.
    Triton's own tl.log is the device's fast approximation, whose absolute error (~2^-21) swamps
    log(u) for u near 1 -- the uniforms that make the largest Gumbel values, the draws' winners."""
    ix = x.to(tl.uint32, bitcast=True) + (0x3F800000 - 0x3F3504F3)
    k = (ix >> 23).to(tl.int32) - 0x7F
    m = ((ix & 0x007FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True)
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    r = z * (0.66666662693 + w * 0.28498786688) + w * (0.40000972152 + w * 0.24279078841)
    hfsq = 0.5 * f * f
    dk = k.to(tl.float32)
    return s * (hfsq + r) + dk * 9.0580006145e-06 - hfsq + f + dk * 6.9313812256e-01


@triton.jit
def gumbel_argmax_kernel(s_ptr, s_stride, h_ptr, val_ptr, idx_ptr, V: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr):
    """`triton_sampling.gumbel_argmax`'s first stage: program (r, c) takes row
    r's columns [c CHUNK, (c + 1) CHUNK) and writes its first maximum of
    s - log(-log(u)) (its first NaN, where it meets one) and that column to
    val/idx[r, c]. V, the vocabulary, is a compile-time constant: one build
    per model."""
    r = tl.program_id(0)
    c = tl.program_id(1)
    a = tl.load(h_ptr + r).to(tl.uint32)  # the row's murmur3 state, rotated (`sampler._hash_parts`)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    at = tl.zeros([BLOCK], tl.int64)
    row = s_ptr + r.to(tl.int64) * s_stride
    start = c.to(tl.int64) * CHUNK
    for j0 in range(0, CHUNK, BLOCK):
        j = start + j0 + tl.arange(0, BLOCK)
        inside = j < V
        s = tl.load(row + j, mask=inside, other=float("-inf")).to(tl.float32)
        # the column's word: rotl(k_mix(j), 13), k_mix(k) = rotl(k * C1, 15) * C2
        k = j.to(tl.uint32) * 0xCC9E2D51
        k = (k << 15) | (k >> 17)
        k = k * 0x1B873593
        k = (k << 13) | (k >> 19)
        # the last block and the finaliser (`sampler.uniform`; `hash_u01` of the CPU kernels)
        h = (a ^ k) * 5 + 0xE6546B64
        h = h ^ 24
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        h = h ^ (h >> 16)
        u = (h >> 9).to(tl.float32) * (1.0 / 8388608.0) + (1.0 / 16777216.0)
        v = s - logf(-logf(u))
        v = tl.where(inside, v, float("-inf"))
        # each lane keeps its first maximum, and its first NaN once it meets one
        take = (v > best) | ((v != v) & (best == best))
        best = tl.where(take, v, best)
        at = tl.where(take, j.to(tl.int64), at)
    big = V  # past every column: the lanes' minimum over those that hold the chunk's answer
    nan = best != best
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    first_nan = tl.min(tl.where(nan, at, big), axis=0)
    first_top = tl.min(tl.where(best == top, at, big), axis=0)
    has_nan = first_nan < big
    # a chunk of nothing but -inf (masked columns) answers its first column, as argmax does
    first_top = tl.where(first_top < big, first_top, start)
    out = r.to(tl.int64) * tl.num_programs(1) + c
    tl.store(val_ptr + out, tl.where(has_nan, float("nan"), top))
    tl.store(idx_ptr + out, tl.where(has_nan, first_nan, first_top))
