"""The Triton Gumbel-max kernel (`engine/triton_sampling.py`) against the
sampler's torch ops: the same uniforms, so the same draws. Without a GPU it
runs under Triton's interpreter (skipped where Triton is not installed, as
on CI); on a GPU `test_gpu_path` checks the compiled kernel too."""

import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent("""
    import sys
    import torch
    from stepserve.engine import sampler as S, triton_sampling as T

    DEVICE = sys.argv[1]

    def reference(s, seeds, counters):
        u = S.uniform(seeds, counters, s.shape[1], S.STREAM_SAMPLE)
        return torch.sub(s, u.log().neg().log())

    g = torch.Generator().manual_seed(7)
    for V in (2053, 3 * T.BLOCK):  # a last block part-full, and none
        R = 24
        s = torch.randn(R, V, generator=g) * torch.rand(R, 1, generator=g) * 6
        s[1, : V - 5] = float("-inf")  # a top-k of 5
        s[2] = float("-inf")  # nothing left: column 0, as argmax has it
        s[3, 77] = float("nan"); s[3, 1500] = float("nan")  # the first NaN
        # ties (float32 rounds the noise away at 1e9, whose ulp is 64): the first column wins, within a lane
        s[4, 10] = 1e9; s[4, 10 + T.BLOCK] = 1e9
        s[6, 5] = 1e9; s[6, 1030] = 1e9  # ... and across lanes (and chunks of one block)
        s[7, : 2 * T.BLOCK] = float("-inf")  # whole chunks masked
        s[5] = 0.0  # flat: the uniforms alone decide
        s = s.to(DEVICE, torch.bfloat16 if V % 2 else torch.float32)  # the kernel reads either
        seeds = torch.randint(-2**62, 2**62, (R,), generator=g).to(DEVICE)
        counters = torch.randint(0, 1 << 40, (R,), generator=g).to(DEVICE)
        got = T.gumbel_argmax(s, S._row_hash(seeds, counters, S.STREAM_SAMPLE))
        assert got is not None and got.dtype == torch.int64 and got.shape == (R,)
        # in chunks of one block (3 a row): the chunks' first maxima reduce to the row's first
        assert torch.equal(T.gumbel_argmax(s, S._row_hash(seeds, counters, S.STREAM_SAMPLE), chunk=T.BLOCK), got)
        v = reference(s.float(), seeds, counters)
        want = torch.argmax(v, dim=1)
        assert got[1] >= V - 5 and got[2] == 0 and got[3] == 77 and got[4] == 10 and got[6] == 5
        assert got[7] >= 2 * T.BLOCK
        for r in range(R):  # equal, or both within a float ulp of the row's maximum (the logs may differ there)
            if got[r] != want[r]:
                top = v[r, want[r]].item()
                assert abs(v[r, got[r]].item() - top) <= 1e-6 * max(1.0, abs(top)), (r, got[r], want[r])
        # batch invariance: a row alone draws what it drew in the batch
        for r in (0, 5, R - 1):
            alone = T.gumbel_argmax(s[r : r + 1], S._row_hash(seeds[r : r + 1], counters[r : r + 1], S.STREAM_SAMPLE))
            assert alone.item() == got[r].item()
        # a strided view of the scores (the sampler's rows of a larger batch) reads the same
        wide = torch.cat([s, s], dim=1)[:, :V]
        assert torch.equal(T.gumbel_argmax(wide, S._row_hash(seeds, counters, S.STREAM_SAMPLE)), got)
    assert T.gumbel_argmax(torch.empty(0, 10, device=DEVICE), torch.empty(0, dtype=torch.int64)).shape == (0,)
    print("ok")
""")


def _check(device: str, interpret: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", CHECK, device], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_kernel_draws_the_torch_ops_draws_under_the_interpreter():
    pytest.importorskip("triton")
    _check("cpu", interpret=True)


@pytest.mark.gpu
def test_gpu_kernel_draws_the_torch_ops_draws():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    _check("cuda", interpret=False)


@pytest.mark.gpu
def test_gpu_sampled_generation_through_the_kernel(ckpt_factory, monkeypatch):
    """Seeded sampling on the GPU: the kernel serves the engine's draws, and
    they are the torch ops' (the same uniforms; a token could part only at a
    tie within an ulp)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("triton")
    from stepserve import LLM, SamplingParams
    from stepserve.engine import triton_sampling as T

    path = ckpt_factory("llama", head_dim=128, dtype=torch.bfloat16)
    llm = LLM(path, device="cuda", dtype="bfloat16", kv_memory_gb=1)
    prompts = [[5 + i, 9, 11 + 2 * i] for i in range(8)]
    p = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    calls = []
    kernel = T.gumbel_argmax
    monkeypatch.setattr(T, "gumbel_argmax", lambda *a: calls.append(1) or kernel(*a))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert calls and not T._failed
    monkeypatch.setattr(T, "_failed", True)  # the torch ops
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    assert got == want


def test_on_the_cpu_the_kernel_declines(monkeypatch):
    """Without CUDA (and the interpreter) the kernel declines, and the
    sampler keeps its own paths."""
    import torch

    from stepserve.engine import triton_sampling as T

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    s = torch.zeros(2, 8)
    assert not T.available(s) and T.gumbel_argmax(s, torch.zeros(2, dtype=torch.int64)) is None


def test_a_kernel_that_fails_is_reported_once_then_left(monkeypatch, caplog):
    pytest.importorskip("triton")
    import torch

    from stepserve.engine import triton_sampling as T

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(T, "_kernel", None)
    monkeypatch.setattr(T, "_failed", False)
    builds = []

    def broken():
        builds.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(T, "_build", broken)
    s = torch.zeros(2, 8)
    for _ in range(3):
        assert T.gumbel_argmax(s, torch.zeros(2, dtype=torch.int64)) is None
    assert builds == [1] and T._failed and not T.available(s)
    assert [r.message for r in caplog.records if "Gumbel-max kernel failed" in r.message]
