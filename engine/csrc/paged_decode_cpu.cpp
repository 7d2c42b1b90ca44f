// Paged decode attention for CPU: one query token per row, reading K/V straight
// from the token-slot pool through the req->token table. The torch reference
// path gathers every row's K and V into dense tensors first (one extra write and
// read of the whole context per layer); this kernel reads each slot in place,
// prefetching a few slots ahead since a row's slots are scattered over the pool.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// bf16 -> f32 is a 16-bit shift; written on raw bits so the loops vectorise.
inline void load_f32(const float* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = src[i];
}
inline void load_f32(const at::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

// T: storage type of q, the pool and out (float or bfloat16); math is float32.
// Two passes per (row, kv head): all scores first (dot products over head_dim,
// vectorised), then one max, the exponentials, and the weighted sum of V. No
// per-token rescaling branch, which is what kept the online-softmax form slow.
template <typename T, int D>
void decode_rows(const T* q, const T* kp, const T* vp, const int64_t* table,
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
      load_f32(q + (b * Hq + h * G) * d, qf.data(), G * d);
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
      // softmax per group
      for (int64_t g = 0; g < G; ++g) {
        float* s = sc.data() + g * n;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
        float l = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          s[t] = std::exp(s[t] - m);
          l += s[t];
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
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
#define CALL(TT, DD)                                                                                       \
  decode_rows<TT, DD>(q.data_ptr<TT>(), k_pool.data_ptr<TT>(), v_pool.data_ptr<TT>(),                      \
                      table.data_ptr<int64_t>(), rows_c.data_ptr<int64_t>(), lens_c.data_ptr<int64_t>(),  \
                      out.data_ptr<TT>(), B, Hq, Hkv, table.size(1), s, D)
#define DISPATCH_D(TT)        \
  if (D == 64) CALL(TT, 64);  \
  else if (D == 128) CALL(TT, 128); \
  else CALL(TT, 0);
  if (q.scalar_type() == torch::kFloat32) {
    DISPATCH_D(float)
  } else {
    DISPATCH_D(at::BFloat16)
  }
#undef DISPATCH_D
#undef CALL
  return out;
}

// ---------------------------------------------------------------------------
// Small-batch float32 linear: y[M, N] = x[M, K] . W^T for M <= 8 rows (decode
// and verify steps of small batches). W is kept in 16-column panels,
// panels[N / 16][K][16], so each panel streams from memory once while the M
// rows' 16 accumulators each stay in registers, vectorised across the
// columns. BLAS sgemm at these row counts reads W as if for a large M and
// reaches a fraction of the machine (measured on an AVX2 EPYC, 2 threads:
// 1.5-4.8x slower at the embedded model's shapes, M = 1-5).

// [N, K] -> [N / 16, K, 16]
torch::Tensor pack_panels(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "a float32 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0, "out_features must be a multiple of 16");
  return w.contiguous().view({N / 16, 16, K}).transpose(1, 2).contiguous();
}

namespace {

template <int M>
void panel_rows(const float* x, const float* panels, float* y, int64_t N, int64_t K, int64_t nb) {
  float acc[M][16] = {};
  const float* w = panels + nb * K * 16;
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * 16;
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * K + k];
#pragma omp simd
      for (int j = 0; j < 16; ++j) acc[m][j] += xv * wk[j];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 16; ++j) y[m * N + nb * 16 + j] = acc[m][j];
}

}  // namespace

torch::Tensor small_linear(torch::Tensor x, torch::Tensor panels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "a contiguous float32 [M, K] input");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == 16 && panels.is_contiguous(), "packed panels [N/16, K, 16]");
  const int64_t M = x.size(0), K = x.size(1), NB = panels.size(0), N = NB * 16;
  TORCH_CHECK(panels.size(1) == K, "input features do not match the weight's");
  TORCH_CHECK(M >= 1 && M <= 8, "1 to 8 rows");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // about 16K multiply-adds per task at least, so a small product is not split across threads for nothing
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(16 * K * M, 1));
  at::parallel_for(0, NB, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb) {
      switch (M) {
        case 1: panel_rows<1>(xp, wp, yp, N, K, nb); break;
        case 2: panel_rows<2>(xp, wp, yp, N, K, nb); break;
        case 3: panel_rows<3>(xp, wp, yp, N, K, nb); break;
        case 4: panel_rows<4>(xp, wp, yp, N, K, nb); break;
        case 5: panel_rows<5>(xp, wp, yp, N, K, nb); break;
        case 6: panel_rows<6>(xp, wp, yp, N, K, nb); break;
        case 7: panel_rows<7>(xp, wp, yp, N, K, nb); break;
        default: panel_rows<8>(xp, wp, yp, N, K, nb); break;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("pack_panels", &pack_panels, "a float32 weight [N, K] as 16-column panels for small_linear");
  m.def("small_linear", &small_linear, "x [M <= 8, K] . W^T from W's panels (float32, CPU)");
}
