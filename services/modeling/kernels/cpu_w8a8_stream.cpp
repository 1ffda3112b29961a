// The W8A8 matmul's tiles on AVX512-VNNI at two rows and more (a decode step's batch, a prefill
// chunk) and a row's blocks that its 8-block tiles leave, and on AVX2 at every row count: the weights
// stream in under the arithmetic. Layout and order of summation: cpu_w8a8.cpp; the same group sums
// and the same fused multiply-adds across groups, the same bits as its portable path.
//
// 4-row tiles through all of K took each column's weights from memory in the first tile, waiting on
// them, and the other row tiles from cache: stream and arithmetic one after the other. Here the
// weights go column by column (VNNI: 3 blocks, 4-row tiles, 12 int32 and 12 float32 sums; AVX2: 1
// block, 2-row tiles), K in panels of kPanelGroups groups, the float32 sums kept in memory between
// panels. The first row tile of a panel asks for each block's weights kAheadSteps 4-byte steps ahead;
// the other full row tiles share out the next panel's lines among them (this column's next panel, or
// the next column's first), so the first tile of the next panel finds most of it in cache.
//
// The SmolLM2 / 1B-class weight sequence on a 2-core AMD EPYC (Zen 5), against the 4-row (VNNI) and
// 2-row (AVX2 build) tiles through all of K: VNNI 0.68-0.80x the time at 8-64 rows, 0.90-0.99x at 2-4
// and 128-1,024; AVX2 0.77-0.83x at 8-16 rows, 0.90-0.91x at 64-256, 0.94-0.98x at one row.

#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_w8a8.h"

namespace shardline::w8a8 {

#if defined(SHARDLINE_W8A8_VNNI) || defined(SHARDLINE_W8A8_AVX2)
namespace {

#if defined(SHARDLINE_W8A8_VNNI)
constexpr int kRowTile = 4;
constexpr int kBlocks = 3;
#else  // AVX2: 2 rows x 1 block (two 8-lane halves), 8 int32 and 8 float32 sums (1-row tiles: 2-4 % slower)
constexpr int kRowTile = 2;
constexpr int kBlocks = 1;
#endif
constexpr int64_t kPanelGroups = 64;  // 2,048 k: 32 KB of a block's weights
constexpr int kAheadSteps = 64;
constexpr int64_t kStepBytes = 4 * kBlockCols;  // one k-step of a block: one 64-byte line

template <typename T>
struct Operands {
  const int8_t* xq;
  const float* d;
  const int32_t* bias;
  int64_t M, Kp, G;
  const uint8_t* w;
  const float* wscale;
  T* y;
  int64_t N;
  const Chunks<T>& ch;
};

// A tile's asks for weight lines at each 4-byte step (wg: the step's line of the first block). First:
// each block's line kAheadSteps steps ahead. `next`, when not null: one of its steps (NB lines)
// every `every` steps.
template <int NB, bool First>
SHARDLINE_INLINE void fetch_lines(const uint8_t* wg, int64_t stride, const uint8_t*& next, int64_t& countdown,
                                  int64_t every) {
  if constexpr (First)
    for (int j = 0; j < NB; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(wg + j * stride + kAheadSteps * kStepBytes), _MM_HINT_T0);
  if (next != nullptr && countdown-- == 0) {
    for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * stride), _MM_HINT_T0);
    next += kStepBytes * every;
    countdown = every - 1;
  }
}

