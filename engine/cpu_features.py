"""What this CPU can do, probed once at run time; every CPU fast path asks here.

x86-64 CPUs differ in what the engine's fast paths need: bf16 matrix products
in hardware (AMX or AVX512_BF16: oneDNN's bf16 GEMMs 2-8x faster than
float32), oneDNN's bf16 weight prepacking (which torch refuses
without AVX512-BW/VL/DQ or AVX-NE-CONVERT: an AMD EPYC with AVX2 alone raises
"bf16 path needs the cpu support ..."), and the ISA the native kernels are
compiled for. Nothing is assumed from the CPU's model: each feature is asked
of torch or tried on a tiny input, and a path that fails falls back.

`STEPSERVE_CPU_ISA=avx2` makes this machine behave as an AVX2-only CPU (no
AVX-512, no AMX): no bf16 products, no prepacked bf16 linears, kernels
compiled for x86-64-v3. `STEPSERVE_CPU_ISA=baseline` goes down to the first
x86-64 CPUs (SSE2, no AVX; a virtual machine's generic CPU model may show no
more): the same, with kernels compiled for plain x86-64, so they take their
portable loops. The test suite runs its CPU-path tests again under each cap
(with torch's own `ATEN_CPU_CAPABILITY` and oneDNN's `ONEDNN_MAX_CPU_ISA`
capped alike), so a green run on an AMX machine also covers the other two.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os

import torch

log = logging.getLogger("stepserve.cpu_features")

ISA_ENV = "STEPSERVE_CPU_ISA"
_ISAS = ("native", "avx2", "baseline")


def isa_cap() -> str:
    """`native` (use whatever the CPU has), `avx2` (behave as an AVX2-only CPU)
    or `baseline` (behave as the first x86-64 CPUs: SSE2, no AVX)."""
    cap = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if cap not in _ISAS:
        raise ValueError(f"{ISA_ENV}={cap!r}: expected one of {', '.join(_ISAS)}")
    return cap


def has_bf16_matmul() -> bool:
    """bf16 matrix products in hardware: AMX tiles (Intel Sapphire Rapids on)
    or AVX512_BF16's bf16 dot products (Intel Cooper Lake, AMD Zen 4 on).
    Either makes oneDNN's bf16 GEMMs several times faster than float32's
    (AMX: 4-8x on the 2-core Xeon; AVX512_BF16: 2-3.5x from 32 rows on the
    2-core Zen 4 EPYC, 2-7x at TinyLlama's shapes); without them oneDNN
    emulates bf16, slower than float32."""
    if isa_cap() != "native":
        return False
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        try:
            if getattr(torch.cpu, probe)():
                return True
        except AttributeError:  # older torch
            pass
    return False


def has_amx() -> bool:
    """AMX tiles (Intel Sapphire Rapids on). torch's CPU flash attention in
    bf16 runs on them 1.6-2.2x faster than in float32 (the 2-core Xeon); with
    AVX512_BF16 alone (the 2-core Zen 5 EPYC) it ran slower than float32."""
    if isa_cap() != "native":
        return False
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older torch
        return False


@functools.cache
def _probe_prepacked_bf16() -> str | None:
    """None if a bf16 weight prepacked for oneDNN computes what F.linear does
    on a tiny input, else why not."""
    mkldnn = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN linear prepacking"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(24, generator=g).to(torch.bfloat16)
    try:
        got = mkldnn._linear_pointwise(x, mkldnn._reorder_linear_weight(w, 64), b, "none", [], "")
    except RuntimeError as e:  # e.g. "bf16 path needs the cpu support avx_ne_convert or avx512bw, ..."
        return str(e).strip().splitlines()[0]
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    if got.shape != want.shape or not torch.allclose(got.float(), want, atol=0.1, rtol=0.02):
        return "prepacked bf16 linear gave wrong results"
    return None


def prepacked_bf16_linear_reason() -> str | None:
    """Why bf16 linears cannot be prepacked for oneDNN here (None: they can)."""
    if isa_cap() != "native":
        return f"{ISA_ENV}={isa_cap()}"
    reason = _probe_prepacked_bf16()
    if reason is not None:
        log.info("bf16 linears stay plain nn.Linear: %s", reason)
    return reason


def can_prepack_bf16_linear() -> bool:
    return prepacked_bf16_linear_reason() is None


def kernel_march() -> str:
    """The -march the native CPU kernels are compiled with: the build runs on
    the machine that uses it, so `native` unless capped."""
    return {"native": "native", "avx2": "x86-64-v3", "baseline": "x86-64"}[isa_cap()]


def kernel_build_tag() -> str:
    """Names a native build after what it was compiled for, so a build cache
    shared between machines (or between a capped and an uncapped run) never
    loads a binary with instructions this CPU lacks."""
    if kernel_march() != "native":
        return kernel_march().replace("-", "_")
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1]
                    break
    except OSError:
        pass
    return "native_" + hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:10]
