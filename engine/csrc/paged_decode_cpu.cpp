// Paged decode attention for CPU: one query token per row, reading K/V straight
// from the token-slot pool through the req->token table. The torch reference
// path gathers every row's K and V into dense tensors first (one extra write and
// read of the whole context per layer); this kernel reads each slot in place,
// prefetching a few slots ahead since a row's slots are scattered over the pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// bfloat16 bits -> float32: a 16-bit shift
inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// bf16 -> f32 is a 16-bit shift; written on raw bits so the loops vectorise.
inline void load_f32(const float* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = src[i];
}
inline void load_f32(const at::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

// exp(x) for float32 in a form the compiler vectorizes for the -march it builds
// for (std::exp is a libm call per element without -ffast-math: silu_and_mul
// over 320 x 768 took 480 us where torch's took 110, and the decode softmax
// paid one per score): x = n ln2 + r with
// |r| <= ln2 / 2, Cephes' degree-6 polynomial for exp(r) (about 1 ulp), and 2^n
// put into the exponent bits. Clamped to exp(-87.3) .. exp(88.3): a finite
// result for every finite input; NaN stays NaN.
static inline float vec_expf(float x) {
  x = x < 88.3f ? x : 88.3f;
  x = x > -87.3f ? x : -87.3f;
  const float magic = 12582912.f;  // 1.5 * 2^23: adding and taking it away rounds to the nearest integer
  float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// scores -> probabilities, in place (one row of n scores)
inline void softmax_in_place(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  float l = 0.f;
#pragma omp simd reduction(+ : l)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = vec_expf(s[t] - m);
    l += s[t];
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// T: storage type of q, the pool and out (float or bfloat16); math is float32.
// Two passes per (row, kv head): all scores first (dot products over head_dim,
// vectorised), then one max, the exponentials, and the weighted sum of V. No
// per-token rescaling branch, which is what kept the online-softmax form slow.
template <typename T, int D>
void decode_rows(const T* q, int64_t qs, const T* kp, const T* vp, const int64_t* table,
                 const int64_t* rows, const int64_t* lens, T* out, int64_t B, int64_t Hq,
                 int64_t Hkv, int64_t table_stride, float scale, int64_t dyn_d) {
  const int64_t G = Hq / Hkv;
  const int64_t d = D > 0 ? D : dyn_d;
  const int64_t kv_stride = Hkv * d;  // elements per slot
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lens[b]);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * d), qf(G * d), kf(d), vf(d), sc(G * std::max<int64_t>(max_len, 1));
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / Hkv, h = work % Hkv;
      load_f32(q + b * qs + h * G * d, qf.data(), G * d);
      const int64_t* slots = table + rows[b] * table_stride;
      const int64_t n = lens[b];
      // pass 1: scores[g][t]
      constexpr int64_t kAhead = 8;
      for (int64_t t = 0; t < n; ++t) {
        if (t + kAhead < n) {
          __builtin_prefetch(kp + slots[t + kAhead] * kv_stride + h * d);
          __builtin_prefetch(vp + slots[t + kAhead] * kv_stride + h * d);
        }
        load_f32(kp + slots[t] * kv_stride + h * d, kf.data(), d);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qg[i] * kf[i];
          sc[g * n + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < G; ++g) softmax_in_place(sc.data() + g * n, n);
      // pass 2: out[g] = sum_t p[g][t] * v[t]
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        load_f32(vp + slots[t] * kv_stride + h * d, vf.data(), d);
        for (int64_t g = 0; g < G; ++g) {
          const float p = sc[g * n + t];
          float* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += p * vf[i];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (b * Hq + h * G + g) * d;
        const float* a = acc.data() + g * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(a[i]);
      }
    }
  });
}

#if defined(__AVX512F__)
// 16 values as float32: bf16 -> f32 is a 16-bit shift (the vector decode's rows, the panels' rows)
inline __m512 load16z(const at::BFloat16* p) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}
inline __m512 load16z(const float* p) { return _mm512_loadu_ps(p); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same two passes with the head row in vector registers, for the common
// shapes (head_dim 64 or 128, 1-8 query heads per KV head): each token's K row
// is read once straight from the pool (no copy into a float buffer) against all
// G queries, whose D-wide products stay in registers until one horizontal sum
// per score; V's weighted sums stay in G * D / W registers over the whole
// context (the general form above kept them in memory: a load and a store per
// multiply-add). Pass 2 sums over t in order per lane, as the general form
// does; a score's dot product sums in vector lanes, then across them.
// On the 2-core Xeon (AVX-512; G = 2, D = 64), 4-48 rows of 448 tokens:
// 1.27-1.82x the general form in float32, 1.46-2.08x in bfloat16
// (STEPSERVE_VEC_DECODE=0 for the general form; ARCHITECTURE.md).
#if defined(__AVX512F__)
struct VecF {
  static constexpr int W = 16;
  using V = __m512;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename T>
  static V load(const T* p) { return load16z(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static float sum(V a) { return _mm512_reduce_add_ps(a); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
};
#else
struct VecF {
  static constexpr int W = 8;
  using V = __m256;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static float sum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
};
#endif

inline void store_row(float* o, const float* a, int64_t d) { std::memcpy(o, a, d * sizeof(float)); }
inline void store_row(at::BFloat16* o, const float* a, int64_t d) {
  for (int64_t i = 0; i < d; ++i) o[i] = static_cast<at::BFloat16>(a[i]);
}

template <typename T, int D, int G>
void decode_rows_vec(const T* q, int64_t qs, const T* kp, const T* vp, const int64_t* table, const int64_t* rows,
                     const int64_t* lens, T* out, int64_t B, int64_t Hkv, int64_t table_stride, float scale) {
  using F = VecF;
  using V = typename F::V;
  constexpr int NV = D / F::W;
  const int64_t Hq = G * Hkv;
  const int64_t kv_stride = Hkv * D;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lens[b]);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(G * std::max<int64_t>(max_len, 1));
    alignas(64) float acc[G * D];
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / Hkv, h = work % Hkv;
      const int64_t* slots = table + rows[b] * table_stride;
      const int64_t n = lens[b];
      V qv[G][NV];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) qv[g][j] = F::load(q + b * qs + (h * G + g) * D + j * F::W);
      // pass 1: scores[g][t]
      constexpr int64_t kAhead = 8;
      for (int64_t t = 0; t < n; ++t) {
        if (t + kAhead < n) {
          __builtin_prefetch(kp + slots[t + kAhead] * kv_stride + h * D);
          __builtin_prefetch(vp + slots[t + kAhead] * kv_stride + h * D);
        }
        const T* kr = kp + slots[t] * kv_stride + h * D;
        V s[G];
        V k0 = F::load(kr);
        for (int g = 0; g < G; ++g) s[g] = F::mul(qv[g][0], k0);
        for (int j = 1; j < NV; ++j) {
          V kj = F::load(kr + j * F::W);
          for (int g = 0; g < G; ++g) s[g] = F::fma(qv[g][j], kj, s[g]);
        }
        for (int g = 0; g < G; ++g) sc[g * n + t] = F::sum(s[g]) * scale;
      }
      for (int64_t g = 0; g < G; ++g) softmax_in_place(sc.data() + g * n, n);
      // pass 2: out[g] = sum_t p[g][t] * v[t], the sums in registers
      V o[G][NV];
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) o[g][j] = F::zero();
      for (int64_t t = 0; t < n; ++t) {
        const T* vr = vp + slots[t] * kv_stride + h * D;
        for (int j = 0; j < NV; ++j) {
          V vj = F::load(vr + j * F::W);
          for (int g = 0; g < G; ++g) o[g][j] = F::fma(F::set1(sc[g * n + t]), vj, o[g][j]);
        }
      }
      for (int g = 0; g < G; ++g) {
        for (int j = 0; j < NV; ++j) F::store(acc + g * D + j * F::W, o[g][j]);
        store_row(out + (b * Hq + h * G + g) * D, acc + g * D, D);
      }
    }
  });
}

// The vector form where it has an instance (STEPSERVE_VEC_DECODE=0: the general one, for A/B runs)
template <typename T, int D>
bool decode_rows_fast(const T* q, int64_t qs, const T* kp, const T* vp, const int64_t* table, const int64_t* rows,
                      const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t table_stride,
                      float scale) {
  static const bool off = [] {
    const char* e = std::getenv("STEPSERVE_VEC_DECODE");
    return e != nullptr && std::strcmp(e, "0") == 0;
  }();
  if constexpr (D == 0) {
    return false;
  } else {
    if (off) return false;
    switch (Hq / Hkv) {
      case 1: decode_rows_vec<T, D, 1>(q, qs, kp, vp, table, rows, lens, out, B, Hkv, table_stride, scale); return true;
      case 2: decode_rows_vec<T, D, 2>(q, qs, kp, vp, table, rows, lens, out, B, Hkv, table_stride, scale); return true;
      case 4: decode_rows_vec<T, D, 4>(q, qs, kp, vp, table, rows, lens, out, B, Hkv, table_stride, scale); return true;
      case 8: decode_rows_vec<T, D, 8>(q, qs, kp, vp, table, rows, lens, out, B, Hkv, table_stride, scale); return true;
      default: return false;
    }
  }
}
#else
template <typename T, int D>
bool decode_rows_fast(const T*, int64_t, const T*, const T*, const int64_t*, const int64_t*, const int64_t*, T*,
                      int64_t, int64_t, int64_t, int64_t, float) {
  return false;
}
#endif

