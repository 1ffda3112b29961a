// Paged attention for a few query rows of one sequence at a time, in bfloat16 with float32 sums:
// the pieces the AMX tile kernel (cpu_amx_attention.cpp) and the AVX512-BF16 vector kernel
// (cpu_attention_rows.cpp) share, and the vector kernels' entry point.
//
// Each computes the same thing for N = R * G <= 16 query rows: R tokens of one sequence (one block
// table), each with the G query heads of one KV head. Row (r, g) reads q + r * q_row_stride +
// g * q_head_stride and writes out + r * out_row_stride + g * d; it sees the first ctx[r] tokens,
// token t's key and value rows at k + off[t] and v + off[t]. Scores: q . k as exact products
// summed in float32, then scaled; softmax in float32, exp(s - max) (rounded to bfloat16 where
// p . v multiplies bfloat16 pairs: AMX, AVX512-BF16), p . v summed in float32 in token order
// (past ctx[r], p is 0: adding it changes no bit), then divided by the row's sum of exp. Each
// kernel sums an element in one fixed order whatever R is and whichever rows share its work, so a
// row's output has the same bits in a prefill and in a decode step. The kernels' orders differ:
// the machine picks one, never the batch.
#pragma once

#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_vec.h"

namespace shardline::rows {

// The values packed as pairs of tokens (pack_values), kept between calls on one sequence and KV
// head whose offsets (off) agree: `whole` leading 32-token chunks are reusable. The caller sets
// whole to 0 (or fewer) when the offsets change.
struct ValuePairs {
  std::vector<uint32_t> data;
  int64_t whole = 0;
};

// whether attend_vector is built here (AVX512-BF16, or AVX2 + FMA), takes rows of this shape and
// is not turned off (SHARDLINE_ATTENTION_ROWS=0)
bool vector_fits(int64_t d, int64_t G);

// the vector kernels (cpu_attention_rows.cpp): the contract above, no block-size condition
void attend_vector(const c10::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, int64_t R, int64_t G,
                   const int64_t* ctx, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* off, int64_t d,
                   float scale, c10::BFloat16* out, int64_t out_row_stride, ValuePairs& pairs);

// One call's sizes and this thread's buffers for them: scores [N, stride] (the context rounded up
// to 16 tokens) and probabilities [N, width] (to whole 32-token chunks; the AVX2 kernel keeps them
// float32, in scores)
struct Buffers {
  int64_t max_ctx, stride, width, chunks;
  float* scores;
  uint16_t* probs;
};

inline Buffers buffers(int64_t N, const int64_t* ctx, int64_t R) {
  thread_local std::vector<float> scores;
  thread_local std::vector<uint16_t> probs;
  const int64_t max_ctx = *std::max_element(ctx, ctx + R);
  const int64_t stride = (max_ctx + 15) / 16 * 16, width = (max_ctx + 31) / 32 * 32;
  if (static_cast<int64_t>(scores.size()) < N * stride) scores.resize(N * stride);
  if (static_cast<int64_t>(probs.size()) < N * width) probs.resize(N * width);
  return {max_ctx, stride, width, width / 32, scores.data(), probs.data()};
}

#if defined(SHARDLINE_AVX512) && defined(__AVX512BF16__)
// r[i] lane j <- r[j] lane i: pairs of rows, then of pairs, then 128-bit lanes twice
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 16; i += 4) {  // r[4m + c], lane L: column 4L + c of rows 4m .. 4m + 3
    r[i] = lo(t[i], t[i + 2]);
    r[i + 1] = hi(t[i], t[i + 2]);
    r[i + 2] = lo(t[i + 1], t[i + 3]);
    r[i + 3] = hi(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd);
  }
}

inline void prefetch_rows(const uint16_t* base, const int64_t* off, int64_t from, int64_t to, int64_t lines) {
  for (int64_t t = from; t < to; ++t)
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(base + off[t]) + 64 * l, _MM_HINT_T0);
}

