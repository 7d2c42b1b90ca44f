"""The GPU path: the flashinfer attention backend, decode CUDA graphs and the
GPU memory sizing.

Without CUDA (CI) the backend runs against `fake_flashinfer`, a naive
stand-in with flashinfer's plan/run contract, so the metadata it plans (page
index lists, indptrs, graph buffers, padding rows) is checked against the
torch backend through the engine's public API; the graph runner runs its
static buffers, padding and re-planning eagerly. Tests marked `gpu` run the
real kernels and graphs where CUDA and flashinfer are present."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import fake_flashinfer
from stepserve import LLM, SamplingParams
from stepserve.engine.attention_flashinfer import PageListStaging, indptr_of, paged_indices
from stepserve.engine.cuda_graph import bucket_for, graph_buckets, mixed_buckets
from stepserve.engine.engine import activation_reserve_bytes, gpu_kv_bytes

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_of(lengths, seed=0, vocab=380):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def tokens(llm, prompts, max_new, **kw):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_new, **GREEDY, **kw))]


@pytest.fixture
def fake_fi(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    return fake_flashinfer


# -- pure functions ---------------------------------------------------------------------------------
def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(50) == [1, 2, 4, 8, 16, 32, 50]
    b = graph_buckets(256)
    assert b[:7] == [1, 2, 4, 8, 16, 32, 64] and b[-1] == 256 and all(y - x == 32 for x, y in zip(b[6:], b[7:]))
    assert [bucket_for(b, n) for n in (1, 3, 33, 64, 65, 256, 257)] == [1, 4, 64, 64, 96, 256, None]
    with pytest.raises(ValueError):
        graph_buckets(0)


def test_mixed_buckets():
    assert mixed_buckets(2048) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048]
    assert mixed_buckets(48) == [16, 32, 48]
    assert mixed_buckets(1000) == [16, 32, 64, 128, 256, 384, 512, 768, 1000]
    assert mixed_buckets(10) == [10]
    for n in range(1, 2049):  # a step pads to at most 2x its tokens, 1.5x past 256 (and 16 at least)
        b = bucket_for(mixed_buckets(2048), n)
        assert n <= b <= max(16, 2 * n if n <= 256 else 1.5 * n)
    with pytest.raises(ValueError):
        mixed_buckets(0)


def test_paged_indices_equal_a_naive_gather():
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 1000, (6, 40), generator=g)
    rows = torch.tensor([4, 0, 4, 2])
    lens = torch.tensor([1, 40, 7, 13])
    ip = indptr_of(lens)
    assert ip.dtype == torch.int32 and ip.tolist() == [0, 1, 41, 48, 61]
    assert indptr_of(lens.tolist(), 2).tolist() == [0, 1, 41, 48, 61, 62, 63]  # two padding rows of one page
    assert indptr_of([]).tolist() == [0]
    got = paged_indices(table, rows, lens)
    want = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), lens.tolist())])
    assert got.dtype == torch.int32 and got.device.type == "cpu" and torch.equal(got.long(), want)
    padded = paged_indices(table, rows, lens, pad=2)  # two padding rows, each reading the padding slot 0
    assert torch.equal(padded.long(), torch.cat([want, torch.zeros(2, dtype=torch.long)]))
    assert paged_indices(table, rows[:0], lens[:0]).numel() == 0
    assert paged_indices(table, rows[:0], lens[:0], pad=3).tolist() == [0, 0, 0]
    buf = np.full(100, -1, dtype=np.int32)  # written in place, stale entries past the list untouched
    assert torch.equal(paged_indices(table, rows, lens, pad=1, out=buf).long(), torch.cat([want, torch.zeros(1).long()]))
    assert (buf[62:] == -1).all()


def test_page_lists_are_staged_into_the_graph_buffer():
    """The page list lands in the given device buffer (a graph wrapper's),
    as paged_indices builds it, and the staging buffer is reused and grown."""
    g = torch.Generator().manual_seed(1)
    table = torch.randint(1, 1000, (5, 30), generator=g)
    staging = PageListStaging(torch.device("cpu"))
    dest = torch.full((200,), -7, dtype=torch.int32)
    for rows, lens, pad in (([3, 1], [30, 4], 2), ([0], [9], 0), ([4, 2, 0, 1], [30, 30, 30, 30], 1)):
        rows, lens = torch.tensor(rows), torch.tensor(lens)
        got = staging.send(table, rows, lens, pad, dest)
        assert got.data_ptr() == dest.data_ptr() and len(got) == int(lens.sum()) + pad
        assert torch.equal(got, paged_indices(table, rows, lens, pad))
    fresh = staging.send(table, torch.tensor([2]), torch.tensor([5]), 0)
    assert fresh.tolist() == table[2, :5].tolist()
    big = torch.randint(1, 1 << 20, (3, 40000), generator=g)  # past the staging buffer's first size
    rows, lens = torch.tensor([2, 0, 1]), torch.tensor([40000, 39999, 1])
    assert torch.equal(staging.send(big, rows, lens, 3), paged_indices(big, rows, lens, 3))


def test_gpu_memory_sizing_arithmetic():
    gib = 1 << 30
    # 80 GiB card, 16 GiB of weights loaded: 0.9 * 80 - 16 - reserve
    assert gpu_kv_bytes(free=64 * gib, total=80 * gib, utilization=0.9, reserve=2 * gib) == int(72 * gib) - 18 * gib
    assert gpu_kv_bytes(free=4 * gib, total=80 * gib, utilization=0.5, reserve=gib) == 0  # nothing left: never negative

    class Llama8B:  # Llama-3-8B's shapes
        hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, vocab_size = 4096, 14336, 32, 8, 128, 128256

    r = activation_reserve_bytes(Llama8B, torch.bfloat16, max_batched_tokens=2048, max_rows=256)
    per_token = (4 * 4096 + 3 * 14336 + 48 * 128) * 2
    assert r == 2 * 2048 * per_token + 4 * 256 * 128256 * 4 + (256 << 20)
    assert 1.0 < r / gib < 2.0
    # the mixed-step graphs hold one more step's activations for good
    assert activation_reserve_bytes(Llama8B, torch.bfloat16, 2048, 256, mixed_graphs=True) == r + 2048 * per_token


def test_cpu_engine_sizes_kv_from_kv_memory_gb(llama_ckpt):
    from stepserve.engine.config import ModelConfig

    mc = ModelConfig.from_pretrained(llama_ckpt)
    per_tok = mc.kv_bytes_per_token(torch.float32)
    assert LLM(llama_ckpt, max_running=4096).engine.kv_capacity == (1 << 30) // per_tok  # 1 GiB on CPU
    assert LLM(llama_ckpt, kv_memory_gb=0.01).engine.kv_capacity == int(0.01 * (1 << 30)) // per_tok
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(llama_ckpt, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="attention backend"):
        LLM(llama_ckpt, attention_backend="triton")


def test_flashinfer_named_without_it_is_a_clear_error(llama_ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    for device in devices:
        with pytest.raises(ValueError, match="attention_backend 'flashinfer' cannot be used"):
            LLM(llama_ckpt, attention_backend="flashinfer", device=device)
    llm = LLM(llama_ckpt)  # auto: the torch backend
    assert llm.engine.attention_backend == "TorchAttention" and llm.engine.runner.graphs is None


# -- the backend's plans, through the engine, against the torch backend (fake kernels on CPU) -------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_flashinfer_backend_plans_equal_torch_backend(fake_fi, ckpt_factory, arch):
    """Decode rows of many lengths, prefill chunks over radix-cached prefixes
    (a second pass of the same prompts, and chunks of 16 tokens), mixed in one
    step, with logprobs: the same tokens and logprobs as the torch backend."""
    path = ckpt_factory(arch)
    prompts = prompts_of([3, 40, 17, 90, 1, 60], seed=1)
    kw = dict(max_batched_tokens=16, max_running=4, device="cpu")
    ref = LLM(path, attention_backend="torch", **kw)
    fi = LLM(path, attention_backend="flashinfer", enforce_eager=True, **kw)
    assert fi.engine.attention_backend == "FlashInferAttention" and fi.engine.runner.graphs is None
    for _ in range(2):  # the second pass hits the radix cache
        a = ref.generate(prompts, SamplingParams(max_tokens=12, logprobs=2, **GREEDY))
        b = fi.generate(prompts, SamplingParams(max_tokens=12, logprobs=2, **GREEDY))
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            lx = torch.tensor([t.logprob for t in x.outputs[0].logprobs])
            ly = torch.tensor([t.logprob for t in y.outputs[0].logprobs])
            torch.testing.assert_close(lx, ly, atol=1e-4, rtol=1e-4)
    assert b[0].num_cached_tokens > 0
    fi.engine.kv_report()


def test_flashinfer_kernels_never_launch_over_no_rows(fake_fi, ckpt_factory):
    """A prompt longer than a step's token budget, alone: the steps of its
    first chunks need no logits rows, so the last norm runs over none. A
    kernel launched over no rows is a CUDA error (on an H200 it killed the
    engine at a replay's first long prompt); the fake kernels raise it too.
    The tokens equal the torch backend's, and a request after it is served."""
    path = ckpt_factory("llama")
    prompts = prompts_of([70, 5], seed=3)
    kw = dict(max_batched_tokens=16, max_running=4, device="cpu")
    ref = LLM(path, attention_backend="torch", **kw)
    fi = LLM(path, attention_backend="flashinfer", enforce_eager=True, **kw)
    for p in prompts:  # one at a time: the long one's first 4 steps are chunks alone
        assert tokens(fi, [p], 6) == tokens(ref, [p], 6)
    fi.engine.kv_report()


def test_decode_graphs_equal_eager(fake_fi, ckpt_factory):
    """The graph runner's static buffers: batch sizes that need padding rows
    (3, 5, 17 rows into buckets 4, 8, 32), rows finishing at different times
    (so a bucket shrinks and stale rows sit in the buffers), n > 1 forks and
    speculative verify rows (decode-shaped queries beyond the row count)."""
    path = ckpt_factory("llama")
    eager = LLM(path, attention_backend="flashinfer", enforce_eager=True, max_running=32, device="cpu")
    graphs = LLM(path, attention_backend="flashinfer", max_running=32, device="cpu")
    assert graphs.engine.runner.graphs is not None and not graphs.engine.runner.graphs.capture_graphs
    for n_prompts, seed in ((3, 2), (5, 3), (17, 4)):
        prompts = prompts_of([5 + 7 * i for i in range(n_prompts)], seed=seed)
        lens = [4 + 3 * i for i in range(n_prompts)]
        want = [o.outputs[0].token_ids for o in eager.generate(
            prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lens])]
        got = [o.outputs[0].token_ids for o in graphs.generate(
            prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lens])]
        assert got == want
    assert graphs.engine.runner.graphs.replays > 20
    p = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=7)
    assert ([c.token_ids for c in graphs.generate(prompts[:2], p)[1].outputs]
            == [c.token_ids for c in eager.generate(prompts[:2], p)[1].outputs])
    graphs.engine.kv_report()


