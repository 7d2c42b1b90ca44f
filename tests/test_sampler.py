"""Sampler tests against independent numpy / pure-Python references.

All randomness is seeded (the sampler is counter-based), so every statistical
test below is deterministic; thresholds (p > 1e-4) are still chosen so that a
correct implementation would pass for essentially any seed, while the
``*_detects_*`` tests show that the same sample sizes reject a wrong
distribution.
"""

import math
import struct

import numpy as np
import pytest
import torch

from stepserve.engine.sampler import (
    HASH_SEED,
    STREAM_SAMPLE,
    PenaltyCounts,
    RowInput,
    Sampler,
    SamplingBatch,
    apply_logit_processors,
    apply_sampling_transforms,
    derive_seed,
    uniform,
)
from stepserve.engine.sampling_params import SamplingParams

P_MIN = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # The tensors here are small; on a shared 2-core box intra-op threads only
    # add contention (10x slower).  Restored afterwards.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# ----------------------------------------------------------------------------
# Independent references
# ----------------------------------------------------------------------------


def murmur3_32(data: bytes, seed: int) -> int:
    """Textbook MurmurHash3 x86_32 on bytes (pure Python ints)."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    m = 0xFFFFFFFF

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & m

    h = seed & m
    n = len(data)
    for i in range(0, n - n % 4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = rotl((k * c1) & m, 15) * c2 & m
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
    tail = data[n - n % 4 :]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= rotl((k * c1) & m, 15) * c2 & m
    h ^= n
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def ref_uniform(seed: int, counter: int, stream: int, j: int) -> float:
    key = struct.pack("<qqII", seed, counter, stream, j)
    return ((murmur3_32(key, HASH_SEED) >> 9) + 0.5) / 2**23


def chi2_pvalue(observed, probs, n):
    """Chi-square goodness of fit; bins with expected < 5 are pooled."""
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    assert observed.sum() == n
    observed, probs = observed[probs > 0], probs[probs > 0]  # callers check zero-prob bins
    expected = probs * n
    small = expected < 5
    obs = list(observed[~small])
    exp = list(expected[~small])
    if small.any():
        obs.append(observed[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.array(obs), np.array(exp)
    if len(obs) < 2:
        return 1.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def ks_pvalue_uniform(x):
    """One-sample Kolmogorov-Smirnov test against U(0, 1) (asymptotic, Stephens' correction)."""
    x = np.sort(np.asarray(x, dtype=np.float64))
    n = len(x)
    i = np.arange(1, n + 1)
    d = max((i / n - x).max(), (x - (i - 1) / n).max())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    q = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, q))


def np_softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_distribution(logits, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, margin=1e-3):
    """Exact sampling distribution in float64, written from the definitions.

    Asserts the test logits keep every top-p / min-p decision ``margin`` away
    from its threshold, so float32 rounding in the sampler cannot matter.
    """
    z = np.asarray(logits, dtype=np.float64) / temperature
    if top_k > 0:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    if top_p < 1.0:
        p = np_softmax(z)
        order = np.argsort(-p, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        assert np.abs(before - top_p).min() > margin
        n_keep = max(1, int((before < top_p).sum()))
        keep = np.zeros(len(z), dtype=bool)
        keep[order[:n_keep]] = True
        z = np.where(keep, z, -np.inf)
    if min_p > 0.0:
        p = np_softmax(z)
        ratio = p / p.max()
        assert np.abs(ratio[p > 0] - min_p).min() > margin
        z = np.where(ratio >= min_p, z, -np.inf)
    return np_softmax(z)


def np_log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


# A fixed, tie-free logits vector; permuted so that the best tokens are not 0, 1, 2...
_BASE = np.array([2.0, 1.5, 1.0, 0.6, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0])
_PERM = np.array([3, 7, 0, 9, 5, 1, 8, 2, 6, 4])
LOGITS = np.empty(10)
LOGITS[_PERM] = _BASE
V = len(LOGITS)


def sample_many(params: SamplingParams, logits=LOGITS, n=20000, seed=1234, counter0=0, **build_kw):
    rows = [RowInput(params, seed=seed, counter=counter0 + i) for i in range(n)]
    batch = SamplingBatch.build(rows, len(logits), "cpu", **build_kw)
    x = torch.tensor(logits, dtype=torch.float32).expand(n, len(logits)).contiguous()
    return Sampler()(x, batch).token_ids.numpy()


def row(params=None, seed=0, counter=0, **kw):
    return RowInput(params or SamplingParams(), seed=seed, counter=counter, **kw)


# ----------------------------------------------------------------------------
# Statistics helpers themselves
# ----------------------------------------------------------------------------


def test_stat_helpers_against_known_quantiles():
    # chi2(df=1).sf(3.841) = 0.05, chi2(df=9).sf(16.919) = 0.05
    stat1 = 3.8414588
    assert abs(float(torch.special.gammaincc(torch.tensor(0.5, dtype=torch.float64), torch.tensor(stat1 / 2, dtype=torch.float64))) - 0.05) < 1e-6
    stat9 = 16.918978
    assert abs(float(torch.special.gammaincc(torch.tensor(4.5, dtype=torch.float64), torch.tensor(stat9 / 2, dtype=torch.float64))) - 0.05) < 1e-6
    # Kolmogorov: Q(1.3581) = 0.05
    lam = 1.3580986
    q = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    assert abs(q - 0.05) < 1e-5
    assert abs(murmur3_32(b"Hello, world!", 0x9747B28C) - 0x24884CBA) == 0
    assert murmur3_32(b"test", 0) == 0xBA6BD213


# ----------------------------------------------------------------------------
# uniform()
# ----------------------------------------------------------------------------


def test_uniform_matches_pure_python_murmur3():
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345, 0xDEADBEEF]
    counters = [0, 5, 2**40 + 3, -7, 99, 1, 2**32]
    for stream in (0, 1, 2**32 - 1):
        u = uniform(torch.tensor(seeds), torch.tensor(counters), 6, stream=stream, offset=2**32 - 3)
        for r, (s, c) in enumerate(zip(seeds, counters)):
            for j in range(6):
                col = (2**32 - 3 + j) & 0xFFFFFFFF
                assert u[r, j].item() == ref_uniform(s, c, stream, col)