// The decode attention over raw rows: q's rows `qs` elements apart (each
// token's heads contiguous), `out` [B, Hq, D] contiguous; the vector form
// where it has an instance, else the general one.
template <typename T>
void paged_decode_rows(const T* q, int64_t qs, const T* kp, const T* vp, const int64_t* table, int64_t table_stride,
                       const int64_t* rows, const int64_t* lens, T* out, int64_t B, int64_t Hq, int64_t Hkv,
                       int64_t D, float scale) {
  bool done = false;
  if (D == 64)
    done = decode_rows_fast<T, 64>(q, qs, kp, vp, table, rows, lens, out, B, Hq, Hkv, table_stride, scale);
  else if (D == 128)
    done = decode_rows_fast<T, 128>(q, qs, kp, vp, table, rows, lens, out, B, Hq, Hkv, table_stride, scale);
  if (!done) {
    if (D == 64)
      decode_rows<T, 64>(q, qs, kp, vp, table, rows, lens, out, B, Hq, Hkv, table_stride, scale, D);
    else if (D == 128)
      decode_rows<T, 128>(q, qs, kp, vp, table, rows, lens, out, B, Hq, Hkv, table_stride, scale, D);
    else
      decode_rows<T, 0>(q, qs, kp, vp, table, rows, lens, out, B, Hq, Hkv, table_stride, scale, D);
  }
}

}  // namespace

// q [B, Hq, D]; k_pool/v_pool [N, Hkv, D] (float32 or bfloat16, same as q);
// table [R, C] int64; rows [B] int64 (row of the table per query); lens [B]
// int64 (context length, including the token being decoded, whose K/V is
// already in the pool).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor table,
                           torch::Tensor rows, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(),
              "q and the KV pool must share a dtype");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16,
              "float32 or bfloat16 only");
  TORCH_CHECK(q.is_contiguous() && k_pool.is_contiguous() && v_pool.is_contiguous() && table.is_contiguous(),
              "contiguous inputs required");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pool.size(1);
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  auto out = torch::empty_like(q);
  auto rows_c = rows.contiguous();
  auto lens_c = lens.contiguous();
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat32)
    paged_decode_rows(q.data_ptr<float>(), Hq * D, k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                      table.data_ptr<int64_t>(), table.size(1), rows_c.data_ptr<int64_t>(),
                      lens_c.data_ptr<int64_t>(), out.data_ptr<float>(), B, Hq, Hkv, D, s);
  else
    paged_decode_rows(q.data_ptr<at::BFloat16>(), Hq * D, k_pool.data_ptr<at::BFloat16>(),
                      v_pool.data_ptr<at::BFloat16>(), table.data_ptr<int64_t>(), table.size(1),
                      rows_c.data_ptr<int64_t>(), lens_c.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), B, Hq,
                      Hkv, D, s);
  return out;
}

// ---------------------------------------------------------------------------
// Small-batch float32 linear: y[M, N] = x[M, K] . W^T for few rows (decode
// and verify steps of small batches; the caller picks where torch takes over). W is kept in 16-column panels,
// panels[N / 16][K][16], so each panel streams from memory once while the M
// rows' 16 accumulators each stay in registers, vectorised across the
// columns. BLAS sgemm at these row counts reads W as if for a large M and
// reaches a fraction of the machine (measured on an AVX2 EPYC, 2 threads:
// 1.5-4.8x slower at the embedded model's shapes, M = 1-5).

// A bfloat16 panel row holds its 16 columns in this order: 0-3, 8-11, 4-7,
// 12-15. Unpacking one 256-bit load's 16-bit halves against zeros (per 128-bit
// lane, `_mm256_unpacklo/hi_epi16`) then gives columns 0-7 and 8-15 as float32,
// one instruction per 8 values where widening them in order takes two (a
// zero-extension and a shift), beside the multiply-adds on the same ports.
// The order is its own inverse.
constexpr int kBf16Order[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// [N, K] -> [N / 16, K, 16], in float32, or in bfloat16 when `bf16` (for a
// weight whose every value is a bfloat16 -- a bf16 checkpoint run in float32 --
// the panels are then exact and half the bytes: at batch 1 a product streams
// its weight once, so its time is the weight's bytes over the memory's speed;
// each row's columns in `kBf16Order`).
torch::Tensor pack_panels(torch::Tensor w, bool bf16) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "a float32 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0, "out_features must be a multiple of 16");
  auto p = w.contiguous().view({N / 16, 16, K});
  if (bf16) p = p.index_select(1, torch::tensor(std::vector<int64_t>(kBf16Order, kBf16Order + 16)));
  p = p.transpose(1, 2).contiguous();
  return bf16 ? p.to(torch::kBFloat16) : p;
}

namespace {

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return bf16_bits_to_f32(reinterpret_cast<const uint16_t&>(v)); }
// column j of a panel row
inline float column(const float* row, int j) { return row[j]; }
inline float column(const at::BFloat16* row, int j) { return widen(row[kBf16Order[j]]); }

// STEPSERVE_ZMM_PANELS=0: the AVX2 form on an AVX-512 build, for A/B runs (read once)
inline bool zmm_off() {
  static const bool off = [] {
    const char* v = std::getenv("STEPSERVE_ZMM_PANELS");
    return v != nullptr && v[0] == '0';
  }();
  return off;
}

#if defined(__AVX512F__)
// AVX-512: a panel row of 16 weights is one 16-float vector, and 32 registers
// hold a block of up to 8 rows against up to 4 panels (24 accumulators, the
// panels' vectors, each row's value broadcast from memory into the
// multiply-add). With 16 registers (AVX2, below) 4-5 rows against one panel
// gave 8-10 chains of multiply-adds, about half of what keeps both FMA ports
// busy: 4 rows ran at half the speed per row of 6. Every (row, column) sum
// still runs over k in order with one fused multiply-add per step, so the
// same bits as the AVX2 and portable forms, whatever the block.
// (`load16z`, above, reads a panel row in `kBf16Order`: its lanes in that order)
// the lanes back in column order (`kBf16Order` is its own inverse)
inline __m512 in_order(__m512 v, const at::BFloat16*) {
  return _mm512_permutexvar_ps(_mm512_loadu_si512(kBf16Order), v);
}
inline __m512 in_order(__m512 v, const float*) { return v; }

#define STEPSERVE_Z_LOAD(p)                                                 \
  __m512 w##p = _mm512_setzero_ps();                                        \
  if constexpr (P > p) {                                                    \
    const W* wk = w0 + p * K * 16 + k * 16;                                 \
    if ((k * 16 * sizeof(W)) % 64 == 0) __builtin_prefetch(wk + kAhead);   \
    w##p = load16z(wk);                                                     \
  }
#define STEPSERVE_Z_ROW(m)                                                  \
  if constexpr (M > m) {                                                    \
    const __m512 xv = _mm512_set1_ps(x[m * K + k]);                         \
    if constexpr (P > 0) a##m##0 = _mm512_fmadd_ps(xv, w0v, a##m##0);       \
    if constexpr (P > 1) a##m##1 = _mm512_fmadd_ps(xv, w1, a##m##1);        \
    if constexpr (P > 2) a##m##2 = _mm512_fmadd_ps(xv, w2, a##m##2);        \
    if constexpr (P > 3) a##m##3 = _mm512_fmadd_ps(xv, w3, a##m##3);        \
  }
