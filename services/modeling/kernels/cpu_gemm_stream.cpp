// The packed bfloat16 matmul at 5 to kStreamRows rows on AVX512-BF16 (a decode step's batch, a
// short prefill chunk): the weights stream in under the arithmetic. Layout and order of summation:
// cpu_gemm_packed.h; the same chains, the same bits as the tiles of cpu_gemm_packed.cpp.
//
// There a panel's first 4-row tile waited on memory and the others then computed from cache, the
// stream and the arithmetic one after the other. Here the weights go column by column (3 blocks,
// 8-row tiles: 24 sums), K in panels of 1,024 k-pairs. The first row tile of a panel asks for each
// block's weights 64 k-pairs ahead (more lines in flight than the hardware prefetcher keeps); the
// other full row tiles share out the next panel's lines among them (this column's next panel, or
// the next column's first), so the first tile of the next panel finds most of it in cache. The rows'
// k-pairs are first interleaved ([pairs, M]: a row tile's broadcasts from one line, where rows a power
// of two apart all map to one set of the L1 cache).
//
// AVX2 + FMA has no streaming columns: the AVX2 machines this serves (a 2-core AMD EPYC with AVX2
// only) ran AVX2 columns (4-row tiles one block wide, the activations widened to float32 once per
// call) at 55-70 GFLOP/s from 4 to 48 rows, where the 4-row tiles of cpu_gemm_packed.cpp ran 90-130
// (bench.gemm_packed, SmolLM2's shapes); an AVX2 build on an AVX-512 EPYC had found the opposite.
//
// A translation unit of its own: each change to the 4-row tiles' code in cpu_gemm_packed.cpp, even a
// branch never taken there, moved their 128-256-row products by 6-16 %.

#include <algorithm>
#include <vector>

#include "cpu_gemm_packed.h"
#include "cpu_gemm_packed_sums.h"
#include "cpu_vec.h"

namespace shardline::packed {

#if defined(SHARDLINE_AVX512) && defined(__AVX512BF16__)
namespace {

constexpr int kRowTile = 8;
constexpr int kBlocks = 3;
constexpr int64_t kPanelPairs = 1024;
constexpr int kAheadPairs = 64;

struct Operands {
  const uint32_t* x;  // [pairs, M]: row i's k-pair q at q * M + i
  int64_t M;
  const uint16_t* w;
  int64_t kp, p0;
  c10::BFloat16* y;
  int64_t ldy;
};

// rows [m, m + MB) x blocks [b, b + NB), k-pairs [q0, q1); where the sums start and go: ChunkFlags
// (cpu_gemm_packed_sums.h). First: ask kAheadPairs ahead. `next`, when not null: ask for one of its
// k-pairs (NB lines) every `every` pairs.
template <int MB, int NB, bool First>
SHARDLINE_INLINE void tile(const Operands& o, int64_t m, int64_t b, int64_t q0, int64_t q1, const ChunkFlags s,
                           float* kept, float* total, int64_t ld, const uint16_t* next, int64_t every) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = s.fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(kept + i * ld + j * 16);
  const uint16_t* w = o.w + (b * o.kp + o.p0 + q0) * 32;
  const int64_t stride = o.kp * 32;
  const uint32_t* x = o.x + q0 * o.M + m;
  int64_t countdown = 0;
  for (int64_t q = q0; q < q1; ++q, w += 32, x += o.M) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_castsi512_ps(_mm512_loadu_si512(w + j * stride));
    if constexpr (First)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * stride + kAheadPairs * 32), _MM_HINT_T0);
    if (next != nullptr && countdown-- == 0) {
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * stride), _MM_HINT_T0);
      next += 32 * every;
      countdown = every - 1;
    }
    for (int i = 0; i < MB; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(x[i]));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      finish_sums(acc[i][j], s, kept + i * ld + j * 16, total + i * ld + j * 16,
                  reinterpret_cast<uint16_t*>(o.y + (m + i) * o.ldy + (b + j) * 16));
}

// every row against blocks [b, b + NB), panel by panel of the call's k-pairs (walk_column); `kept` and
// `total` at the column's first channel. After the task's last column the next panel is the next
// task's, or past the weight: a prefetch never faults.
template <int NB>
void column(const Operands& o, int64_t b, int64_t pairs, int64_t chunk, float* kept, float* total, int64_t ld) {
  walk_column<kRowTile>(
      o.M, pairs, chunk, kPanelPairs, 32,
      [&](int64_t q1) { return o.w + ((q1 < pairs ? b : b + NB) * o.kp + o.p0 + (q1 < pairs ? q1 : 0)) * 32; },
      [&](auto mb, auto first, int64_t m, int64_t q0, int64_t q1, ChunkFlags s, int64_t, const uint16_t* next,
          int64_t every) SHARDLINE_LAMBDA_INLINE {
        tile<decltype(mb)::value, NB, decltype(first)::value>(o, m, b, q0, q1, s, kept + m * ld, total + m * ld, ld,
                                                               next, every);
      });
}

}  // namespace

void stream_blocks(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t kp, int64_t p0, int64_t pairs,
                   c10::BFloat16* y, int64_t ldy, int64_t b0, int64_t b1, int64_t chunk_pairs) {
  const int64_t chunk = chunk_pairs > 0 ? chunk_pairs : pairs, ld = 16 * (b1 - b0);
  thread_local std::vector<uint32_t> rows_by_pair;
  thread_local std::vector<float> kept, totals;
  rows_by_pair.resize(static_cast<size_t>(pairs * M));
  kept.resize(static_cast<size_t>(M * ld));
  if (chunk < pairs) totals.resize(static_cast<size_t>(M * ld));
  for (int64_t i = 0; i < M; ++i) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(x + i * ldx);  // a k-pair as one 32-bit word
    for (int64_t q = 0; q < pairs; ++q) rows_by_pair[q * M + i] = row[q];
  }
  const Operands o{rows_by_pair.data(), M, w, kp, p0, y, ldy};
  int64_t b = b0;
  for (; b + kBlocks <= b1; b += kBlocks)
    column<kBlocks>(o, b, pairs, chunk, kept.data() + (b - b0) * 16, totals.data() + (b - b0) * 16, ld);
  for (; b < b1; ++b) column<1>(o, b, pairs, chunk, kept.data() + (b - b0) * 16, totals.data() + (b - b0) * 16, ld);
}

#else

void stream_blocks(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, int64_t, c10::BFloat16*,
                   int64_t, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "packed stream_blocks: this build has no AVX512-BF16");
}

#endif

}  // namespace shardline::packed