@pytest.mark.cpu_paths
def test_uniform_native_pass_equals_the_torch_ops(monkeypatch):
    """On the CPU the per-element part of uniform() runs as one native pass in
    uint32 arithmetic where the native kernels build: the same bits as the
    torch ops, and as the pure-Python murmur3, across the column words' wrap."""
    from stepserve.engine import sampler
    from stepserve.engine.cpu_kernels import paged_decode_module

    native = paged_decode_module()
    if native is None:
        pytest.skip("the native CPU kernels do not build here")
    calls = []  # the native passes uniform() took
    pick = sampler._native

    def spy(*args):
        module = pick(*args)
        if module is not None:
            calls.append(1)
        return module

    monkeypatch.setattr(sampler, "_native", spy)
    g = torch.Generator().manual_seed(3)
    seeds = torch.cat([torch.tensor([0, -1, 2**63 - 1, -(2**63)]), torch.randint(-(2**62), 2**62, (29,), generator=g)])
    counters = torch.cat([torch.tensor([0, 2**32, -7, 2**40 + 3]), torch.randint(0, 10**9, (29,), generator=g)])
    for n, offset, stream in ((4099, 0, 0), (700, 2**32 - 300, 2**32 - 1), (5000, 123, 2)):
        monkeypatch.setattr(sampler, "_NATIVE_MIN_ELEMS", 1)
        fast = uniform(seeds, counters, n, stream=stream, offset=offset)
        monkeypatch.setattr(sampler, "_NATIVE_MIN_ELEMS", 1 << 62)
        assert torch.equal(fast, uniform(seeds, counters, n, stream=stream, offset=offset))
        for r, j in ((0, 0), (3, n - 1), (20, n // 2), (32, 299)):
            col = (offset + j) & 0xFFFFFFFF
            assert fast[r, j].item() == ref_uniform(int(seeds[r]), int(counters[r]), stream, col)
    assert len(calls) == 3


@pytest.mark.cpu_paths
def test_native_gumbel_argmax_equals_the_torch_path():
    """On the CPU the Gumbel-max runs as one native pass (`gumbel_argmax`):
    the same uniforms and, with a log within 1 ulp of torch's, the same
    token wherever the best two scores are not within float rounding of
    each other; a masked (-inf) token is never drawn, a row of NaN scores
    gives its first NaN, as torch's argmax, and a row all -inf gives 0."""
    from stepserve.engine.cpu_kernels import paged_decode_module
    from stepserve.engine.sampler import _hash_parts, argmax_rows

    native = paged_decode_module()
    if native is None:
        pytest.skip("the native CPU kernels do not build here")
    g = torch.Generator().manual_seed(5)
    for R, V in ((2000, 512), (64, 4096), (3, 151936)):
        s = torch.randn(R, V, generator=g) * 3
        s[0, 1:] = float("-inf")  # one token left
        s[1, ::2] = float("-inf")
        seeds = torch.randint(-(2**62), 2**62, (R,), generator=g)
        counters = torch.randint(0, 10**9, (R,), generator=g)
        got = native.gumbel_argmax(s, *_hash_parts(seeds, counters, V, STREAM_SAMPLE))
        w = uniform(seeds, counters, V, stream=STREAM_SAMPLE)
        scores = s - w.log_().neg_().log_()
        want = argmax_rows(scores)
        top2 = scores.topk(2, dim=1).values
        near = (top2[:, 0] - top2[:, 1]) <= 1e-5 * top2[:, 0].abs().clamp(min=1.0)
        assert bool(((got == want) | near).all()) and int(near.sum()) < max(2, R // 1000)
        assert int(got[0]) == 0 and int(got[1]) % 2 == 1
    s = torch.randn(3, 5000, generator=g)
    s[1, [4000, 4500]] = float("nan")
    s[2] = float("-inf")
    got = native.gumbel_argmax(s, *_hash_parts(torch.arange(3), torch.arange(3), 5000, STREAM_SAMPLE)).tolist()
    assert got[1:] == [4000, 0]


def test_uniform_range_shape_dtype():
    u = uniform(torch.arange(50), torch.arange(50) * 3, 1000, stream=3)
    assert u.shape == (50, 1000) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    assert uniform(torch.arange(3), torch.zeros(3, dtype=torch.int64), 0).shape == (3, 0)


def test_uniform_batch_invariance():
    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(2**62), 2**62, (64,), generator=g)
    counters = torch.randint(0, 10**6, (64,), generator=g)
    full = uniform(seeds, counters, 257, stream=5)
    for i in (0, 17, 63):
        alone = uniform(seeds[i : i + 1], counters[i : i + 1], 257, stream=5)
        assert torch.equal(alone[0], full[i])
    perm = torch.randperm(64, generator=g)
    assert torch.equal(uniform(seeds[perm], counters[perm], 257, stream=5), full[perm])
    # a column slice computed through ``offset`` equals the slice of the full row
    assert torch.equal(uniform(seeds, counters, 100, stream=5, offset=150), full[:, 150:250])


def test_uniform_differs_across_seed_counter_stream():
    base = uniform(torch.tensor([7]), torch.tensor([3]), 4096, stream=0)[0]
    others = [
        uniform(torch.tensor([8]), torch.tensor([3]), 4096, stream=0)[0],
        uniform(torch.tensor([7]), torch.tensor([4]), 4096, stream=0)[0],
        uniform(torch.tensor([7]), torch.tensor([3]), 4096, stream=1)[0],
        uniform(torch.tensor([7 + 2**32]), torch.tensor([3]), 4096, stream=0)[0],
        uniform(torch.tensor([7]), torch.tensor([3 + 2**32]), 4096, stream=0)[0],
    ]
    for o in others:
        assert (o != base).float().mean() > 0.99
        assert abs(np.corrcoef(o.numpy(), base.numpy())[0, 1]) < 0.06  # ~4 sigma for n=4096


def test_uniform_is_uniform_ks_and_chi2():
    # consecutive seeds and counters, as an engine would hand them out
    seeds = torch.arange(200).repeat_interleave(5)
    counters = torch.arange(5).repeat(200)
    u = uniform(seeds, counters, 100).numpy().ravel()  # 100k values
    assert ks_pvalue_uniform(u) > P_MIN
    counts = np.bincount((u * 100).astype(int), minlength=100)
    assert chi2_pvalue(counts, np.full(100, 0.01), u.size) > P_MIN
    # first draw of 20k requests with consecutive seeds (column 0 only)
    u0 = uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.int64), 1).numpy().ravel()
    assert ks_pvalue_uniform(u0) > P_MIN


