// The dense bfloat16 matmul on the packed weight (layout and order of summation: cpu_gemm_packed.h).
//
// AVX512-BF16: tiles of 4 rows x 4 blocks (64 channels), 16 accumulators, 4 weight vectors and one
// broadcast activation pair per k-pair: no horizontal sums, the weight vectors reused by 4 rows. A
// single row (a decode step at batch 1) takes 8 blocks per tile, 8 weight streams in flight. On the
// 1B-class and SmolLM2 shapes with their lm_heads, 1 to 1,024 rows (bench/gemm_packed.py, 2-core
// AMD EPYC): 0.99-4.8x oneDNN through torch, and 1.0-1.7x the [N, K] kernel from 4 rows up
// (0.87-1.15x at one row, where both stream the weights from memory).
//
// AVX2 + FMA (no AVX512-BF16): the same layout, each 16-channel block as two 8-lane float32 halves
// (a k-pair's even and odd bfloat16 split off by a shift and a mask, as the [N, K] AVX2 kernel does),
// tiles of 4 rows x 1 block, two fused multiply-adds per k-pair and output, k in order. Its own bits,
// batch-invariant as above. The whole SmolLM2 / 1B-class weight sequence, cold, in the AVX2 build on
// the same machine: 1.15x / 1.27x the [N, K] AVX2 kernel at one row, 1.27x / 1.25x at 16.
//
// Both: rows are taken in blocks of kRowBlock and K in panels of kPanelPairs k-pairs: one panel of a
// tile's weights (256 KB) stays in L2 while every row tile of the block passes over it, the block's
// activations stay in L2 across the task's channels.
//
// The streaming columns of cpu_gemm_stream.cpp instead: AVX512-BF16 at 5 to kStreamRows rows. AVX2
// takes the 4-row tiles from 2 rows: on the AVX2-only EPYC they ran SmolLM2's weight sequence at 16
// rows in 35 ms where AVX2 streaming columns took 68 (the [N, K] kernel 40-42 in both runs).

#include "cpu_gemm_packed.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_gemm_packed_sums.h"
#include "cpu_vec.h"

#if defined(SHARDLINE_AVX512) && defined(__AVX512BF16__)
#define SHARDLINE_PACKED 1
#elif defined(SHARDLINE_GEMM_AVX2)
#define SHARDLINE_PACKED 1
#define SHARDLINE_PACKED_AVX2 1
#endif

namespace shardline::packed {

#ifdef SHARDLINE_PACKED
namespace {

constexpr int kRows = 4;          // rows per tile
#ifdef SHARDLINE_PACKED_AVX2
constexpr int kBlocks = 1;        // AVX2's 16 registers: 4 rows x 16 channels of sums
constexpr int kRowBlocks = 4;
#else
constexpr int kBlocks = 4;        // 16-channel blocks per tile
constexpr int kRowBlocks = 8;     // blocks per tile when the product has one row
#endif
// Rows per block and k-pairs per panel: of 64-512 rows x 256-1,024 pairs, 256 x 1,024 was within a
// few percent of the best on every 1B-class and SmolLM2 shape from 16 to 1,024 rows (64 x 512 was
// 0.8-0.9x at 256-1,024 rows of the 1B MLP)
constexpr int64_t kRowBlock = 256;
// A last block of up to this many rows joins the one before (a step of a 256-token prefill chunk and
// 16 decodes: one pass over the weights instead of a second for 16 rows; 268-320 rows took 0.91-0.95x
// the time on the 1B-class weights)
constexpr int64_t kRowBlockSlack = 64;
constexpr int64_t kPanelPairs = 1024;
// A task's weights above this many bytes, in streams of one panel or less, are fetched ahead (see
// column)
constexpr int64_t kFetchBytes = 8 << 20;

// One call's operands: x rows ldx apart (at the call's first k), the packed weight (kp k-pairs per
// block, the call's range starting at pair p0), y rows ldy apart
struct Job {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t kp, p0;
  c10::BFloat16* y;
  int64_t ldy;
};

// rows [m, m + MB) x blocks [b, b + NB), k-pairs [q0, q1) of the call's range; `kept` and `total`
// float32, rows ld apart (see ChunkFlags). `fetch`: also ask for the next NB blocks' weights, a line for
// each one read.
#ifdef SHARDLINE_PACKED_AVX2
template <int MB, int NB>
SHARDLINE_INLINE void tile(const Job& o, int64_t m, int64_t b, int64_t q0, int64_t q1, ChunkFlags s, float* kept,
                           float* total, int64_t ld, bool fetch = false) {
  // AVX2 + FMA: a block's 16 channels as two 8-lane halves; a k-pair's 32 bytes of a half hold its
  // 8 channels' even k in the words' low halves and odd k in the high halves (even_bf16/odd_bf16)
  __m256 acc[MB][2 * NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 2 * NB; ++j) acc[i][j] = s.fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(kept + i * ld + j * 8);
  const uint16_t* w = o.w + (b * o.kp + o.p0 + q0) * 32;
  const int64_t stride = o.kp * 32;
  const uint16_t* x = o.x + m * o.ldx + 2 * q0;
  for (int64_t q = q0; q < q1; ++q, w += 32, x += 2) {
    __m256 we[2 * NB], wo[2 * NB];
    for (int j = 0; j < 2 * NB; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j / 2) * stride + (j % 2) * 16));
      we[j] = even_bf16(v);
      wo[j] = odd_bf16(v);
    }
    if (fetch)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (NB + j) * stride), _MM_HINT_T0);
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * o.ldx, 4);
      const __m256i a = _mm256_set1_epi32(pair);
      const __m256 xe = even_bf16(a), xo = odd_bf16(a);
      for (int j = 0; j < 2 * NB; ++j) acc[i][j] = _mm256_fmadd_ps(xo, wo[j], _mm256_fmadd_ps(xe, we[j], acc[i][j]));
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 2 * NB; ++j)
      finish_sums(acc[i][j], s, kept + i * ld + j * 8, total + i * ld + j * 8, o.y + (m + i) * o.ldy + b * 16 + j * 8);
}