#define STEPSERVE_Z_STORE(m, p)                                             \
  if constexpr (M > m && P > p) _mm512_storeu_ps(y + m * N + (nb + p) * 16, in_order(a##m##p, w0));
#define STEPSERVE_Z_ACC(m) __m512 a##m##0 = z, a##m##1 = z, a##m##2 = z, a##m##3 = z;
template <int M, int P, typename W>
void panel_block_z(const float* x, const W* panels, float* y, int64_t N, int64_t K, int64_t nb) {
  static_assert(M >= 1 && M <= 8 && P >= 1 && P <= 4 && M * P <= 24, "at most 24 accumulators");
  const __m512 z = _mm512_setzero_ps();
  STEPSERVE_Z_ACC(0) STEPSERVE_Z_ACC(1) STEPSERVE_Z_ACC(2) STEPSERVE_Z_ACC(3)
  STEPSERVE_Z_ACC(4) STEPSERVE_Z_ACC(5) STEPSERVE_Z_ACC(6) STEPSERVE_Z_ACC(7)
  const W* w0 = panels + nb * K * 16;
  constexpr int64_t kAhead = 1024 / sizeof(W);  // 1 KiB ahead in each panel's stream
  for (int64_t k = 0; k < K; ++k) {
    __m512 w0v;
    {
      const W* wk = w0 + k * 16;
      if ((k * 16 * sizeof(W)) % 64 == 0) __builtin_prefetch(wk + kAhead);
      w0v = load16z(wk);
    }
    STEPSERVE_Z_LOAD(1) STEPSERVE_Z_LOAD(2) STEPSERVE_Z_LOAD(3)
    STEPSERVE_Z_ROW(0) STEPSERVE_Z_ROW(1) STEPSERVE_Z_ROW(2) STEPSERVE_Z_ROW(3)
    STEPSERVE_Z_ROW(4) STEPSERVE_Z_ROW(5) STEPSERVE_Z_ROW(6) STEPSERVE_Z_ROW(7)
  }
#define STEPSERVE_Z_STORE_ROW(m) \
  STEPSERVE_Z_STORE(m, 0) STEPSERVE_Z_STORE(m, 1) STEPSERVE_Z_STORE(m, 2) STEPSERVE_Z_STORE(m, 3)
  STEPSERVE_Z_STORE_ROW(0) STEPSERVE_Z_STORE_ROW(1) STEPSERVE_Z_STORE_ROW(2) STEPSERVE_Z_STORE_ROW(3)
  STEPSERVE_Z_STORE_ROW(4) STEPSERVE_Z_STORE_ROW(5) STEPSERVE_Z_STORE_ROW(6) STEPSERVE_Z_STORE_ROW(7)
#undef STEPSERVE_Z_STORE_ROW
}
#undef STEPSERVE_Z_LOAD
#undef STEPSERVE_Z_ROW
#undef STEPSERVE_Z_STORE
#undef STEPSERVE_Z_ACC

constexpr int kRowBlockZ = 8;
// a block of M rows over panels [nb, nb + np): 4 panels at a time (3 from 7 rows up), then one
template <int M, typename W>
void panels_of_block_z(const float* x, const W* wp, float* y, int64_t N, int64_t K, int64_t nb, int64_t np) {
  constexpr int P = M <= 6 ? 4 : 3;
  int64_t j = 0;
  for (; j + P <= np; j += P) panel_block_z<M, P>(x, wp, y, N, K, nb + j);
  for (; j < np; ++j) panel_block_z<M, 1>(x, wp, y, N, K, nb + j);
}
template <typename W>
void panel_range_z(const float* xp, const W* wp, float* yp, int64_t M, int64_t N, int64_t K, int64_t b0,
                   int64_t b1) {
  // groups of 4 panels, each passed over by every block of 8 rows while it is in the cache: the weight
  // is still read from memory once
  for (int64_t g0 = b0; g0 < b1; g0 += 4) {
    const int64_t np = std::min<int64_t>(4, b1 - g0);
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlockZ) {
      const float* x = xp + m0 * K;
      float* y = yp + m0 * N;
      switch (std::min<int64_t>(M - m0, kRowBlockZ)) {
        case 1: panels_of_block_z<1>(x, wp, y, N, K, g0, np); break;
        case 2: panels_of_block_z<2>(x, wp, y, N, K, g0, np); break;
        case 3: panels_of_block_z<3>(x, wp, y, N, K, g0, np); break;
        case 4: panels_of_block_z<4>(x, wp, y, N, K, g0, np); break;
        case 5: panels_of_block_z<5>(x, wp, y, N, K, g0, np); break;
        case 6: panels_of_block_z<6>(x, wp, y, N, K, g0, np); break;
        case 7: panels_of_block_z<7>(x, wp, y, N, K, g0, np); break;
        default: panels_of_block_z<8>(x, wp, y, N, K, g0, np); break;
      }
    }
  }
}
constexpr bool kZmm = true;
#else
constexpr bool kZmm = false;
template <typename W>
void panel_range_z(const float*, const W*, float*, int64_t, int64_t, int64_t, int64_t, int64_t) {}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// 16 weights of a panel row as two 8-float vectors (bf16 -> f32 is a 16-bit shift)
inline void load16(const at::BFloat16* p, __m256& lo, __m256& hi) {  // a row in `kBf16Order`
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i z = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w));
}
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}

// Up to 6 rows against one panel, each row's 16 sums in two named registers
// (12 accumulators, the panel's two vectors and a broadcast: 15 of the 16
// AVX2 registers). Written out rather than as an array, which GCC kept on the
// stack (a store and reload per step, and 128-bit vectors on Zen tuning):
// 1.3-1.4x faster from 3 rows up, measured on an AVX2 EPYC. Every row's sums
// run over k in order with one fused multiply-add each, so a row's result does
// not depend on how many rows share its call (batch invariance), as before.
#define STEPSERVE_PANEL_ROW(m)                                     \
  if constexpr (M > m) {                                           \
    const __m256 xv = _mm256_broadcast_ss(x + m * K + k);          \
    a##m##l = _mm256_fmadd_ps(xv, lo, a##m##l);                    \
    a##m##h = _mm256_fmadd_ps(xv, hi, a##m##h);                    \
  }
