// Paged attention for a few rows of one sequence on AVX512-BF16 vectors (machines without AMX):
// the contract in cpu_attention_rows.h, for every bfloat16 row, decode or prefill, on such a
// machine. Both products run on vdpbf16ps, 32 multiply-adds per instruction, twice what the
// float32 kernel in cpu_attention.cpp gets, and the rows of a prefill share every key and value
// they read, where that kernel reads and converts them per row.
//
// Scores, per 16 tokens: the keys transposed in registers into pairs of d (kp[p] lane t holds
// k[t][2p], k[t][2p + 1]), then for each query row n, d / 2 vdpbf16ps of q's pair p broadcast
// against kp[p]: lane t of the sum is row n's score for token t, summed over p in order. No
// horizontal sum, and the transposition is shared by all N rows.
// Values, per 32 tokens: the values packed as pairs of tokens (pack_values), then for each row n
// and 16 of d, 16 vdpbf16ps of its probability pair r broadcast against pair r's values, summed
// over the chunks and pairs in order.
//
// An element's order of summation depends on d alone, never on N, on which rows share the work
// or on ctx beyond the element's own (zeros past a row's context add nothing).

#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_attention_rows.h"
#include "cpu_vec.h"

namespace shardline::rows {

#if defined(SHARDLINE_AVX512) && defined(__AVX512BF16__)
namespace {

constexpr int kRowsPerPass = 8;  // query rows whose sums stay in registers while keys pass

// scores[n * stride + t] = scale * q_n . k_t, t < ctx rounded up to 16, for rows [n0, n0 + NB)
// of qw (each row's d / 2 pairs as 32-bit words); kp: the 16 tokens' keys as pairs
template <int NB, int NP>
inline void score_rows(const uint32_t (*qw)[NP], int64_t n0, const uint32_t (&kp)[NP][16], __m512 scale,
                       float* scores, int64_t stride, int64_t t0) {
  __m512 acc[NB];
  for (int n = 0; n < NB; ++n) acc[n] = _mm512_setzero_ps();
  for (int p = 0; p < NP; ++p) {
    const __m512bh kv = (__m512bh)_mm512_load_si512(kp[p]);
    for (int n = 0; n < NB; ++n)
      acc[n] = _mm512_dpbf16_ps(acc[n], (__m512bh)_mm512_set1_epi32(static_cast<int>(qw[n0 + n][p])), kv);
  }
  for (int n = 0; n < NB; ++n) _mm512_storeu_ps(scores + (n0 + n) * stride + t0, _mm512_mul_ps(acc[n], scale));
}

// f(std::integral_constant<int, n>) for n = min(count, kRowsPerPass) in 1..kRowsPerPass
template <typename F>
inline void with_rows(int64_t count, F&& f) {
  switch (std::min<int64_t>(count, kRowsPerPass)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// phase 1: scores[n * stride + t] for t < ctx rounded up to 16; NP = d / 2
template <int NP>
void scores_phase(const uint16_t* q, int64_t q_row_stride, int64_t q_head_stride, int64_t G, int64_t N,
                  const uint16_t* k, const int64_t* off, int64_t ctx, float scale, float* scores, int64_t stride) {
  alignas(64) uint32_t qw[16][NP];
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(qw[n], q + (n / G) * q_row_stride + (n % G) * q_head_stride, NP * sizeof(uint32_t));
  alignas(64) uint32_t kp[NP][16];
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    if (t0 + 32 < ctx) prefetch_rows(k, off, t0 + 32, std::min(ctx, t0 + 48), NP / 16);
    const int64_t n_tok = std::min<int64_t>(16, ctx - t0);
    for (int c = 0; c < NP; c += 16) {  // 16 pairs of the 16 tokens at a time
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < n_tok ? _mm512_loadu_ps(k + off[t0 + i] + 2 * c) : _mm512_setzero_ps();
      transpose16(r);  // r[p]: pair c + p of each token
      for (int p = 0; p < 16; ++p) _mm512_store_ps(reinterpret_cast<float*>(kp[c + p]), r[p]);
    }
    for (int64_t n0 = 0; n0 < N; n0 += kRowsPerPass)
      with_rows(N - n0, [&](auto nb) { score_rows<decltype(nb)::value, NP>(qw, n0, kp, s, scores, stride, t0); });
  }
}

// out[n] for rows [n0, n0 + NB), the 64 of d from d0: inv[n] * sum over chunks and token pairs of
// p[n] pair . v pair. vp(c): chunk c's values (4 groups of 16 of d, 16 pairs each)
template <int NB, typename Values>
inline void value_rows(const uint16_t* probs, int64_t width, const float* inv, int64_t n0, int64_t G, int64_t chunks,
                       int64_t d0, int64_t d, Values&& vp, c10::BFloat16* out, int64_t out_row_stride) {
  __m512 acc[NB][4];
  for (int n = 0; n < NB; ++n)
    for (int j = 0; j < 4; ++j) acc[n][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* v = vp(c);
    for (int r = 0; r < 16; ++r) {
      __m512bh pr[NB];
      for (int n = 0; n < NB; ++n) {
        uint32_t pair;
        std::memcpy(&pair, probs + (n0 + n) * width + 32 * c + 2 * r, sizeof pair);
        pr[n] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      }
      for (int j = 0; j < 4; ++j) {
        const __m512bh vv = (__m512bh)_mm512_loadu_si512(v + j * 256 + r * 16);
        for (int n = 0; n < NB; ++n) acc[n][j] = _mm512_dpbf16_ps(acc[n][j], pr[n], vv);
      }
    }
  }
  for (int n = 0; n < NB; ++n) {
    const int64_t row = n0 + n;
    c10::BFloat16* o = out + (row / G) * out_row_stride + (row % G) * d + d0;
    const __m512 sc = _mm512_set1_ps(inv[row]);
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[n][j], sc)));
  }
}

