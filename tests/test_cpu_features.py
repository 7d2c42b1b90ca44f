"""CPU feature probes decide the fast paths, and every path has a fallback:
the probes agree with what the hardware actually does, a capped run
(`STEPSERVE_CPU_ISA=avx2`) takes the AVX2-only paths, and bf16 loads and
generates on any x86-64 CPU."""

import pytest
import torch

from stepserve import LLM, SamplingParams
from stepserve.engine import cpu_features
from stepserve.engine.config import ModelConfig
from stepserve.engine.loader import resolve_dtype
from stepserve.engine.models.llama import PackedLinear

pytestmark = pytest.mark.cpu_paths


def raw_prepack_works() -> bool:
    """The op itself, tried directly (independent of the probe's code path)."""
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=torch.bfloat16), 4)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 16, dtype=torch.bfloat16), w, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def test_prepack_probe_agrees_with_the_cpu():
    if cpu_features.isa_cap() == "avx2":
        assert not cpu_features.can_prepack_bf16_linear()
    else:
        assert cpu_features.can_prepack_bf16_linear() == raw_prepack_works()


def test_capped_isa_takes_the_avx2_paths(monkeypatch):
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert not cpu_features.has_amx()
    assert not cpu_features.can_prepack_bf16_linear()
    assert cpu_features.kernel_march() == "x86-64-v3"
    assert cpu_features.kernel_build_tag() == "x86_64_v3"
    cfg = ModelConfig.from_dict({"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                                 "num_hidden_layers": 1, "num_attention_heads": 2, "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32  # bf16 without AMX: slower
    monkeypatch.setenv(cpu_features.ISA_ENV, "native")
    assert cpu_features.kernel_build_tag().startswith("native_")
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="STEPSERVE_CPU_ISA"):
        cpu_features.isa_cap()


@pytest.mark.parametrize("cap", ["native", "avx2"])
def test_bf16_runs_on_every_cpu_with_or_without_prepacking(ckpt_factory, monkeypatch, cap):
    """An explicit bf16 engine loads and generates whatever the CPU; it prepacks
    its linears only where the probe allows, and the tokens are the same."""
    monkeypatch.setenv(cpu_features.ISA_ENV, cap)
    path = ckpt_factory("qwen2", dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", device="cpu")
    packed = any(isinstance(m, PackedLinear) for m in llm.engine.model.modules())
    assert packed == cpu_features.can_prepack_bf16_linear()
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    monkeypatch.setenv("STEPSERVE_PACK_LINEARS", "0")
    plain = LLM(path, dtype="bfloat16", device="cpu")
    again = plain.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids
