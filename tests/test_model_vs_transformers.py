"""Our greedy tokens equal transformers' on the same random weights, through
every path the scheduler can take: batching, chunked prefill, radix hits,
retraction. The reference is `transformers` generate (greedy, no EOS)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from stepserve import LLM, SamplingParams
from stepserve.scheduler.plan import FoldRule

# run a second time by `make test` as an AVX2-only CPU would (see cpu_features)
pytestmark = pytest.mark.cpu_paths

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def reference(path, prompts, max_new, dtype=torch.float32):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    outs = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (n,), generator=g).tolist() for n in lengths]


def run(llm, prompts, max_new):
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, **GREEDY))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_single_prompt(ckpt_factory, arch):
    path = ckpt_factory(arch)
    prompts = prompts_of([11])
    llm = LLM(path, check_invariants=True)
    assert run(llm, prompts, 16) == reference(path, prompts, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tied_embeddings(ckpt_factory, arch):
    path = ckpt_factory(arch, tie=True)
    prompts = prompts_of([9, 30])
    assert run(LLM(path), prompts, 10) == reference(path, prompts, 10)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_very_different_lengths(ckpt_factory, arch):
    path = ckpt_factory(arch)
    prompts = prompts_of([1, 7, 64, 3, 150, 23])
    llm = LLM(path, check_invariants=True)
    assert run(llm, prompts, 12) == reference(path, prompts, 12)


def test_pure_torch_backend_equals_native_kernel(ckpt_factory):
    """The reference torch attention and the native CPU decode kernel agree."""
    path = ckpt_factory("qwen3")
    prompts = prompts_of([5, 80, 33, 1])
    native = LLM(path)
    if native.engine.runner.backend.kernel is None:
        pytest.skip("native CPU kernel did not build on this machine")
    torch_only = LLM(path, attention_backend="torch")
    assert torch_only.engine.runner.backend.kernel is None
    assert run(native, prompts, 20) == run(torch_only, prompts, 20) == reference(path, prompts, 20)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (8, 2, 128), (2, 2, 64), (8, 1, 64), (16, 2, 128),
                                      (6, 2, 96), (4, 4, 32)])
def test_native_decode_attention_against_float64(hq, hkv, d):
    """The native paged decode kernel (its softmax on the kernel's own
    vectorized exp) against softmax attention in float64 over the same
    slots: grouped heads, scattered slots, contexts from 1 to 700, scores
    from flat to so peaked that most weights underflow, float32 and
    bfloat16 storage. Head shapes of the vector form (head_dim 64 or 128,
    1-8 query heads per KV head) and of the general one (the rest)."""
    from stepserve.engine.cpu_kernels import paged_decode_module

    native = paged_decode_module()
    if native is None:
        pytest.skip("native CPU kernel did not build on this machine")
    g = torch.Generator().manual_seed(3)
    pool = 4096
    lens = torch.tensor([1, 2, 37, 700, 300, 64], dtype=torch.int64)
    b = len(lens)
    table = torch.stack([torch.randperm(pool, generator=g)[:700] for _ in range(b)])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):  # (old libm-exp kernel: 5e-6, 7e-3)
        kp = torch.randn(pool, hkv, d, generator=g).to(dtype)
        vp = torch.randn(pool, hkv, d, generator=g).to(dtype)
        for sharp in (0.1, 1.0, 30.0):  # scores' spread: up to thousands apart at 30
            q = (torch.randn(b, hq, d, generator=g) * sharp).to(dtype)
            rows = torch.arange(b, dtype=torch.int64)
            out = native.paged_decode(q, kp, vp, table, rows, lens, d ** -0.5)
            for i in range(b):
                slots = table[i, : lens[i]]
                k = kp[slots].double().repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
                v = vp[slots].double().repeat_interleave(hq // hkv, dim=1)
                p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k) * d ** -0.5, dim=-1)
                want = torch.einsum("hn,nhd->hd", p, v)
                torch.testing.assert_close(out[i].double(), want.to(dtype).double(), rtol=10 * tol, atol=tol)


def test_extend_attention_against_float64():
    """Prompt chunks through the torch backend (`TorchAttention`), after a
    cached prefix and without one, against softmax attention in float64 over
    the same scattered slots: float32 as it is, and with `bf16_extend` (a
    float32 model whose large products run in bf16) a chunk of more than
    BF16_EXTEND_MIN tokens within bf16 rounding, while a shorter one stays
    float32."""
    from stepserve.engine.attention import TorchAttention
    from stepserve.engine.forward_batch import ForwardBatch
    from stepserve.kvcache import TokenKVPool

    hq, hkv, d, slots = 4, 2, 64, 2048
    g = torch.Generator().manual_seed(5)
    pool = TokenKVPool(slots, 1, hkv, d, torch.float32, "cpu")
    pool.k_buffers[0].copy_(torch.randn(slots, hkv, d, generator=g))
    pool.v_buffers[0].copy_(torch.randn(slots, hkv, d, generator=g))
    rows = [(0, 300), (120, 40), (0, 20), (500, 33)]  # (cached prefix, new tokens)
    extend, out_slots, start = [], [], 0
    for prefix, n in rows:
        kv_idx = torch.randperm(slots - 1, generator=g)[: prefix + n] + 1
        extend.append((start, n, kv_idx))
        out_slots.append(kv_idx[prefix:])
        start += n
    q = torch.randn(start, hq, d, generator=g)
    k_new = pool.k_buffers[0][torch.cat(out_slots)].clone()  # the chunk's own K/V, written again in place
    v_new = pool.v_buffers[0][torch.cat(out_slots)].clone()
    fb = ForwardBatch(input_ids=torch.zeros(start, dtype=torch.int64), positions=torch.zeros(start, dtype=torch.int64),
                      out_slots=torch.cat(out_slots), num_decode=0, req_to_token=torch.zeros(1, 1, dtype=torch.int64),
                      decode_rows=None, decode_kv_lens=None, extend_rows=extend,
                      logits_indices=torch.zeros(1, dtype=torch.int64))
    want = []
    for (prefix, n), (s0, _, kv_idx) in zip(rows, extend):
        kk = pool.k_buffers[0][kv_idx].double().repeat_interleave(hq // hkv, dim=1)  # [L, hq, d]
        vv = pool.v_buffers[0][kv_idx].double().repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[s0:s0 + n].double(), kk) * d ** -0.5
        s = s.masked_fill(torch.arange(prefix + n)[None, :] > torch.arange(n)[:, None] + prefix, float("-inf"))
        want.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vv))
    for bf16 in (False, True):
        be = TorchAttention(pool, hq, hkv, d, native=False, bf16_extend=bf16)
        assert be.bf16_extend == bf16
        be.prepare(fb)
        out = be.forward(0, q, k_new, v_new, fb)
        assert out.dtype == torch.float32
        for (prefix, n), (s0, _, _), w in zip(rows, extend, want):
            got = out[s0:s0 + n].double()
            if bf16 and n > TorchAttention.BF16_EXTEND_MIN:
                torch.testing.assert_close(got, w, rtol=0.05, atol=0.02)
                assert not torch.allclose(got, w, rtol=1e-4, atol=1e-4)  # it did run in bf16
            else:
                torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_tiny_chunks(ckpt_factory):
    path = ckpt_factory("qwen2")
    prompts = prompts_of([45, 3, 90])
    llm = LLM(path, max_batched_tokens=5, check_invariants=True)
    assert run(llm, prompts, 10) == reference(path, prompts, 10)
    # a 90-token prompt with a 5-token budget must have taken many steps
    assert llm.engine.step_id >= 90 // 5


def test_second_run_hits_radix_cache(ckpt_factory):
    path = ckpt_factory("llama")
    base = prompts_of([40])[0]
    llm = LLM(path, check_invariants=True)
    first = llm.generate([base], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert first.num_cached_tokens == 0
    extended = base + first.outputs[0].token_ids + [17, 18]
    again = llm.generate([base, extended], SamplingParams(max_tokens=8, **GREEDY))
    assert again[0].num_cached_tokens == len(base) - 1  # the last token is always recomputed
    assert again[1].num_cached_tokens >= len(base) + 7
    assert [o.outputs[0].token_ids for o in again] == reference(path, [base, extended], 8)
    assert again[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_retraction_under_tiny_kv_pool(ckpt_factory):
    path = ckpt_factory("llama")
    prompts = prompts_of([30, 25, 35, 20, 28, 33])
    # six requests of ~30 + 60 tokens against 140 slots: admission reserves only
    # part of each request's future, so decoding outgrows the pool
    llm = LLM(path, kv_slots=140, check_invariants=True)
    got = run(llm, prompts, 60)
    assert llm.engine.scheduler.num_retractions > 0
    assert got == reference(path, prompts, 60)
    sched = llm.engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.kv.tree.protected_size() == 0


def test_request_too_large_for_pool_is_a_clear_error(ckpt_factory):
    llm = LLM(ckpt_factory("llama"), kv_slots=64)
    with pytest.raises(ValueError, match="KV slots"):
        llm.generate([prompts_of([40])[0]], SamplingParams(max_tokens=40))
    # the engine still serves
    assert len(run(llm, prompts_of([10]), 5)[0]) == 5


def test_no_prefix_caching_same_tokens(ckpt_factory):
    path = ckpt_factory("qwen3")
    prompts = prompts_of([20, 20, 31])
    prompts[1] = prompts[0][:15] + prompts[1][:5]
    llm = LLM(path, prefix_caching=False, check_invariants=True)
    assert run(llm, prompts, 8) == reference(path, prompts, 8)
    assert llm.engine.scheduler.kv.tree.total_size() == 0


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_logprobs_match_transformers(ckpt_factory, arch, backend):
    """bf16 vs bf16, stated tolerances (bf16 keeps ~3 significant digits):
    - prefill (first generated token): within 0.05 nats;
    - decode steps: within 0.1 nats. Decode attention reads bf16 KV from the
      pool and reduces in a different order than the reference's full-context
      forward (the native CPU kernel even accumulates in float32), so rounding
      differs; measured worst cases on these checkpoints are 0.06-0.07.
    Three prompts in one batch (43 tokens: on CPU the step is padded to a shape
    bucket), checked at generated positions 0 and 2."""
    path = ckpt_factory(arch, dtype=torch.bfloat16)
    prompts = prompts_of([24, 5, 14])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", attention_backend=backend)
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, logprobs=20, **GREEDY))
    for prompt, out in zip(prompts, outs):
        o = out.outputs[0]
        for k in (0, 2):
            tol = 0.1 if k else 0.05
            ctx = prompt + o.token_ids[:k]
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([ctx])).logits[0, -1].float(), -1)
            lp = o.logprobs[k]
            for tok, val in lp.top:
                assert abs(float(ref[tok]) - val) < tol, (k, tok, float(ref[tok]), val)
            assert abs(float(ref[lp.token_id]) - lp.logprob) < tol


def test_sharded_checkpoint_loads(ckpt_factory, tmp_path):
    """A checkpoint split into several safetensors files with an index."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = ckpt_factory("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(src)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    prompts = prompts_of([12, 4])
    assert run(LLM(str(tmp_path)), prompts, 8) == reference(src, prompts, 8)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_logprobs_equal_transformers_through_chunks_cache_and_fork(ckpt_factory, arch):
    """Prompt logprobs (each prompt token given those before it, with top-k)
    equal transformers' log-softmax over the whole prompt, whether the prompt
    is prefilled in chunks, already sits in the radix cache (it is recomputed:
    no cached tokens), or belongs to an n > 1 request."""
    path = ckpt_factory(arch)
    prompts = prompts_of([1, 29, 40], seed=3)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = LLM(path, max_batched_tokens=8, check_invariants=True)
    llm.generate([prompts[2]], SamplingParams(max_tokens=2, **GREEDY))  # puts prompt 2 in the cache
    outs = llm.generate(prompts, [SamplingParams(max_tokens=3, prompt_logprobs=k, n=n, **GREEDY)
                                  for k, n in ((2, 1), (0, 1), (4, 2))])
    for p, out, k in zip(prompts, outs, (2, 0, 4)):
        pl = out.prompt_logprobs
        assert len(pl) == len(p) and pl[0] is None
        assert out.num_cached_tokens == 0
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), dim=-1)
        for i in range(1, len(p)):
            assert pl[i].token_id == p[i]
            assert pl[i].logprob == pytest.approx(ref[i - 1, p[i]].item(), abs=1e-4)
            top_v = ref[i - 1].topk(k).values if k else torch.empty(0)
            # the top k by value: each token's logprob is transformers' for it, and the values are its top k
            # (two logprobs within float noise of each other may come in either order: a random checkpoint
            # has such near-ties, and an ulp in any kernel swaps them)
            assert len(pl[i].top) == k
            for t, v in pl[i].top:
                assert v == pytest.approx(ref[i - 1, t].item(), abs=1e-4)
            assert [v for _, v in pl[i].top] == pytest.approx(top_v.tolist(), abs=1e-4)
    # without prompt logprobs the same prompt is served from the cache again
    again = llm.generate([prompts[2]], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert again.prompt_logprobs is None and again.num_cached_tokens > 0


def test_packed_cpu_linears_change_nothing(ckpt_factory, monkeypatch):
    """On CPU in bfloat16 the projections run on weights prepacked for oneDNN,
    where the CPU can (`cpu_features`); tokens and logprobs equal the plain
    nn.Linear path's exactly. (CPU explicitly: on a GPU machine `auto` picks CUDA.)"""
    from stepserve.engine.cpu_features import prepacked_bf16_linear_reason
    from stepserve.engine.models.llama import PackedLinear

    reason = prepacked_bf16_linear_reason()
    if reason is not None:
        pytest.skip(f"no prepacked bf16 linears on this CPU: {reason}")
    path = ckpt_factory("qwen2", dtype=torch.bfloat16)  # q/k/v bias: packed with a bias too
    prompts = prompts_of([5, 33, 80], seed=4)
    params = SamplingParams(max_tokens=12, logprobs=3, prompt_logprobs=1, **GREEDY)
    packed = LLM(path, dtype="bfloat16", device="cpu")
    assert any(isinstance(m, PackedLinear) for m in packed.engine.model.modules())
    monkeypatch.setenv("STEPSERVE_PACK_LINEARS", "0")
    plain = LLM(path, dtype="bfloat16", device="cpu")
    assert not any(isinstance(m, PackedLinear) for m in plain.engine.model.modules())
    for a, b in zip(packed.generate(prompts, params), plain.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == [x.logprob for x in b.outputs[0].logprobs]
        assert [x.logprob for x in a.prompt_logprobs[1:]] == [x.logprob for x in b.prompt_logprobs[1:]]


def test_small_batch_linears_against_torch(ckpt_factory, monkeypatch):
    """On CPU in float32, products of up to 8 rows run on the native panel
    kernel: equal to torch's linear within float rounding for every row count,
    odd input widths and a bias; a model that uses them (tied head included)
    generates the tokens transformers does, and logprobs within rounding of
    the torch-only path (STEPSERVE_SMALL_LINEAR=0)."""
    import torch.nn.functional as F

    from stepserve.engine.models.llama import SMALL_M, SmallBatchLinear, small_batch_kernels, use_small_batch_linears

    kernels = small_batch_kernels(torch.device("cpu"), torch.float32)
    if kernels is None:
        pytest.skip("native CPU kernels did not build on this machine")
    g = torch.Generator().manual_seed(0)
    for k, n in [(37, 48), (100, 16), (256, 768)]:
        for bf16_values in (False, True):
            w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
            if bf16_values:  # a bf16 checkpoint run in float32: exact bfloat16 panels, half the bytes
                w = w.bfloat16().float()
            lin = SmallBatchLinear(w, b, kernels)
            assert lin.panels.dtype == (torch.bfloat16 if bf16_values else torch.float32)
            for m in [1, 2, 3, 5, 7, 8, 9, 13, SMALL_M, SMALL_M + 1, 33]:  # rows in blocks of 8; past SMALL_M: torch
                x = torch.randn(m, k, generator=g)
                torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
            x = torch.randn(SMALL_M, 2 * k, generator=g)[:, ::2]  # not contiguous
            torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
            if bf16_values:  # the same weight in float32 panels: the same products, bit for bit
                x = torch.randn(3, k, generator=g)
                assert torch.equal(lin(x), kernels.small_linear(x, kernels.pack_panels(w, False)).add_(b))

    path = ckpt_factory("qwen2", tie=True)  # q/k/v bias, tied output head
    prompts = prompts_of([5, 33, 2], seed=5)
    params = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    fast = LLM(path, device="cpu")
    n_small = sum(isinstance(m, SmallBatchLinear) for m in fast.engine.model.modules())
    assert n_small > 0 and fast.engine.model.tied_head is not None
    assert fast.engine.model._native_decode is not None  # q/k/v bias and a tied head, in the one-call forward
    monkeypatch.setenv("STEPSERVE_SMALL_LINEAR", "0")
    plain = LLM(path, device="cpu")
    assert not any(isinstance(m, SmallBatchLinear) for m in plain.engine.model.modules())
    _fast_matches_torch_path(path, prompts, params, fast, plain)

    # the panel budget is charged what the panels take: bf16-valued weights fit in half the bytes
    model = LLM(path, device="cpu").engine.model
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear and m.out_features % 16 == 0]
    weights = [m.weight for m in lins] + [model.model.embed_tokens.weight]  # the tied head's too
    with torch.no_grad():
        for w in weights:
            w.copy_(w.bfloat16().float())
    need = sum(w.numel() * 2 for w in weights)
    assert use_small_batch_linears(model, kernels, budget=need) == len(weights)
    assert all(m.panels.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, SmallBatchLinear))


