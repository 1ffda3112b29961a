// Paged decode attention on CPU: one query token per sequence, keys and values read in place
// from the block-paged cache through each sequence's block table (no gather into a padded batch,
// no padding mask), grouped-query heads sharing each key/value row.
//
// One task per (sequence, kv head): the G query heads of the group are scaled and kept in float;
// for every cached token the key row is converted once and dotted with all G queries; softmax
// per query head (max subtracted, fast_exp); the value rows are accumulated the same way. All
// arithmetic in float32, the output rounded once to the query's dtype, like SDPA's CPU kernels.
// Two implementations of that: explicit AVX-512 for head_dim 64 and 128 (what the kernels are
// built for here), and portable loops for the rest; tests check both against gather + SDPA.
// bfloat16 rows go to a rows kernel instead (cpu_attention_rows.h): AMX tiles (amx::attend_rows,
// block size a multiple of 16) or vectors (rows::attend_vector), several rows of one
// sequence per call, for decode and prefill rows alike, so a token's attention has the same bits
// in both.

// the few ATen headers it uses, not ATen/ATen.h or torch/extension.h: a third of the compile time
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <numeric>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_amx.h"
#include "cpu_attention_rows.h"
#include "cpu_vec.h"

using shardline::Elem;
using shardline::fast_exp;

namespace {

// p[i] <- exp(p[i] - max) / sum_j exp(p[j] - max): the softmax once the maximum is known
inline void exp_normalize_(float* p, int64_t n, float max) {
  float sum = 0.f;
  SHARDLINE_SIMD_SUM(sum)
  for (int64_t i = 0; i < n; ++i) { p[i] = fast_exp(p[i] - max); sum += p[i]; }
  const float inv = 1.f / sum;
  SHARDLINE_SIMD
  for (int64_t i = 0; i < n; ++i) p[i] *= inv;
}

// rows asked for this many tokens ahead of their use: a sequence's rows are scattered in blocks
// over the cache and, after a step's weights have streamed through, mostly in memory (SmolLM2 at
// 16 sequences of ~140 tokens: 5.5 ms of attention per decode step without, 3.7 ms at 16 ahead,
// 3.5 ms at 48; the whole-sequence prefetch below alone had not moved it)
constexpr int64_t kAhead = 48;

// one cached row of d elements, into L1
template <typename T>
inline void prefetch_row(const T* r, int64_t d) {
  const char* p = reinterpret_cast<const char*>(r);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b, 0, 3);
}

// kD > 0: the head dimension known at compile time (loops fully unrolled); 0: ``d`` at run time.
// Rows are read at off[t] (each token's row, computed once per run of rows sharing a table) and
// asked for kAhead tokens early, as in the AVX-512 kernel: float32 decode on an AVX2 EPYC, 8
// sequences of the tiny model's 4 KV heads x 32, took 67 ns a token and head at 200 tokens of
// context and 133 ns at 1,000 with a table lookup per row and no prefetch; 35 and 45 ns with them
template <typename T, int64_t kD>
void attend_group(const T* q, int64_t q_head_stride, const T* k, const T* v, const int64_t* off, int64_t ctx,
                  int64_t G, int64_t d_runtime, float scale, T* out, float* qf, float* scores, float* acc,
                  float* row) {
  using E = Elem<T>;
  const int64_t d = kD > 0 ? kD : d_runtime;
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * q_head_stride;
    SHARDLINE_SIMD
    for (int64_t i = 0; i < d; ++i) qf[g * d + i] = E::load(qg + i) * scale;
  }
  for (int64_t t = 0; t < ctx; ++t) {
    const T* kr = k + off[t];
    if (t + kAhead < ctx) prefetch_row(k + off[t + kAhead], d);
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
    exp_normalize_(sc, ctx, m);
  }
  std::fill(acc, acc + G * d, 0.f);
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vr = v + off[t];
    if (t + kAhead < ctx) prefetch_row(v + off[t + kAhead], d);
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

#if defined(__AVX512F__)
// The AVX-512 path (the machine the kernels are built on has it): 16 floats per register.
// Keys: each key row is loaded once and dotted with up to kG query heads at a time; the 16-lane
// partial sums of 16 tokens are reduced together (sum16x16), not one horizontal sum per token.
// Values: kG x kC accumulators stay in registers across the whole context.

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return shardline::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// lane j of the result = the sum of the 16 lanes of v[j] (v is overwritten): pairs of vectors
// fold their even and odd lanes together, four times
inline __m512 sum16x16(__m512* v) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int n = 8; n >= 1; n /= 2)
    for (int j = 0; j < n; ++j)
      v[j] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * j], even, v[2 * j + 1]),
                           _mm512_permutex2var_ps(v[2 * j], odd, v[2 * j + 1]));
  return v[0];
}

