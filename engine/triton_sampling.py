"""The sampler's Gumbel-max draw as one Triton kernel (CUDA).

`sampler.gumbel_argmax` picks, per random row, the first column j that
maximises ``s[r, j] - log(-log(u[r, j]))``, ``u`` the counter-based uniforms
of `sampler.uniform`. In torch ops that is about 30 passes over a [rows,
vocab] tensor (the murmur3 finaliser in int64, two logs, the subtraction,
the argmax) and as many launches: about 1 ms of a decode step at 64 rows on
an H200. This kernel reads the scores once: each program walks a chunk of a
row's columns in blocks, hashing each column's uniform in uint32 registers
(the same bits as `sampler.uniform`; the column's word is mixed in place, so
no [vocab] vector is read either), and keeps each lane's first maximum; the
lanes' maxima are reduced to the chunk's first, and the chunks' to the
row's by one argmax. A NaN score counts as the maximum, as torch's argmax
has it.

A row's draw depends on its own scores, seed and counter alone, so batch
invariance holds. Its logs are musl's logf, as the CPU kernel's, within an
ulp of torch's, so a draw may differ from the torch ops' only where two
columns' values lie within an ulp: the distribution is the same.

Triton is imported on first use: installs without it (every CPU one) never
load it. `gumbel_argmax` returns None where it cannot run (no Triton, not a
CUDA tensor); a kernel that fails to build or launch is reported once and
not tried again, so the caller's torch ops take over. Under
``TRITON_INTERPRET=1`` (set before the first call) it also runs on CPU
tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch
from torch import Tensor

log = logging.getLogger(__name__)

BLOCK = 1024  # columns per iteration of a program
CHUNK = 16384  # columns per program (a multiple of BLOCK): a 128k vocabulary makes 8 programs a row
NUM_WARPS = 8
ENABLED = True  # False: the torch ops serve (`tools/bench_gpu.py --sampler-kernels on,off` compares them)
_kernel = None  # the jitted kernel, once built
_failed = False  # a build or launch failed: the torch ops serve from then on
_importable: bool | None = None  # whether Triton is installed (None: not asked yet)


def _build():
    from .triton_kernels import gumbel_argmax_kernel

    return gumbel_argmax_kernel


def available(t: Tensor) -> bool:
    """Whether the kernel may serve `t`: a CUDA tensor (any tensor under the
    interpreter), Triton importable, and no earlier failure."""
    global _importable
    if not ENABLED or _failed or not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if _importable is None:  # once: a failed import searches the path again each time (every sampled step)
        _importable = importlib.util.find_spec("triton") is not None
    return _importable


def gumbel_argmax(s: Tensor, h_row: Tensor, chunk: int = CHUNK) -> Tensor | None:
    """Per row of `s` [R, V] (float), the first column maximising
    s - log(-log(u)), u the uniforms of row state `h_row` [R] (int64,
    `sampler._hash_parts`' first part) at columns 0..V-1: int64 [R]. None
    where the kernel cannot serve (see `available`).

    Two stages: programs of `chunk` columns of a row each (so that a few rows
    of a large vocabulary still fill the GPU) write their first maximum and
    its column; `torch.argmax` over a row's chunks then takes the first
    largest (a NaN first, as in one pass), and its column."""
    global _kernel, _failed
    if not available(s):
        return None
    R, V = s.shape
    if s.stride(1) != 1:
        s = s.contiguous()
    if R == 0:
        return torch.empty(0, dtype=torch.int64, device=s.device)
    chunks = -(-V // chunk)
    val = torch.empty(R, chunks, dtype=torch.float32, device=s.device)
    idx = torch.empty(R, chunks, dtype=torch.int64, device=s.device)
    try:
        if _kernel is None:
            _kernel = _build()
        _kernel[(R, chunks)](s, s.stride(0), h_row.to(s.device).contiguous(), val, idx, V, CHUNK=chunk, BLOCK=BLOCK,
                             num_warps=NUM_WARPS)
    except Exception as e:  # a build or launch that fails here leaves sampling to the torch ops
        _failed = True
        log.warning("the Triton Gumbel-max kernel failed (%s: %s); sampling takes the torch ops from now on",
                    type(e).__name__, e)
        return None
    if chunks == 1:
        return idx[:, 0]
    return idx.gather(1, torch.argmax(val, dim=1, keepdim=True))[:, 0]
