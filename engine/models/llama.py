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
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stepserve.engine.attention import AttentionBackend
from stepserve.engine.config import ModelConfig
from stepserve.engine.forward_batch import ForwardBatch


class PackedLinear(nn.Module):
    """A frozen `nn.Linear` whose weight is kept only in oneDNN's blocked layout
    (an opaque mkldnn tensor: computes like the original, cannot be indexed)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, batch_hint), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, exactly as the
        # reference implementation does, so bf16 results agree bit-for-bit-ish.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
        self.build(torch.get_default_device())

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

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend, fb: ForwardBatch):
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        o = backend.forward(self.layer_id, q, k, v, fb)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, backend, fb):
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
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

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.rotary = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the batch; returns logits (float32) for `fb.logits_indices` only,
        and the final (normed) hidden states at `fb.hidden_indices` (None if none)."""
        backend.prepare(fb)
        x = self.model.embed_tokens(fb.input_ids)
        rope = self.rotary.lookup(fb.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, backend, fb)
        hidden = self.model.norm(x[fb.hidden_indices]) if fb.hidden_indices is not None else None
        return self.compute_logits(self.model.norm(x[fb.logits_indices])), hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final (normed) hidden states -> float32 logits."""
        if self.config.tie_word_embeddings:
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
