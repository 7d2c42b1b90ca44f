"""CPU feature probes decide the fast paths, and every path has a fallback:
the probes agree with what the hardware actually does, a capped run
(`STEPSERVE_CPU_ISA=avx2` or `baseline`) takes the AVX2-only or portable paths, and bf16 loads and
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
    if cpu_features.isa_cap() != "native":
        assert not cpu_features.can_prepack_bf16_linear()
    else:
        assert cpu_features.can_prepack_bf16_linear() == raw_prepack_works()


def test_bf16_products_probe_agrees_with_torch():
    """bf16 products in hardware are AMX tiles or AVX512_BF16, as torch reports
    them (on this machine, uncapped); never under the AVX2 cap."""
    if cpu_features.isa_cap() != "native":
        assert not cpu_features.has_bf16_matmul() and not cpu_features.has_amx()
        return
    want = any(getattr(torch.cpu, p, lambda: False)() for p in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    assert cpu_features.has_bf16_matmul() == want
    assert cpu_features.has_amx() == getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    assert not cpu_features.has_amx() or cpu_features.has_bf16_matmul()


def test_capped_isa_takes_the_avx2_paths(monkeypatch):
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert not cpu_features.has_bf16_matmul() and not cpu_features.has_amx()
    assert not cpu_features.can_prepack_bf16_linear()
    assert cpu_features.kernel_march() == "x86-64-v3"
    assert cpu_features.kernel_build_tag() == "x86_64_v3"
    cfg = ModelConfig.from_dict({"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                                 "num_hidden_layers": 1, "num_attention_heads": 2, "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32  # bf16 without bf16 products in hardware: slower
    monkeypatch.setenv(cpu_features.ISA_ENV, "baseline")
    assert not cpu_features.has_bf16_matmul()
    assert not cpu_features.can_prepack_bf16_linear()
    assert cpu_features.kernel_march() == "x86-64"
    assert cpu_features.kernel_build_tag() == "x86_64"
    monkeypatch.setenv(cpu_features.ISA_ENV, "native")
    assert cpu_features.kernel_build_tag().startswith("native_")
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="STEPSERVE_CPU_ISA"):
        cpu_features.isa_cap()


@pytest.mark.parametrize("cap", ["native", "avx2", "baseline"])
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


def test_a_small_bf16_checkpoint_runs_float32_and_its_large_products_in_bf16(ckpt_factory, monkeypatch):
    """On CPU, `auto` runs a small bf16 checkpoint in float32 where the native
    kernels build (its one-call decode path is float32), and on a CPU with bf16 products
    its products of more than SMALL_M rows in bf16 on prepacked weights: the
    same as a bf16 linear of the bf16-rounded rows, while up to SMALL_M rows
    stay float32. A float32 asked for is float32 throughout, an AVX2-capped
    run takes no bf16 path, and a model past SMALL_MODEL_PARAMS stays bf16
    with bf16 products."""
    import torch.nn.functional as F

    from stepserve.engine.loader import SMALL_MODEL_PARAMS, bf16_large_steps
    from stepserve.engine.models.llama import SMALL_M, SmallBatchLinear, small_batch_kernels

    if small_batch_kernels(torch.device("cpu"), torch.float32) is None:
        pytest.skip("native CPU kernels did not build on this machine")
    cpu = torch.device("cpu")
    path = ckpt_factory("qwen2", dtype=torch.bfloat16)  # q/k/v bias
    cfg = ModelConfig.from_pretrained(path)
    assert resolve_dtype("auto", cfg, cpu) == torch.float32
    fast = cpu_features.has_bf16_matmul() and cpu_features.can_prepack_bf16_linear()
    assert bf16_large_steps("auto", cfg, cpu) == fast and not bf16_large_steps("float32", cfg, cpu)
    llm = LLM(path, device="cpu")
    assert llm.engine.dtype == torch.float32 and llm.engine.bf16_large_steps == fast
    # a prompt chunk's attention goes to bf16 with it only on AMX (with AVX512_BF16 alone it is slower)
    assert llm.engine.runner.backend.bf16_extend == (fast and cpu_features.has_amx())
    lins = [m for m in llm.engine.model.modules() if isinstance(m, SmallBatchLinear)]
    assert lins and all((m._large is not None) == fast for m in lins)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    exact = LLM(path, device="cpu", dtype="float32")
    assert not exact.engine.bf16_large_steps
    assert not any(m._large is not None for m in exact.engine.model.modules() if isinstance(m, SmallBatchLinear))
    # one row at a time: the float32 one-call path in both, so the same tokens
    again = exact.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    if fast:
        lin = lins[0]
        g = torch.Generator().manual_seed(0)
        for m in (SMALL_M, SMALL_M + 1, 100):
            x = torch.randn(m, lin.in_features, generator=g)
            y = lin(x)
            assert y.dtype == torch.float32
            if m <= SMALL_M:
                torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)
            else:
                b = None if lin.bias is None else lin.bias.bfloat16()
                ref = F.linear(x.bfloat16(), lin.weight.bfloat16(), b).float()
                torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
                assert not torch.allclose(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(cpu_features.ISA_ENV, "avx2")
    assert resolve_dtype("auto", cfg, cpu) == torch.float32 and not bf16_large_steps("auto", cfg, cpu)
    monkeypatch.setenv(cpu_features.ISA_ENV, "native")
    big = ModelConfig.from_dict({"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
                                 "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
                                 "torch_dtype": "bfloat16"})  # TinyLlama-1.1B's shape
    assert big.num_parameters() > SMALL_MODEL_PARAMS
    assert abs(big.num_parameters() - 1_100_048_384) < 1e6  # its weights, norms left out
    assert resolve_dtype("auto", big, cpu) == (torch.bfloat16 if cpu_features.has_bf16_matmul() else torch.float32)
    assert not bf16_large_steps("auto", big, cpu)


def test_bf16_mlp_keeps_its_products_output_in_bf16(ckpt_factory, monkeypatch):
    """A float32 model with bf16 products past SMALL_M rows hands the gate/up
    product's bf16 output to SiLU-and-mul as it is and its bf16 output to the
    down product (`MLP`, `silu_and_mul_bf16`): a long prompt's logprobs equal
    those through float32 and two casts, bit for bit, and its chunks did take
    the bf16 path."""
    from stepserve.engine.models.llama import SmallBatchLinear

    path = ckpt_factory("llama", dtype=torch.bfloat16)
    llm = LLM(path, device="cpu", prefix_caching=False)  # (the second run's prompts prefilled again, not hit)
    kern = llm.engine.model.kernels
    if not (llm.engine.bf16_large_steps and getattr(kern, "bf16_silu", False)):
        pytest.skip("no bf16 products or no native kernels on this CPU")
    calls = []
    fwd = SmallBatchLinear.forward_bf16

    def spy(self, x):
        calls.append(x.shape[0])
        return fwd(self, x)

    monkeypatch.setattr(SmallBatchLinear, "forward_bf16", spy)
    prompts = [list(range(3, 123)), list(range(7, 207, 2))]  # 120 and 100 tokens
    params = SamplingParams(max_tokens=4, logprobs=3, temperature=0.0, ignore_eos=True)
    fused = llm.generate(prompts, params)
    assert calls and min(calls) > 32
    n = len(calls)
    monkeypatch.setattr(kern, "bf16_silu", False)
    casts = llm.generate(prompts, params)
    assert len(calls) == n  # through float32 this time
    for a, b in zip(fused, casts):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_bf16_products_of_many_rows_run_on_bucketed_row_counts(ckpt_factory, monkeypatch):
    """oneDNN builds a bf16 product's kernel per row count: a float32 model
    with bf16 products past SMALL_M rows pads those forwards' tokens (and
    their output head's rows) to a `token_bucket`, so every bf16 product runs
    on a bucketed row count, while forwards of up to SMALL_M tokens stay
    unpadded (the native panels take any count). A padded step's logits are
    the unpadded forward's within bf16 rounding, and its generations are
    complete."""
    import dataclasses

    import stepserve.engine.models.llama as llama
    from stepserve.engine.forward_batch import logits_rows, token_bucket

    path = ckpt_factory("qwen2", dtype=torch.bfloat16)
    llm = LLM(path, device="cpu", max_batched_tokens=96)
    runner = llm.engine.runner
    if not llm.engine.bf16_large_steps:
        assert runner.pads_from is None  # float32 throughout: MKL builds nothing per shape, nothing is padded
        pytest.skip("no bf16 products on this CPU")
    assert runner.pads_from == llama.SMALL_M + 1
    assert [token_bucket(m) for m in (33, 64, 65, 250, 257, 2048, 2049, 5000)] == [40, 64, 80, 256, 320, 2048, 2176, 5120]
    model = llm.engine.model
    rows, steps, bare_run = [], [], []
    product = llama.packed_linear

    def spy_product(x, w, b):
        if not bare_run:
            rows.append(x.shape[0])
        return product(x, w, b)

    forward = model.forward_planned

    def spy(fb, backend):
        logits, hidden = forward(fb, backend)
        real = fb.input_ids.numel() - fb.num_padding
        steps.append((real, fb.num_padding, fb.logits_indices.numel(), fb.pad_logits))
        if fb.num_padding or fb.pad_logits:  # the same forward unpadded (the same KV written again)
            bare = dataclasses.replace(fb, input_ids=fb.input_ids[:real], positions=fb.positions[:real],
                                       out_slots=fb.out_slots[:real], num_padding=0, pad_logits=False)
            bare_run.append(True)
            again, _ = forward(bare, backend)
            bare_run.clear()
            torch.testing.assert_close(logits, again, rtol=2e-2, atol=2e-2)
        return logits, hidden

    monkeypatch.setattr(llama, "packed_linear", spy_product)
    model.forward_planned = spy
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (37, 45, 70, 9, 5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert rows and all(token_bucket(m) == m for m in rows), sorted(set(rows))  # every bf16 product on a bucket
    assert any(pad for _, pad, _, _ in steps)  # some steps padded
    for real, pad, logits_n, pad_logits in steps:
        assert (real + pad == token_bucket(real)) if real > llama.SMALL_M else not pad
        assert pad_logits == (logits_n > llama.SMALL_M) and logits_rows(logits_n, pad_logits) >= logits_n