@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
def test_mixed_step_graphs_equal_eager(fake_fi, ckpt_factory, backend):
    """Steps with prompt chunks cut at their attention calls (`MixedGraphs`,
    its pieces run uncaptured on the CPU): chunked prompts beside decode rows,
    token counts padded into buckets (16, 32, 48), a warm radix cache, forks
    (n = 3, seeded sampling) and a prompt-logprobs request (which runs
    eagerly) give the tokens, and logprobs within rounding, of the same steps
    run whole; the KV check holds after every step."""
    path = ckpt_factory("qwen2")  # q/k/v bias
    kw = dict(attention_backend=backend, device="cpu", max_batched_tokens=48, check_invariants=True)
    whole = LLM(path, mixed_step_graphs="off", **kw)
    pieces = LLM(path, mixed_step_graphs="auto" if backend == "flashinfer" else "on", **kw)
    mixed = pieces.engine.runner.mixed_graphs
    assert mixed is not None and not mixed.capture_graphs and whole.engine.runner.mixed_graphs is None
    prompts = prompts_of([70, 5, 33, 12, 90, 1], seed=6)
    params = [SamplingParams(max_tokens=6 + 3 * i, logprobs=2, **GREEDY) for i in range(len(prompts))]
    for _ in range(2):  # the second pass hits the radix cache
        a, b = whole.generate(prompts, params), pieces.generate(prompts, params)
        for x, y in zip(a, b):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor([t.logprob for t in x.outputs[0].logprobs]),
                                       torch.tensor([t.logprob for t in y.outputs[0].logprobs]), atol=1e-4, rtol=0)
    assert mixed.replays >= 4
    p = SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=11)
    assert ([c.token_ids for c in pieces.generate(prompts[:3], p)[2].outputs]
            == [c.token_ids for c in whole.generate(prompts[:3], p)[2].outputs])
    p = SamplingParams(max_tokens=3, prompt_logprobs=1, **GREEDY)  # its chunks' steps run eagerly (`fits`)
    x, y = whole.generate(prompts[4:5], p)[0], pieces.generate(prompts[4:5], p)[0]
    assert x.outputs[0].token_ids == y.outputs[0].token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in x.prompt_logprobs[1:]]),
                               torch.tensor([lp.logprob for lp in y.prompt_logprobs[1:]]), atol=1e-4, rtol=0)
    pieces.engine.kv_report()