#else
template <int MB, int NB>
SHARDLINE_INLINE void tile(const Job& o, int64_t m, int64_t b, int64_t q0, int64_t q1, ChunkFlags s, float* kept,
                           float* total, int64_t ld, bool fetch = false) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = s.fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(kept + i * ld + j * 16);
  const uint16_t* w = o.w + (b * o.kp + o.p0 + q0) * 32;
  const int64_t stride = o.kp * 32;  // one block to the next
  const uint16_t* x = o.x + m * o.ldx + 2 * q0;
  for (int64_t q = q0; q < q1; ++q, w += 32, x += 2) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_castsi512_ps(_mm512_loadu_si512(w + j * stride));
    if (fetch)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (NB + j) * stride), _MM_HINT_T0);
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * o.ldx, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      finish_sums(acc[i][j], s, kept + i * ld + j * 16, total + i * ld + j * 16,
                  reinterpret_cast<uint16_t*>(o.y + (m + i) * o.ldy + (b + j) * 16));
}

#endif

// rows [m0, m1) against blocks [b, b + NB): 4-row tiles, then the 1-3 rows left. The first tile
// reads the weights' panel from memory, the others find it in cache. With `ahead`, one row tile
// (the second, or the only one) asks for the next blocks' weights meanwhile. That helped only
// where a block's stream is short and the matrix comes from memory (SmolLM2's lm_head, K = 576:
// 1.1-1.2x at 2-8 rows); elsewhere the hardware prefetcher alone was 1.1-1.6x faster at 2-16 rows.
template <int NB>
SHARDLINE_INLINE void column(const Job& o, int64_t m0, int64_t m1, int64_t b, int64_t q0, int64_t q1, ChunkFlags s,
                             float* kept, float* total, int64_t ld, bool ahead) {
  const int64_t fetcher = ahead ? (m1 - m0 > kRows ? m0 + kRows : m0) : -1;
  int64_t m = m0;
  for (; m + kRows <= m1; m += kRows)
    tile<kRows, NB>(o, m, b, q0, q1, s, kept + (m - m0) * ld, total + (m - m0) * ld, ld, m == fetcher);
  float* rest = kept + (m - m0) * ld;
  float* rest_total = total + (m - m0) * ld;
  const bool fetch = m == fetcher;
  switch (m1 - m) {
    case 3: tile<3, NB>(o, m, b, q0, q1, s, rest, rest_total, ld, fetch); break;
    case 2: tile<2, NB>(o, m, b, q0, q1, s, rest, rest_total, ld, fetch); break;
    case 1: tile<1, NB>(o, m, b, q0, q1, s, rest, rest_total, ld, fetch); break;
    default: break;
  }
}

}  // namespace

bool built() { return true; }