#define STEPSERVE_PANEL_STORE(m)                                   \
  if constexpr (M > m) {                                           \
    _mm256_storeu_ps(y + m * N + nb * 16, a##m##l);                \
    _mm256_storeu_ps(y + m * N + nb * 16 + 8, a##m##h);            \
  }
constexpr int kRowBlock = 6;
template <int M, typename W>
void panel_rows(const float* x, const W* panels, float* y, int64_t N, int64_t K, int64_t nb) {
  __m256 a0l = _mm256_setzero_ps(), a0h = a0l, a1l = a0l, a1h = a0l, a2l = a0l, a2h = a0l, a3l = a0l, a3h = a0l,
         a4l = a0l, a4h = a0l, a5l = a0l, a5h = a0l;
  const W* w = panels + nb * K * 16;
  // the panel is one stream of K * 16 values; fetched well ahead, since on some machines (a
  // virtualised EPYC) a cold product otherwise waits on memory line by line
  constexpr int64_t kAhead = 1024 / sizeof(W);  // 1 KiB ahead
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * 16;
    if ((k * 16 * sizeof(W)) % 64 == 0) __builtin_prefetch(wk + kAhead);
    __m256 lo, hi;
    load16(wk, lo, hi);
    STEPSERVE_PANEL_ROW(0) STEPSERVE_PANEL_ROW(1) STEPSERVE_PANEL_ROW(2)
    STEPSERVE_PANEL_ROW(3) STEPSERVE_PANEL_ROW(4) STEPSERVE_PANEL_ROW(5)
  }
  STEPSERVE_PANEL_STORE(0) STEPSERVE_PANEL_STORE(1) STEPSERVE_PANEL_STORE(2)
  STEPSERVE_PANEL_STORE(3) STEPSERVE_PANEL_STORE(4) STEPSERVE_PANEL_STORE(5)
}
#undef STEPSERVE_PANEL_ROW
#undef STEPSERVE_PANEL_STORE

// 1-3 rows against P panels at once. One row's 16 sums of one panel are two
// chains of dependent multiply-adds, so a block of 1-3 rows against one panel
// waits on the multiply-add's latency (measured: 1, 2 and 3 rows cost the same);
// P panels side by side give 2 * M * P independent chains (8-12), enough to
// keep both FMA ports busy. Each (row, column) sum still runs over k in order,
// one fused multiply-add per step, exactly as `panel_rows` does: the same bits
// whichever function or block computes it.
#define STEPSERVE_MP_FMA(m, p)                                              \
  if constexpr (M > m && P > p) {                                           \
    a##m##p##l = _mm256_fmadd_ps(x##m, lo##p, a##m##p##l);                  \
    a##m##p##h = _mm256_fmadd_ps(x##m, hi##p, a##m##p##h);                  \
  }
#define STEPSERVE_MP_LOAD(p)                                                \
  __m256 lo##p, hi##p;                                                      \
  if constexpr (P > p) {                                                    \
    const W* wk = w##p + k * 16;                                            \
    if ((k * 16 * sizeof(W)) % 64 == 0) __builtin_prefetch(wk + kAhead);   \
    load16(wk, lo##p, hi##p);                                               \
  }
#define STEPSERVE_MP_STORE(m, p)                                            \
  if constexpr (M > m && P > p) {                                           \
    _mm256_storeu_ps(y + m * N + (nb + p) * 16, a##m##p##l);                \
    _mm256_storeu_ps(y + m * N + (nb + p) * 16 + 8, a##m##p##h);            \
  }
template <int M, int P, typename W>
void panel_rows_multi(const float* x, const W* panels, float* y, int64_t N, int64_t K, int64_t nb) {
  static_assert(M >= 1 && M <= 3 && P >= 1 && P <= 4 && M * P <= 6, "at most 12 accumulators");
  const __m256 z = _mm256_setzero_ps();
  __m256 a00l = z, a00h = z, a01l = z, a01h = z, a02l = z, a02h = z, a03l = z, a03h = z;
  __m256 a10l = z, a10h = z, a11l = z, a11h = z, a12l = z, a12h = z, a13l = z, a13h = z;
  __m256 a20l = z, a20h = z, a21l = z, a21h = z, a22l = z, a22h = z, a23l = z, a23h = z;
  const W* w0 = panels + nb * K * 16;
  const W* w1 = w0 + K * 16;
  const W* w2 = w1 + K * 16;
  const W* w3 = w2 + K * 16;
  constexpr int64_t kAhead = 1024 / sizeof(W);  // 1 KiB ahead in each panel's stream
  for (int64_t k = 0; k < K; ++k) {
    STEPSERVE_MP_LOAD(0) STEPSERVE_MP_LOAD(1) STEPSERVE_MP_LOAD(2) STEPSERVE_MP_LOAD(3)
    const __m256 x0 = _mm256_broadcast_ss(x + k);
    __m256 x1 = z, x2 = z;
    if constexpr (M > 1) x1 = _mm256_broadcast_ss(x + K + k);
    if constexpr (M > 2) x2 = _mm256_broadcast_ss(x + 2 * K + k);
    STEPSERVE_MP_FMA(0, 0) STEPSERVE_MP_FMA(0, 1) STEPSERVE_MP_FMA(0, 2) STEPSERVE_MP_FMA(0, 3)
    STEPSERVE_MP_FMA(1, 0) STEPSERVE_MP_FMA(1, 1) STEPSERVE_MP_FMA(1, 2) STEPSERVE_MP_FMA(1, 3)
    STEPSERVE_MP_FMA(2, 0) STEPSERVE_MP_FMA(2, 1) STEPSERVE_MP_FMA(2, 2) STEPSERVE_MP_FMA(2, 3)
  }
  STEPSERVE_MP_STORE(0, 0) STEPSERVE_MP_STORE(0, 1) STEPSERVE_MP_STORE(0, 2) STEPSERVE_MP_STORE(0, 3)
  STEPSERVE_MP_STORE(1, 0) STEPSERVE_MP_STORE(1, 1) STEPSERVE_MP_STORE(1, 2) STEPSERVE_MP_STORE(1, 3)
  STEPSERVE_MP_STORE(2, 0) STEPSERVE_MP_STORE(2, 1) STEPSERVE_MP_STORE(2, 2) STEPSERVE_MP_STORE(2, 3)
}
#undef STEPSERVE_MP_FMA
#undef STEPSERVE_MP_LOAD
#undef STEPSERVE_MP_STORE
constexpr bool kMultiPanel = true;
#else
// Portable form (no AVX2/FMA at build time): the compiler vectorises the
// columns; rows in blocks of 8.
constexpr int kRowBlock = 8;
template <int M, typename W>
void panel_rows(const float* x, const W* panels, float* y, int64_t N, int64_t K, int64_t nb) {
  float acc[M][16] = {};
  const W* w = panels + nb * K * 16;
  constexpr int64_t kAhead = 1024 / sizeof(W);  // 1 KiB ahead
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * 16;
    if ((k * 16 * sizeof(W)) % 64 == 0) __builtin_prefetch(wk + kAhead);
    float wf[16];
#pragma omp simd
    for (int j = 0; j < 16; ++j) wf[j] = column(wk, j);
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * K + k];
#pragma omp simd
      for (int j = 0; j < 16; ++j) acc[m][j] += xv * wf[j];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 16; ++j) y[m * N + nb * 16 + j] = acc[m][j];
}
// the compiler's own vectorisation keeps a row's 16 sums in one vector chain either way
constexpr bool kMultiPanel = false;
template <int M, int P, typename W>
void panel_rows_multi(const float* x, const W* panels, float* y, int64_t N, int64_t K, int64_t nb) {
  for (int p = 0; p < P; ++p) panel_rows<M>(x, panels, y, N, K, nb + p);
}
#endif

// Rows in blocks of kRowBlock; a panel stays in L1 while every block of rows
// passes over it, so the weight is still read from memory once. A product of
// 1-3 rows takes 4 or 2 panels at a time (`panel_rows_multi`); more rows keep
// one panel at a time, so that it stays in L1 across their blocks.
template <int M, typename W>
void panels_of_block(const float* x, const W* wp, float* y, int64_t N, int64_t K, int64_t nb, int64_t np) {
  constexpr int P = M == 1 ? 4 : 2;
  int64_t j = 0;
  for (; j + P <= np; j += P) panel_rows_multi<M, P>(x, wp, y, N, K, nb + j);
  for (; j < np; ++j) panel_rows<M>(x, wp, y, N, K, nb + j);
}
template <typename W>
void panel_range(const float* xp, const W* wp, float* yp, int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1,
                 bool zmm) {
  if (kZmm && zmm && M >= 4 && !zmm_off()) {  // (1-3 rows: the AVX2 form below, 10-25% faster on Zen 4's halved
    panel_range_z(xp, wp, yp, M, N, K, b0, b1);  // 512-bit units; from 8 rows up the AVX-512 form is 15-20%
    return;                                      // faster there, one block of 8 rows where AVX2 takes 6 + 2)
  }
  if (kMultiPanel && M <= 3) {
    if (M == 1) panels_of_block<1>(xp, wp, yp, N, K, b0, b1 - b0);
    else if (M == 2) panels_of_block<2>(xp, wp, yp, N, K, b0, b1 - b0);
    else panels_of_block<3>(xp, wp, yp, N, K, b0, b1 - b0);
    return;
  }
  for (int64_t nb = b0; nb < b1; ++nb) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const float* x = xp + m0 * K;
      float* y = yp + m0 * N;
      switch (std::min<int64_t>(M - m0, kRowBlock)) {
        case 1: panel_rows<1>(x, wp, y, N, K, nb); break;
        case 2: panel_rows<2>(x, wp, y, N, K, nb); break;
        case 3: panel_rows<3>(x, wp, y, N, K, nb); break;
        case 4: panel_rows<4>(x, wp, y, N, K, nb); break;
        case 5: panel_rows<5>(x, wp, y, N, K, nb); break;
#if !(defined(__AVX2__) && defined(__FMA__))
        case 6: panel_rows<6>(x, wp, y, N, K, nb); break;
        case 7: panel_rows<7>(x, wp, y, N, K, nb); break;
        default: panel_rows<8>(x, wp, y, N, K, nb); break;
#else
        default: panel_rows<6>(x, wp, y, N, K, nb); break;
#endif
      }
    }
  }
}

// y [M, NB * 16] = x [M, K] . W^T from W's panels, float32 (wf) or bfloat16 (wb; the other null)
void panel_product(const float* xp, const float* wf, const at::BFloat16* wb, float* yp, int64_t M, int64_t K,
                   int64_t NB, bool zmm) {
  const int64_t N = NB * 16;
  // about 16K multiply-adds per task at least, so a small product is not split across threads for nothing
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(16 * K * M, 1));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    if (wb != nullptr)
      panel_range(xp, wb, yp, M, N, K, b0, b1, zmm);
    else
      panel_range(xp, wf, yp, M, N, K, b0, b1, zmm);
  });
}

void check_panels(const torch::Tensor& panels) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.is_contiguous() &&
                  (panels.scalar_type() == torch::kFloat32 || panels.scalar_type() == torch::kBFloat16),
              "packed float32 or bfloat16 panels [N/16, K, 16]");
}

}  // namespace

// `zmm`: the AVX-512 form where it is built and chosen (False: the AVX2 form; the same bits either way)
torch::Tensor small_linear(torch::Tensor x, torch::Tensor panels, bool zmm = true) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "a contiguous float32 [M, K] input");
  check_panels(panels);
  const int64_t M = x.size(0), K = x.size(1), NB = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "input features do not match the weight's");
  TORCH_CHECK(M >= 1, "at least one row");
  auto y = torch::empty({M, NB * 16}, x.options());
  const bool bf16 = panels.scalar_type() == torch::kBFloat16;
  panel_product(x.data_ptr<float>(), bf16 ? nullptr : panels.data_ptr<float>(),
                bf16 ? panels.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<float>(), M, K, NB, zmm);
  return y;
}

// ---------------------------------------------------------------------------
// The small per-layer ops of a float32 model on CPU, each one call instead of
// the 3-12 torch ops (and their dispatch) of `TorchKernels`: at the decode
// steps of small batches those ops, not the products, made most of a layer's
// time. Same math as the torch path, in float32 (sums may round in another
// order).

namespace {

inline float row_rsqrt_mean_sq(const float* x, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  return 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
}

void check_rows(const torch::Tensor& x, const char* what, at::ScalarType dtype = torch::kFloat32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.stride(1) == 1, what, ": a ",
              dtype == torch::kFloat32 ? "float32" : "bfloat16", " [T, H] tensor with unit column stride");
}

// rows per task: at least ~32K elements of work, so a small batch is not split across threads for nothing
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

}  // namespace

namespace {

// o = w * x * rsqrt(mean(x^2) + eps), per row (rows xs and os elements apart; o may be x)
void rmsnorm_rows(const float* xp, int64_t xs, const float* wp, float* op, int64_t os, int64_t T, int64_t H,
                  float eps) {
  at::parallel_for(0, T, row_grain(H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xr = xp + t * xs;
      const float r = row_rsqrt_mean_sq(xr, H, eps);
      float* o = op + t * os;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * (xr[i] * r);
    }
  });
}