def test_native_rows_limit_of_the_panel_products(ckpt_factory, monkeypatch):
    """Past SMALL_M rows, a small float32 model without bf16 products keeps
    its products on the panels up to NATIVE_ROWS rows (the panel kernel's
    bits, which do not depend on the batch), and hands larger ones to torch;
    STEPSERVE_NATIVE_ROWS sets the limit, never below SMALL_M. A model whose
    products past SMALL_M run in bf16 keeps SMALL_M."""
    import torch.nn.functional as F

    from stepserve.engine.config import ModelConfig
    from stepserve.engine.loader import native_linear_rows
    from stepserve.engine.models.llama import NATIVE_ROWS, SMALL_M, SmallBatchLinear, small_batch_kernels

    kernels = small_batch_kernels(torch.device("cpu"), torch.float32)
    if kernels is None:
        pytest.skip("native CPU kernels did not build on this machine")
    g = torch.Generator().manual_seed(1)
    # (at 256 inputs torch's sgemm sums in another order than the panels: the two paths' bits differ)
    w, b = torch.randn(48, 256, generator=g).bfloat16().float(), torch.randn(48, generator=g)
    lin = SmallBatchLinear(w, b, kernels, native_rows=NATIVE_ROWS)
    assert lin.native_rows == NATIVE_ROWS > SMALL_M
    for m in (SMALL_M + 1, 100, NATIVE_ROWS, NATIVE_ROWS + 1):
        x = torch.randn(m, 256, generator=g)
        panels = kernels.small_linear(x, lin.panels).add_(b)
        got = lin(x)
        if m <= NATIVE_ROWS:
            assert torch.equal(got, panels), m
            assert torch.equal(got[:7], lin(x[:7])), m  # a row's bits whatever shares its product
        else:
            assert torch.equal(got, F.linear(x, w, b)), m
    assert SmallBatchLinear(w, b, kernels, native_rows=4).native_rows == SMALL_M

    path = ckpt_factory("llama")
    cfg = ModelConfig.from_pretrained(path)
    assert native_linear_rows(cfg, bf16_large=False) == NATIVE_ROWS
    assert native_linear_rows(cfg, bf16_large=True) == SMALL_M
    model = LLM(path, device="cpu", dtype="float32").engine.model
    lins = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    assert lins and all(m.native_rows == (SMALL_M if model.bf16_large_steps else NATIVE_ROWS) for m in lins)
    monkeypatch.setenv("STEPSERVE_NATIVE_ROWS", "100")
    assert native_linear_rows(cfg, bf16_large=True) == 100
    model = LLM(path, device="cpu", dtype="float32").engine.model
    assert {m.native_rows for m in model.modules() if isinstance(m, SmallBatchLinear)} == {100}
    monkeypatch.setenv("STEPSERVE_NATIVE_ROWS", "8")
    assert native_linear_rows(cfg, bf16_large=False) == SMALL_M
    monkeypatch.setenv("STEPSERVE_NATIVE_ROWS", "many")
    with pytest.raises(ValueError, match="STEPSERVE_NATIVE_ROWS"):
        native_linear_rows(cfg, bf16_large=False)


