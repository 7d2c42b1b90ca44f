"""Loads a Hugging Face model directory (config.json + *.safetensors) offline."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

from stepserve.engine import cpu_features
from stepserve.engine.config import ModelConfig, parse_dtype
from stepserve.engine.models.llama import (NATIVE_ROWS, SMALL_M, LlamaForCausalLM, can_pack_linears, cpu_kernels,
                                           pack_linears, small_batch_kernels, use_small_batch_linears)


# On CPU, a bf16 checkpoint with at most this many parameters runs in float32 where the native small-batch
# kernels are built, even where the CPU multiplies bf16 in hardware: its steps are short enough that per-op
# overhead, not GEMM speed, decides a small batch's step, and the one-call native decode path is float32
# (`SmallBatchLinear`). Measured on the 2-core Xeon with AMX, the embedded model (4M parameters): plain greedy
# decoding 3.7x bf16's tok/s at batch 1, 1.8x at 8, 1.05x at 32; with `bf16_large_steps`, 1.0x at 64 and 128,
# and prefill 0.75-0.85x. (On the 2-core Zen 4 EPYC, AVX512_BF16 without AMX, `bf16_large_steps` against
# float32 throughout: plain decoding at batch 64 1.6-2.3x, prefill 1.2-1.4x, in three interleaved pairs.)
# A larger model streams its weights each step at any batch size, where bf16 halves the bytes.
SMALL_MODEL_PARAMS = 64_000_000


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on GPU; on CPU, a bf16 checkpoint stays
    bf16 where the CPU multiplies bf16 in hardware (`has_bf16_matmul`: AMX or
    AVX512_BF16, bf16 GEMMs 2-8x faster than float32 on this project's
    machines; without either, bf16 is slower than float32) and
    the model is larger than SMALL_MODEL_PARAMS or the native kernels did not
    build; everything else runs in float32."""
    if dtype in (None, "auto"):
        if device.type == "cpu":
            if (cfg.checkpoint_dtype == torch.bfloat16 and cpu_features.has_bf16_matmul()
                    and not _small_native(cfg, device)):
                return torch.bfloat16
            return torch.float32
        return cfg.checkpoint_dtype or torch.bfloat16
    return parse_dtype(dtype)


def _small_native(cfg: ModelConfig, device: torch.device) -> bool:
    return (cfg.num_parameters() <= SMALL_MODEL_PARAMS
            and small_batch_kernels(device, torch.float32) is not None)


def bf16_large_steps(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> bool:
    """Whether a model `resolve_dtype` put in float32 although its checkpoint is
    bf16 on a CPU with bf16 products (a small model, above) runs its products of more than
    SMALL_M rows (prefill chunks, large batches) in bf16 on prepacked weights:
    as fast there as the bf16 model (plain decoding at batch 64 and 128 1.3-1.4x
    float32's with AMX, 1.6-2.3x at 64 with AVX512_BF16), with the float32
    one-call path below. Only under `auto`: a
    float32 asked for is float32 throughout."""
    return (dtype in (None, "auto") and device.type == "cpu" and cfg.checkpoint_dtype == torch.bfloat16
            and cpu_features.has_bf16_matmul() and cpu_features.can_prepack_bf16_linear() and _small_native(cfg, device)
            and os.environ.get("STEPSERVE_BF16_LARGE", "1") != "0")


def native_linear_rows(cfg: ModelConfig, bf16_large: bool) -> int:
    """The most rows a float32 linear's product runs on the native panels
    (`SmallBatchLinear`): `NATIVE_ROWS` for a small model (SMALL_MODEL_PARAMS)
    without bf16 products past SMALL_M, else SMALL_M (a larger model is
    unmeasured there, and bf16 hardware products beat the panels);
    STEPSERVE_NATIVE_ROWS sets it (at least SMALL_M)."""
    env = os.environ.get("STEPSERVE_NATIVE_ROWS")
    if env:
        try:
            rows = int(env)
        except ValueError:
            raise ValueError(f"STEPSERVE_NATIVE_ROWS must be a row count, got {env!r}") from None
        return max(SMALL_M, rows)
    if bf16_large or cfg.num_parameters() > SMALL_MODEL_PARAMS:
        return SMALL_M
    return NATIVE_ROWS


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir!r}")
    return files


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)`: every meta parameter and buffer replaced by an
    uninitialised tensor of its shape and dtype on `device`, a parameter
    shared by several modules still shared. (`to_empty` calls `empty_like` on
    meta tensors, which runs torch's Python reference for it, whose first use
    imports sympy and torch.fx's symbolic shapes: 0.3-0.4 s of every start.)"""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, its replacement)
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or not t.is_meta:
                    continue
                got = made.get(id(t))
                if got is None:
                    new = torch.empty(t.shape, dtype=t.dtype, device=device)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    got = made[id(t)] = (t, new)
                store[name] = got[1]


def load_model(
    model_dir: str,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    bf16_large: bool | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """`bf16_large`: as `bf16_large_steps` decides when None (a draft model takes
    its target's choice, so that both compute alike); the model's
    `bf16_large_steps` says what was done."""
    cfg = ModelConfig.from_pretrained(model_dir)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions).to(torch_dtype)
    # Materialise on the target device in the target dtype (an 8B model never
    # exists in float32 on the GPU), then overwrite with checkpoint tensors
    # (`copy_` rounds as `.to` would); rotary cos/sin are recomputed there in float32.
    _materialize(model, device)
    model.rotary.build(device)
    model.load_weights(iter_weights(model_dir))
    model.eval()
    if can_pack_linears(device, torch_dtype) and os.environ.get("STEPSERVE_PACK_LINEARS", "1") != "0":
        pack_linears(model)
    kernels = small_batch_kernels(device, torch_dtype)
    if bf16_large is None:
        bf16_large = bf16_large_steps(dtype, cfg, device)
    model.bf16_large_steps = bf16_large and kernels is not None
    if kernels is not None:
        use_small_batch_linears(model, kernels, bf16_large=bf16_large,
                                native_rows=native_linear_rows(cfg, bf16_large))
    fused = cpu_kernels(device, torch_dtype)
    if fused is not None:
        model.use_cpu_kernels(fused)
    return cfg, model