// residual += x; x = rmsnorm(residual) * w, per row, in place
void add_rmsnorm_rows(float* xp, int64_t xs, float* rp, int64_t rs, const float* wp, int64_t T, int64_t H,
                      float eps) {
  at::parallel_for(0, T, row_grain(H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = xp + t * xs;
      float* rr = rp + t * rs;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) rr[i] += xr[i];
      const float r = row_rsqrt_mean_sq(rr, H, eps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) xr[i] = wp[i] * (rr[i] * r);
    }
  });
}

void check_norm_weight(const torch::Tensor& w, int64_t H, const char* what) {
  TORCH_CHECK(w.numel() == H && w.is_contiguous() && w.scalar_type() == torch::kFloat32, what,
              ": a float32 [H] weight");
}

}  // namespace

// out = w * x * rsqrt(mean(x^2) + eps), per row
torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "rmsnorm");
  const int64_t T = x.size(0), H = x.size(1);
  check_norm_weight(w, H, "rmsnorm");
  auto out = torch::empty({T, H}, x.options());
  rmsnorm_rows(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), out.data_ptr<float>(), H, T, H,
               static_cast<float>(eps));
  return out;
}

// residual += x; x = rmsnorm(residual) * w, in place (both [T, H], contiguous rows)
void add_rmsnorm_(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_rows(x, "add_rmsnorm_");
  check_rows(residual, "add_rmsnorm_");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(residual.size(0) == T && residual.size(1) == H, "add_rmsnorm_: x and residual differ in shape");
  check_norm_weight(w, H, "add_rmsnorm_");
  add_rmsnorm_rows(x.data_ptr<float>(), x.stride(0), residual.data_ptr<float>(), residual.stride(0),
                   w.data_ptr<float>(), T, H, static_cast<float>(eps));
}

namespace {

// Rotate-half rotary embedding in place of Hq heads at q and Hk at k per token (rows qs and ks elements
// apart, each head D contiguous values), from float32 cos/sin tables [P, D] at `pos` [T].
void rope_rows(float* qp, int64_t qs, int64_t Hq, float* kp, int64_t ks, int64_t Hk, const int64_t* pos,
               const float* cp, const float* sp, int64_t P, int64_t T, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rope_neox_: position out of the table");
  auto rotate = [&](float* x, const float* c, const float* s) {
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c[i] + (-x2) * s[i];
      x[i + half] = x2 * c[i + half] + x1 * s[i + half];
    }
  };
  at::parallel_for(0, T, row_grain((Hq + Hk) * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      for (int64_t h = 0; h < Hq; ++h) rotate(qp + t * qs + h * D, c, s);
      for (int64_t h = 0; h < Hk; ++h) rotate(kp + t * ks + h * D, c, s);
    }
  });
}

void check_rope_tables(const torch::Tensor& cos, const torch::Tensor& sin, int64_t D) {
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == D && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  sin.sizes() == cos.sizes(),
              "rope_neox_: float32 cos/sin tables [P, D]");
}

// k_buf[slots[t]] = the row at k + t * ks, v_buf likewise (rows of `bytes` bytes; strides in bytes)
void store_kv_rows(char* kb, char* vb, int64_t S, int64_t bytes, const int64_t* sl, const char* kp, int64_t ks,
                   const char* vp, int64_t vs, int64_t T) {
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "store_kv: slot out of the pool");
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kb + sl[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vb + sl[t] * bytes, vp + t * vs, bytes);
  }
}

}  // namespace

// Neox-style (rotate-half) rotary embedding of q [T, Hq * D] and k [T, Hkv * D]
// in place, from float32 cos/sin tables [P, D] at `positions` [T].
void rope_neox_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                int64_t head_dim) {
  check_rows(q, "rope_neox_ q");
  check_rows(k, "rope_neox_ k");
  const int64_t T = q.size(0), D = head_dim;
  TORCH_CHECK(D % 2 == 0 && q.size(1) % D == 0 && k.size(1) % D == 0 && k.size(0) == T,
              "rope_neox_: q and k rows must hold whole heads");
  TORCH_CHECK(positions.numel() == T && positions.scalar_type() == torch::kInt64 && positions.is_contiguous(),
              "rope_neox_: int64 positions [T]");
  check_rope_tables(cos, sin, D);
  rope_rows(q.data_ptr<float>(), q.stride(0), q.size(1) / D, k.data_ptr<float>(), k.stride(0), k.size(1) / D,
            positions.data_ptr<int64_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0), T, D);
}

// float32 -> bfloat16 bits, round to nearest even (as c10::BFloat16 and torch's casts do; a NaN stays a NaN)
static inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((b & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : r);  // (a select: vectorizes)
}
static inline float as_f32(float v) { return v; }
static inline float as_f32(uint16_t h) { return bf16_bits_to_f32(h); }
static inline void put_f32(float v, float* o) { *o = v; }
static inline void put_f32(float v, uint16_t* o) { *o = f32_to_bf16_bits(v); }

// x [T, 2I] (gate, up) -> silu(gate) * up [T, I] in float32 math, each output rounded once to E: float,
// or uint16_t holding bfloat16 bits
template <typename E>
void silu_and_mul_rows(const E* xp, E* op, int64_t T, int64_t I, int64_t xs) {
  at::parallel_for(0, T, row_grain(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const E* g = xp + t * xs;
      const E* u = g + I;
      E* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float gf = as_f32(g[i]);
        put_f32(gf / (1.f + vec_expf(-gf)) * as_f32(u[i]), o + i);
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: an even width");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1) / 2, x.stride(0));
  return out;
}

// silu_and_mul on a bfloat16 [T, 2I] (a bf16 product's output) into a bfloat16 [T, I] (the next bf16
// product's input): the same float32 math, rounded once, so it equals silu_and_mul(x.float()).bfloat16()
// bit for bit, without the two casts around it.
torch::Tensor silu_and_mul_bf16(torch::Tensor x) {
  check_rows(x, "silu_and_mul_bf16", torch::kBFloat16);
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul_bf16: an even width");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_and_mul_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                    reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), x.size(0), x.size(1) / 2, x.stride(0));
  return out;
}

// k_buf[slots[t]] = k[t], v_buf[slots[t]] = v[t]: this step's K/V into the pool
// ([S, Hkv, D] buffers; k and v [T, Hkv, D] in the buffers' dtype, rows of any
// stride, each row's heads contiguous), one call instead of two index_copy_.
void store_kv(torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes() && k_buf.dim() == 3,
              "store_kv: contiguous [S, Hkv, D] buffers");
  TORCH_CHECK(k.scalar_type() == k_buf.scalar_type() && v.scalar_type() == k_buf.scalar_type(),
              "store_kv: k and v in the buffers' dtype");
  const int64_t T = k.size(0), row = k_buf.size(1) * k_buf.size(2), S = k_buf.size(0);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) * k.size(2) == row && v.size(1) * v.size(2) == row &&
                  v.size(0) == T && k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2),
              "store_kv: k and v [T, Hkv, D] with contiguous heads");
  TORCH_CHECK(slots.numel() == T && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "store_kv: int64 slots [T]");
  store_kv_rows(static_cast<char*>(k_buf.data_ptr()), static_cast<char*>(v_buf.data_ptr()), S,
                row * k_buf.element_size(), slots.data_ptr<int64_t>(), static_cast<const char*>(k.data_ptr()),
                k.stride(0) * k.element_size(), static_cast<const char*>(v.data_ptr()),
                v.stride(0) * v.element_size(), T);
}

// ---------------------------------------------------------------------------
// A whole forward pass of a float32 Llama-family model over a few (SMALL_M)
// decode-shaped tokens (the decode and verify steps of small batches, and a
// draft model's steps) in one call: the ops above in the order of
// `LlamaForCausalLM.forward_planned` with `CpuKernels`, so the result is the
// same bit for bit, without the Python and dispatch between them, which at
// these sizes cost more than the arithmetic. The ops run on raw rows in one
// scratch buffer kept by the thread (no tensor made or op dispatched between
// them: on the 2-core Xeon, ATen's dispatch and the allocator took ~40% of a
// draft model's step at one token, 2 layers of 128 wide).
//
// layers: per layer, 12 tensors in this order (an empty tensor for an absent
// one): input norm, qkv panels, qkv bias, q norm, k norm, o panels, o bias,
// post-attention norm, gate_up panels, gate_up bias, down panels, down bias.