#if defined(SHARDLINE_W8A8_VNNI)
// rows [m, m + MB) x blocks [b, b + NB), groups [g0, g1) of chunk `chunk`; where the sums start and
// go: ChunkFlags (cpu_vec.h); First, `next` and `every`: fetch_lines
template <int MB, int NB, bool First, typename T>
SHARDLINE_INLINE void tile(const Operands<T>& o, int64_t m, int64_t b, int64_t g0, int64_t g1, const ChunkFlags s,
                           int64_t chunk, float* kept, float* total, int64_t ld, const uint8_t* next, int64_t every) {
  const int64_t stride = kBlockCols * o.Kp;
  __m512 fa[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) fa[i][j] = s.fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(kept + i * ld + j * 16);
  const uint8_t* wg = o.w + b * stride + g0 * kGroupSteps * kStepBytes;
  int64_t countdown = 0;
  for (int64_t g = g0; g < g1; ++g, wg += kGroupSteps * kStepBytes) {
    __m512i acc[MB][NB];
    for (int i = 0; i < MB; ++i) {
      const __m512i start = _mm512_set1_epi32(o.bias[(m + i) * o.G + g]);
      for (int j = 0; j < NB; ++j) acc[i][j] = start;
    }
    const int8_t* xg = o.xq + m * o.Kp + g * kGroup;
#pragma GCC unroll 8
    for (int st = 0; st < kGroupSteps; ++st) {
      __m512i wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(wg + j * stride + st * kStepBytes);
      fetch_lines<NB, First>(wg + st * kStepBytes, stride, next, countdown, every);
      for (int i = 0; i < MB; ++i) {
        int32_t four;
        std::memcpy(&four, xg + i * o.Kp + st * 4, 4);
        const __m512i a = _mm512_set1_epi32(four);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wv[j], a);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 dg = _mm512_set1_ps(o.d[(m + i) * o.G + g]);
      for (int j = 0; j < NB; ++j) fa[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), dg, fa[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float* keep = kept + i * ld + j * 16;
      const int64_t n0 = (b + j) * kBlockCols, count = std::min(kBlockCols, o.N - n0);
      T* out = o.y + (m + i) * o.N + n0;
      if (!s.end) {
        _mm512_storeu_ps(keep, fa[i][j]);
      } else if (s.first && s.last) {
        store16(fa[i][j], o.wscale, out, n0, count);
      } else {  // a chunk's product: written out, or added into the float32 total in chunk order
        const __m512 v = product16<T>(fa[i][j], o.wscale, n0, count);
        if (o.ch.parts != nullptr) {
          store16_raw(v, o.ch.parts + chunk * o.M * o.N + (m + i) * o.N + n0, count);
          continue;
        }
        float* tot = total + i * ld + j * 16;
        const __m512 sum = s.first ? v : _mm512_add_ps(_mm512_loadu_ps(tot), v);
        if (s.last)
          store16_raw(sum, out, count);
        else
          _mm512_storeu_ps(tot, sum);
      }
    }
}

#else
// AVX2: the same on 8-lane halves, the weight bytes flipped back to signed: vpmaddubsw on |xq| and the
// weights with xq's signs (no pair of products overflows int16: 2 * 127 * 127 < 2^15), pairs widened to
// int32 by vpmaddwd; the group sums start at zero (no bias: the weights are signed here)
template <int MB, int NB, bool First, typename T>
SHARDLINE_INLINE void tile(const Operands<T>& o, int64_t m, int64_t b, int64_t g0, int64_t g1, const ChunkFlags s,
                           int64_t chunk, float* kept, float* total, int64_t ld, const uint8_t* next, int64_t every) {
  const int64_t stride = kBlockCols * o.Kp;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 fa[MB][2 * NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 2 * NB; ++j) fa[i][j] = s.fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(kept + i * ld + j * 8);
  const uint8_t* wg = o.w + b * stride + g0 * kGroupSteps * kStepBytes;
  int64_t countdown = 0;
  for (int64_t g = g0; g < g1; ++g, wg += kGroupSteps * kStepBytes) {
    __m256i acc[MB][2 * NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < 2 * NB; ++j) acc[i][j] = _mm256_setzero_si256();
    const int8_t* xg = o.xq + m * o.Kp + g * kGroup;
#pragma GCC unroll 8
    for (int st = 0; st < kGroupSteps; ++st) {
      __m256i wv[2 * NB];
      for (int j = 0; j < 2 * NB; ++j)
        wv[j] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (j / 2) * stride + st * kStepBytes + (j % 2) * 32)),
            flip);
      fetch_lines<NB, First>(wg + st * kStepBytes, stride, next, countdown, every);
      for (int i = 0; i < MB; ++i) {
        int32_t four;
        std::memcpy(&four, xg + i * o.Kp + st * 4, 4);
        const __m256i a = _mm256_set1_epi32(four), mag = _mm256_abs_epi8(a);
        for (int j = 0; j < 2 * NB; ++j) {
          const __m256i pairs = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(wv[j], a));
          acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m256 dg = _mm256_set1_ps(o.d[(m + i) * o.G + g]);
      for (int j = 0; j < 2 * NB; ++j) fa[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][j]), dg, fa[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 2 * NB; ++j) {
      if (!s.end) {
        _mm256_storeu_ps(kept + i * ld + j * 8, fa[i][j]);
        continue;
      }
      alignas(32) float sums[8];
      _mm256_store_ps(sums, fa[i][j]);
      const int64_t n0 = (2 * b + j) * 8, count = std::max<int64_t>(0, std::min<int64_t>(8, o.N - n0));
      if (s.first && s.last)
        store_lanes(sums, o.wscale, o.y + (m + i) * o.N + n0, n0, count);
      else
        chunk_end_lanes(sums, o.wscale, total + i * ld + j * 8, o.y, o.ch, chunk, s.last, m + i, o.N, n0, count);
    }
}
#endif

// every row against blocks [b, b + NB), panel by panel of the groups (walk_column); `kept` and `total`
// at the column's first channel
template <int NB, typename T>
void column(const Operands<T>& o, int64_t b, float* kept, float* total, int64_t ld) {
  const int64_t G = o.G;
  walk_column<kRowTile>(
      o.M, G, o.ch.gpc, kPanelGroups, kStepBytes,
      [&](int64_t g1) {
        return o.w + (g1 < G ? b * kBlockCols * o.Kp + g1 * kGroupSteps * kStepBytes : (b + NB) * kBlockCols * o.Kp);
      },
      [&](auto mb, auto first, int64_t m, int64_t g0, int64_t g1, ChunkFlags s, int64_t chunk, const uint8_t* next,
          int64_t every) SHARDLINE_LAMBDA_INLINE {
        tile<decltype(mb)::value, NB, decltype(first)::value>(o, m, b, g0, g1, s, chunk, kept + m * ld,
                                                               total + m * ld, ld, next, every);
      });
}

}  // namespace