def test_uniform_pairs_are_independent():
    # 2-D chi-square on (u[c, j], u[c + 1, j]) and (u[c, j], u[c, j + 1]): catches
    # a weak hash whose neighbouring outputs are correlated.
    n_ctr, n_col = 251, 200
    u = uniform(torch.full((n_ctr,), 42), torch.arange(n_ctr), n_col).numpy()
    bins = (u * 10).astype(int)
    for a, b in ((bins[:-1, :], bins[1:, :]), (bins[:, :-1], bins[:, 1:])):
        cells = np.bincount((a * 10 + b).ravel(), minlength=100)
        assert chi2_pvalue(cells, np.full(100, 0.01), cells.sum()) > P_MIN


def test_uniform_test_detects_non_uniform():
    u = uniform(torch.arange(1000), torch.zeros(1000, dtype=torch.int64), 100).numpy().ravel()
    assert ks_pvalue_uniform(u**1.05) < P_MIN


# ----------------------------------------------------------------------------
# Sampling distributions
# ----------------------------------------------------------------------------

DIST_CASES = {
    "T=1": dict(temperature=1.0),
    "T=0.7": dict(temperature=0.7),
    "T=1.5": dict(temperature=1.5),
    "top_k=3": dict(temperature=1.0, top_k=3),
    "top_p=0.8": dict(temperature=1.0, top_p=0.8),
    "top_p=0.5,T=1.5": dict(temperature=1.5, top_p=0.5),
    "min_p=0.15": dict(temperature=1.0, min_p=0.15),
    "combo": dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
    "combo2": dict(temperature=1.3, top_k=8, top_p=0.95, min_p=0.1),
}


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_sampling_distribution_matches_reference(case):
    kw = DIST_CASES[case]
    probs = ref_distribution(LOGITS, **kw)
    n = 20000
    tokens = sample_many(SamplingParams(**kw), n=n, seed=1000 + list(DIST_CASES).index(case))
    counts = np.bincount(tokens, minlength=V)
    assert counts[probs == 0].sum() == 0, "sampled a token outside the allowed set"
    assert chi2_pvalue(counts, probs, n) > P_MIN