def test_decode_graphs_serve_verify_rows(fake_fi, ckpt_factory):
    path = ckpt_factory("llama")
    prompts = prompts_of([30, 12, 50], seed=5)
    prompts = [p + p[:10] + p for p in prompts]  # repetitive: the n-gram proposer drafts
    ref = tokens(LLM(path, attention_backend="torch", device="cpu"), prompts, 20)
    spec = LLM(path, attention_backend="flashinfer", speculative="ngram", spec_length="fixed:3", max_running=16,
               device="cpu")
    assert tokens(spec, prompts, 20) == ref
    assert spec.engine.runner.graphs.replays > 0
    assert spec.engine.stats().policy.get("spec_draft_tokens", 0) > 0
    spec.engine.kv_report()


# -- on a GPU ---------------------------------------------------------------------------------------------
def _real_flashinfer():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        import flashinfer  # noqa: F401  (imports, or the test is skipped)
    except Exception as e:
        pytest.skip(f"flashinfer does not import: {e}")


GPU_ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral"]


def assert_greedy_within_bf16_noise(path, prompts, outputs, what):
    """Each greedy token of `outputs` checked, teacher-forced, against
    transformers on the same sequence: in float32 (the exact reference) its
    logit must be within the bf16 noise of the best one there -- twice the
    largest difference between transformers' own bf16 and float32 logits at
    that position, plus 0.05. A bf16 engine can pick either of two tokens that
    bf16 cannot tell apart, and nothing else."""
    from transformers import AutoModelForCausalLM

    ref32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    ref16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for p, got in zip(prompts, outputs):
        ids = torch.tensor([p + got], device="cuda")
        at = slice(len(p) - 1, len(p) - 1 + len(got))
        with torch.inference_mode():
            f = ref32(ids).logits[0, at].float()
            b = ref16(ids).logits[0, at].float()
        noise = (f - b).abs().amax(-1)
        gap = f.amax(-1) - f.gather(1, torch.tensor(got, device="cuda")[:, None]).squeeze(1)
        bad = (gap > 0.05 + 2 * noise).nonzero().flatten().tolist()
        assert not bad, (f"{what}, prompt of {len(p)}: output positions {bad} are not near-best in float32 "
                         f"(gaps {gap[bad].tolist()}, bf16 noise {noise[bad].tolist()})")