namespace {

// A product's weight: its panels (float32 or bfloat16) and bias (null: none)
struct PanelWeight {
  const float* wf = nullptr;
  const at::BFloat16* wb = nullptr;
  const float* bias = nullptr;
  int64_t K = 0, N = 0;
};

PanelWeight panel_weight(const torch::Tensor& panels, const torch::Tensor& bias, int64_t K, const char* what) {
  check_panels(panels);
  TORCH_CHECK(panels.size(1) == K, what, ": input features do not match the weight's");
  PanelWeight w;
  w.K = K;
  w.N = panels.size(0) * 16;
  if (panels.scalar_type() == torch::kBFloat16)
    w.wb = panels.data_ptr<at::BFloat16>();
  else
    w.wf = panels.data_ptr<float>();
  if (bias.numel()) {
    TORCH_CHECK(bias.numel() == w.N && bias.is_contiguous() && bias.scalar_type() == torch::kFloat32, what,
                ": a float32 bias [N]");
    w.bias = bias.data_ptr<float>();
  }
  return w;
}

// y [M, N] = x [M, K] . W^T (+ bias), as `small_linear` then `add_`: the same bits
void apply(const PanelWeight& w, const float* x, float* y, int64_t M) {
  panel_product(x, w.wf, w.wb, y, M, w.K, w.N / 16, true);
  if (w.bias != nullptr)
    for (int64_t t = 0; t < M; ++t) {
      float* yr = y + t * w.N;
#pragma omp simd
      for (int64_t i = 0; i < w.N; ++i) yr[i] += w.bias[i];
    }
}

struct LayerWeights {
  const float* in_norm;
  PanelWeight qkv, o, gate_up, down;
  const float* q_norm;  // null: no q/k norm
  const float* k_norm;
  const float* post_norm;
  float* k_pool;
  float* v_pool;
};

// The arguments of `decode_forward` after the batch's, checked and as raw pointers
struct ModelWeights {
  int64_t H, vocab, Hq, Hkv, D, I, slots, positions;
  const float* embed;
  std::vector<LayerWeights> layers;
  const float* cos;
  const float* sin;
  const float* final_norm;
  PanelWeight head;
  float eps, scale;
};

ModelWeights model_weights(const torch::Tensor& embed, const std::vector<torch::Tensor>& layers,
                           const std::vector<torch::Tensor>& k_bufs, const std::vector<torch::Tensor>& v_bufs,
                           const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& final_norm,
                           const torch::Tensor& head_panels, const torch::Tensor& head_bias, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double eps, double scale) {
  constexpr size_t kPer = 12;
  const size_t L = k_bufs.size();
  TORCH_CHECK(L >= 1 && layers.size() == kPer * L && v_bufs.size() == L,
              "decode_forward: at least one layer, 12 tensors and a K/V pair per layer");
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous() && embed.scalar_type() == torch::kFloat32,
              "decode_forward: a float32 [V, H] embedding");
  TORCH_CHECK(num_heads >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0 && head_dim >= 2 &&
                  head_dim % 2 == 0,
              "decode_forward: query heads a multiple of KV heads, an even head_dim");
  ModelWeights m;
  m.H = embed.size(1);
  m.vocab = embed.size(0);
  m.Hq = num_heads;
  m.Hkv = num_kv_heads;
  m.D = head_dim;
  m.embed = embed.data_ptr<float>();
  m.eps = static_cast<float>(eps);
  m.scale = static_cast<float>(scale);
  const int64_t H = m.H, Q = m.Hq * m.D, KV = m.Hkv * m.D;
  check_rope_tables(cos, sin, m.D);
  m.cos = cos.data_ptr<float>();
  m.sin = sin.data_ptr<float>();
  m.positions = cos.size(0);
  check_norm_weight(final_norm, H, "decode_forward final norm");
  m.final_norm = final_norm.data_ptr<float>();
  m.head = panel_weight(head_panels, head_bias, H, "decode_forward head");
  m.I = 0;
  m.slots = k_bufs[0].size(0);
  m.layers.reserve(L);
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* w = layers.data() + kPer * l;
    LayerWeights lw;
    check_norm_weight(w[0], H, "decode_forward input norm");
    check_norm_weight(w[7], H, "decode_forward post-attention norm");
    lw.in_norm = w[0].data_ptr<float>();
    lw.post_norm = w[7].data_ptr<float>();
    lw.qkv = panel_weight(w[1], w[2], H, "decode_forward qkv");
    TORCH_CHECK(lw.qkv.N == Q + 2 * KV, "decode_forward: qkv's width is not q + k + v");
    lw.q_norm = lw.k_norm = nullptr;
    if (w[3].numel()) {
      check_norm_weight(w[3], m.D, "decode_forward q norm");
      check_norm_weight(w[4], m.D, "decode_forward k norm");
      lw.q_norm = w[3].data_ptr<float>();
      lw.k_norm = w[4].data_ptr<float>();
    }
    lw.o = panel_weight(w[5], w[6], Q, "decode_forward o");
    TORCH_CHECK(lw.o.N == H, "decode_forward: o's width is not the hidden size");
    lw.gate_up = panel_weight(w[8], w[9], H, "decode_forward gate_up");
    TORCH_CHECK(lw.gate_up.N % 2 == 0 && (l == 0 || lw.gate_up.N / 2 == m.I),
                "decode_forward: an even gate_up width, the same in every layer");
    m.I = lw.gate_up.N / 2;
    lw.down = panel_weight(w[10], w[11], m.I, "decode_forward down");
    TORCH_CHECK(lw.down.N == H, "decode_forward: down's width is not the hidden size");
    const torch::Tensor& kb = k_bufs[l];
    const torch::Tensor& vb = v_bufs[l];
    TORCH_CHECK(kb.dim() == 3 && kb.is_contiguous() && vb.is_contiguous() && kb.sizes() == vb.sizes() &&
                    kb.scalar_type() == torch::kFloat32 && vb.scalar_type() == torch::kFloat32 &&
                    kb.size(0) == m.slots && kb.size(1) == m.Hkv && kb.size(2) == m.D,
                "decode_forward: float32 [S, Hkv, D] K/V pools, alike in every layer");
    lw.k_pool = kb.data_ptr<float>();
    lw.v_pool = vb.data_ptr<float>();
    m.layers.push_back(lw);
  }
  return m;
}

// A req->token table, as raw rows
struct TokenTable {
  const int64_t* data;
  int64_t rows, cols, stride;
};

TokenTable token_table(const torch::Tensor& table) {
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.dim() == 2 && table.is_contiguous(),
              "a contiguous int64 req->token table");
  return {table.data_ptr<int64_t>(), table.size(0), table.size(1), table.stride(0)};
}

inline float* take(float*& p, int64_t n) {
  float* r = p;
  p += (n + 15) / 16 * 16;  // each buffer 64-byte aligned after the first
  return r;
}

// The forward over T decode-shaped tokens (ids, positions, the slots their K/V go to, their table rows and
// context lengths) into logits [NL, V] at the tokens `li`.
void forward_rows(const ModelWeights& m, const TokenTable& tab, const int64_t* ids, const int64_t* pos,
                  const int64_t* out_slots, const int64_t* rows, const int64_t* lens, int64_t T, const int64_t* li,
                  int64_t NL, float* logits) {
  TORCH_CHECK(T >= 1, "decode_forward: at least one token");
  const int64_t H = m.H, Q = m.Hq * m.D, KV = m.Hkv * m.D, QKV = Q + 2 * KV, I = m.I, D = m.D;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ids[t] >= 0 && ids[t] < m.vocab, "decode_forward: token id out of the embedding");
    TORCH_CHECK(rows[t] >= 0 && rows[t] < tab.rows && lens[t] >= 1 && lens[t] <= tab.cols,
                "decode_forward: a token's table row or context length out of the table");
  }
  for (int64_t j = 0; j < NL; ++j) TORCH_CHECK(li[j] >= 0 && li[j] < T, "decode_forward: logits index out of range");
  const int64_t need = 16 * 9 + 3 * T * H + T * QKV + T * Q + 3 * T * I + 2 * NL * H;
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  float* p = scratch.data();
  float* res = take(p, T * H);
  float* hb = take(p, T * H);
  float* xb = take(p, T * H);
  float* qkv = take(p, T * QKV);
  float* ob = take(p, T * Q);
  float* gu = take(p, 2 * T * I);
  float* act = take(p, T * I);
  float* xl = take(p, NL * H);
  float* rl = take(p, NL * H);
  for (int64_t t = 0; t < T; ++t) std::memcpy(res + t * H, m.embed + ids[t] * H, H * sizeof(float));
  const float eps = m.eps;
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const LayerWeights& w = m.layers[l];
    const float* h;
    if (l == 0) {
      rmsnorm_rows(res, H, w.in_norm, hb, H, T, H, eps);
      h = hb;
    } else {
      add_rmsnorm_rows(xb, H, res, H, w.in_norm, T, H, eps);
      h = xb;
    }
    apply(w.qkv, h, qkv, T);
    float* q = qkv;
    float* k = qkv + Q;
    float* v = qkv + Q + KV;
    if (w.q_norm != nullptr)  // q/k norm per head, before rotary
      for (int64_t t = 0; t < T; ++t) {
        rmsnorm_rows(q + t * QKV, D, w.q_norm, q + t * QKV, D, m.Hq, D, eps);
        rmsnorm_rows(k + t * QKV, D, w.k_norm, k + t * QKV, D, m.Hkv, D, eps);
      }
    rope_rows(q, QKV, m.Hq, k, QKV, m.Hkv, pos, m.cos, m.sin, m.positions, T, D);
    store_kv_rows(reinterpret_cast<char*>(w.k_pool), reinterpret_cast<char*>(w.v_pool), m.slots,
                  KV * sizeof(float), out_slots, reinterpret_cast<const char*>(k), QKV * sizeof(float),
                  reinterpret_cast<const char*>(v), QKV * sizeof(float), T);
    paged_decode_rows(q, QKV, w.k_pool, w.v_pool, tab.data, tab.stride, rows, lens, ob, T, m.Hq, m.Hkv, D, m.scale);
    apply(w.o, ob, xb, T);
    add_rmsnorm_rows(xb, H, res, H, w.post_norm, T, H, eps);
    apply(w.gate_up, xb, gu, T);
    silu_and_mul_rows(gu, act, T, I, 2 * I);
    apply(w.down, act, xb, T);
  }
  for (int64_t j = 0; j < NL; ++j) {
    std::memcpy(xl + j * H, xb + li[j] * H, H * sizeof(float));
    std::memcpy(rl + j * H, res + li[j] * H, H * sizeof(float));
  }
  add_rmsnorm_rows(xl, H, rl, H, m.final_norm, NL, H, eps);
  apply(m.head, xl, logits, NL);
}