// scores[g][t] = scale * q_g . k_t for kG heads; kC = d / 16
template <typename T, int kC, int kG>
void head_scores(const T* q, int64_t q_head_stride, const T* k, const int64_t* off, int64_t ctx, float scale,
                 float* scores, int64_t sc_stride) {
  __m512 qv[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) qv[g][c] = _mm512_mul_ps(load16(q + g * q_head_stride + 16 * c), _mm512_set1_ps(scale));
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    __m512 part[kG][16];
    const int64_t n = std::min<int64_t>(16, ctx - t0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        for (int g = 0; g < kG; ++g) part[g][j] = _mm512_setzero_ps();
        continue;
      }
      const T* kr = k + off[t0 + j];
      if (t0 + j + kAhead < ctx) {
        const char* ahead = reinterpret_cast<const char*>(k + off[t0 + j + kAhead]);
        _mm_prefetch(ahead, _MM_HINT_T0);
        if (sizeof(T) * 16 * kC > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      }
      __m512 kv[kC];
      for (int c = 0; c < kC; ++c) kv[c] = load16(kr + 16 * c);
      for (int g = 0; g < kG; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < kC; ++c) acc = _mm512_fmadd_ps(qv[g][c], kv[c], acc);
        part[g][j] = acc;
      }
    }
    for (int g = 0; g < kG; ++g) _mm512_storeu_ps(scores + g * sc_stride + t0, sum16x16(part[g]));
  }
}

// out_g = sum_t p[g][t] v_t for kG heads, p already normalised
template <typename T, int kC, int kG>
void head_values(const T* v, const int64_t* off, int64_t ctx, const float* p, int64_t p_stride, T* out) {
  __m512 acc[kG][kC];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vr = v + off[t];
    if (t + kAhead < ctx) {
      const char* ahead = reinterpret_cast<const char*>(v + off[t + kAhead]);
      _mm_prefetch(ahead, _MM_HINT_T0);
      if (sizeof(T) * 16 * kC > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    __m512 vv[kC];
    for (int c = 0; c < kC; ++c) vv[c] = load16(vr + 16 * c);
    for (int g = 0; g < kG; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * p_stride + t]);
      for (int c = 0; c < kC; ++c) acc[g][c] = _mm512_fmadd_ps(pt, vv[c], acc[g][c]);
    }
  }
  alignas(64) float tmp[16];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kC; ++c) {
      _mm512_store_ps(tmp, acc[g][c]);
      SHARDLINE_SIMD
      for (int i = 0; i < 16; ++i) Elem<T>::store(out + g * 16 * kC + 16 * c + i, tmp[i]);
    }
}

// softmax in place over p[0, ctx)
inline void softmax_(float* p, int64_t ctx) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= ctx; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(p + t));
  if (t < ctx) mv = _mm512_mask_max_ps(mv, static_cast<__mmask16>((1u << (ctx - t)) - 1), mv, _mm512_loadu_ps(p + t));
  exp_normalize_(p, ctx, _mm512_reduce_max_ps(mv));
}

// f(std::integral_constant<int, n>) for n = min(count, kMaxG) in 1..kMaxG: a run-time head count
// as the compile-time one head_scores/head_values are unrolled for
template <int kMaxG, typename F>
void with_head_count(int64_t count, F&& f) {
  switch (std::min<int64_t>(kMaxG, count)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, (kMaxG >= 2 ? 2 : 1)>{}); break;
    case 3: f(std::integral_constant<int, (kMaxG >= 3 ? 3 : 1)>{}); break;
    default: f(std::integral_constant<int, kMaxG>{}); break;
  }
}

// up to kMaxG = 16 / kC heads per pass, so that q (scores) or the accumulators (values) fit in registers
template <typename T, int kC>
void attend_group_avx512(const T* q, int64_t q_head_stride, const T* k, const T* v, const int64_t* off, int64_t ctx,
                         int64_t G, float scale, T* out, float* scores) {
  constexpr int kMaxG = 16 / kC < 4 ? 16 / kC : 4;
  constexpr int64_t d = 16 * kC;
  const int64_t stride = (ctx + 15) / 16 * 16;  // head_scores writes whole groups of 16
  for (int64_t g0 = 0; g0 < G; g0 += kMaxG)
    with_head_count<kMaxG>(G - g0, [&](auto n) {
      head_scores<T, kC, decltype(n)::value>(q + g0 * q_head_stride, q_head_stride, k, off, ctx, scale,
                                             scores + g0 * stride, stride);
    });
  for (int64_t g = 0; g < G; ++g) softmax_(scores + g * stride, ctx);
  for (int64_t g0 = 0; g0 < G; g0 += kMaxG)
    with_head_count<kMaxG>(G - g0, [&](auto n) {
      head_values<T, kC, decltype(n)::value>(v, off, ctx, scores + g0 * stride, stride, out + g0 * d);
    });
}
#endif  // __AVX512F__