def test_distribution_test_detects_wrong_distribution():
    n = 20000
    tokens = sample_many(SamplingParams(temperature=0.7), n=n, seed=5)
    counts = np.bincount(tokens, minlength=V)
    assert chi2_pvalue(counts, ref_distribution(LOGITS, temperature=0.8), n) < P_MIN
    tokens = sample_many(SamplingParams(top_p=0.8), n=n, seed=5)
    counts = np.bincount(tokens, minlength=V)
    # wrong nucleus semantics ("cumulative prob <= top_p", i.e. one token fewer)
    wrong = ref_distribution(LOGITS, top_k=3)
    assert (counts[wrong == 0] > 0).any()


@pytest.mark.parametrize(
    "a, b",
    [
        (dict(temperature=1.0, top_k=3), dict(temperature=0.7)),  # top-k via topk(), other row untouched
        (dict(temperature=1.0, top_p=0.8), dict(temperature=1.5, top_k=3)),
        (dict(temperature=1.0, min_p=0.15), dict(temperature=0.0)),  # greedy rows mixed in
    ],
)
def test_mixed_batch_distributions(a, b):
    # rows with different settings interleaved in one batch each follow their own distribution
    n = 10000
    pa, pb = SamplingParams(**a), SamplingParams(**b)
    rows = [RowInput(pa if i % 2 == 0 else pb, seed=77, counter=i) for i in range(2 * n)]
    x = torch.tensor(LOGITS, dtype=torch.float32).expand(2 * n, V).contiguous()
    tokens = Sampler()(x, SamplingBatch.build(rows, V)).token_ids.numpy()
    for params, kw, toks in ((pa, a, tokens[0::2]), (pb, b, tokens[1::2])):
        if params.greedy:
            assert (toks == np.argmax(LOGITS)).all()
            continue
        probs = ref_distribution(LOGITS, **kw)
        counts = np.bincount(toks, minlength=V)
        assert counts[probs == 0].sum() == 0
        assert chi2_pvalue(counts, probs, n) > P_MIN


def test_distribution_over_seeds_rather_than_counters():
    # the other axis: one counter, many (consecutive) seeds
    kw = dict(temperature=0.9, top_p=0.9)
    probs = ref_distribution(LOGITS, **kw)
    p = SamplingParams(**kw)
    n = 20000
    rows = [RowInput(p, seed=s, counter=0) for s in range(n)]
    x = torch.tensor(LOGITS, dtype=torch.float32).expand(n, V).contiguous()
    tokens = Sampler()(x, SamplingBatch.build(rows, V)).token_ids.numpy()
    counts = np.bincount(tokens, minlength=V)
    assert counts[probs == 0].sum() == 0
    assert chi2_pvalue(counts, probs, n) > P_MIN


def _random_logits(rows, vocab, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)


def test_top_k_never_outside_top_k():
    R, Vb = 600, 64
    logits = _random_logits(R, Vb, 1)
    ks = np.random.default_rng(2).integers(2, 12, R)
    rows = [row(SamplingParams(temperature=1.5, top_k=int(k)), seed=i, counter=3) for i, k in enumerate(ks)]
    toks = Sampler()(torch.from_numpy(logits), SamplingBatch.build(rows, Vb)).token_ids.numpy()
    for i in range(R):
        top = np.argsort(-logits[i])[: ks[i]]
        assert toks[i] in top


def test_top_p_never_outside_nucleus():
    R, Vb = 600, 64
    logits = _random_logits(R, Vb, 3)
    ps = np.random.default_rng(4).uniform(0.05, 0.95, R)
    rows = [row(SamplingParams(temperature=1.0, top_p=float(p)), seed=i, counter=0) for i, p in enumerate(ps)]
    toks = Sampler()(torch.from_numpy(logits), SamplingBatch.build(rows, Vb)).token_ids.numpy()
    for i in range(R):
        p = np_softmax(logits[i])
        order = np.argsort(-p)
        before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        nucleus = order[: max(1, int((before < ps[i] + 1e-5).sum()))]  # float32 slack
        assert toks[i] in nucleus


def _nucleus_reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The tokens top-k then top-p keep, in float64, row by row: a whole sort."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    k = len(z) if top_k <= 0 else min(top_k, len(z))
    kth = z[order[k - 1]]
    allowed = z >= kth
    p = np.exp(z - z.max()) * allowed
    p /= p.sum()
    ranked = order[allowed[order]]
    before = np.concatenate([[0.0], np.cumsum(p[ranked])[:-1]])
    n = max(1, int((before < top_p).sum())) if top_p < 1.0 else len(ranked)
    keep[z >= z[ranked[n - 1]]] = True
    return keep & allowed