// each row's exp(s - max) over its own context, rounded to bfloat16 (the probabilities p . v
// takes, not yet divided by their sum), zero from there to `width`; inv[n]: 1 / row n's sum, which
// the values phase applies to its output (one pass over the scores fewer than normalising them)
inline void softmax_phase(const float* scores, int64_t stride, int64_t N, int64_t G, const int64_t* ctx, uint16_t* probs,
                   int64_t width, float* inv) {
  for (int64_t n = 0; n < N; ++n) {
    const float* sc = scores + n * stride;
    const int64_t len = ctx[n / G], full = len / 16 * 16;
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1);
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < full; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sc + t));
    if (tail) mv = _mm512_mask_max_ps(mv, tail, mv, _mm512_maskz_loadu_ps(tail, sc + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    uint16_t* p = probs + n * width;
    for (int64_t t = 0; t < full; t += 16) {
      const __m512 x = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), m));
      sum = _mm512_add_ps(sum, x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(x));
    }
    if (tail) {
      const __m512 x = _mm512_maskz_mov_ps(tail, fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + full), m)));
      sum = _mm512_add_ps(sum, x);
      _mm256_mask_storeu_epi16(p + full, tail, (__m256i)_mm512_cvtneps_pbh(x));
    }
    inv[n] = 1.f / _mm512_reduce_add_ps(sum);
    std::fill(p + len, p + width, uint16_t(0));
  }
}

// the values of chunks [from, to) of 32 tokens as pairs of tokens, for the dn of d from d0: chunk
// c's 16 of d j is 16 rows (token pairs r) of 16 (v[32c + 2r][d0 + 16j + i], v[32c + 2r + 1][d0 +
// 16j + i]) at out + ((c - from) * dn / 16 + j) * 256 (an AMX tile, or 16 vectors); tokens from ctx
// on are zeros
inline void pack_values(const uint16_t* v, const int64_t* off, int64_t ctx, int64_t d0, int64_t dn, int64_t from, int64_t to,
                 uint32_t* out) {
  alignas(64) static const uint16_t zeros[128] = {};
  const int64_t groups = dn / 16, lines = dn * 2 / 64;
  for (int64_t c = from; c < to; ++c) {
    const int64_t t0 = 32 * c;
    if (t0 + 64 < ctx) prefetch_rows(v + d0, off, t0 + 64, std::min(ctx, t0 + 96), lines);
    uint32_t* chunk = out + (c - from) * groups * 256;
    for (int r = 0; r < 16; ++r) {
      const int64_t ta = t0 + 2 * r, tb = ta + 1;
      const uint16_t* va = ta < ctx ? v + off[ta] + d0 : zeros;
      const uint16_t* vb = tb < ctx ? v + off[tb] + d0 : zeros;
      for (int64_t j = 0; j < groups; ++j) {
        const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(va + 16 * j)));
        const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vb + 16 * j)));
        _mm512_storeu_si512(chunk + j * 256 + r * 16, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
      }
    }
  }
}

// A prefill's rows (R > 1), or a call after one: the values packed once for all of d and kept for
// the next call on this sequence (its next rows); a chunk holds zeros past the context it was
// packed for, so only whole ones (all 32 tokens in it) are reused. A decode row: null (the caller
// packs chunk by chunk, into L1, where a decode row's values are read once).
inline const uint32_t* kept_values(ValuePairs& pairs, const uint16_t* v, const int64_t* off, const Buffers& b,
                                   int64_t d, int64_t R) {
  if (R == 1 && pairs.whole == 0) return nullptr;
  const int64_t per_chunk = d / 16 * 256, from = std::min(pairs.whole, b.chunks);
  if (static_cast<int64_t>(pairs.data.size()) < b.chunks * per_chunk) pairs.data.resize(b.chunks * per_chunk);
  pack_values(v, off, b.max_ctx, 0, d, from, b.chunks, pairs.data.data() + from * per_chunk);
  pairs.whole = std::max(pairs.whole, b.max_ctx / 32);
  return pairs.data.data();
}
#endif  // SHARDLINE_AVX512 && __AVX512BF16__

}  // namespace shardline::rows