// Ask for a sequence's cached blocks (every KV head, keys and values) ahead of use. Blocks are
// scattered and, after a step's weights have streamed through, mostly out of cache: without
// this the kernel waits on one row at a time (measured 3x slower cold than warm).
template <typename T>
void prefetch_sequence(const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, int64_t block_size,
                       int64_t row_stride) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t t = 0, blk = 0; t < ctx; t += block_size, ++blk) {
    const int64_t base = table[blk] * block_size * row_stride, n = std::min(block_size, ctx - t) * row_stride;
    for (int64_t i = 0; i < n; i += kLine) {
      __builtin_prefetch(k_cache + base + i, 0, 2);
      __builtin_prefetch(v_cache + base + i, 0, 2);
    }
  }
}

}  // namespace

// q [B, H, d] (any row and head strides, unit element stride); caches [blocks, block_size, KV, d]
// contiguous; tables [B, >= ceil(max ctx / block_size)] int64; context_lens [B] int64 (>= 1).
// Returns [B, H, d] in q's dtype. ``vectorized`` false forces the portable loops (tests run both).
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor tables, at::Tensor context_lens, double scale, bool vectorized) {
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
  auto out = at::empty({B, H, d}, q.options());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
#if defined(__AVX512F__)
  const bool avx512 = vectorized && (d == 64 || d == 128) && q.scalar_type() != at::kDouble;
#else
  const bool avx512 = false;
#endif
  // bfloat16 rows go to a rows kernel (cpu_attention_rows.h), every row, decode or prefill, the
  // same way: on AMX tiles where the machine has them, else on vectors (AVX512-BF16, AVX2 + FMA)
  const bool bf16 = vectorized && q.scalar_type() == at::kBFloat16;
  const bool amx = bf16 && avx512 && shardline::amx::ready() && shardline::amx::attention_fits(d, block_size, G);
  const bool vector_rows = bf16 && !amx && shardline::rows::vector_fits(d, G);
  const bool grouped = amx || vector_rows;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    // Rows b and b + 1 of one sequence (a prefill's tokens, each a row over its own prefix) have
    // the same block table: the row offsets already worked out for b hold for b + 1 up to b's
    // length, and its blocks are already asked for. A 130-token prefill over 1.1k cached tokens
    // spent a third of its time redoing both for every row.
    auto same_table = [&](int64_t a, int64_t c) {
      const int64_t blocks = (std::min(lp[a], lp[c]) + block_size - 1) / block_size;
      return std::equal(tp + a * nb, tp + a * nb + blocks, tp + c * nb);
    };
    // Tasks are (group of rows, KV head). A group is one row, or for a rows kernel up to 16 / G
    // rows that read the same blocks (a prefill's tokens; decode rows sharing a cached prefix):
    // they share every key and value they read.
    std::vector<int64_t> first{0};  // group i: rows [first[i], first[i + 1])
    const int64_t per_group = grouped ? std::max<int64_t>(1, 16 / G) : 1;
    for (int64_t b = 1; b < B; ++b) {
      const int64_t start = first.back();
      bool joins = b - start < per_group;
      for (int64_t x = start; joins && x < b; ++x) joins = same_table(x, b);
      if (!joins) first.push_back(b);
    }
    first.push_back(B);
    const int64_t groups = static_cast<int64_t>(first.size()) - 1;
    auto run = [&](int64_t begin, int64_t end) {
      const int64_t padded = (max_ctx + 15) / 16 * 16;
      std::vector<float> buf(2 * G * d + d + G * padded);
      std::vector<int64_t> off(max_ctx);
      int64_t off_row = -1, off_len = 0;  // off[0, off_len) are the offsets of row off_row's table
      float *qf = buf.data(), *acc = qf + G * d, *row = acc + G * d, *scores = row + d;
      auto portable = d == 64 ? attend_group<scalar_t, 64> : d == 128 ? attend_group<scalar_t, 128>
                                                                      : attend_group<scalar_t, 0>;
      // rows kernels: each KV head's values packed as pairs, valid while the offsets they came from are
      std::vector<shardline::rows::ValuePairs> pairs(grouped ? KV : 0);
      // off[0, ctx) for row b: each token's row, once per run of rows sharing a table
      auto offsets = [&](int64_t b, int64_t ctx) {
        if (off_row == b) return;
        if (off_row < 0 || !same_table(off_row, b)) off_len = 0;
        off_len = std::min(off_len, ctx) / block_size * block_size;  // whole blocks kept
        for (auto& p : pairs) p.whole = std::min(p.whole, off_len / 32);
        for (int64_t t = off_len, blk = off_len / block_size; t < ctx; t += block_size, ++blk) {
          const int64_t base = tp[b * nb + blk] * block_size * row_stride, n = std::min(block_size, ctx - t);
          for (int64_t j = 0; j < n; ++j) off[t + j] = base + j * row_stride;
        }
        off_row = b;
        off_len = ctx;
      };
      for (int64_t task = begin; task < end; ++task) {
        const int64_t grp = task / KV, h = task % KV, b = first[grp], rows = first[grp + 1] - b;
        const int64_t longest = *std::max_element(lp + b, lp + b + rows), last = first[grp + 1] - 1;
        const int64_t ctx = lp[b];
        if (task == begin) prefetch_sequence(kc, vc, tp + b * nb, longest, block_size, row_stride);
        if (h == 0 && last + 1 < B && (grp + 1) * KV < end) {  // the next group, while this one is computed
          if (!same_table(last, last + 1))
            prefetch_sequence(kc, vc, tp + (last + 1) * nb, lp[last + 1], block_size, row_stride);
          else if (lp[last + 1] > longest)  // more of the same prefill: only what it reads beyond these rows
            prefetch_sequence(kc, vc, tp + (last + 1) * nb + longest / block_size,
                              lp[last + 1] - longest / block_size * block_size, block_size, row_stride);
        }
        const scalar_t* qh = qp + b * qs0 + h * G * qs1;
        scalar_t* oh = op + (b * H + h * G) * d;
        if (grouped) {
          using BF16 = const c10::BFloat16*;  // grouped is true for bfloat16 only
          offsets(std::find(lp + b, lp + b + rows, longest) - lp, longest);
          const auto qb = reinterpret_cast<BF16>(qh);
          const auto kb = reinterpret_cast<BF16>(kc + h * d), vb = reinterpret_cast<BF16>(vc + h * d);
          auto* ob = reinterpret_cast<c10::BFloat16*>(oh);
          const float sc = static_cast<float>(scale);
          if (amx)
            shardline::amx::attend_rows(qb, qs0, qs1, rows, G, lp + b, kb, vb, off.data(), row_stride, d, sc, ob,
                                        H * d, pairs[h]);
          else
            shardline::rows::attend_vector(qb, qs0, qs1, rows, G, lp + b, kb, vb, off.data(), d, sc, ob, H * d,
                                           pairs[h]);
          continue;
        }
        if (!avx512) {
          offsets(b, ctx);
          portable(qh, qs1, kc + h * d, vc + h * d, off.data(), ctx, G, d, static_cast<float>(scale), oh, qf, scores,
                   acc, row);
          continue;
        }
#if defined(__AVX512F__)
        if constexpr (!std::is_same_v<scalar_t, double>) {
          offsets(b, ctx);
          auto fast = d == 64 ? attend_group_avx512<scalar_t, 4> : attend_group_avx512<scalar_t, 8>;
          fast(qh, qs1, kc + h * d, vc + h * d, off.data(), ctx, G, static_cast<float>(scale), oh, scores);
        }
#endif
      }
      if (amx) shardline::amx::end();
    };
    // Tasks split between the threads by their rows, not their count: a prefill's rows are its
    // tokens, each over its own prefix, so the last half of a prompt holds three quarters of
    // the work and an even split of tasks left one thread waiting on the other.
    const int64_t tasks = groups * KV;
    std::vector<int64_t> cost(tasks + 1, 0);  // cost[i]: rows of tasks [0, i), plus 16 for each task's setup
    for (int64_t i = 0; i < tasks; ++i) {
      const int64_t grp = i / KV;
      cost[i + 1] = cost[i] + std::accumulate(lp + first[grp], lp + first[grp + 1], int64_t{16});
    }
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
    // below ~1k cached rows in all (a few tens of microseconds) waking the other threads costs more
    if (threads <= 1 || cost[tasks] < 1024 + 16 * tasks) {
      run(0, tasks);
    } else {
      auto bound = [&](int64_t t) {  // the first task of thread t's share
        return std::lower_bound(cost.begin(), cost.end(), cost[tasks] * t / threads) - cost.begin();
      };
      at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t begin = bound(t), end = t + 1 == threads ? tasks : bound(t + 1);
          if (begin < end) run(begin, end);
        }
      });
    }
  });
  return out;
}