@pytest.mark.parametrize("candidates", [64, 256])
def test_top_p_from_candidates_keeps_the_whole_sorts_tokens(monkeypatch, candidates):
    """Top-p settles a row from its largest few values (`TOP_P_CANDIDATES`)
    where its nucleus ends among them, else from 4x as many (and so on), and
    sorts the row whole once that reaches the vocabulary: peaked and flat rows, top-k off, small, larger than
    the candidates and the vocabulary, top-p from 0.3 to 1. Every row keeps
    the tokens a float64 reference keeps, each way is taken, and a row's
    result is the same bits alone as in the batch."""
    import stepserve.engine.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "TOP_P_CANDIDATES", candidates)
    rng = np.random.default_rng(7)
    R, Vb = 480, 1000
    logits = (rng.standard_normal((R, Vb)) * rng.choice([0.3, 2.0, 6.0], R)[:, None]).astype(np.float32)
    temps = rng.choice([0.5, 1.0, 1.3], R)
    ks = rng.choice([0, 3, 40, candidates - 1, candidates + 50, Vb], R)
    ps = rng.choice([0.3, 0.8, 0.95, 0.999, 1.0], R)
    x = torch.from_numpy(logits)
    args = (torch.tensor(temps, dtype=torch.float32), torch.tensor(np.where(ks > 0, ks, Vb)),
            torch.tensor(ps, dtype=torch.float32))
    calls = []  # (candidates, rows) of each way taken
    real, real_sorted = sampler_mod._top_k_top_p, sampler_mod._top_k_top_p_sorted
    monkeypatch.setattr(sampler_mod, "_top_k_top_p", lambda s, k, p, c=0: calls.append((c, s.shape[0])) or real(s, k, p, c))
    monkeypatch.setattr(sampler_mod, "_top_k_top_p_sorted", lambda s, *a: calls.append((None, s.shape[0])) or real_sorted(s, *a))
    out = apply_sampling_transforms(x, args[0], args[1], args[2], None)
    # every row from the candidates, fewer from 4x as many (and so on), the rest sorted whole once 4x reaches
    # the vocabulary (of 1,000 here)
    ways, rows = [c for c, _ in calls], [n for _, n in calls]
    if candidates == 64:
        assert ways == [0, 256, 1024, None] and R == rows[0] > rows[1] > rows[2] == rows[3] > 0
    else:
        assert ways == [0, 1024, None] and R == rows[0] > rows[1] == rows[2] > 0
    for i in range(R):
        want = _nucleus_reference(logits[i].astype(np.float64), float(np.float32(temps[i])), int(ks[i]), float(np.float32(ps[i])))
        assert np.array_equal(torch.isfinite(out[i]).numpy(), want), i
    for i in (0, 1, 2, 100):
        alone = apply_sampling_transforms(x[i : i + 1], args[0][i : i + 1], args[1][i : i + 1], args[2][i : i + 1], None)
        assert torch.equal(alone[0], out[i])


def test_min_p_never_below_threshold():
    R, Vb = 600, 64
    logits = _random_logits(R, Vb, 5)
    mps = np.random.default_rng(6).uniform(0.01, 0.9, R)
    rows = [row(SamplingParams(temperature=0.9, min_p=float(m)), seed=i, counter=1) for i, m in enumerate(mps)]
    toks = Sampler()(torch.from_numpy(logits), SamplingBatch.build(rows, Vb)).token_ids.numpy()
    for i in range(R):
        p = np_softmax(logits[i] / 0.9)
        assert p[toks[i]] >= mps[i] * p.max() * (1 - 1e-4)


def test_transforms_mask_matches_reference():
    # the exposed transform helper: softmax of its output is the reference distribution
    for kw in DIST_CASES.values():
        kw = dict(dict(top_k=-1, top_p=1.0, min_p=0.0), **kw)
        x = torch.tensor(LOGITS, dtype=torch.float32)[None]
        s = apply_sampling_transforms(
            x,
            torch.tensor([kw["temperature"]]),
            torch.tensor([kw["top_k"] if kw["top_k"] > 0 else V]),
            torch.tensor([kw["top_p"]]),
            torch.tensor([kw["min_p"]]),
        )
        got = torch.softmax(s.double(), -1)[0].numpy()
        np.testing.assert_allclose(got, ref_distribution(LOGITS, **kw), atol=1e-6)


def test_temperature_zero_is_argmax_with_lowest_index_ties():
    R, Vb = 50, 40
    logits = _random_logits(R, Vb, 7)
    logits[0, [5, 9, 30]] = 100.0  # ties: lowest index wins
    logits[1, :] = 0.0
    rows = [row(SamplingParams(temperature=0.0), seed=i, counter=i) for i in range(R)]
    rows[2] = row(SamplingParams(temperature=0.7, top_k=1), seed=2)  # top_k=1 is greedy too
    out = Sampler()(torch.from_numpy(logits), SamplingBatch.build(rows, Vb))
    expect = np.argmax(logits, axis=1)
    assert expect[0] == 5 and expect[1] == 0
    np.testing.assert_array_equal(out.token_ids.numpy(), expect)
    assert out.logprobs is None and out.top_ids is None


def test_sampler_is_gumbel_max_over_stream_zero_uniforms():
    # the contract other components (e.g. speculative decoding) rely on
    R, Vb = 40, 33
    logits = _random_logits(R, Vb, 8)
    seeds = np.arange(R) * 1000003 - 77
    rows = [row(SamplingParams(temperature=0.6), seed=int(seeds[i]), counter=i * 7) for i in range(R)]
    toks = Sampler()(torch.from_numpy(logits), SamplingBatch.build(rows, Vb)).token_ids.numpy()
    u = np.array([[ref_uniform(int(seeds[i]), i * 7, STREAM_SAMPLE, j) for j in range(Vb)] for i in range(R)])
    expect = np.argmax(logits.astype(np.float64) / 0.6 - np.log(-np.log(u)), axis=1)
    np.testing.assert_array_equal(toks, expect)