def test_small_linear_rows_do_not_depend_on_their_batch():
    """A row's product from the native panel kernel is the same bits however
    many rows share its call and however its panels are split between
    threads: 1-3 rows take several panels at a time (more independent sums
    in flight), more rows one panel in blocks of rows, and every output's sum
    runs over k in the same order either way. Batch-invariant sampling needs
    this: a seeded request draws the same tokens in any batch. On a build
    with AVX-512 (`zmm_panels`), its form (blocks of up to 8 rows against
    up to 4 panels, from 4 rows up) gives the AVX2 form's bits too."""
    from stepserve.engine.models.llama import SMALL_M, small_batch_kernels

    kernels = small_batch_kernels(torch.device("cpu"), torch.float32)
    if kernels is None:
        pytest.skip("native CPU kernels did not build on this machine")
    g = torch.Generator().manual_seed(2)
    threads = torch.get_num_threads()
    try:
        for k, panels in [(37, 1), (64, 3), (256, 5), (128, 9), (256, 48)]:
            for bf16 in (False, True):
                w = torch.randn(16 * panels, k, generator=g)
                p = kernels.pack_panels(w.bfloat16().float() if bf16 else w, bf16)
                x = torch.randn(SMALL_M, k, generator=g)
                for t in (1, 2):
                    torch.set_num_threads(t)
                    alone = torch.cat([kernels.small_linear(x[i : i + 1], p) for i in range(SMALL_M)])
                    for m in [2, 3, 4, 5, 7, 13, SMALL_M]:
                        got = kernels.small_linear(x[:m].contiguous(), p)
                        assert torch.equal(got, alone[:m]), (k, panels, bf16, t, m)
                    for i in (1, 2):  # rows 1-2 and 1-3 of the batch: the few-row path again, other rows
                        assert torch.equal(kernels.small_linear(x[1 : 1 + i + 1].contiguous(), p), alone[1 : 2 + i])
                    for m in [4, 8, 9, 21, SMALL_M]:  # the AVX2 form, where the AVX-512 one is built
                        assert torch.equal(kernels.small_linear(x[:m].contiguous(), p, zmm=False), alone[:m])
    finally:
        torch.set_num_threads(threads)


