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
from stepserve.engine.models.llama import (LlamaForCausalLM, can_pack_linears, cpu_kernels, pack_linears,
                                           small_batch_kernels, use_small_batch_linears)


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on GPU; on CPU, a bf16 checkpoint stays
    bf16 where the CPU has AMX (bf16 GEMMs 4-8x faster than float32, measured
    on this project's machines; without AMX bf16 is slower than float32), and
    everything else runs in float32."""
    if dtype in (None, "auto"):
        if device.type == "cpu":
            if cfg.checkpoint_dtype == torch.bfloat16 and cpu_features.has_amx():
                return torch.bfloat16
            return torch.float32
        return cfg.checkpoint_dtype or torch.bfloat16
    return parse_dtype(dtype)


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


def load_model(
    model_dir: str,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
) -> tuple[ModelConfig, LlamaForCausalLM]:
    cfg = ModelConfig.from_pretrained(model_dir)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions).to(torch_dtype)
    # Materialise on the target device in the target dtype (an 8B model never
    # exists in float32 on the GPU), then overwrite with checkpoint tensors
    # (`copy_` rounds as `.to` would); rotary cos/sin are recomputed there in float32.
    model = model.to_empty(device=device)
    model.rotary.build(device)
    model.load_weights(iter_weights(model_dir))
    model.eval()
    if can_pack_linears(device, torch_dtype) and os.environ.get("STEPSERVE_PACK_LINEARS", "1") != "0":
        pack_linears(model)
    kernels = small_batch_kernels(device, torch_dtype)
    if kernels is not None:
        use_small_batch_linears(model, kernels)
    fused = cpu_kernels(device, torch_dtype)
    if fused is not None:
        model.use_cpu_kernels(fused)
    return cfg, model