template <typename T>
void stream_blocks(const int8_t* xq, const float* d, const int32_t* bias, const uint8_t* w, const float* wscale,
                   T* y, int64_t M, int64_t Kp, int64_t N, int64_t b0, int64_t b1, const Chunks<T>& ch) {
  const int64_t ld = kBlockCols * (b1 - b0);
  thread_local std::vector<float> kept, totals;
  kept.resize(static_cast<size_t>(M * ld));
  totals.resize(static_cast<size_t>(M * ld));
  const Operands<T> o{xq, d, bias, M, Kp, Kp / kGroup, w, wscale, y, N, ch};
  int64_t b = b0;
  for (; b + kBlocks <= b1; b += kBlocks)
    column<kBlocks>(o, b, kept.data() + (b - b0) * kBlockCols, totals.data() + (b - b0) * kBlockCols, ld);
  for (; b < b1; ++b) column<1>(o, b, kept.data() + (b - b0) * kBlockCols, totals.data() + (b - b0) * kBlockCols, ld);
}

template void stream_blocks<float>(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*, float*,
                                   int64_t, int64_t, int64_t, int64_t, int64_t, const Chunks<float>&);
template void stream_blocks<c10::BFloat16>(const int8_t*, const float*, const int32_t*, const uint8_t*, const float*,
                                           c10::BFloat16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                           const Chunks<c10::BFloat16>&);

#endif

}  // namespace shardline::w8a8
