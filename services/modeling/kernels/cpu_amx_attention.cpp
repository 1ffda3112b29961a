// Paged attention on AMX tiles: what amx::attend_rows computes is in cpu_amx.h.
//
// Two phases per call, each with tiles shaped for it (amx::load_tiles):
// 1. scores, per 16-token tile of the context: tile 0 accumulates 16 tokens x N rows, the keys
//    (tiles 4 and 5 alternately: 16 tokens x 32 of d, read in place from the cache, a block's rows
//    ldk apart) times the N query rows packed as pairs of d (tiles 6, 7, and 2, 3 for d 128); the
//    tile is transposed in registers into each row's run of scores.
// 2. p . v, per 32-token chunk: tiles 0-3 accumulate 4 x 16 of d for the N rows, tile 4 holds the
//    rows' probabilities (N x 32 tokens, bfloat16) and 5-7 the values of 16 of d each, two tokens'
//    values interleaved (the pairs the tile instruction multiplies), packed once per chunk and
//    kept (ValuePairs) for the later calls on the same sequence: a prefill's next rows.
// Between them each row's softmax, over its own context only, in float32: exp(s - max) rounded to
// bfloat16 for the tile, the division by the sum applied to the output.
//
// Rows share the keys and values they read: at 5 rows of 3 heads (a prefill) each tile
// instruction serves 15 rows, where the vector kernel reads and multiplies per row.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_amx.h"
#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace shardline::amx {
namespace {

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

// phase 1: scores[n * stride + t] for t < ctx rounded up to 16, NC chunks of 32 in d
template <int NC>
void scores_phase(const uint16_t* q, int64_t q_row_stride, int64_t q_head_stride, int64_t G, int64_t N,
                  const uint16_t* k, const int64_t* off, int64_t ldk, int64_t ctx, float scale, float* scores,
                  int64_t stride) {
  alignas(64) uint32_t qp[NC][16][16];  // chunk c, d-pair r, row n
  for (int64_t n = 0; n < N; ++n) {
    const uint32_t* qn = reinterpret_cast<const uint32_t*>(q + (n / G) * q_row_stride + (n % G) * q_head_stride);
    for (int c = 0; c < NC; ++c)
      for (int r = 0; r < 16; ++r) qp[c][r][n] = qn[16 * c + r];
  }
  constexpr uint8_t extra = NC > 2 ? 16 : 0;  // tiles 2 and 3: d 128's last two chunks
  const uint8_t rows[8] = {16, 0, extra, extra, 16, 16, 16, 16};
  const uint16_t q_bytes = static_cast<uint16_t>(N * 4), extra_bytes = NC > 2 ? q_bytes : 0;
  const uint16_t colsb[8] = {q_bytes, 0, extra_bytes, extra_bytes, 64, 64, q_bytes, q_bytes};
  load_tiles(-(1000 * NC + N), rows, colsb);
  _tile_loadd(6, qp[0], 64);
  _tile_loadd(7, qp[1], 64);
  if constexpr (NC > 2) {
    _tile_loadd(2, qp[2], 64);
    _tile_loadd(3, qp[3], 64);
  }
  const int64_t bytes = ldk * 2, lines = NC;  // 32 of d in bfloat16: one line per chunk
  const __m512 s = _mm512_set1_ps(scale);
  alignas(64) float acc[16][16];
  for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
    if (t0 + 32 < ctx) prefetch_rows(k, off, t0 + 32, std::min(ctx, t0 + 48), lines);
    const uint16_t* kt = k + off[t0];
    _tile_zero(0);
    _tile_loadd(4, kt, bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, kt + 32, bytes);
    _tile_dpbf16ps(0, 5, 7);
    if constexpr (NC > 2) {
      _tile_loadd(4, kt + 64, bytes);
      _tile_dpbf16ps(0, 4, 2);
      _tile_loadd(5, kt + 96, bytes);
      _tile_dpbf16ps(0, 5, 3);
    }
    _tile_stored(0, acc, 64);  // acc[t][n]
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(acc[i]);
    transpose16(r);  // r[n]: row n's 16 scores
    for (int64_t n = 0; n < N; ++n) _mm512_storeu_ps(scores + n * stride + t0, _mm512_mul_ps(r[n], s));
  }
}

// each row's exp(s - max) over its own context, rounded to bfloat16 (the tile's probabilities,
// not yet divided by their sum), zero from there to `width`; inv[n]: 1 / row n's sum, which
// values_phase applies to its output (one pass over the scores fewer than normalising them)
void softmax_phase(const float* scores, int64_t stride, int64_t N, int64_t G, const int64_t* ctx, uint16_t* probs,
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
      const __m512 x = shardline::fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), m));
      sum = _mm512_add_ps(sum, x);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), (__m256i)_mm512_cvtneps_pbh(x));
    }
    if (tail) {
      const __m512 x = _mm512_maskz_mov_ps(tail, shardline::fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + full), m)));
      sum = _mm512_add_ps(sum, x);
      _mm256_mask_storeu_epi16(p + full, tail, (__m256i)_mm512_cvtneps_pbh(x));
    }
    inv[n] = 1.f / _mm512_reduce_add_ps(sum);
    std::fill(p + len, p + width, uint16_t(0));
  }
}