def test_same_seed_counter_repeats_and_batch_invariance():
    Vb = 50
    logits = _random_logits(12, Vb, 9)
    params = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.2, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.7, repetition_penalty=1.3),
        SamplingParams(min_p=0.1, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=0.5, logit_bias={3: 2.0}, logprobs=3),
    ] * 2
    rows = [
        row(p, seed=100 + i, counter=i, prompt_ids=[1, 2, 3, i], output_ids=[4, 4, i + 5], stop_ids_to_mask=[0] if i % 3 == 0 else [])
        for i, p in enumerate(params)
    ]
    sampler = Sampler()
    full = sampler(torch.from_numpy(logits), SamplingBatch.build(rows, Vb)).token_ids
    again = sampler(torch.from_numpy(logits), SamplingBatch.build(rows, Vb)).token_ids
    assert torch.equal(full, again)
    for i in range(len(rows)):  # alone
        alone = sampler(torch.from_numpy(logits[i : i + 1]), SamplingBatch.build([rows[i]], Vb)).token_ids
        assert alone.item() == full[i].item()
    perm = np.random.default_rng(0).permutation(len(rows))
    shuffled = sampler(torch.from_numpy(logits[perm]), SamplingBatch.build([rows[i] for i in perm], Vb)).token_ids
    assert torch.equal(shuffled, full[perm])
    # chunked drawing gives the same tokens
    chunked = Sampler(max_chunk_elems=Vb)(torch.from_numpy(logits), SamplingBatch.build(rows, Vb)).token_ids
    assert torch.equal(chunked, full)


def test_different_counters_and_seeds_give_different_tokens():
    flat = np.zeros(1000, dtype=np.float32)  # uniform over 1000 tokens
    a = sample_many(SamplingParams(), logits=flat, n=200, seed=1)
    b = sample_many(SamplingParams(), logits=flat, n=200, seed=2)
    assert len(set(a.tolist())) > 150 and (a != b).mean() > 0.95


def test_derive_seed():
    s = [derive_seed(42, i) for i in range(100)]
    assert len(set(s)) == 100 and all(-(2**63) <= x < 2**63 for x in s)
    assert derive_seed(42, 0) == derive_seed(42, 0) != derive_seed(43, 0)
    assert derive_seed(-(2**70), 1) == derive_seed(-(2**70), 1)


# ----------------------------------------------------------------------------
# Penalties, bias, min_tokens
# ----------------------------------------------------------------------------


def ref_penalised(logits, prompt, output, rep, pres, freq, bias=None, masked=()):
    x = np.asarray(logits, dtype=np.float64).copy()
    for tok, val in (bias or {}).items():
        x[tok] += val
    for tok in masked:
        x[tok] = -np.inf
    seen = set(prompt) | set(output)
    for tok in seen:
        x[tok] = x[tok] / rep if x[tok] > 0 else x[tok] * rep
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(x))
    return x - freq * counts - pres * (counts > 0)