constexpr int kValueRows = 4;  // 4 rows x 4 groups of 16 of d: 16 sums in registers

// phase 2: out[n] = inv[n] * p[n] . v for the 64 of d from d0, the values from `kept` (all of d
// packed, from chunk 0) or packed here chunk by chunk when it is null (a decode row)
void values_phase(const uint16_t* probs, int64_t width, const float* inv, int64_t N, int64_t G, const uint32_t* kept,
                  const uint16_t* v, const int64_t* off, int64_t ctx, int64_t chunks, int64_t d0, int64_t d,
                  c10::BFloat16* out, int64_t out_row_stride) {
  auto run = [&](auto&& vp) {
    for (int64_t n0 = 0; n0 < N; n0 += kValueRows) {
      auto pass = [&](auto nb) {
        value_rows<decltype(nb)::value>(probs, width, inv, n0, G, chunks, d0, d, vp, out, out_row_stride);
      };
      switch (std::min<int64_t>(N - n0, kValueRows)) {
        case 1: pass(std::integral_constant<int, 1>{}); break;
        case 2: pass(std::integral_constant<int, 2>{}); break;
        case 3: pass(std::integral_constant<int, 3>{}); break;
        default: pass(std::integral_constant<int, 4>{}); break;
      }
    }
  };
  if (kept) {
    run([&](int64_t c) { return kept + (c * d / 16 + d0 / 16) * 256; });
    return;
  }
  if (N <= kValueRows) {  // one pass over the chunks: each packed into L1 as it is reached
    alignas(64) uint32_t local[4 * 256];
    run([&](int64_t c) {
      pack_values(v, off, ctx, d0, 64, c, c + 1, local);
      return static_cast<const uint32_t*>(local);
    });
    return;
  }
  // more rows than one pass holds, without kept values: packed once for the passes
  thread_local std::vector<uint32_t> packed;
  if (static_cast<int64_t>(packed.size()) < chunks * 4 * 256) packed.resize(chunks * 4 * 256);
  pack_values(v, off, ctx, d0, 64, 0, chunks, packed.data());
  run([&](int64_t c) { return static_cast<const uint32_t*>(packed.data() + c * 4 * 256); });
}

}  // namespace

bool vector_fits(int64_t d, int64_t G) {
  // SHARDLINE_ATTENTION_ROWS=0: bfloat16 rows on the float32 kernel instead, one row at a time
  // (bench.attention's comparison)
  static const bool enabled = [] {
    const char* flag = std::getenv("SHARDLINE_ATTENTION_ROWS");
    return flag == nullptr || std::string(flag) != "0";
  }();
  return enabled && (d == 64 || d == 128) && G >= 1 && G <= 16;
}

void attend_vector(const c10::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, int64_t R, int64_t G,
                   const int64_t* ctx, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* off, int64_t d,
                   float scale, c10::BFloat16* out, int64_t out_row_stride, ValuePairs& pairs) {
  const int64_t N = R * G;
  const Buffers b = buffers(N, ctx, R);
  float inv[16];
  const auto* qb = reinterpret_cast<const uint16_t*>(q);
  const auto* kb = reinterpret_cast<const uint16_t*>(k);
  if (d == 128) scores_phase<64>(qb, q_row_stride, q_head_stride, G, N, kb, off, b.max_ctx, scale, b.scores, b.stride);
  else scores_phase<32>(qb, q_row_stride, q_head_stride, G, N, kb, off, b.max_ctx, scale, b.scores, b.stride);
  softmax_phase(b.scores, b.stride, N, G, ctx, b.probs, b.width, inv);
  const auto* vb = reinterpret_cast<const uint16_t*>(v);
  const uint32_t* kept = kept_values(pairs, vb, off, b, d, R);
  for (int64_t d0 = 0; d0 < d; d0 += 64)
    values_phase(b.probs, b.width, inv, N, G, kept, vb, off, b.max_ctx, b.chunks, d0, d, out, out_row_stride);
}

#else  // no AVX512-BF16 here: vector_fits() is false and attend_vector is never called

bool vector_fits(int64_t, int64_t) { return false; }
void attend_vector(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const c10::BFloat16*,
                   const c10::BFloat16*, const int64_t*, int64_t, float, c10::BFloat16*, int64_t, ValuePairs&) {}

#endif

}  // namespace shardline::rows
