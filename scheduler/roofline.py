"""Step latency for hardware we do not have, from a roofline calculation.

Per device of a tensor-parallel group of N:
  memory time  = (weights/N + KV read + KV written) / (HBM bandwidth * mem_eff)
  compute time = (dense FLOPs + attention FLOPs) / N / (bf16 dense peak * mfu)
  step time    = overhead + max(memory, compute) + all-reduce time
with two all-reduces per layer (after attention and after the MLP) of
new_tokens * hidden * 2 bytes each, ring algorithm over NVLink or PCIe:
  2 (N-1)/N * bytes / link bandwidth + a fixed latency per collective.

KV heads split over the group; when there are fewer KV heads than devices
they are replicated (each device holds at least one). Attention FLOPs count
4 * layers * heads * head_dim per (query, key) pair: decode rows attend over
their context (`context_tokens`), prefill chunks add their causal pairs
(`prefill_pairs`, see latency_model).

These are estimates, labelled `"source": "roofline"` everywhere they appear:
the efficiency factors and the overhead below are assumptions, not
measurements. The KV pool follows the usual serving-engine sizing: a share
(`gpu_memory_utilization`) of each device's memory, minus its weights and an
activation reserve.

Built-in profile names: `DEVICE[xN]:MODEL`, e.g. `h100:llama3-8b`,
`h100x8:qwen3-32b`, `a10x8:llama2-70b`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    hbm_gbps: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense (no sparsity) bf16 tensor peak
    memory_gb: float
    link: str  # nvlink | pcie
    link_gbps: float  # per-direction bandwidth per device for collectives, GB/s
    link_latency_s: float  # fixed cost of one all-reduce


# Vendor datasheet figures (SXM parts where both exist).
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM5 80GB", 3350, 989, 80, "nvlink", 450, 8e-6),
    "h200": Device("H200 SXM 141GB", 4800, 989, 141, "nvlink", 450, 8e-6),
    "a100": Device("A100 SXM4 80GB", 2039, 312, 80, "nvlink", 300, 10e-6),
    "l4": Device("L4 24GB", 300, 121, 24, "pcie", 25, 30e-6),  # PCIe Gen4 x16, ~25 GB/s achieved
    "a10": Device("A10 24GB", 600, 125, 24, "pcie", 25, 30e-6),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_position: int
    tied: bool = False
    qk_norm: bool = False

    @property
    def layer_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h
        mlp = 3 * h * self.intermediate
        norms = 2 * h + (2 * d if self.qk_norm else 0)
        return attn + mlp + norms

    @property
    def params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layers * self.layer_params + emb * (1 if self.tied else 2) + self.hidden

    @property
    def dense_flops_per_token(self) -> int:
        """2 FLOPs per weight touched by a token (the LM head is charged per sampled row)."""
        return 2 * self.layers * self.layer_params

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# Public Hugging Face config.json values.
MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape("Meta-Llama-3-8B", 4096, 14336, 32, 32, 8, 128, 128256, 8192),
    "llama3-70b": ModelShape("Meta-Llama-3-70B", 8192, 28672, 80, 64, 8, 128, 128256, 8192),
    "llama2-7b": ModelShape("Llama-2-7b", 4096, 11008, 32, 32, 32, 128, 32000, 4096),
    "llama2-70b": ModelShape("Llama-2-70b", 8192, 28672, 80, 64, 8, 128, 32000, 4096),
    "qwen3-8b": ModelShape("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, 40960, qk_norm=True),
    "qwen3-32b": ModelShape("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, 40960, qk_norm=True),
    # a draft model for llama3-8b (same tokenizer)
    "llama3.2-1b": ModelShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, 128256, 131072, tied=True),
}


@dataclass
class RooflineAssumptions:
    dtype_bytes: int = 2  # bf16 weights and KV
    mem_eff: float = 0.80  # achieved / peak HBM bandwidth
    mfu: float = 0.60  # achieved / peak dense bf16 FLOPs
    overhead_s: float = 1.5e-3  # per step: scheduling, launches, sampling (CUDA graphs assumed)
    gpu_memory_utilization: float = 0.90  # share of device memory the engine takes
    activation_reserve_gb: float = 2.0  # per device, for activations and workspace


@dataclass
class RooflineLatencyModel:
    """Step time from the roofline; same `predict` signature as the linear model."""

    form: str = "roofline"
    tp: int = 1
    weight_bytes_per_dev: float = 0.0
    kv_bytes_per_token_per_dev: float = 0.0
    dense_flops_per_token: float = 0.0
    lm_head_flops_per_row: float = 0.0
    attn_flops_per_pair: float = 0.0
    mem_bw: float = 1.0  # effective bytes/s
    flops: float = 1.0  # effective FLOP/s per device
    allreduce_bytes_per_token: float = 0.0  # per layer and collective
    allreduces_per_step: int = 0
    link_bw: float = 1.0
    link_latency_s: float = 0.0
    overhead_s: float = 0.0

    def predict(self, rows: int, context_tokens: int, new_tokens: int, prefill_pairs: float = 0.0,
                extend_rows: int = 0, chunk_rows: int = 0, layered: bool = False) -> float:
        """(`extend_rows`, `chunk_rows` and `layered` are not priced: the
        roofline is the forward pass's, and a chunk's bookkeeping outside it
        is a measured profile's term.)"""
        mem = (self.weight_bytes_per_dev
               + self.kv_bytes_per_token_per_dev * (context_tokens + new_tokens)) / self.mem_bw
        fl = (self.dense_flops_per_token * new_tokens + self.lm_head_flops_per_row * rows
              + self.attn_flops_per_pair * (context_tokens + prefill_pairs)) / self.tp / self.flops
        t = self.overhead_s + (mem if mem > fl else fl)
        if self.tp > 1:
            n = self.tp
            per = 2 * (n - 1) / n * self.allreduce_bytes_per_token * new_tokens / self.link_bw + self.link_latency_s
            t += self.allreduces_per_step * per
        return t

    def predict_features(self, f) -> float:
        return self.predict(f.rows, f.context_tokens, f.new_tokens, f.prefill_pairs, f.extend_rows, f.chunk_rows,
                            f.layered)

    def predict_plan(self, plan) -> float:
        from stepserve.scheduler.latency_model import plan_features

        return self.predict_features(plan_features(plan))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RooflineLatencyModel":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


_NAME = re.compile(r"^(?P<dev>[a-z0-9]+?)(?:x(?P<n>\d+))?:(?P<model>[a-z0-9.\-]+)$")


def _match(name: str):
    m = _NAME.match(name.strip().lower())
    return m if m and m.group("dev") in DEVICES and m.group("model") in MODELS else None


def parse_name(name: str) -> tuple[str, int, str]:
    m = _match(name)
    if not m:
        raise ValueError(
            f"bad roofline profile name {name!r}: want DEVICE[xN]:MODEL with DEVICE in "
            f"{', '.join(DEVICES)} and MODEL in {', '.join(MODELS)} (e.g. h100x8:qwen3-32b)")
    n = int(m.group("n") or 1)
    if n < 1:  # every per-device share divides by it
        raise ValueError(f"bad roofline profile name {name!r}: the device count N of DEVICExN must be at least 1")
    return m.group("dev"), n, m.group("model")


def is_builtin_name(name: str) -> bool:
    """Whether `name` names a built-in device and model (`load_profile` takes it
    as one); a device count below 1 is then refused by `parse_name` as such,
    not reported as a missing file."""
    return _match(name) is not None


def builtin_names() -> list[str]:
    """The built-in profiles whose model fits its devices (with the default
    assumptions): `simulate --list-profiles` (a 70B model on one H100 would
    only ever answer "does not fit")."""
    a = RooflineAssumptions()
    names = []
    for d in DEVICES:
        for n in (1, 2, 4, 8):
            for m in MODELS:
                try:
                    kv_slots(DEVICES[d], n, MODELS[m], a)
                except ValueError:
                    continue
                names.append(f"{d}{'' if n == 1 else f'x{n}'}:{m}")
    return names


def roofline_model(dev: Device, n: int, shape: ModelShape, a: RooflineAssumptions) -> RooflineLatencyModel:
    kv_heads_per_dev = max(1, math.ceil(shape.kv_heads / n))
    return RooflineLatencyModel(
        tp=n,
        weight_bytes_per_dev=shape.params * a.dtype_bytes / n,
        kv_bytes_per_token_per_dev=2 * shape.layers * kv_heads_per_dev * shape.head_dim * a.dtype_bytes,
        dense_flops_per_token=shape.dense_flops_per_token,
        lm_head_flops_per_row=2 * shape.hidden * shape.vocab,
        attn_flops_per_pair=4 * shape.layers * shape.heads * shape.head_dim,
        mem_bw=dev.hbm_gbps * GB * a.mem_eff,
        flops=dev.bf16_tflops * 1e12 * a.mfu,
        allreduce_bytes_per_token=shape.hidden * a.dtype_bytes,
        allreduces_per_step=2 * shape.layers if n > 1 else 0,
        link_bw=dev.link_gbps * GB,
        link_latency_s=dev.link_latency_s,
        overhead_s=a.overhead_s,
    )


def kv_slots(dev: Device, n: int, shape: ModelShape, a: RooflineAssumptions) -> int:
    """Tokens of KV the group holds: per device, usable memory minus its weight
    shard and the activation reserve, over its per-token KV share."""
    usable = dev.memory_gb * GB * a.gpu_memory_utilization
    free = usable - shape.params * a.dtype_bytes / n - a.activation_reserve_gb * GiB
    per_tok = 2 * shape.layers * max(1, math.ceil(shape.kv_heads / n)) * shape.head_dim * a.dtype_bytes
    if free <= 0:
        raise ValueError(
            f"{shape.name} ({shape.params * a.dtype_bytes / GB:.0f} GB of weights) does not fit on "
            f"{n} x {dev.name} at {a.gpu_memory_utilization:.0%} memory utilisation")
    return int(free // per_tok)


def roofline_profile(name: str, assumptions: RooflineAssumptions | None = None,
                     max_running: int = 256, max_batched_tokens: int = 8192) -> dict:
    """The profile JSON for `DEVICE[xN]:MODEL`."""
    from stepserve.scheduler.latency_model import PROFILE_KIND

    a = assumptions or RooflineAssumptions()
    d, n, m = parse_name(name)
    dev, shape = DEVICES[d], MODELS[m]
    model = roofline_model(dev, n, shape, a)
    slots = kv_slots(dev, n, shape, a)
    return {
        "kind": PROFILE_KIND,
        "version": 1,
        "name": name,
        "source": "roofline",
        "device": {"key": d, "count": n, **asdict(dev)},
        "model": {"key": m, "params": shape.params, **asdict(shape)},
        "target": "wall_s",
        "latency": model.to_dict(),
        "engine": {
            "kv_slots": slots,
            "max_running": max_running,
            "max_batched_tokens": max_batched_tokens,
            "max_context": shape.max_position,
            "vocab_size": shape.vocab,
        },
        "assumptions": asdict(a),
        "notes": [
            "roofline estimate, not a measurement: step = overhead + max(bytes/bandwidth, FLOPs/peak) "
            "+ TP all-reduces; efficiencies as in 'assumptions'",
            f"KV pool: {a.gpu_memory_utilization:.0%} of {n} x {dev.memory_gb:g} GB minus bf16 weights "
            f"({shape.params * a.dtype_bytes / GB:.1f} GB) and {a.activation_reserve_gb:g} GiB per device "
            f"for activations = {slots} tokens",
        ],
    }
