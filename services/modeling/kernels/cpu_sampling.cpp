// The per-row reductions a sampler needs from a step's logits, in one pass each over the
// vocabulary: the greedy token (first index of the maximum, as torch.argmax) and
// logsumexp (max + log(sum(exp(x - max)))), from which every raw logprob follows.

// the few ATen headers it uses, not ATen/ATen.h or torch/extension.h: a third of the compile time
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <cmath>

#include "cpu_vec.h"

using shardline::Elem;
using shardline::fast_exp;

namespace {

constexpr int64_t kChunk = 256;  // the maximum is found chunk by chunk, then its first index in the chunk

template <typename T>
void reduce_row(const T* x, int64_t V, int64_t* argmax, float* lse) {
  using E = Elem<T>;
  float m = -INFINITY;
  int64_t best_chunk = 0;
  bool nan = false;
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t n = std::min(kChunk, V - c);
    float cm = -INFINITY;
    int64_t bad = 0;
    SHARDLINE_PRAGMA(omp simd reduction(max : cm) reduction(+ : bad))
    for (int64_t i = 0; i < n; ++i) {
      const float v = E::load(x + c + i);
      cm = v > cm ? v : cm;
      bad += v != v;
    }
    if (bad) {  // torch.argmax treats NaN as the maximum: the first NaN wins
      for (int64_t i = 0; i < n; ++i) {
        if (E::load(x + c + i) != E::load(x + c + i)) { *argmax = c + i; break; }
      }
      nan = true;
      break;
    }
    if (cm > m || c == 0) { m = cm; best_chunk = c; }
  }
  if (nan) { *lse = NAN; return; }
  const int64_t n = std::min(kChunk, V - best_chunk);
  *argmax = best_chunk;
  for (int64_t i = 0; i < n; ++i) {
    if (E::load(x + best_chunk + i) == m) { *argmax = best_chunk + i; break; }
  }
  if (m == -INFINITY) { *lse = -INFINITY; return; }
  double sum = 0.0;  // chunk sums in float lanes, added in double: a cascade, ~1 ulp over 10^5 terms
  for (int64_t c = 0; c < V; c += kChunk) {
    const int64_t n = std::min(kChunk, V - c);
    float part = 0.f;
    SHARDLINE_SIMD_SUM(part)
    for (int64_t i = 0; i < n; ++i) part += fast_exp(E::load(x + c + i) - m);
    sum += part;
  }
  *lse = m + static_cast<float>(std::log(sum));
}

}  // namespace

// logits [n, V] (rows contiguous) -> (argmax int64 [n], logsumexp float32 [n])
std::vector<at::Tensor> greedy_logsumexp(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [n, vocab] with contiguous rows");
  const int64_t n = logits.size(0), V = logits.size(1), rs = logits.stride(0);
  TORCH_CHECK(V > 0, "empty vocabulary");
  auto ids = at::empty({n}, logits.options().dtype(at::kLong));
  auto lse = at::empty({n}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "greedy_logsumexp", [&] {
    const scalar_t* xp = logits.data_ptr<scalar_t>();
    int64_t* ip = ids.data_ptr<int64_t>();
    float* lp = lse.data_ptr<float>();
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) reduce_row(xp + r * rs, V, ip + r, lp + r);
    });
  });
  return {ids, lse};
}

// Structured outputs: logits [n, V] float32 (rows contiguous), in place: token t of row r goes to
// -inf unless bit t of mask row r is set (masks uint8 [n, B], LSB first in each byte; tokens past
// 8 * B are not allowed)
void mask_tokens_(at::Tensor logits, at::Tensor masks) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat,
              "logits must be float32 [n, vocab] with contiguous rows");
  TORCH_CHECK(masks.dim() == 2 && masks.is_contiguous() && masks.scalar_type() == at::kByte &&
                  masks.size(0) == logits.size(0), "masks must be uint8 [n, bytes], one row per logits row");
  const int64_t n = logits.size(0), V = logits.size(1), rs = logits.stride(0), B = masks.size(1);
  float* lp = logits.data_ptr<float>();
  const uint8_t* mp = masks.data_ptr<uint8_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* x = lp + r * rs;
      const uint8_t* m = mp + r * B;
      const int64_t covered = std::min(V, 8 * B);
      for (int64_t t0 = 0; t0 < covered; t0 += 8) {  // a byte at a time: most are all-0 or all-1
        const unsigned bits = m[t0 >> 3];
        if (bits == 0xFFu) continue;
        const int64_t t1 = std::min(covered, t0 + 8);
        for (int64_t t = t0; t < t1; ++t)
          if (!((bits >> (t - t0)) & 1u)) x[t] = -INFINITY;
      }
      for (int64_t t = covered; t < V; ++t) x[t] = -INFINITY;
    }
  });
}