void check_indices(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.numel() == n, what);
}

}  // namespace

torch::Tensor decode_forward(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor out_slots,
                             torch::Tensor table, torch::Tensor rows, torch::Tensor lens,
                             torch::Tensor logits_indices, torch::Tensor embed, std::vector<torch::Tensor> layers,
                             std::vector<torch::Tensor> k_bufs, std::vector<torch::Tensor> v_bufs, torch::Tensor cos,
                             torch::Tensor sin, torch::Tensor final_norm, torch::Tensor head_panels,
                             torch::Tensor head_bias, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                             double eps, double scale) {
  const ModelWeights m = model_weights(embed, layers, k_bufs, v_bufs, cos, sin, final_norm, head_panels, head_bias,
                                       num_heads, num_kv_heads, head_dim, eps, scale);
  const int64_t T = input_ids.numel(), NL = logits_indices.numel();
  for (auto* t : {&input_ids, &positions, &out_slots, &rows, &lens})
    check_indices(*t, T, "decode_forward: contiguous int64 ids, positions, slots, rows and lengths, one per token");
  check_indices(logits_indices, NL, "decode_forward: contiguous int64 logits indices");
  auto logits = torch::empty({NL, m.head.N}, embed.options());
  forward_rows(m, token_table(table), input_ids.data_ptr<int64_t>(), positions.data_ptr<int64_t>(),
               out_slots.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), T,
               logits_indices.data_ptr<int64_t>(), NL, logits.data_ptr<float>());
  return logits;
}

// ---------------------------------------------------------------------------
// A draft model's greedy steps in one call. The first forward runs the given
// decode-shaped tokens (each row's catch-up entry: the tokens from its first
// position without draft KV up to its pending token) exactly as
// `decode_forward`; each row's next token is the argmax of its logits (the
// first maximum, a NaN counting as the maximum: numpy's rule, which
// `argmax_rows` uses), fed back as the one token of the next forward, at the
// next position, into the slot the req->token table holds for it, until the
// row has drafted `steps[r]` tokens. Every slot written is marked in `valid`
// (the draft's KV-written bitmap). Returns the drafted tokens [R, max(steps)]
// (-1 past a row's steps). Same forwards and argmax as the Python loop, so the
// same tokens, without the Python between the steps. With a head over part of
// the vocabulary (the speculative token map), `vocab_map` gives each of its
// columns' token ids, in ascending order, so the first maximum is the one the
// Python loop's masked argmax takes.

namespace {

int64_t first_argmax(const float* x, int64_t V) {
  int64_t best = 0;
  float bv = x[0];
  if (std::isnan(bv)) return 0;
  for (int64_t i = 1; i < V; ++i) {
    const float v = x[i];
    if (std::isnan(v)) return i;
    if (v > bv) {
      bv = v;
      best = i;
    }
  }
  return best;
}

}  // namespace

// For each row r, the first position p < ends[r] whose slot (table[rows[r], p])
// is not marked in `valid` (a draft model's KV-written map): where the row's
// draft catch-up starts. ends[r] - 1 when every position is marked.
torch::Tensor first_unmarked(torch::Tensor valid, torch::Tensor table, torch::Tensor rows, torch::Tensor ends) {
  TORCH_CHECK(valid.scalar_type() == torch::kBool && valid.is_contiguous(), "first_unmarked: a bool map");
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.dim() == 2 && table.stride(1) == 1,
              "first_unmarked: an int64 req->token table");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && ends.scalar_type() == torch::kInt64 && rows.is_contiguous() &&
                  ends.is_contiguous() && rows.numel() == ends.numel(),
              "first_unmarked: int64 rows and ends, one each per row");
  const int64_t R = rows.numel(), S = valid.numel(), ts = table.stride(0);
  const bool* v = valid.data_ptr<bool>();
  const int64_t* tab = table.data_ptr<int64_t>();
  const int64_t* rw = rows.data_ptr<int64_t>();
  const int64_t* en = ends.data_ptr<int64_t>();
  auto out = torch::empty({R}, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(rw[r] >= 0 && rw[r] < table.size(0) && en[r] >= 1 && en[r] <= table.size(1),
                "first_unmarked: a row's positions out of the table");
    const int64_t* slots = tab + rw[r] * ts;
    int64_t p = 0;
    for (; p < en[r]; ++p) {
      TORCH_CHECK(slots[p] >= 0 && slots[p] < S, "first_unmarked: slot out of the map");
      if (!v[slots[p]]) break;
    }
    o[r] = std::min(p, en[r] - 1);
  }
  return out;
}

torch::Tensor greedy_draft_steps(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor tok_rows,
                                 torch::Tensor last, torch::Tensor steps, torch::Tensor table, torch::Tensor valid,
                                 torch::Tensor embed, std::vector<torch::Tensor> layers,
                                 std::vector<torch::Tensor> k_bufs, std::vector<torch::Tensor> v_bufs,
                                 torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm,
                                 torch::Tensor head_panels, torch::Tensor head_bias, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
                                 torch::Tensor vocab_map) {
  const int64_t T = input_ids.numel(), R = last.numel();
  TORCH_CHECK(T >= 1 && R >= 1 && positions.numel() == T && tok_rows.numel() == T && steps.numel() == R,
              "greedy_draft_steps: tokens, their positions and rows; one last index and step count per row");
  for (auto* t : {&input_ids, &positions, &tok_rows, &last, &steps})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "greedy_draft_steps: contiguous int64 indices");
  TORCH_CHECK(valid.scalar_type() == torch::kBool && valid.is_contiguous(), "greedy_draft_steps: a bool valid map");
  const ModelWeights m = model_weights(embed, layers, k_bufs, v_bufs, cos, sin, final_norm, head_panels, head_bias,
                                       num_heads, num_kv_heads, head_dim, eps, scale);
  const TokenTable tab = token_table(table);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* trow = tok_rows.data_ptr<int64_t>();
  const int64_t* lst = last.data_ptr<int64_t>();
  const int64_t* st = steps.data_ptr<int64_t>();
  const int64_t S = valid.numel();
  bool* vmap = valid.data_ptr<bool>();
  int64_t max_steps = 0;
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(st[r] >= 1 && lst[r] >= 0 && lst[r] < T, "greedy_draft_steps: a row's steps and last index");
    max_steps = std::max(max_steps, st[r]);
  }
  auto slot_of = [&](int64_t row, int64_t p) {
    TORCH_CHECK(row >= 0 && row < tab.rows && p >= 0 && p < tab.cols, "greedy_draft_steps: position out of the table");
    const int64_t s = tab.data[row * tab.stride + p];
    TORCH_CHECK(s >= 0 && s < S, "greedy_draft_steps: slot out of the pool");
    return s;
  };
  auto out = torch::full({R, max_steps}, -1, torch::kInt64);
  int64_t* o = out.data_ptr<int64_t>();
  // first forward: the entries as given
  const int64_t* in_ids = input_ids.data_ptr<int64_t>();
  std::vector<int64_t> ids(in_ids, in_ids + T), p_t(pos, pos + T), rows_t(trow, trow + T), li(lst, lst + R);
  std::vector<int64_t> slots(T), lens(T);
  for (int64_t t = 0; t < T; ++t) {
    slots[t] = slot_of(trow[t], pos[t]);
    lens[t] = pos[t] + 1;
  }
  std::vector<int64_t> row_of(R), next_pos(R), active(R);
  for (int64_t r = 0; r < R; ++r) {
    row_of[r] = trow[lst[r]];
    next_pos[r] = pos[lst[r]] + 1;
    active[r] = r;
  }
  const int64_t V = m.head.N;
  // a head over some of the vocabulary (`vocab_map`: the token id of each of its columns; empty: all of it)
  const int64_t* vmap_ids = nullptr;
  if (vocab_map.numel()) {
    TORCH_CHECK(vocab_map.scalar_type() == torch::kInt64 && vocab_map.is_contiguous() && vocab_map.numel() == V,
                "greedy_draft_steps: an int64 vocab map, a token id per column of the head");
    vmap_ids = vocab_map.data_ptr<int64_t>();
  }
  std::vector<float> logits(R * V);
  std::vector<int64_t> tok(R), still;
  for (int64_t step = 0; step < max_steps; ++step) {
    const int64_t n = static_cast<int64_t>(ids.size()), A = static_cast<int64_t>(active.size());
    for (int64_t t = 0; t < n; ++t) vmap[slots[t]] = true;
    forward_rows(m, tab, ids.data(), p_t.data(), slots.data(), rows_t.data(), lens.data(), n, li.data(), A,
                 logits.data());
    still.clear();
    for (int64_t j = 0; j < A; ++j) {
      tok[j] = first_argmax(logits.data() + j * V, V);
      if (vmap_ids != nullptr) tok[j] = vmap_ids[tok[j]];
      o[active[j] * max_steps + step] = tok[j];
      if (st[active[j]] > step + 1) still.push_back(j);
    }
    if (still.empty()) break;
    const int64_t mm = static_cast<int64_t>(still.size());
    ids.resize(mm);
    p_t.resize(mm);
    rows_t.resize(mm);
    slots.resize(mm);
    lens.resize(mm);
    li.resize(mm);
    std::vector<int64_t> next_active(mm);
    for (int64_t i = 0; i < mm; ++i) {
      const int64_t j = still[i], r = active[j];
      const int64_t p = next_pos[r] + step;
      ids[i] = tok[j];
      p_t[i] = p;
      rows_t[i] = row_of[r];
      slots[i] = slot_of(row_of[r], p);
      lens[i] = p + 1;
      li[i] = i;
      next_active[i] = r;
    }
    active.swap(next_active);
  }
  return out;
}