def test_penalties_match_reference_formulas():
    Vb, R = 30, 8
    rng = np.random.default_rng(11)
    logits = _random_logits(R, Vb, 12)
    cfgs = [
        dict(),  # untouched row
        dict(repetition_penalty=1.5),
        dict(repetition_penalty=0.7),
        dict(presence_penalty=0.8),
        dict(frequency_penalty=-0.4),
        dict(repetition_penalty=1.2, presence_penalty=-1.0, frequency_penalty=1.5),
        dict(logit_bias={1: 3.0, 2: -7.5}, repetition_penalty=1.3),
        dict(frequency_penalty=2.0),
    ]
    rows, refs = [], []
    for i, cfg in enumerate(cfgs):
        prompt = rng.integers(0, Vb, rng.integers(0, 12)).tolist()
        output = rng.integers(0, Vb, rng.integers(0, 15)).tolist()
        masked = [0] if i == 5 else []
        rows.append(row(SamplingParams(**cfg), prompt_ids=prompt, output_ids=output, stop_ids_to_mask=masked))
        refs.append(
            ref_penalised(
                logits[i],
                prompt,
                output,
                cfg.get("repetition_penalty", 1.0),
                cfg.get("presence_penalty", 0.0),
                cfg.get("frequency_penalty", 0.0),
                cfg.get("logit_bias"),
                masked,
            )
        )
    batch = SamplingBatch.build(rows, Vb)
    raw = torch.from_numpy(logits.copy())
    got = apply_logit_processors(raw, batch).numpy()
    np.testing.assert_allclose(got, np.stack(refs), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(raw.numpy(), logits)  # input untouched
    assert got[5, 0] == -np.inf


def test_output_counts_are_bincounts():
    Vb = 20
    outs = [[1, 1, 1, 4, 19], [], [0, 0, 7], list(range(20)) * 3]
    rows = [row(SamplingParams(frequency_penalty=0.1), output_ids=o) for o in outs]
    rows.insert(1, row(SamplingParams(), output_ids=[5, 5]))  # no penalties: not stored
    b = SamplingBatch.build(rows, Vb)
    assert b.penalty_rows.tolist() == [0, 2, 3, 4]
    expect = np.stack([np.bincount(np.array(o, dtype=int), minlength=Vb) for o in outs])
    np.testing.assert_array_equal(b.output_counts.numpy(), expect)


class _Seq:
    """What `PenaltyCounts` reads of a sequence."""

    def __init__(self, seq_id, prompt):
        self.seq_id, self.token_ids, self.prompt_len, self.finished = seq_id, list(prompt), len(prompt), False


@pytest.mark.parametrize("seed", range(4))
def test_penalty_counts_follow_the_rebuilt_counts(seed):
    """`PenaltyCounts` (counts kept on the device, a step adding only the
    tokens each sequence gained) against `SamplingBatch`'s rebuild from
    whole outputs, over random histories: sequences arrive, skip steps,
    gain 0-4 tokens a step (a verify run), finish; some last tokens are still
    placeholders (-1 - k, the overlap schedule's) read from the step in
    flight; an output is cut short or a prompt changes (the sequence is
    counted again). Counts and seen masks are equal at every step, and finished
    sequences give their rows back."""
    rng = np.random.default_rng(seed)
    Vb = 37
    pc = PenaltyCounts(Vb, "cpu", capacity=2)  # small: it must grow
    live, next_id, max_live = [], 0, 0
    kinds = [dict(frequency_penalty=0.5), dict(presence_penalty=0.3, repetition_penalty=1.4),
             dict(repetition_penalty=0.8), dict(frequency_penalty=-0.2, repetition_penalty=1.1)]
    for step in range(60):
        for _ in range(rng.integers(0, 3)):
            live.append((_Seq(next_id, rng.integers(0, Vb, rng.integers(1, 9)).tolist()), kinds[next_id % 4]))
            next_id += 1
        for seq, _ in live:
            if seq.token_ids[-1] < 0:
                seq.token_ids[-1] = int(prev[-seq.token_ids[-1] - 1])  # resolved, as `Scheduler.resolve` does
            seq.token_ids += rng.integers(0, Vb, rng.integers(0, 5)).tolist()
            if rng.random() < 0.02:
                seq.prompt_len = max(1, seq.prompt_len - 1)  # another prompt
        sampled = [(seq, kw) for seq, kw in live if rng.random() < 0.8]
        prev = torch.from_numpy(rng.integers(0, Vb, 8))
        for seq, _ in sampled:
            if rng.random() < 0.05 and len(seq.token_ids) > seq.prompt_len + 2:
                # an output cut short (in the engine only as a sequence ends: `Scheduler.finish`), seen
                # before it grows again
                del seq.token_ids[-2:]
            elif rng.random() < 0.3:
                seq.token_ids.append(-1 - int(rng.integers(0, 8)))  # its last token still on the device
        params = [SamplingParams(**kw) for _, kw in sampled]
        if not sampled:
            continue
        got = SamplingBatch.build([RowInput(p, 0, 0, seq=seq) for p, (seq, _) in zip(params, sampled)], Vb,
                                  prev_tokens=prev, counts=pc)
        resolved = [[int(prev[-t - 1]) if t < 0 else t for t in seq.token_ids] for seq, _ in sampled]
        want = SamplingBatch.build([RowInput(p, 0, 0, prompt_ids=ids[: seq.prompt_len],
                                             output_ids=ids[seq.prompt_len :])
                                    for p, (seq, _), ids in zip(params, sampled, resolved)], Vb)
        for name in ("output_counts", "seen_mask"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), (step, name)
        for seq, _ in live:
            if rng.random() < 0.1:
                seq.finished = True
        live = [(seq, kw) for seq, kw in live if not seq.finished]
        max_live = max(max_live, pc.live)
    assert pc.counts.shape[0] > 2 and max_live > 2
    for seq, _ in live:
        seq.finished = True
    pc.rows([], False)
    assert pc.live == 0  # every finished sequence gave its row back


def test_penalties_change_greedy_outcome():
    logits = torch.tensor([[1.0, 0.9, -0.5, -0.45]] * 4)
    rows = [
        row(SamplingParams(temperature=0), output_ids=[0]),  # no penalty: 0
        row(SamplingParams(temperature=0, frequency_penalty=0.2), output_ids=[0]),  # 1.0-0.2 < 0.9: 1
        row(SamplingParams(temperature=0, repetition_penalty=1.2), prompt_ids=[0]),  # 1/1.2 < 0.9: 1
        # negatives multiplied: with 0, 1 biased away, -0.45*1.2 = -0.54 < -0.5: token 2
        row(SamplingParams(temperature=0, repetition_penalty=1.2, logit_bias={0: -10, 1: -10}), prompt_ids=[3]),
    ]
    toks = Sampler()(logits, SamplingBatch.build(rows, 4)).token_ids.tolist()
    assert toks == [0, 1, 1, 2]


def test_logit_bias_forces_and_bans_tokens():
    n = 2000
    forced = sample_many(SamplingParams(temperature=1.5, logit_bias={_PERM[9]: 100.0}), n=n)
    assert (forced == _PERM[9]).all()
    banned = sample_many(SamplingParams(temperature=1.0, logit_bias={_PERM[0]: -100.0}), n=n)
    assert not (banned == _PERM[0]).any()
    # and the rest keeps its (renormalised) distribution
    probs = np_softmax(np.where(np.arange(V) == _PERM[0], -np.inf, LOGITS))
    assert chi2_pvalue(np.bincount(banned, minlength=V), probs, n) > P_MIN


def test_min_tokens_masking_blocks_eos():
    eos = 3
    logits = np.zeros(16, dtype=np.float32)
    logits[eos] = 8.0  # EOS ~99% likely
    n = 2000
    params = SamplingParams(temperature=1.0, min_tokens=5)
    rows = [row(params, seed=1, counter=i, stop_ids_to_mask=[eos, 7]) for i in range(n)]
    x = torch.from_numpy(logits).expand(n, 16).contiguous()
    toks = Sampler()(x, SamplingBatch.build(rows, 16)).token_ids.numpy()
    assert not np.isin(toks, [eos, 7]).any()
    greedy = [row(SamplingParams(temperature=0, min_tokens=3), stop_ids_to_mask=[eos])]
    assert Sampler()(x[:1], SamplingBatch.build(greedy, 16)).token_ids.item() != eos
    unmasked = [row(params, seed=1, counter=i) for i in range(200)]
    toks = Sampler()(x[:200], SamplingBatch.build(unmasked, 16)).token_ids.numpy()
    assert (toks == eos).mean() > 0.9


# ----------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_sorted_top_k():
    R, Vb = 9, 100
    logits = _random_logits(R, Vb, 13)
    asked = [None, 0, 1, 5, 3, None, 20, 2, 0]
    rows = [
        row(
            SamplingParams(
                temperature=0.0 if i % 2 else 0.7,
                logprobs=k,
                repetition_penalty=1.4,
                logit_bias={4: 9.0},
            ),
            seed=i,
            counter=i,
            prompt_ids=[1, 2, 3],
        )
        for i, k in enumerate(asked)
    ]
    out = Sampler()(torch.from_numpy(logits), SamplingBatch.build(rows, Vb))
    ref = np_log_softmax(logits)  # raw model distribution: no penalty/bias/temperature
    toks = out.token_ids.numpy()
    np.testing.assert_allclose(out.logprobs.numpy(), ref[np.arange(R), toks], atol=1e-5)
    assert out.top_ids.shape == (R, 20) and out.top_logprobs.shape == (R, 20)
    order = np.argsort(-ref, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(out.top_ids.numpy(), order)
    np.testing.assert_allclose(out.top_logprobs.numpy(), np.take_along_axis(ref, order, 1), atol=1e-5)
    assert (np.diff(out.top_logprobs.numpy(), axis=1) <= 0).all()


def test_logprobs_zero_gives_only_chosen_token():
    rows = [row(SamplingParams(temperature=0, logprobs=0)), row(SamplingParams(temperature=0))]
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 2.0]])
    out = Sampler()(logits, SamplingBatch.build(rows, 3))
    assert out.token_ids.tolist() == [2, 0]
    np.testing.assert_allclose(out.logprobs.numpy(), np_log_softmax(logits.numpy())[[0, 1], [2, 0]], atol=1e-6)
    assert out.top_ids is None and out.top_logprobs is None


