// Paged attention for a few rows of one sequence on vectors (machines without AMX): the contract
// in cpu_attention_rows.h, for every bfloat16 row, decode or prefill, on such a machine. With
// AVX512-BF16, below; with AVX2 + FMA alone, the same plan on 8 float32 lanes (further down). The
// rows of a prefill share every key and value they read, where the float32 kernel in
// cpu_attention.cpp reads and converts them per row; with AVX512-BF16 both products run on
// vdpbf16ps, 32 multiply-adds per instruction, twice what that kernel's float32 FMAs do.
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

using shardline::Elem;
using shardline::fast_exp;
namespace {
// SHARDLINE_ATTENTION_ROWS=0: bfloat16 rows on cpu_attention.cpp's kernels instead, one row at a
// time (bench.attention's comparison)
[[maybe_unused]] bool rows_enabled() {
  static const bool enabled = [] {
    const char* flag = std::getenv("SHARDLINE_ATTENTION_ROWS");
    return flag == nullptr || std::string(flag) != "0";
  }();
  return enabled;
}

// f(std::integral_constant<int, n>) for n = min(count, kMax), count >= 1: a run-time count of rows
// as the compile-time one the row loops are unrolled for
template <int kMax, typename F>
[[maybe_unused]] inline void with_count(int64_t count, F&& f) {
  if constexpr (kMax > 1) {
    if (count < kMax) {
      with_count<kMax - 1>(count, f);
      return;
    }
  }
  f(std::integral_constant<int, kMax>{});
}
}  // namespace

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
      with_count<kRowsPerPass>(N - n0, [&](auto nb) {
        score_rows<decltype(nb)::value, NP>(qw, n0, kp, s, scores, stride, t0);
      });
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
      with_count<kValueRows>(N - n0, [&](auto nb) {
        value_rows<decltype(nb)::value>(probs, width, inv, n0, G, chunks, d0, d, vp, out, out_row_stride);
      });
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

#elif defined(SHARDLINE_GEMM_AVX2)
// AVX2 + FMA (no AVX512-BF16): 8 float32 lanes, the same plan with float32 multiply-adds. Scores:
// per 8 tokens the keys transposed into pairs of d, each pair's even and odd elements widened
// once (cpu_vec.h's even_bf16 / odd_bf16) and multiplied by the rows' query elements broadcast:
// lane t sums, over p in order, q[2p] k_t[2p] in one sum and q[2p + 1] k_t[2p + 1] in another,
// then adds the two. Probabilities stay float32. Values: each row's output summed over tokens in
// order, 16 of d per pass, read as bfloat16 by a decode row and by a prefill's rows from float32
// copies made once (kept for the sequence's next rows as ValuePairs).
namespace {

constexpr int kRowsPerPass = 6;  // AVX2's 16 registers: 6 sums, the key pair's halves, broadcasts

// r[i] lane j <- r[j] lane i (8 x 8 32-bit words)
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // s[i + c] = column c (and c + 4 in the upper half) of rows i .. i + 3
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(s[c], s[4 + c], 0x31);
  }
}

// scores of rows [n0, n0 + NB) for the 8 tokens from t0; qe / qo: each row's even / odd elements.
// A row's even and odd products go to two sums (added at the end): two dependent chains of
// multiply-adds per row instead of one, so that a decode step's 3 or 4 rows keep the FMA units busy.
template <int NB, int NP>
inline void score_rows(const float (*qe)[NP], const float (*qo)[NP], int64_t n0, const uint32_t (&kp)[NP][8],
                       __m256 scale, float* scores, int64_t stride, int64_t t0) {
  __m256 even[NB], odd[NB];
  for (int n = 0; n < NB; ++n) even[n] = odd[n] = _mm256_setzero_ps();
  for (int p = 0; p < NP; ++p) {
    const __m256i kv = _mm256_load_si256(reinterpret_cast<const __m256i*>(kp[p]));
    const __m256 ke = shardline::even_bf16(kv), ko = shardline::odd_bf16(kv);
    for (int n = 0; n < NB; ++n) {
      even[n] = _mm256_fmadd_ps(_mm256_set1_ps(qe[n0 + n][p]), ke, even[n]);
      odd[n] = _mm256_fmadd_ps(_mm256_set1_ps(qo[n0 + n][p]), ko, odd[n]);
    }
  }
  for (int n = 0; n < NB; ++n)
    _mm256_storeu_ps(scores + (n0 + n) * stride + t0, _mm256_mul_ps(_mm256_add_ps(even[n], odd[n]), scale));
}

template <int NP>
void scores_phase(const uint16_t* q, int64_t q_row_stride, int64_t q_head_stride, int64_t G, int64_t N,
                  const uint16_t* k, const int64_t* off, int64_t ctx, float scale, float* scores, int64_t stride) {
  alignas(32) float qe[16][NP], qo[16][NP];
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* qn = q + (n / G) * q_row_stride + (n % G) * q_head_stride;
    for (int p = 0; p < NP; ++p) {
      qe[n][p] = Elem<c10::BFloat16>::load(reinterpret_cast<const c10::BFloat16*>(qn + 2 * p));
      qo[n][p] = Elem<c10::BFloat16>::load(reinterpret_cast<const c10::BFloat16*>(qn + 2 * p + 1));
    }
  }
  alignas(32) uint32_t kp[NP][8];
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
    const int64_t n_tok = std::min<int64_t>(8, ctx - t0);
    for (int c = 0; c < NP; c += 8) {  // 8 pairs of the 8 tokens at a time
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = i < n_tok ? _mm256_loadu_ps(reinterpret_cast<const float*>(k + off[t0 + i] + 2 * c))
                         : _mm256_setzero_ps();
      transpose8(r);
      for (int p = 0; p < 8; ++p) _mm256_store_ps(reinterpret_cast<float*>(kp[c + p]), r[p]);
    }
    for (int64_t n0 = 0; n0 < N; n0 += kRowsPerPass)
      with_count<kRowsPerPass>(N - n0, [&](auto nb) {
        score_rows<decltype(nb)::value, NP>(qe, qo, n0, kp, s, scores, stride, t0);
      });
  }
}