def assert_agree_or_within_bf16_noise(path, prompts, a, b, name_a, name_b):
    """Two paths' greedy tokens `a`, `b` for `prompts`: equal, or for each
    prompt where they part, both within bf16 noise of float32 transformers."""
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if differ:
        pick = [prompts[i] for i in differ]
        assert_greedy_within_bf16_noise(path, pick, [a[i] for i in differ], name_a)
        assert_greedy_within_bf16_noise(path, pick, [b[i] for i in differ], name_b)


@pytest.mark.gpu
def test_gpu_flashinfer_equals_torch_backend(ckpt_factory):
    """Greedy tokens of flashinfer (fused kernels, CUDA graphs) and of the
    torch backend, both bf16 on the GPU: equal, or where they part, both within
    bf16 noise of float32 transformers at every position."""
    _real_flashinfer()
    path = ckpt_factory("llama", head_dim=128, dtype=torch.bfloat16)
    prompts = prompts_of([3, 40, 17, 90, 1, 60], seed=1)
    kw = dict(device="cuda", dtype="bfloat16", max_batched_tokens=32, kv_memory_gb=1)
    ref = LLM(path, attention_backend="torch", **kw)
    fi = LLM(path, attention_backend="flashinfer", **kw)
    assert fi.engine.runner.graphs is not None and fi.engine.runner.graphs.capture_graphs
    assert fi.engine.model.kernels.name == "flashinfer" and ref.engine.model.kernels.name == "torch"
    for _ in range(2):  # the second pass hits the radix cache
        a, b = tokens(fi, prompts, 24), tokens(ref, prompts, 24)
        print(f"flashinfer and torch agree on {sum(x == y for x, y in zip(a, b))} of {len(prompts)} rows")
        assert_agree_or_within_bf16_noise(path, prompts, a, b, "flashinfer", "torch")
    assert fi.engine.runner.graphs.replays > 0