def test_fused_cpu_ops_against_torch(ckpt_factory, monkeypatch):
    """On CPU in float32 the small per-layer ops are single native calls
    (`CpuKernels`): RMSNorm, the residual add fused into it (in place), rotary
    on strided q/k views (in place) and SiLU-and-mul equal `TorchKernels`
    within float rounding, and a model that uses them (q/k norm and q/k/v
    bias included) generates transformers' tokens, with logprobs within
    rounding of the torch ops (STEPSERVE_CPU_FUSED=0)."""
    from stepserve.engine.config import ModelConfig
    from stepserve.engine.models.llama import CpuKernels, RotaryEmbedding, TorchKernels, cpu_kernels

    native = cpu_kernels(torch.device("cpu"), torch.float32)
    if native is None:
        pytest.skip("native CPU kernels did not build on this machine")
    path = ckpt_factory("qwen3")  # q/k norm
    cfg = ModelConfig.from_pretrained(path)
    rotary = RotaryEmbedding(cfg, 64)
    ref, fused = TorchKernels(rotary), CpuKernels(rotary, native)
    g = torch.Generator().manual_seed(1)
    close = dict(rtol=1e-5, atol=1e-5)
    d = cfg.head_dim
    for t in [1, 3, 8, 37]:
        h = 96
        x, r, w = torch.randn(t, h, generator=g), torch.randn(t, h, generator=g), torch.randn(h, generator=g)
        torch.testing.assert_close(fused.rmsnorm(x, w, 1e-6), ref.rmsnorm(x, w, 1e-6), **close)
        want_h, want_r = ref.add_rmsnorm(x, r, w, 1e-6)
        got_h, got_r = fused.add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
        torch.testing.assert_close(got_r, want_r, **close)
        torch.testing.assert_close(got_h, want_h, **close)
        hq, hk = 4, 2
        qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
        q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)  # strided views, as in the model
        pos = torch.randint(0, 64, (t,), generator=g)
        wq, wk = ref.rope(ref.rope_prepare(pos, torch.float32), q.clone(), k.clone(), d)
        gq, gk = fused.rope(fused.rope_prepare(pos, torch.float32), q, k, d)
        torch.testing.assert_close(gq, wq, **close)
        torch.testing.assert_close(gk, wk, **close)
        assert torch.equal(qkv[:, : hq * d].view(t, hq, d), gq)  # rotated in place
        gu = torch.randn(t, 2 * 48, generator=g) * 4
        torch.testing.assert_close(fused.silu_and_mul(gu), ref.silu_and_mul(gu), **close)
    # the native kernel's own exp, over every gate a model sees and past it, against float64 (NaN stays NaN)
    gate = torch.linspace(-100, 100, 20001)
    got = fused.silu_and_mul(torch.stack([gate, torch.ones_like(gate)], 1))[:, 0]
    torch.testing.assert_close(got, (gate.double() * torch.sigmoid(gate.double())).float(), rtol=1e-6, atol=1e-30)
    assert torch.isnan(fused.silu_and_mul(torch.tensor([[float("nan"), 1.0]]))).all()
    # a bf16 product's output in, bf16 out: the float32 path's values rounded once, bit for bit
    assert fused.bf16_silu and not ref.bf16_silu
    for t, i in [(1, 5), (37, 48), (300, 384)]:
        gu = (torch.randn(t, 2 * i, generator=g) * 6).bfloat16()
        gu[0, :3] = torch.tensor([float("inf"), float("-inf"), 3e38])
        got = fused.silu_and_mul(gu)
        assert got.dtype == torch.bfloat16 and got.shape == (t, i)
        want = fused.silu_and_mul(gu.float()).bfloat16()
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.isnan(fused.silu_and_mul(torch.tensor([[float("nan"), 1.0]]).bfloat16())).all()
    with pytest.raises(RuntimeError, match="position out of the table"):
        fused.rope(torch.tensor([64]), torch.randn(1, d), torch.randn(1, d), d)

    prompts = prompts_of([5, 33, 2], seed=7)
    params = SamplingParams(max_tokens=10, logprobs=2, **GREEDY)
    fast = LLM(path, device="cpu")
    assert isinstance(fast.engine.model.kernels, CpuKernels)
    assert fast.engine.model._native_decode is not None  # decode steps of <= SMALL_M tokens: one native call
    monkeypatch.setenv("STEPSERVE_NATIVE_DECODE", "0")
    layerwise = LLM(path, device="cpu")
    assert layerwise.engine.model._native_decode is None
    # the one-call forward runs the same ops in the same order: the same logprobs, bit for bit
    for a, b in zip(fast.generate(prompts, params), layerwise.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == [x.logprob for x in b.outputs[0].logprobs]
    monkeypatch.setenv("STEPSERVE_CPU_FUSED", "0")
    plain = LLM(path, device="cpu")
    assert type(plain.engine.model.kernels) is TorchKernels
    _fast_matches_torch_path(path, prompts, params, fast, plain)


def test_larger_decode_batches_run_as_one_native_call(ckpt_factory, monkeypatch):
    """Where every product stays on its panels past SMALL_M rows, a decode
    step of up to NATIVE_STEP_TOKENS rows is one native call too, with the
    layered forward's logprobs bit for bit; a step with prompt chunks folds
    them only up to SMALL_M tokens, and with the panels' limit at SMALL_M
    (STEPSERVE_NATIVE_ROWS=32) the one-call limit stays SMALL_M."""
    from stepserve.engine.models.llama import NATIVE_STEP_TOKENS, SMALL_M

    path = ckpt_factory("llama")
    fast = LLM(path, device="cpu", dtype="float32", check_invariants=True)
    model = fast.engine.model
    if model._native_decode is None:
        pytest.skip("native CPU kernels did not build on this machine")
    backend = fast.engine.runner.backend
    assert model.native_step_tokens(backend) == NATIVE_STEP_TOKENS > SMALL_M
    assert fast.engine.runner.fold_rule.tokens == SMALL_M
    native, sizes = model._forward_native, []

    def spy(fb, backend):
        sizes.append(fb.input_ids.numel())
        return native(fb, backend)

    model._forward_native = spy
    monkeypatch.setenv("STEPSERVE_NATIVE_DECODE", "0")
    layerwise = LLM(path, device="cpu", dtype="float32")
    prompts = prompts_of([3 + i % 5 for i in range(40)], seed=11)
    params = SamplingParams(max_tokens=5, logprobs=2, **GREEDY)
    for a, b in zip(fast.generate(prompts, params), layerwise.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == [x.logprob for x in b.outputs[0].logprobs]
    assert 40 in sizes  # the 40-row decode steps ran natively
    assert max(sizes) <= NATIVE_STEP_TOKENS
    monkeypatch.delenv("STEPSERVE_NATIVE_DECODE")
    monkeypatch.setenv("STEPSERVE_NATIVE_ROWS", str(SMALL_M))
    capped = LLM(path, device="cpu", dtype="float32")
    assert capped.engine.model.native_step_tokens(capped.engine.runner.backend) == SMALL_M


def test_a_step_of_few_tokens_runs_its_prompt_chunks_natively(ckpt_factory, monkeypatch):
    """A step of at most SMALL_M tokens runs as one native call with its
    prompt chunks too, each chunk's tokens as decode-shaped queries (a short
    prompt, a suffix past a radix-cache hit, a prompt beside decode rows):
    such steps generate transformers' greedy tokens, with logprobs within
    float rounding of the layer-by-layer forward (STEPSERVE_NATIVE_DECODE=0),
    whose chunks run through the extend path (STEPSERVE_FOLD_PAIRS=0 too).
    A step with more tokens folds a chunk of at most `fold_pairs` query-key
    pairs (one native call where the one-call limit allows); a larger chunk,
    or a row that scores its prompt, keeps the extend path."""
    from stepserve.engine.models.llama import SMALL_M

    path = ckpt_factory("qwen2")  # q/k/v bias
    fast = LLM(path, device="cpu", check_invariants=True)
    model = fast.engine.model
    if model._native_decode is None:
        pytest.skip("native CPU kernels did not build on this machine")
    assert fast.engine.runner.fold_rule.tokens == SMALL_M
    native, steps = model._forward_native, []

    def spy(fb, backend):
        steps.append((fb.input_ids.numel(), fb.positions.tolist()))
        return native(fb, backend)

    model._forward_native = spy
    monkeypatch.setenv("STEPSERVE_NATIVE_DECODE", "0")
    monkeypatch.setenv("STEPSERVE_FOLD_PAIRS", "0")
    layerwise = LLM(path, device="cpu", check_invariants=True)
    assert layerwise.engine.runner.fold_rule == FoldRule() == layerwise.engine.scheduler.fold
    params = SamplingParams(max_tokens=8, logprobs=2, **GREEDY)
    short = prompts_of([6, 11, 3], seed=4)
    _fast_matches_torch_path(path, short, params, fast, layerwise)  # one step of 20 prompt tokens
    assert any(n == 20 and pos[:6] == list(range(6)) for n, pos in steps)
    # a continuation past a radix-cache hit, prefilled beside another request's decode rows
    base = prompts_of([40], seed=5)[0]
    fast.generate([base], params)
    layerwise.generate([base], params)
    steps.clear()
    out = {name: _second_beside_decode_rows(llm, prompts_of([9], seed=6)[0], base + [17, 18, 19], params, 3)
           for name, llm in (("fast", fast), ("layerwise", layerwise))}
    assert any(len(pos) == 4 and pos[-3:] == [40, 41, 42] for _, pos in steps)  # the suffix, beside a decode row
    for (ta, la), (tb, lb) in zip(out["fast"], out["layerwise"]):
        assert ta == tb and la == pytest.approx(lb, abs=1e-4)
    assert out["fast"][1][0] == reference(path, [base + [17, 18, 19]], 8)[0]
    # more tokens than SMALL_M: folded within the pair budget (561 pairs), one call where the limit allows
    steps.clear()
    longer = prompts_of([SMALL_M + 1], seed=8)
    _fast_matches_torch_path(path, longer, params, fast, layerwise)
    runner = fast.engine.runner
    assert runner.fold_rule.pairs > (SMALL_M + 1) * (SMALL_M + 2) // 2
    assert any(n == SMALL_M + 1 for n, _ in steps) == (model.native_step_tokens(runner.backend) > SMALL_M)
    # a chunk past the pair budget, or prompt logprobs: the extend path
    steps.clear()
    fast.engine.scheduler.fold = FoldRule(runner.fold_rule.tokens, 100)
    fast.generate(prompts_of([SMALL_M + 1], seed=10), params)
    fast.generate(prompts_of([7], seed=9), SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY))
    assert all(n == 1 for n, _ in steps)  # only the one-row decode steps ran natively


def test_prompt_chunks_within_the_pair_budget_attend_as_decode_queries(ckpt_factory, monkeypatch):
    """In a layer-by-layer step (STEPSERVE_NATIVE_DECODE=0), each prompt
    chunk of at most `fold_pairs` query-key pairs attends through the paged
    kernel as decode-shaped queries, beside decode rows and beside a chunk
    past the budget, which keeps the extend path: transformers' greedy
    tokens, and the extend path's logprobs (STEPSERVE_FOLD_PAIRS=0) within
    float rounding."""
    path = ckpt_factory("llama")
    monkeypatch.setenv("STEPSERVE_NATIVE_DECODE", "0")
    monkeypatch.setenv("STEPSERVE_FOLD_PAIRS", "0")
    plain = LLM(path, device="cpu", check_invariants=True)
    monkeypatch.setenv("STEPSERVE_FOLD_PAIRS", "2000")
    folding = LLM(path, device="cpu", check_invariants=True)
    runner = folding.engine.runner
    if runner.fold_rule.pairs == 0:
        pytest.skip("the paged CPU kernel did not build on this machine")
    assert runner.fold_rule.pairs == 2000 and plain.engine.runner.fold_rule.pairs == 0
    assert folding.engine.scheduler.fold is runner.fold_rule
    picked, real = [], runner.build_batch

    def spy(plan):
        chunks = plan.rows[plan.num_decode + plan.num_verify:]
        picked.append([(r.start, r.num_new) for r, f in zip(chunks, plan.folded or [False] * len(chunks)) if f])
        return real(plan)

    runner.build_batch = spy
    params = SamplingParams(max_tokens=6, logprobs=2, **GREEDY)
    # 40 tokens (820 pairs) and 50 tokens (1,275) fold; 70 (2,485) does not
    prompts = prompts_of([40, 70, 50], seed=21)
    _fast_matches_torch_path(path, prompts, params, folding, plain)
    assert (0, 40) in picked[0] and (0, 50) in picked[0] and all(n != 70 for step in picked for _, n in step)
    # what the step model prices: only the unfolded chunk pays the extend path's prices
    first = {llm: next(r for r in llm.engine.records if r.new_tokens == 160) for llm in (folding, plain)}
    assert (first[folding].extend_rows, first[plain].extend_rows) == (1, 3)
    # a 30-token suffix past a 40-token cached prefix (1,665 pairs), beside another request's decode rows
    suffix = prompts[0] + prompts_of([30], seed=23)[0]
    out = {name: _second_beside_decode_rows(llm, prompts_of([9], seed=22)[0], suffix, params, 2)
           for name, llm in (("folding", folding), ("plain", plain))}
    assert any((40, 30) in step for step in picked)
    for (ta, la), (tb, lb) in zip(out["folding"], out["plain"]):
        assert ta == tb and la == pytest.approx(lb, abs=1e-4)
    monkeypatch.setenv("STEPSERVE_FOLD_PAIRS", "-1")
    with pytest.raises(ValueError, match="STEPSERVE_FOLD_PAIRS"):
        LLM(path, device="cpu")


def _second_beside_decode_rows(llm, first_prompt, second_prompt, params, steps):
    """Runs `first_prompt`, and after `steps` steps `second_prompt` beside its
    decode rows; (token ids, logprobs) of each."""
    eng = llm.engine
    first = eng.add_request(first_prompt, params)
    for _ in range(steps):
        eng.step()
    second = eng.add_request(second_prompt, params)
    while eng.has_unfinished():
        eng.step()
    return [(r.outputs[0].token_ids, [x.logprob for x in r.outputs[0].logprobs])
            for r in (first.output(False), second.output(False))]


def _fast_matches_torch_path(path, prompts, params, fast, plain):
    """`fast` (a native CPU path on) generates transformers' greedy tokens
    for `prompts`, and the tokens of `plain` (that path off) with logprobs
    within float rounding of its."""
    got, want = fast.generate(prompts, params), plain.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == reference(path, prompts, params.max_tokens)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in a.outputs[0].logprobs] == pytest.approx(
            [x.logprob for x in b.outputs[0].logprobs], abs=1e-4)


