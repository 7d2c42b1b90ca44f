"""One implementation for the Llama family: Llama (incl. Llama 3 rope scaling),
Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

The forward pass runs over a flat ragged batch (see `ForwardBatch`): no padding,
no batch dimension, every token carries its own position. q/k/v and gate/up are
fused into single matmuls at load time (`load_weights`), which halves the number
of GEMM launches per layer compared with the Hugging Face layout.

On CPU in bfloat16, `pack_linears` then swaps every projection for a
`PackedLinear`: its weight reordered once into oneDNN's blocked layout, which
`nn.Linear` would otherwise redo on every call (measured 1.2-2x faster for
decode-shaped GEMMs, with bit-identical results), where the CPU supports it
(probed once, see `cpu_features`). `STEPSERVE_PACK_LINEARS=0` keeps plain
`nn.Linear`, for A/B runs.
"""

from __future__ import annotations

import math
import os
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stepserve.engine.attention import AttentionBackend
from stepserve.engine.config import ModelConfig
from stepserve.engine.forward_batch import ForwardBatch, logits_rows
from stepserve.engine.inference import inference


def prepack_weight(w: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    """`w` in oneDNN's blocked layout for `packed_linear` (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, b) on a weight from `prepack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class PackedLinear(nn.Module):
    """A frozen `nn.Linear` whose weight is kept only in oneDNN's blocked layout
    (an opaque mkldnn tensor: computes like the original, cannot be indexed)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(prepack_weight(linear.weight.detach(), batch_hint), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU bf16 on a CPU and torch build where prepacking was tried and works
    (`cpu_features`: not on an AVX2-only CPU, for one)."""
    from stepserve.engine.cpu_features import can_prepack_bf16_linear

    return device.type == "cpu" and dtype == torch.bfloat16 and can_prepack_bf16_linear()


def pack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear of a loaded model by a PackedLinear; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


# rows up to which the panel kernel computes a float32 linear on CPU (and a decode step runs as one native
# call). On an AVX2 EPYC at the embedded model's shapes the kernel alone is as fast as torch's sgemm or
# faster up to 16 rows (2.2x on the output head) and 0.6-1.5x at 32; with the one-call decode step, the
# embedded model decodes batches of 24 and 32 1.45-1.6x faster with 32 here than with 16, and 64 was not
# consistently better than 32
SMALL_M = 32
# rows up to which a float32 linear's product stays on the panel kernel where no bf16 hardware product takes
# the larger ones (`loader.native_linear_rows`): past SMALL_M torch's sgemm was slower at every row count
# up to 512 in the engine. Measured on the 2-core Zen 3 EPYC (AVX2, no bf16 products), one engine toggled
# between interleaved repeats: a prompt of 33-40 tokens prefilled 1.4x faster (a 32-token one took 4.0 ms,
# a 33-token one 9.5 ms at 32 rows), plain decoding of batches of 48 and 64 1.43-1.53x and of 128-256
# 1.1-1.17x (whole `generate` calls), prompt chunks of 256 and 512 tokens 1.04-1.08x; chunks of 1,024 and
# 2,048 tokens 0.90-0.97x with this limit at 2,048 (sgemm wins there).
NATIVE_ROWS = 512
# decode-shaped tokens up to which a forward whose products all stay on the panels past SMALL_M runs as one
# native call (`LlamaForCausalLM.native_step_tokens`). Measured on the Zen 3 EPYC, one engine whose limit was
# toggled between interleaved repeats (the same tokens every time): plain decoding of batches of 48 and 64
# 1.14-1.16x (11 repeats of 96 tokens), of 96 1.13x and of 128 1.03x (7 of 48), of 32 and fewer unchanged.
NATIVE_STEP_TOKENS = 128
_NONE = torch.empty(0)  # an absent tensor argument of the native calls
SMALL_M_BUDGET_BYTES = 1 << 30  # panel copies made at most (the weights are kept too)


class SmallBatchLinear(nn.Module):
    """A frozen float32 linear on CPU that also holds its weight in 16-column
    panels (`pack_panels`) for the native small-batch kernel: a product of at
    most `SMALL_M` rows (the decode and verify steps of small batches) streams
    each panel once with the rows' accumulators in registers, where BLAS
    sgemm is 1.5-4.8x slower at the embedded model's shapes on an AVX2 CPU.
    More rows (prefill chunks, large batches) go to torch with the original
    weight, which stays, so the panels cost one more copy of the weights.

    A weight whose every value is a bfloat16 (a bf16 checkpoint run in
    float32) gets bfloat16 panels: exact, half the bytes, and a product of a
    few rows streams its weight from memory, so it takes about half the
    time once the weights no longer fit in the cache (the math stays float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernels, bf16: bool | None = None,
                 bf16_large: bool = False, native_rows: int = SMALL_M):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        w = self.weight.data
        bf16 = bf16_panels(w) if bf16 is None else bf16
        self.register_buffer("panels", kernels.pack_panels(w, bf16), persistent=False)
        self._kernels = kernels
        # more rows than SMALL_M: a bf16 weight prepacked for oneDNN (AMX or AVX512_BF16), where asked for and exact
        self._large = None
        if bf16_large and bf16:
            self._large = (prepack_weight(w.bfloat16()), None if self.bias is None else self.bias.data.bfloat16())
        # products of up to this many rows run on the panels (at least SMALL_M: the one-call decode step's);
        # a bf16 product takes over past SMALL_M where there is one
        self.native_rows = SMALL_M if self._large is not None else max(SMALL_M, int(native_rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.native_rows and x.shape[0] > 0:
            y = self._kernels.small_linear(x.contiguous(), self.panels)
            return y if self.bias is None else y.add_(self.bias)
        if self.large(x):
            return packed_linear(x.bfloat16(), *self._large).float()
        return F.linear(x, self.weight, self.bias)

    def large(self, x: torch.Tensor) -> bool:
        """Whether `x` [T, in] goes through the bf16 product (more than SMALL_M rows, `bf16_large`)."""
        return self._large is not None and x.dim() == 2 and x.shape[0] > SMALL_M

    def forward_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The bf16 product of a `large` x, its output left in bfloat16 (for a
        next op that takes bf16: `MLP`)."""
        return packed_linear(x.bfloat16(), *self._large)


def bf16_panels(w: torch.Tensor) -> bool:
    """Whether `w` gets bfloat16 panels: every value is a bfloat16 (and
    STEPSERVE_BF16_PANELS is not 0)."""
    return os.environ.get("STEPSERVE_BF16_PANELS", "1") != "0" and torch.equal(w, w.bfloat16().float())


def _float32_cpu_native(device: torch.device, dtype: torch.dtype, switch: str, needs: str):
    """The native CPU module if it has `needs`, for float32 on CPU (None: not
    this device or dtype, the environment variable `switch` set to 0, or no
    native build)."""
    if device.type != "cpu" or dtype != torch.float32 or os.environ.get(switch, "1") == "0":
        return None
    from stepserve.engine.cpu_kernels import paged_decode_module

    mod = paged_decode_module()
    return mod if mod is not None and hasattr(mod, needs) else None


def small_batch_kernels(device: torch.device, dtype: torch.dtype):
    """The native module with `small_linear`, for float32 on CPU (None: not
    this device or dtype, STEPSERVE_SMALL_LINEAR=0, or no native build)."""
    return _float32_cpu_native(device, dtype, "STEPSERVE_SMALL_LINEAR", "small_linear")


def use_small_batch_linears(model: "LlamaForCausalLM", kernels, budget: int = SMALL_M_BUDGET_BYTES,
                            bf16_large: bool = False, native_rows: int = SMALL_M) -> int:
    """Swaps each float32 nn.Linear of a loaded model whose output width is a
    multiple of 16 (and a tied output head) for a SmallBatchLinear, largest
    first, while the panel copies fit in `budget` bytes; returns how many.
    `bf16_large`: products of more rows than SMALL_M run in bfloat16 on a
    prepacked weight where the weight is exactly bfloat16 (`bf16_large_steps`);
    `native_rows`: the most rows the panels multiply where no bf16 product
    does (`SmallBatchLinear`)."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.out_features % 16 == 0]
    if model.config.tie_word_embeddings and model.model.embed_tokens.weight.shape[0] % 16 == 0:
        swaps.append((model, "tied_head", None))
    done = 0
    for parent, name, child in sorted(swaps, key=lambda s: -(s[2].weight.numel() if s[2] is not None
                                                             else model.model.embed_tokens.weight.numel())):
        w = child.weight if child is not None else model.model.embed_tokens.weight
        bf16 = bf16_panels(w.data)
        size = w.numel() * (2 if bf16 else 4)  # the panels' bytes
        if size > budget:
            continue
        lin = SmallBatchLinear(w, child.bias if child is not None else None, kernels, bf16, bf16_large, native_rows)
        budget -= size
        setattr(parent, name, lin)
        done += 1
    return done


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchKernels.rmsnorm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    if sc["rope_type"] == "linear":
        return inv_freq / sc["factor"]
    # llama3: leave high frequencies, divide low ones by `factor`, blend between.
    factor = sc["factor"]
    low, high = sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
    old_ctx = sc.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin cache."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        device = torch.get_default_device()
        if device.type == "meta":  # (`load_model`) shapes only: `build` fills the table on the real device. Computed
            # on meta, it ran torch's Python decompositions, whose first use imports torch._dynamo (~1 s)
            inv_half = (cfg.head_dim + 1) // 2
            for name in ("cos", "sin"):
                self.register_buffer(name, torch.empty(max_positions, 2 * inv_half), persistent=False)
        else:
            self.build(device)

    def build(self, device: torch.device) -> None:
        """(Re)computes the float32 cos/sin table on `device` (also after meta init)."""
        inv_freq = rope_inv_freq(self.cfg).to(device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        emb = torch.outer(t, inv_freq).repeat(1, 2)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for this step; computed once and shared by all layers."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchKernels:
    """The small per-layer ops in plain torch: the reference, and the CPU path.
    The norm computes in float32 and casts back before the weight, exactly as
    the Hugging Face implementation does; rotary cos/sin are looked up once per
    step (`rope_prepare`) and shared by every layer."""

    name = "torch"

    def __init__(self, rotary: RotaryEmbedding):
        self.rotary = rotary

    @staticmethod
    def rmsnorm(x, weight, eps):
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    def add_rmsnorm(self, x, residual, weight, eps):
        """(norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rmsnorm(residual, weight, eps), residual

    def rope_prepare(self, positions, dtype):
        return self.rotary.lookup(positions, dtype)

    @staticmethod
    def rope(state, q, k, head_dim):
        """q [T, Hq * D], k [T, Hkv * D] rotated; returns them as [T, H, D]."""
        t = q.shape[0]
        return apply_rotary(q.view(t, -1, head_dim), k.view(t, -1, head_dim), *state)

    # silu_and_mul takes a bf16 product's output as it is, and returns bf16 (`MLP`)
    bf16_silu = False

    @staticmethod
    def silu_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuKernels(TorchKernels):
    """The same ops as single native calls for a float32 model on CPU
    (`cpu_kernels`: `rmsnorm`, `add_rmsnorm_` in place, `rope_neox_` in place
    from the float32 cos/sin tables, `silu_and_mul`), one call each instead of
    3-12 torch ops. The decode steps of small batches are dominated by such
    per-op costs: the products of a 2-layer draft model take about a tenth of
    its forward pass."""

    name = "cpu"

    def __init__(self, rotary: RotaryEmbedding, native):
        super().__init__(rotary)
        self.native = native
        self.bf16_silu = hasattr(native, "silu_and_mul_bf16")

    def rmsnorm(self, x, weight, eps):
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
            return TorchKernels.rmsnorm(x, weight, eps)
        return self.native.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        self.native.add_rmsnorm_(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def rope_prepare(self, positions, dtype):
        return positions

    def rope(self, positions, q, k, head_dim):
        self.native.rope_neox_(q, k, positions, self.rotary.cos, self.rotary.sin, head_dim)
        t = q.shape[0]
        return q.view(t, -1, head_dim), k.view(t, -1, head_dim)

    def silu_and_mul(self, x):
        if x.dtype == torch.bfloat16:
            return self.native.silu_and_mul_bf16(x)
        return self.native.silu_and_mul(x)


def cpu_kernels(device: torch.device, dtype: torch.dtype):
    """The native module with the fused small ops, for float32 on CPU (None:
    not this device or dtype, STEPSERVE_CPU_FUSED=0, or no native build)."""
    return _float32_cpu_native(device, dtype, "STEPSERVE_CPU_FUSED", "rope_neox_")


class FlashInferKernels(TorchKernels):
    """The same ops as fused flashinfer kernels (one launch each instead of
    5-10): RMSNorm, residual add + RMSNorm in place, rotary on q and k in place
    from a float32 cos/sin cache, SiLU-and-mul. Small numeric differences from
    `TorchKernels` (the norm multiplies by its weight before rounding)."""

    name = "flashinfer"

    def __init__(self, rotary: RotaryEmbedding, flashinfer):
        super().__init__(rotary)
        self.fi = flashinfer
        half = rotary.cos.shape[1] // 2
        # neox layout: cos of each frequency, then sin of each
        self.cos_sin = torch.cat([rotary.cos[:, :half], rotary.sin[:, :half]], dim=1).contiguous()

    def rmsnorm(self, x, weight, eps):
        if not x.shape[0]:  # (a step whose rows need no logits: a launch over no rows is a CUDA error)
            return torch.empty_like(x)
        return self.fi.rmsnorm(x, weight, eps)

    def add_rmsnorm(self, x, residual, weight, eps):
        if x.shape[0]:
            self.fi.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm(residual)
        return x, residual

    def rope_prepare(self, positions, dtype):
        return positions

    def rope(self, positions, q, k, head_dim):
        self.fi.apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, self.cos_sin, is_neox=True)
        t = q.shape[0]
        return q.view(t, -1, head_dim), k.view(t, -1, head_dim)

    def silu_and_mul(self, x):
        return self.fi.silu_and_mul(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, rope, backend: AttentionBackend, fb: ForwardBatch, kern: TorchKernels):
        q, k, v = self.qkv(x, rope, kern)
        return self.output(backend.forward(self.layer_id, q, k, v, fb))

    def qkv(self, x, rope, kern: TorchKernels):
        """The attention's inputs: q [T, Hq, D] and k [T, Hkv, D] normed (q/k
        norm) and rotated, v [T, Hkv, D]."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t, d = x.shape[0], self.head_dim
        if self.qk_norm:  # per head, before rotary
            q = kern.rmsnorm(q.reshape(-1, d), self.q_norm.weight, self.q_norm.eps).view(t, self.q_size)
            k = kern.rmsnorm(k.reshape(-1, d), self.k_norm.weight, self.k_norm.eps).view(t, self.kv_size)
        q, k = kern.rope(rope, q, k, d)
        return q, k, v.view(t, self.num_kv_heads, d)

    def output(self, o):
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x, kern: TorchKernels):
        gate_up, down = self.gate_up_proj, self.down_proj
        if (kern.bf16_silu and isinstance(gate_up, SmallBatchLinear) and isinstance(down, SmallBatchLinear)
                and gate_up.large(x) and down.large(x)):  # (down's input has x's rows)
            # a bf16 product's output straight into silu_and_mul and its bf16 output into down_proj's bf16
            # product: the same values as through float32 (`silu_and_mul_bf16`), two casts fewer
            return down(kern.silu_and_mul(gate_up.forward_bf16(x)))
        return down(kern.silu_and_mul(gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, rope, backend, fb, kern: TorchKernels):
        """(this layer's MLP output, the residual stream before it): the
        residual add is fused into the next norm (`kern.add_rmsnorm`)."""
        q, k, v, residual = self.attention_input(x, residual, rope, kern)
        return self.attention_output(backend.forward(self.self_attn.layer_id, q, k, v, fb), residual, kern)

    def attention_input(self, x, residual, rope, kern: TorchKernels):
        """The half before attention: (q, k, v, the residual stream)."""
        n1 = self.input_layernorm
        if residual is None:
            residual, h = x, kern.rmsnorm(x, n1.weight, n1.eps)
        else:
            h, residual = kern.add_rmsnorm(x, residual, n1.weight, n1.eps)
        return (*self.self_attn.qkv(h, rope, kern), residual)

    def attention_output(self, o, residual, kern: TorchKernels):
        """The half after attention, from its output `o`: (the MLP's output,
        the residual stream before it)."""
        n2 = self.post_attention_layernorm
        h, residual = kern.add_rmsnorm(self.self_attn.output(o), residual, n2.weight, n2.eps)
        return self.mlp(h, kern), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # built empty: the checkpoint overwrites it. (nn.Embedding's own random init goes through a torch
        # decomposition that imports torch._dynamo on first use, even on the meta device: 1.2-1.5 s of every
        # engine's start, the largest part of `LLM()` on the embedded model)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Hugging Face parameter suffix -> (our fused parameter, shard index)
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # a float32 model whose products of more than SMALL_M rows run in bf16 (`loader.bf16_large_steps`)
    bf16_large_steps = False
    # the most decode-shaped tokens of a one-call native forward (`use_cpu_kernels`, `native_step_tokens`)
    native_step_limit = SMALL_M

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rotary = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.kernels: TorchKernels = TorchKernels(self.rotary)  # `use_kernels` swaps in fused ones
        self.tied_head: SmallBatchLinear | None = None  # a tied output head's panels (`use_small_batch_linears`)
        self._native_decode: tuple | None = None  # (native module, its weight lists): `use_cpu_kernels`
        self._native_args: tuple | None = None  # (backend, `_native_model_args` for it)

    def pads_from(self) -> int | None:
        """The token count from which a forward's tokens (and its output head's
        rows, `logits_rows`) are padded to a `token_bucket`, or None: never.
        On the CPU, oneDNN builds a bf16 product's kernel for each row count
        it is first given, and keeps the last 1,024: 0.3-0.6 ms per product
        (against 0.1 warm at 61 rows on the 2-core EPYC), so a prefill step of
        a new token count paid 1.5-2.3 ms on top, and once a server's counts
        outgrew the cache, paid it again and again. A bf16 model pads every
        forward; a float32 one whose products of more than `SMALL_M` rows run
        in bf16 (`bf16_large_steps`) pads those only (fewer run on the native
        panels, for any count)."""
        if self.bf16_large_steps:
            return SMALL_M + 1
        p = next(self.parameters())
        return 1 if p.device.type == "cpu" and p.dtype == torch.bfloat16 else None

    @inference
    def forward(self, fb: ForwardBatch, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the batch; returns logits (float32) for `fb.logits_indices` only,
        and the final (normed) hidden states at `fb.hidden_indices` (None if none)."""
        if self.runs_natively(fb, backend):
            return self._forward_native(fb, backend), None
        backend.prepare(fb)
        return self.forward_planned(fb, backend)

    def runs_natively(self, fb: ForwardBatch, backend) -> bool:
        """Whether `forward` runs `fb` as one native call (the CPU's small decode steps)."""
        return (fb.num_decode == fb.input_ids.shape[0] <= self.native_step_tokens(backend)
                and fb.hidden_indices is None)

    def native_step_tokens(self, backend) -> int:
        """The most decode-shaped tokens `forward` runs as one native call
        with `backend` (0: it runs none natively): `native_step_limit`."""
        ok = self._native_decode is not None and getattr(backend, "native_decode_ok", False)
        return self.native_step_limit if ok else 0

    def fold_step_tokens(self, backend) -> int:
        """The most tokens of a step with prompt chunks that runs as one
        native call, its chunks' tokens as decode-shaped queries (0: none):
        at most SMALL_M. Each such query reads its whole context through the
        paged decode kernel, where the extend path's one attention call per
        chunk reads the keys once for all of the chunk's queries: measured on
        the Zen 3 EPYC, a 100-token suffix past a 900-token cached prefix
        took 34.4 ms folded (a limit of 128) against 28.1 ms on the extend
        path (a 60-token prompt, with no prefix, 1.25x faster folded)."""
        return min(SMALL_M, self.native_step_tokens(backend))

    def _forward_native(self, fb: ForwardBatch, backend) -> torch.Tensor:
        """`forward_planned` for a batch of at most `native_step_limit`
        decode-shaped tokens as one native call (`decode_forward`): the same ops
        (`CpuKernels`, the small-batch panels, the paged decode kernel) in the
        same order, so the same logits, without Python between them."""
        return self._native_decode[0].decode_forward(
            fb.input_ids, fb.positions, fb.out_slots, fb.req_to_token, fb.decode_rows, fb.decode_kv_lens,
            fb.logits_indices, *self._native_model_args(backend))

    def _native_model_args(self, backend) -> tuple:
        """The model's arguments to the native forward (`decode_forward`, and
        `greedy_draft_steps` through it), after the batch's: the embedding,
        the per-layer weight list, the KV pool, rotary tables, final norm,
        output head, shapes, eps and the attention scale."""
        got = self._native_args
        if got is not None and got[0] is backend:
            return got[1]  # the same every step: built once (a dozen nn.Module lookups cost ~60 us a step)
        _, layers, head_bias = self._native_decode
        cfg, pool = self.config, backend.pool
        args = (self.model.embed_tokens.weight, layers, pool.k_buffers, pool.v_buffers, self.rotary.cos,
                self.rotary.sin, self.model.norm.weight, self._head().panels, head_bias, cfg.num_heads,
                cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, backend.scale)
        self._native_args = (backend, args)
        return args

    def native_greedy_steps_ok(self, num_tokens: int, backend) -> bool:
        """Whether `greedy_draft_steps` can run a first forward of `num_tokens`
        decode-shaped tokens (the one-call decode path is available, and the
        tokens are few enough to fold: a draft's entries may be catch-ups on
        a long context, `fold_step_tokens`)."""
        return (self._native_decode is not None and num_tokens <= self.fold_step_tokens(backend)
                and hasattr(self._native_decode[0], "greedy_draft_steps"))

    def greedy_draft_steps(self, input_ids, positions, tok_rows, last, steps, table, valid, backend,
                           head: tuple | None = None) -> torch.Tensor:
        """A draft model's greedy steps as one native call: a forward over the
        decode-shaped tokens (ids, positions, req->token rows), then each row's
        argmax at its `last` token fed back one token at a time until it has
        `steps[r]` tokens; the slots written are marked in `valid`. Returns the
        tokens [R, max(steps)] (-1 past a row's steps): the same forwards
        (`_forward_native`) and argmax (`argmax_rows`) as step by step.
        `head`: (panels, bias, token ids) of an output head over part of the
        vocabulary (`head_rows`), whose argmax is taken among those tokens."""
        args = self._native_model_args(backend)
        vocab_map = _NONE
        if head is not None:
            panels, bias, vocab_map = head
            args = args[:7] + (panels, bias) + args[9:]
        return self._native_decode[0].greedy_draft_steps(input_ids, positions, tok_rows, last, steps, table, valid,
                                                         *args, vocab_map)

    def head_rows(self, token_ids: torch.Tensor) -> tuple:
        """An output head over the tokens `token_ids` (int64, ascending; a
        multiple of 16 of them) for `greedy_draft_steps`: (panels, bias, ids),
        the panels packed as the whole head's are."""
        head = self._head()
        w = (self.model.embed_tokens.weight if self.config.tie_word_embeddings else head.weight).detach()
        rows = w.index_select(0, token_ids.to(w.device)).float()
        bias = getattr(head, "bias", None)
        bias = _NONE if bias is None else bias.detach().index_select(0, token_ids.to(bias.device))
        return self._native_decode[0].pack_panels(rows, bf16_panels(rows)), bias, token_ids

    def _head(self):
        return self.tied_head if self.config.tie_word_embeddings else self.lm_head

    def forward_planned(self, fb: ForwardBatch, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` after `backend` was planned for `fb`: the part a CUDA graph captures."""
        kern = self.kernels
        x = self.model.embed_tokens(fb.input_ids)
        rope = kern.rope_prepare(fb.positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, backend, fb, kern)
        return self.logits_of(x, residual, fb)

    def forward_piece(self, i: int, bufs) -> None:
        """Piece `i` of a forward cut at its attention calls (`cuda_graph.
        MixedGraphs`), on the static buffers `bufs` (`PieceBuffers`, views of
        the step's tokens): piece 0 is the embedding and layer 0's half before
        attention, piece i (0 < i < layers) layer i-1's half after attention
        (from `bufs.o`) and layer i's before, and the last piece the last
        layer's half after attention. Each writes what it hands on into
        `bufs` (q, k, v; the residual stream; the last piece's output, `x`),
        so that the pieces compose into `forward_planned` with each attention
        call between two of them. Pieces hold no attention: each can be
        captured as a CUDA graph of its own."""
        kern = self.kernels
        layers = self.model.layers
        if i == 0:
            x, residual = self.model.embed_tokens(bufs.input_ids), None
        else:
            x, residual = layers[i - 1].attention_output(bufs.o, bufs.residual, kern)
        if i == len(layers):
            bufs.x.copy_(x)
        else:
            rope = kern.rope_prepare(bufs.positions, x.dtype)
            q, k, v, residual = layers[i].attention_input(x, residual, rope, kern)
            bufs.q.copy_(q)
            bufs.k.copy_(k)
            bufs.v.copy_(v)
        if residual.data_ptr() != bufs.residual.data_ptr():  # (fused kernels add into the buffer in place)
            bufs.residual.copy_(residual)

    def logits_of(self, x, residual, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last residual add and norm, the output head: logits at
        `fb.logits_indices` and hidden states at `fb.hidden_indices`."""
        kern = self.kernels
        norm = self.model.norm

        def final(idx):  # the last residual add and norm, for the rows that need them only
            return kern.rmsnorm(residual[idx] + x[idx], norm.weight, norm.eps)

        hidden = final(fb.hidden_indices) if fb.hidden_indices is not None else None
        idx = fb.logits_indices
        m = idx.numel()
        rows = logits_rows(m, fb.pad_logits)
        if rows > m:
            return self.compute_logits(final(torch.cat([idx, idx[-1:].expand(rows - m)])))[:m], hidden
        return self.compute_logits(final(idx)), hidden

    def use_kernels(self, flashinfer) -> None:
        """Runs the small per-layer ops as flashinfer's fused kernels (CUDA)."""
        self.kernels = FlashInferKernels(self.rotary, flashinfer)

    def use_cpu_kernels(self, native) -> None:
        """Runs the small per-layer ops as native CPU calls (float32), and a
        forward over at most `native_step_limit` decode-shaped tokens as one
        native call where every product has small-batch panels
        (STEPSERVE_NATIVE_DECODE=0: layer by layer): SMALL_M, or up to
        NATIVE_STEP_TOKENS where every product stays on its panels that far
        (`SmallBatchLinear.native_rows`), so that the one call computes what
        the layered forward does."""
        self.kernels = CpuKernels(self.rotary, native)
        self._native_decode = None
        self._native_args = None
        self.native_step_limit = SMALL_M
        linears = [m for layer in self.model.layers
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        head = self._head()
        if (os.environ.get("STEPSERVE_NATIVE_DECODE", "1") == "0" or not hasattr(native, "decode_forward")
                or not all(isinstance(m, SmallBatchLinear) for m in linears + [head])):
            return

        def b(lin):
            return lin.bias if lin.bias is not None else _NONE

        layers = []
        for layer in self.model.layers:
            at, mlp = layer.self_attn, layer.mlp
            qn = at.q_norm.weight if at.qk_norm else _NONE
            kn = at.k_norm.weight if at.qk_norm else _NONE
            layers += [layer.input_layernorm.weight, at.qkv_proj.panels, b(at.qkv_proj), qn, kn, at.o_proj.panels,
                       b(at.o_proj), layer.post_attention_layernorm.weight, mlp.gate_up_proj.panels, b(mlp.gate_up_proj),
                       mlp.down_proj.panels, b(mlp.down_proj)]
        self._native_decode = (native, layers, b(head))
        self.native_step_limit = max(SMALL_M, min([NATIVE_STEP_TOKENS] + [m.native_rows for m in linears + [head]]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final (normed) hidden states -> float32 logits."""
        if self.config.tie_word_embeddings:
            if self.tied_head is not None:
                return self.tied_head(hidden).float()
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors into our (partly fused) parameters."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shard_sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self._FUSED:
                fused, shard = self._FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"shape mismatch for {name}: {tuple(tensor.shape)} vs {tuple(param.shape)}")
                    param.copy_(tensor)
                    loaded.add(target)
                else:
                    sizes = shard_sizes[target.split(".")[-2]]
                    off = sum(sizes[:shard])
                    param.narrow(0, off, sizes[shard]).copy_(tensor)
                    loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            kind = pname.split(".")[-2] if "." in pname else ""
            if kind in shard_sizes:
                expected.update(f"{pname}#{i}" for i in range(len(shard_sizes[kind])))
            else:
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