// each row's exp(s - max) over its own context in place, float32, zero from there to max_ctx;
// inv[n]: 1 / its sum (8 lanes in order, then hsum8)
void softmax_phase(float* scores, int64_t stride, int64_t N, int64_t G, const int64_t* ctx, int64_t max_ctx,
                   float* inv) {
  for (int64_t n = 0; n < N; ++n) {
    float* p = scores + n * stride;
    const int64_t len = ctx[n / G];
    float m = p[0];
    for (int64_t t = 1; t < len; ++t) m = p[t] > m ? p[t] : m;
    SHARDLINE_SIMD
    for (int64_t t = 0; t < len; ++t) p[t] = fast_exp(p[t] - m);
    std::fill(p + len, p + max_ctx, 0.f);
    __m256 sum = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= max_ctx; t += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(p + t));
    alignas(32) float tail[8] = {};
    std::copy(p + t, p + max_ctx, tail);
    inv[n] = 1.f / shardline::hsum8(_mm256_add_ps(sum, _mm256_load_ps(tail)));
  }
}

// out rows [n0, n0 + NB), the 16 of d from d0: inv[n] * sum over t of p[n][t] v[t]; row(t, i):
// token t's 8 values from d0 + i as float32
template <int NB, typename Row>
inline void value_rows(const float* probs, int64_t stride, const float* inv, int64_t n0, int64_t G, Row&& row,
                       int64_t ctx, int64_t d0, int64_t d, c10::BFloat16* out, int64_t out_row_stride) {
  __m256 acc[NB][2];
  for (int n = 0; n < NB; ++n) acc[n][0] = acc[n][1] = _mm256_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const __m256 v0 = row(t, d0), v1 = row(t, d0 + 8);
    for (int n = 0; n < NB; ++n) {
      const __m256 pt = _mm256_set1_ps(probs[(n0 + n) * stride + t]);
      acc[n][0] = _mm256_fmadd_ps(pt, v0, acc[n][0]);
      acc[n][1] = _mm256_fmadd_ps(pt, v1, acc[n][1]);
    }
  }
  alignas(32) float tmp[16];
  for (int n = 0; n < NB; ++n) {
    const int64_t r = n0 + n;
    const __m256 sc = _mm256_set1_ps(inv[r]);
    _mm256_store_ps(tmp, _mm256_mul_ps(acc[n][0], sc));
    _mm256_store_ps(tmp + 8, _mm256_mul_ps(acc[n][1], sc));
    c10::BFloat16* o = out + (r / G) * out_row_stride + (r % G) * d + d0;
    for (int i = 0; i < 16; ++i) Elem<c10::BFloat16>::store(o + i, tmp[i]);
  }
}

// 8 bfloat16 as float32 (exact)
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// the values of tokens [0, ctx) as float32 rows of d: rows from pairs.whole * 32 on widened here,
// the earlier ones kept from the sequence's previous call
const float* widened_values(ValuePairs& pairs, const uint16_t* v, const int64_t* off, int64_t ctx, int64_t d) {
  if (static_cast<int64_t>(pairs.data.size()) < ctx * d) pairs.data.resize((ctx + 31) / 32 * 32 * d);
  float* vf = reinterpret_cast<float*>(pairs.data.data());
  for (int64_t t = std::min(pairs.whole * 32, ctx); t < ctx; ++t)
    for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(vf + t * d + i, widen8(v + off[t] + i));
  pairs.whole = ctx / 32;
  return vf;
}

}  // namespace

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
  softmax_phase(b.scores, b.stride, N, G, ctx, b.max_ctx, inv);
  const auto* vb = reinterpret_cast<const uint16_t*>(v);
  auto values = [&](auto&& row) {
    for (int64_t d0 = 0; d0 < d; d0 += 16)
      for (int64_t n0 = 0; n0 < N; n0 += kRowsPerPass)
        with_count<kRowsPerPass>(N - n0, [&](auto nb) {
          value_rows<decltype(nb)::value>(b.scores, b.stride, inv, n0, G, row, b.max_ctx, d0, d, out, out_row_stride);
        });
  };
  // a decode row reads each value once: widened where it is used. A prefill's rows (or a call
  // after one) read them once per pass: widened once, into float32 rows kept for the next call.
  if (R == 1 && pairs.whole == 0) {
    values([&](int64_t t, int64_t i) { return widen8(vb + off[t] + i); });
  } else {
    const float* vf = widened_values(pairs, vb, off, b.max_ctx, d);
    values([&](int64_t t, int64_t i) { return _mm256_loadu_ps(vf + t * d + i); });
  }
}

#else  // neither AVX512-BF16 nor AVX2 + FMA: vector_fits() is false and attend_vector is never called
#define SHARDLINE_NO_ROWS_KERNEL 1
void attend_vector(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const c10::BFloat16*,
                   const c10::BFloat16*, const int64_t*, int64_t, float, c10::BFloat16*, int64_t, ValuePairs&) {}

#endif

#ifdef SHARDLINE_NO_ROWS_KERNEL
constexpr bool kBuilt = false;
#else
constexpr bool kBuilt = true;
#endif

bool vector_fits(int64_t d, int64_t G) {
  return kBuilt && rows_enabled() && (d == 64 || d == 128) && G >= 1 && G <= 16;
}

}  // namespace shardline::rows