@pytest.mark.gpu
def test_gpu_graphs_equal_eager(ckpt_factory):
    _real_flashinfer()
    path = ckpt_factory("qwen2", head_dim=128, dtype=torch.bfloat16)
    prompts = prompts_of([5 + 9 * i for i in range(19)], seed=3)
    lens = [8 + 2 * i for i in range(19)]
    kw = dict(device="cuda", dtype="bfloat16", max_running=64, kv_memory_gb=1)
    eager = LLM(path, enforce_eager=True, **kw)
    graphs = LLM(path, mixed_step_graphs="off", **kw)
    params = [SamplingParams(max_tokens=n, logprobs=1, **GREEDY) for n in lens]
    a, b = eager.generate(prompts, params), graphs.generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor([t.logprob for t in x.outputs[0].logprobs]),
                                   torch.tensor([t.logprob for t in y.outputs[0].logprobs]), atol=2e-2, rtol=0)
    assert graphs.engine.runner.graphs.replays > 0


@pytest.mark.gpu
def test_gpu_mixed_step_graphs_equal_eager(ckpt_factory):
    """Steps with prompt chunks as captured pieces between eager attention
    calls: greedy tokens equal the same steps run eagerly, or where a row
    parts (its chunk's products run padded to a bucket), both within bf16
    noise of float32 transformers."""
    _real_flashinfer()
    path = ckpt_factory("qwen2", head_dim=128, dtype=torch.bfloat16)
    prompts = prompts_of([5 + 23 * i for i in range(12)], seed=4)
    kw = dict(device="cuda", dtype="bfloat16", max_running=64, max_batched_tokens=256, kv_memory_gb=1)
    eager = LLM(path, mixed_step_graphs="off", **kw)
    pieces = LLM(path, **kw)
    assert pieces.engine.runner.mixed_graphs is not None and pieces.engine.runner.mixed_graphs.capture_graphs
    for _ in range(2):  # the second pass hits the radix cache
        a, b = tokens(eager, prompts, 16), tokens(pieces, prompts, 16)
        assert_agree_or_within_bf16_noise(path, prompts, a, b, "eager", "mixed-step graphs")
    assert pieces.engine.runner.mixed_graphs.replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_gpu_speculation_equals_plain_decoding(ckpt_factory, spec):
    """Speculative decoding on the GPU (drafts, verify rows through the
    graphs and flashinfer, the draft model's own pool; the KV check after
    every step): greedy tokens equal plain decoding's, or where a row parts,
    both are within bf16 noise of float32 transformers."""
    _real_flashinfer()
    path = ckpt_factory("llama", head_dim=128, dtype=torch.bfloat16)
    prompts = prompts_of([30, 12, 50, 7], seed=5)
    prompts = [p + p[:10] + p for p in prompts]  # repetitive: the n-gram proposer drafts
    kw = dict(device="cuda", dtype="bfloat16", kv_memory_gb=1, max_running=16, check_invariants=True)
    plain = tokens(LLM(path, **kw), prompts, 24)
    extra = {}
    if spec == "draft":
        extra = dict(draft_model=ckpt_factory("llama", head_dim=128, dtype=torch.bfloat16, layers=1, seed=1))
    llm = LLM(path, speculative=spec, spec_length="fixed:3", **extra, **kw)
    got = tokens(llm, prompts, 24)
    assert llm.engine.stats().policy.get("spec_draft_tokens", 0) > 0
    print(f"{spec}: speculation and plain decoding agree on {sum(x == y for x, y in zip(got, plain))} of "
          f"{len(prompts)} rows")
    assert_agree_or_within_bf16_noise(path, prompts, got, plain, spec, "plain")
    llm.engine.kv_report()