void blocks(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t kp, int64_t p0, int64_t pairs,
            c10::BFloat16* y, int64_t ldy, int64_t b0, int64_t b1, int64_t chunk_pairs) {
  const Job o{x, ldx, w, kp, p0, y, ldy};
  const int64_t chunk = chunk_pairs > 0 ? chunk_pairs : pairs;
  TORCH_CHECK(pairs % chunk == 0, "packed blocks: ", pairs, " k-pairs in chunks of ", chunk);
  // the sums between panels and the chunks' total, [rows, 16 * (b1 - b0)] float32 each
  const int64_t ld = 16 * (b1 - b0), rows = std::min(M, kRowBlock + kRowBlockSlack);
  thread_local std::vector<float> kept_sums, totals;
  if (chunk < pairs) totals.resize(static_cast<size_t>(rows * ld));
  float* total = totals.data();
  if (M == 1) {  // a chunk in registers: 8 weight streams per tile, nothing to reuse
    int64_t b = b0;
    for (; b + kRowBlocks <= b1; b += kRowBlocks)
      for (int64_t c = 0; c < pairs; c += chunk)
        tile<1, kRowBlocks>(o, 0, b, c, c + chunk, ChunkFlags{true, true, c == 0, c + chunk == pairs}, nullptr,
                            total + (b - b0) * 16, ld);
    for (; b < b1; ++b)
      for (int64_t c = 0; c < pairs; c += chunk)
        tile<1, 1>(o, 0, b, c, c + chunk, ChunkFlags{true, true, c == 0, c + chunk == pairs}, nullptr,
                   total + (b - b0) * 16, ld);
    return;
  }
#ifndef SHARDLINE_PACKED_AVX2
  if (M > kRows && M <= kStreamRows) {
    stream_blocks(x, ldx, M, w, kp, p0, pairs, y, ldy, b0, b1, chunk_pairs);
    return;
  }
#endif
  if (chunk > kPanelPairs) kept_sums.resize(static_cast<size_t>(rows * ld));
  float* kept = kept_sums.data();
  const bool ahead = pairs <= kPanelPairs && (b1 - b0) * pairs * 64 > kFetchBytes;
  for (int64_t m0 = 0, m1 = 0; m0 < M; m0 = m1) {
    m1 = M - m0 <= kRowBlock + kRowBlockSlack ? M : m0 + kRowBlock;
    for (int64_t c = 0; c < pairs; c += chunk)
      for (int64_t q0 = c; q0 < c + chunk; q0 += kPanelPairs) {
        const int64_t q1 = std::min(c + chunk, q0 + kPanelPairs);
        const ChunkFlags s{q0 == c, q1 == c + chunk, c == 0, c + chunk == pairs};
        int64_t b = b0;
        for (; b + kBlocks <= b1; b += kBlocks)
          column<kBlocks>(o, m0, m1, b, q0, q1, s, kept + (b - b0) * 16, total + (b - b0) * 16, ld, ahead);
        float* rest = kept + (b - b0) * 16;
        float* rest_total = total + (b - b0) * 16;
        switch (b1 - b) {
          case 3: column<3>(o, m0, m1, b, q0, q1, s, rest, rest_total, ld, ahead); break;
          case 2: column<2>(o, m0, m1, b, q0, q1, s, rest, rest_total, ld, ahead); break;
          case 1: column<1>(o, m0, m1, b, q0, q1, s, rest, rest_total, ld, ahead); break;
          default: break;
        }
      }
  }
}

at::Tensor pack(const at::Tensor& w) {
  if (w.dim() != 2 || w.scalar_type() != at::kBFloat16 || !w.device().is_cpu() || w.size(0) % 16 ||
      w.size(1) % 2 || w.size(1) == 0 || amx::ready())
    return w;
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({N / 16, K / 2, 16, 2}, w.options());
  const uint32_t* src = static_cast<const uint32_t*>(wc.data_ptr());  // a k-pair as one 32-bit word
  uint32_t* dst = static_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < 16; ++c) {
        const uint32_t* row = src + (b * 16 + c) * (K / 2);
        uint32_t* lane = dst + b * 16 * (K / 2) + c;
        for (int64_t p = 0; p < K / 2; ++p) lane[p * 16] = row[p];
      }
  });
  return out;
}

#else  // neither AVX512-BF16 nor AVX2 + FMA: torch's linear on the [N, K] rows

bool built() { return false; }

void blocks(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, int64_t, c10::BFloat16*, int64_t,
            int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "dense_linear: a packed weight, and this build has no packed kernel (neither AVX512-BF16 nor "
                     "AVX2 + FMA)");
}

at::Tensor pack(const at::Tensor& w) { return w; }

#endif  // SHARDLINE_PACKED

}  // namespace shardline::packed
