// Paged decode attention for CPU: one query token per row, reading K/V straight
// from the token-slot pool through the req->token table. The torch reference
// path gathers every row's K and V into dense tensors first (one extra write and
// read of the whole context per layer); this kernel streams each slot once with
// an online softmax, which is what makes decode memory-bound rather than
// copy-bound on CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float to_f32(float x) { return x; }
inline float to_f32(at::BFloat16 x) { return static_cast<float>(x); }

// T: storage type of q, the pool and out (float or bfloat16); math is float32.
template <typename T, int D>
void decode_rows(const T* q, const T* kp, const T* vp, const int64_t* table,
                 const int64_t* rows, const int64_t* lens, T* out, int64_t B, int64_t Hq,
                 int64_t Hkv, int64_t table_stride, float scale, int64_t dyn_d) {
  const int64_t G = Hq / Hkv;
  const int64_t d = D > 0 ? D : dyn_d;
  const int64_t kv_stride = Hkv * d;  // floats per slot
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * d), m(G), l(G), qf(G * d), kf(d), vf(d);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / Hkv, h = work % Hkv;
      const T* qb = q + (b * Hq + h * G) * d;
      for (int64_t i = 0; i < G * d; ++i) qf[i] = to_f32(qb[i]);
      const int64_t* slots = table + rows[b] * table_stride;
      const int64_t n = lens[b];
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = slots[t];
        const T* kt = kp + slot * kv_stride + h * d;
        const T* vt = vp + slot * kv_stride + h * d;
        const float* k = kf.data();
        const float* v = vf.data();
        for (int64_t i = 0; i < d; ++i) {
          kf[i] = to_f32(kt[i]);
          vf[i] = to_f32(vt[i]);
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * d;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < d; ++i) dot += qg[i] * k[i];
          dot *= scale;
          float* a = acc.data() + g * d;
          if (dot > m[g]) {  // rescale what was accumulated under the old max
            const float c = std::exp(m[g] - dot);
            l[g] *= c;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) a[i] *= c;
            m[g] = dot;
          }
          const float p = std::exp(dot - m[g]);
          l[g] += p;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += p * v[i];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (b * Hq + h * G + g) * d;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        const float* a = acc.data() + g * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<T>(a[i] * inv);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