@pytest.mark.gpu
def test_gpu_overlap_equals_plain_schedule(ckpt_factory):
    """The overlap schedule with real asynchrony (each step launched before
    the tokens of the one before are on the host; flashinfer, CUDA graphs;
    the KV check after every step): greedy tokens equal the plain schedule's,
    or where a row parts, both are within bf16 noise of float32 transformers;
    a row given its own 6th token as a stop token ends there, though its next
    step was launched already."""
    _real_flashinfer()
    path = ckpt_factory("llama", head_dim=128, dtype=torch.bfloat16)
    prompts = prompts_of([5 + 9 * i for i in range(12)], seed=9)
    kw = dict(device="cuda", dtype="bfloat16", kv_memory_gb=1, max_running=16, check_invariants=True)
    plain, ov = LLM(path, overlap_schedule="off", **kw), LLM(path, **kw)
    assert ov.engine.overlap_schedule and not plain.engine.overlap_schedule
    a, b = tokens(plain, prompts, 24), tokens(ov, prompts, 24)
    assert ov.engine.core.overlapped_steps > 10
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    print(f"overlap and plain schedules agree on {len(prompts) - len(differ)} of {len(prompts)} rows")
    if differ:
        pick = [prompts[i] for i in differ]
        assert_greedy_within_bf16_noise(path, pick, [b[i] for i in differ], "overlap")
        assert_greedy_within_bf16_noise(path, pick, [a[i] for i in differ], "plain")
    same = [i for i in range(len(prompts)) if i not in differ]
    params = [SamplingParams(max_tokens=24, stop_token_ids=[b[i][5]], **GREEDY) for i in same]
    outs = ov.generate([prompts[i] for i in same], params)
    for i, o in zip(same, outs):
        want = b[i][: b[i].index(b[i][5]) + 1]
        assert (o.outputs[0].token_ids, o.outputs[0].finish_reason) == (want, "stop")
    # penalties (counted on the device, the token in flight too) and a processor that reads the output (sampled
    # after the step before is finished): the steps stay overlapped, the processor never sees a placeholder
    seen = []

    def no_repeat():
        def process(output_ids, logits):
            seen.append(min(output_ids, default=0))
            if output_ids:
                logits[output_ids[-1]] = float("-inf")
        return process

    before = ov.engine.core.overlapped_steps
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, frequency_penalty=0.5, presence_penalty=0.3,
                             repetition_penalty=1.2, ignore_eos=True,
                             logits_processor_factory=no_repeat if i % 2 else None) for i in range(len(prompts))]
    outs = ov.generate(prompts, params)
    assert ov.engine.core.overlapped_steps - before >= 20 and seen and min(seen) >= 0
    for o in outs[1::2]:
        ids = o.outputs[0].token_ids
        assert len(ids) == 24 and all(x != y for x, y in zip(ids, ids[1:]))
    report = ov.engine.kv_report()
    assert not report.busy and report.accounted == report.capacity


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
def test_gpu_greedy_equals_transformers_bf16(ckpt_factory, arch):
    """Greedy tokens on the GPU in bfloat16 (flashinfer, fused kernels, CUDA
    graphs) against transformers: every token within bf16 noise of float32
    transformers, teacher-forced (`assert_greedy_within_bf16_noise`); the
    first divergence from transformers' own bf16 greedy run is reported."""
    _real_flashinfer()
    from transformers import AutoModelForCausalLM

    path = ckpt_factory(arch, head_dim=128, dtype=torch.bfloat16)
    prompts = prompts_of([4, 31, 77], seed=6)
    ours = tokens(LLM(path, device="cuda", dtype="bfloat16"), prompts, 24)
    assert_greedy_within_bf16_noise(path, prompts, ours, arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    for p, got in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        k = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), None)
        print(f"{arch}, prompt of {len(p)}: " + ("equal to transformers bf16" if k is None else
                                                  f"first divergence from transformers bf16 at position {k}"))