// The sampler's counter-based uniform (`sampler.uniform`), the part per element: from the row's murmur3 state
// `a` (after its five words, rotated) and the column's word `k` (mixed, rotated), the last block
// (h = (a ^ k) * 5 + N, then ^ the key's length), the finalization (fmix32) and the top 23 bits as
// (x + 0.5) / 2**23, in uint32 arithmetic: bit for bit the torch path's, which spends ~20 int64 passes over
// [R, n] on it.
static inline float hash_u01(uint32_t a, uint32_t k) {
  uint32_t h = (a ^ k) * 5u + 0xE6546B64u;
  h ^= 24u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return static_cast<float>(h >> 9) * (1.0f / 8388608.0f) + (1.0f / 16777216.0f);
}

// The column words (int64 [n], 32-bit values) as uint32.
static std::vector<uint32_t> column_words(const torch::Tensor& k_col) {
  auto kc = k_col.contiguous();
  const int64_t n = kc.size(0);
  const int64_t* kp = kc.data_ptr<int64_t>();
  std::vector<uint32_t> k(n);
  for (int64_t j = 0; j < n; ++j) k[j] = static_cast<uint32_t>(kp[j]);
  return k;
}

// `hash_u01` over rows x columns: out[r, j] from h_row[r] and k_col[j] (int64 vectors of 32-bit values).
torch::Tensor hash_uniform(torch::Tensor h_row, torch::Tensor k_col) {
  TORCH_CHECK(h_row.dim() == 1 && k_col.dim() == 1 && h_row.scalar_type() == torch::kInt64 &&
                  k_col.scalar_type() == torch::kInt64 && h_row.device().is_cpu() && k_col.device().is_cpu(),
              "hash_uniform: int64 vectors on the CPU");
  auto hr = h_row.contiguous();
  const int64_t R = hr.size(0), n = k_col.size(0);
  auto out = torch::empty({R, n}, torch::kFloat32);
  const std::vector<uint32_t> k = column_words(k_col);
  const int64_t* hp = hr.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const uint32_t* kk = k.data();
  at::parallel_for(0, R, row_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint32_t a = static_cast<uint32_t>(hp[r]);
      float* o = op + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) o[j] = hash_u01(a, kk[j]);
    }
  });
  return out;
}

// log of a positive normal float (musl's logf: the argument reduced into [sqrt(2)/2, sqrt(2)], a degree-4
// polynomial in s = f / (2 + f); under 1 ulp), branch-free so that the compiler vectorizes a loop of it
static inline float logf_normal(float x) {
  uint32_t ix;
  std::memcpy(&ix, &x, 4);
  ix += 0x3f800000u - 0x3f3504f3u;
  const int k = static_cast<int>(ix >> 23) - 0x7f;
  ix = (ix & 0x007fffffu) + 0x3f3504f3u;
  float m;
  std::memcpy(&m, &ix, 4);
  const float f = m - 1.0f, s = f / (2.0f + f), z = s * s, w = z * z;
  const float R = z * (0.66666662693f + w * 0.28498786688f) + w * (0.40000972152f + w * 0.24279078841f);
  const float hfsq = 0.5f * f * f, dk = static_cast<float>(k);
  return s * (hfsq + R) + dk * 9.0580006145e-06f - hfsq + f + dk * 6.9313812256e-01f;
}

// The sampler's Gumbel-max (`Sampler._gumbel_argmax`): per row the first j maximising
// s[r, j] - log(-log(u[r, j])) over `hash_u01`'s uniforms (a NaN counting as the maximum, as torch's and
// numpy's argmax), without the [R, n] uniforms or scores: one pass over s, in blocks that vectorize.
torch::Tensor gumbel_argmax(torch::Tensor s, torch::Tensor h_row, torch::Tensor k_col) {
  TORCH_CHECK(s.dim() == 2 && s.scalar_type() == torch::kFloat32 && s.device().is_cpu() && s.stride(1) == 1,
              "gumbel_argmax: float32 [R, n] scores on the CPU, rows contiguous");
  TORCH_CHECK(h_row.dim() == 1 && k_col.dim() == 1 && h_row.scalar_type() == torch::kInt64 &&
                  k_col.scalar_type() == torch::kInt64 && h_row.size(0) == s.size(0) && k_col.size(0) == s.size(1),
              "gumbel_argmax: int64 row states [R] and column words [n]");
  auto hr = h_row.contiguous();
  const int64_t R = s.size(0), n = s.size(1), ss = s.stride(0);
  auto out = torch::zeros({R}, torch::kInt64);
  const std::vector<uint32_t> k = column_words(k_col);
  const int64_t* hp = hr.data_ptr<int64_t>();
  const float* sp0 = s.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const uint32_t* kk = k.data();
  constexpr int64_t kBlock = 512;
  at::parallel_for(0, R, row_grain(n), [&](int64_t r0, int64_t r1) {
    float buf[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      const uint32_t a = static_cast<uint32_t>(hp[r]);
      const float* sp = sp0 + r * ss;
      float best = -std::numeric_limits<float>::infinity();
      int64_t at = 0;
      bool nan = false;
      for (int64_t j0 = 0; j0 < n && !nan; j0 += kBlock) {
        const int64_t m = std::min(kBlock, n - j0);
#pragma omp simd
        for (int64_t t = 0; t < m; ++t) buf[t] = sp[j0 + t] - logf_normal(-logf_normal(hash_u01(a, kk[j0 + t])));
        for (int64_t t = 0; t < m; ++t) {
          const float v = buf[t];
          if (v > best) {
            best = v;
            at = j0 + t;
          } else if (v != v) {
            at = j0 + t;
            nan = true;
            break;
          }
        }
      }
      op[r] = at;
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("pack_panels", &pack_panels, "a float32 weight [N, K] as 16-column panels for small_linear (float32 or bfloat16)",
        py::arg("w"), py::arg("bf16") = false);
  m.def("small_linear", &small_linear, "x [M, K] . W^T from W's panels (float32, CPU; rows in blocks of kRowBlock)",
        py::arg("x"), py::arg("panels"), py::arg("zmm") = true);
  m.attr("zmm_panels") = kZmm;
  m.def("rmsnorm", &rmsnorm, "w * x * rsqrt(mean(x^2) + eps) per row (float32, CPU)");
  m.def("add_rmsnorm_", &add_rmsnorm_, "residual += x; x = rmsnorm(residual) * w, in place (float32, CPU)");
  m.def("rope_neox_", &rope_neox_, "rotate-half rotary embedding of q and k in place (float32, CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :I]) * x[:, I:] (float32, CPU)");
  m.def("silu_and_mul_bf16", &silu_and_mul_bf16, "silu(x[:, :I]) * x[:, I:] in float32, bfloat16 in and out (CPU)");
  m.def("store_kv", &store_kv, "k_buf[slots] = k, v_buf[slots] = v (CPU)");
  m.def("decode_forward", &decode_forward, "a float32 Llama forward over a few decode-shaped tokens (CPU)");
  m.def("first_unmarked", &first_unmarked, "per row, the first position whose slot is not marked in a bool map (CPU)");
  m.def("hash_uniform", &hash_uniform, "the sampler's counter-based uniforms [R, n] from row states and column words (CPU)");
  m.def("gumbel_argmax", &gumbel_argmax, "per row, argmax of s - log(-log u) over hash_uniform's uniforms (CPU)");
  m.def("greedy_draft_steps", &greedy_draft_steps, "a draft model's greedy steps, each row's argmax fed back (CPU)");
}