def test_fast_path_and_dtypes():
    logits = torch.tensor([[0.1, 0.5, 0.2], [0.9, 0.1, 0.0]], dtype=torch.bfloat16)
    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(top_k=1))]
    b = SamplingBatch.build(rows, 3)
    assert b.all_greedy and not b.needs_processing and b.max_num_logprobs is None
    out = Sampler()(logits, b)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.tolist() == [1, 0]
    assert out.logprobs is None
    with pytest.raises(ValueError):
        Sampler()(logits[:, :2], b)


def test_argmax_rows_equals_torch_argmax_on_ties_nans_infs_and_views():
    """The greedy/Gumbel argmax (numpy's on CPU float32) picks what torch does."""
    from stepserve.engine.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 999, generator=g)
    x[1, 10] = x[1, 900] = 50.0  # tie: the first
    x[2, 333] = float("nan")  # a NaN counts as the maximum
    x[3, :] = float("-inf")
    x[4, 5] = x[4, 6] = float("inf")
    x[5, 2] = x[5, 800] = float("nan")
    x[6, :] = 0.0
    for t in (x, x[:, ::3], x[::2], x.t().contiguous().t(), x.bfloat16(), x.double()):
        assert argmax_rows(t).tolist() == t.argmax(dim=-1).tolist()
        assert argmax_rows(t).dtype == torch.int64
    assert argmax_rows(torch.empty(0, 7)).shape == (0,)