// the values of chunks [from, to) as tile rows, for the dn of d from d0: chunk c's 16 of d j is
// 16 rows (token pairs r) of 16 (v[32c + 2r][d0 + 16j + i], v[32c + 2r + 1][d0 + 16j + i]) at
// out + ((c - from) * dn / 16 + j) * 256; tokens from ctx on are zeros
void pack_values(const uint16_t* v, const int64_t* off, int64_t ctx, int64_t d0, int64_t dn, int64_t from, int64_t to,
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

// phase 2: out[n] = inv[n] * p[n] . v over `chunks` chunks of 32 tokens, for the 64 of d from d0
// (4 tiles): the values from `kept` (pack_values' chunks for all of d, from chunk 0), or packed
// here chunk by chunk (into L1, where a decode row's values are read once) when it is null
void values_phase(const uint16_t* probs, int64_t width, const float* inv, int64_t N, int64_t G,
                  const uint32_t* kept, const uint16_t* v, const int64_t* off, int64_t ctx, int64_t chunks, int64_t d0,
                  int64_t d, c10::BFloat16* out, int64_t out_row_stride) {
  const uint8_t n_rows = static_cast<uint8_t>(N);
  const uint8_t rows[8] = {n_rows, n_rows, n_rows, n_rows, n_rows, 16, 16, 16};
  const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  load_tiles(-(200 + N), rows, colsb);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  alignas(64) uint32_t local[4 * 256];
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* vp = local;
    if (kept) vp = kept + (c * d / 16 + d0 / 16) * 256;
    else pack_values(v, off, ctx, d0, 64, c, c + 1, local);
    _tile_loadd(4, probs + 32 * c, width * 2);
    _tile_loadd(5, vp, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, vp + 256, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, vp + 512, 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, vp + 768, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float acc[4][16][16];
  _tile_stored(0, acc[0], 64);
  _tile_stored(1, acc[1], 64);
  _tile_stored(2, acc[2], 64);
  _tile_stored(3, acc[3], 64);
  for (int64_t n = 0; n < N; ++n) {
    c10::BFloat16* o = out + (n / G) * out_row_stride + (n % G) * d + d0;
    const __m512 scale = _mm512_set1_ps(inv[n]);
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[j][n]), scale)));
  }
}

}  // namespace

bool attention_fits(int64_t d, int64_t block_size, int64_t G) {
  return (d == 64 || d == 128) && block_size % 16 == 0 && G >= 1 && G <= 16;
}

void attend_rows(const c10::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, int64_t R, int64_t G,
                 const int64_t* ctx, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* off, int64_t ldk,
                 int64_t d, float scale, c10::BFloat16* out, int64_t out_row_stride, ValuePairs& pairs) {
  const int64_t N = R * G, max_ctx = *std::max_element(ctx, ctx + R);
  const int64_t stride = (max_ctx + 15) / 16 * 16, width = (max_ctx + 31) / 32 * 32, chunks = width / 32;
  thread_local std::vector<float> scores;
  thread_local std::vector<uint16_t> probs;
  if (static_cast<int64_t>(scores.size()) < N * stride) scores.resize(N * stride);
  if (static_cast<int64_t>(probs.size()) < N * width) probs.resize(N * width);
  float inv[16];
  const auto* qb = reinterpret_cast<const uint16_t*>(q);
  const auto* kb = reinterpret_cast<const uint16_t*>(k);
  if (d == 128) scores_phase<4>(qb, q_row_stride, q_head_stride, G, N, kb, off, ldk, max_ctx, scale, scores.data(), stride);
  else scores_phase<2>(qb, q_row_stride, q_head_stride, G, N, kb, off, ldk, max_ctx, scale, scores.data(), stride);
  softmax_phase(scores.data(), stride, N, G, ctx, probs.data(), width, inv);
  // a prefill's rows (R > 1), or a call after one: values packed once for all of d and kept for the
  // next call on this sequence (its next rows); a chunk holds zeros past the context it was packed
  // for, so only whole ones (all 32 tokens in it) are reused. A decode row: packed chunk by chunk.
  const auto* vb = reinterpret_cast<const uint16_t*>(v);
  const uint32_t* kept = nullptr;
  if (R > 1 || pairs.whole > 0) {
    const int64_t per_chunk = d / 16 * 256, from = std::min(pairs.whole, chunks);
    if (static_cast<int64_t>(pairs.data.size()) < chunks * per_chunk) pairs.data.resize(chunks * per_chunk);
    pack_values(vb, off, max_ctx, 0, d, from, chunks, pairs.data.data() + from * per_chunk);
    pairs.whole = std::max(pairs.whole, max_ctx / 32);
    kept = pairs.data.data();
  }
  for (int64_t d0 = 0; d0 < d; d0 += 64)
    values_phase(probs.data(), width, inv, N, G, kept, vb, off, max_ctx, chunks, d0, d, out, out_row_stride);
}

}  // namespace shardline::amx

#else  // no AMX here: attention_fits() is false and attend_rows is never called

namespace shardline::amx {
bool attention_fits(int64_t, int64_t, int64_t) { return false; }
void attend_rows(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const c10::BFloat16*,
                 const c10::BFloat16*, const int64_t*, int64_t, int64_t, float, c10::BFloat16*, int64_t, ValuePairs&) {}
}  // namespace shardline::amx

#endif
