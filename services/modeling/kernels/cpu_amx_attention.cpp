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
#include "cpu_attention_rows.h"
#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace shardline::amx {
namespace {

using rows::pack_values;
using rows::prefetch_rows;
using rows::softmax_phase;
using rows::transpose16;

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
                 int64_t d, float scale, c10::BFloat16* out, int64_t out_row_stride, rows::ValuePairs& pairs) {
  const int64_t N = R * G;
  const rows::Buffers b = rows::buffers(N, ctx, R);
  float inv[16];
  const auto* qb = reinterpret_cast<const uint16_t*>(q);
  const auto* kb = reinterpret_cast<const uint16_t*>(k);
  auto scores = d == 128 ? scores_phase<4> : scores_phase<2>;
  scores(qb, q_row_stride, q_head_stride, G, N, kb, off, ldk, b.max_ctx, scale, b.scores, b.stride);
  softmax_phase(b.scores, b.stride, N, G, ctx, b.probs, b.width, inv);
  const auto* vb = reinterpret_cast<const uint16_t*>(v);
  const uint32_t* kept = rows::kept_values(pairs, vb, off, b, d, R);
  for (int64_t d0 = 0; d0 < d; d0 += 64)
    values_phase(b.probs, b.width, inv, N, G, kept, vb, off, b.max_ctx, b.chunks, d0, d, out, out_row_stride);
}

}  // namespace shardline::amx

#else  // no AMX here: attention_fits() is false and attend_rows is never called

namespace shardline::amx {
bool attention_fits(int64_t, int64_t, int64_t) { return false; }
void attend_rows(const c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, const int64_t*, const c10::BFloat16*,
                 const c10::BFloat16*, const int64_t*, int64_t, int64_t, float, c10::BFloat16*, int64_t,
                 rows::ValuePairs&) {}
}  // namespace shardline::amx

#endif
