// Paged decode attention on CPU: one query token per sequence, keys and values read in place
// from the block-paged cache through each sequence's block table (no gather into a padded batch,
// no padding mask), grouped-query heads sharing each key/value row.
//
// One task per (sequence, kv head): the G query heads of the group are scaled and kept in float;
// for every cached token the key row is converted once and dotted with all G queries; softmax
// per query head (max subtracted, fast_exp); the value rows are accumulated the same way. All
// arithmetic in float32, the output rounded once to the query's dtype, like SDPA's CPU kernels.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>

#include "cpu_vec.h"

using shardline::Elem;
using shardline::fast_exp;

namespace {

// kD > 0: the head dimension known at compile time (loops fully unrolled); 0: ``d`` at run time
template <typename T, int64_t kD>
void attend_group(const T* q, int64_t q_head_stride, const T* k_cache, const T* v_cache,
                  const int64_t* table, int64_t ctx, int64_t block_size, int64_t row_stride, int64_t G,
                  int64_t d_runtime, float scale, T* out, float* qf, float* scores, float* acc, float* row) {
  using E = Elem<T>;
  const int64_t d = kD > 0 ? kD : d_runtime;
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * q_head_stride;
    SHARDLINE_SIMD
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = E::load(qg + i) * scale;
  }
  for (int64_t t = 0; t < ctx; ++t) {
    const T* kr = k_cache + (table[t / block_size] * block_size + t % block_size) * row_stride;
    SHARDLINE_SIMD
    for (int64_t i = 0; i < d; ++i) row[i] = E::load(kr + i);
    for (int64_t g = 0; g < G; ++g) {
      const float* qq = qf + g * d;
      float s = 0.f;
      SHARDLINE_SIMD_SUM(s)
      for (int64_t i = 0; i < d; ++i) s += qq[i] * row[i];
      scores[g * ctx + t] = s;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sc = scores + g * ctx;
    float m = sc[0];
    for (int64_t t = 1; t < ctx; ++t) m = sc[t] > m ? sc[t] : m;
    float sum = 0.f;
    SHARDLINE_SIMD_SUM(sum)
    for (int64_t t = 0; t < ctx; ++t) { sc[t] = fast_exp(sc[t] - m); sum += sc[t]; }
    const float inv = 1.f / sum;
    SHARDLINE_SIMD
    for (int64_t t = 0; t < ctx; ++t) sc[t] *= inv;
  }
  std::fill(acc, acc + G * d, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vr = v_cache + (table[t / block_size] * block_size + t % block_size) * row_stride;
    SHARDLINE_SIMD
    for (int64_t i = 0; i < d; ++i) row[i] = E::load(vr + i);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * ctx + t];
      float* a = acc + g * d;
      SHARDLINE_SIMD
      for (int64_t i = 0; i < d; ++i) a[i] += p * row[i];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    SHARDLINE_SIMD
    for (int64_t i = 0; i < d; ++i) E::store(out + g * d + i, acc[g * d + i]);
  }
}

}  // namespace

// q [B, H, d] (any row and head strides, unit element stride); caches [blocks, block_size, KV, d]
// contiguous; tables [B, >= ceil(max ctx / block_size)] int64; context_lens [B] int64 (>= 1).
// Returns [B, H, d] in q's dtype.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, d] with unit element stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "caches and q must share a dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "tables and context_lens must be int64");
  auto tab = tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), KV = k_cache.size(2), nb = tab.size(1);
  TORCH_CHECK(H % KV == 0 && k_cache.size(3) == d, "head counts or head_dim do not match the cache");
  TORCH_CHECK(tab.size(0) == B && lens.size(0) == B, "one block table and one length per sequence");
  const int64_t G = H / KV, row_stride = KV * d;
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t max_ctx = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= nb * block_size, "context length ", lp[b], " outside the block table");
    max_ctx = std::max(max_ctx, lp[b]);
  }
  auto out = torch::empty({B, H, d}, q.options());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // below ~1k cached rows in all (a few tens of microseconds) waking the other threads costs more
    const int64_t grain = B * KV * max_ctx < 1024 ? B * KV : 1;
    at::parallel_for(0, B * KV, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(2 * G * d + d + G * max_ctx);
      float *qf = buf.data(), *acc = qf + G * d, *row = acc + G * d, *scores = row + d;
      auto attend = d == 64 ? attend_group<scalar_t, 64> : d == 128 ? attend_group<scalar_t, 128>
                                                                    : attend_group<scalar_t, 0>;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / KV, h = task % KV;
        attend(qp + b * qs0 + h * G * qs1, qs1, kc + h * d, vc + h * d, tp + b * nb, lp[b], block_size, row_stride,
               G, d, static_cast<float>(scale), op + (b * H + h * G) * d, qf, scores, acc, row);
      }
    });
  });
  return out;
}