def test_padded_output_head_rows_change_no_logits(ckpt_factory):
    """On CPU in bfloat16 the output head runs on the logits rows rounded up
    to a shape bucket (oneDNN builds a kernel per new row count, and verify
    rows have k + 1 each): every step's logits are those of the same forward
    with the head on the real rows alone, within bfloat16 rounding."""
    import dataclasses

    from stepserve.engine.forward_batch import logits_rows

    assert [logits_rows(m, True) for m in (1, 2, 3, 5, 8, 9, 17, 70)] == [1, 2, 4, 8, 8, 16, 24, 80]
    assert logits_rows(9, False) == 9
    path = ckpt_factory("qwen3", dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16", device="cpu", speculative="ngram", spec_length="fixed:3")
    model = llm.engine.model
    assert llm.engine.runner.pads_from == 1
    forward, head = model.forward_planned, model.compute_logits
    head_rows, steps = [], []

    def spy_head(hidden):
        head_rows.append(hidden.shape[0])
        return head(hidden)

    def spy(fb, backend):
        logits, hidden = forward(fb, backend)
        assert fb.pad_logits
        again, _ = forward(dataclasses.replace(fb, pad_logits=False), backend)  # the same KV written again
        steps.append((fb.logits_indices.numel(), head_rows[-2], head_rows[-1]))
        assert logits.shape == again.shape  # (equal here; a GEMM may pick another kernel for another row count)
        torch.testing.assert_close(logits, again, rtol=1.6e-2, atol=1.6e-2)
        return logits, hidden

    model.forward_planned, model.compute_logits = spy, spy_head
    prompts = [[5, 6, 7, 8] * 6, prompts_of([19], seed=3)[0]] + prompts_of([40, 7], seed=5)
    llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert steps and all(padded == logits_rows(m, True) >= m and real == m for m, padded, real in steps)
    assert any(padded > real for _, padded, real in steps)  # some steps padded (verify rows of k + 1)
