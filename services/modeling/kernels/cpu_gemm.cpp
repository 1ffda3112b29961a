// Dense bfloat16 linear: y[m, n] = sum_k x[m, k] * w[n, k], float32 accumulation, y rounded to
// bfloat16 once at the end (x [M, K], w [N, K], y [M, N], all bfloat16).
//
// Batch-invariant: every output element is summed the same way whatever M is, whatever the other
// rows hold and however the channels are split across threads. Its 16 float32 lanes take the
// products of x row m and w row n 32 elements at a time (vdpbf16ps, shardline::dot_tile_bf16), K
// in the same chunks for every element (a last chunk of K % 32 zero-filled), and reduce4 folds the
// lanes in one fixed order. Tiles only choose which elements are computed together, never how one
// is summed, so a row of a prefill batch gets the bits it would get alone in a decode step.
//
// Speed: at M = 1 the step is bound by the weight bytes: 8 output channels per tile keep 8 weight
// streams in flight (the hardware prefetcher does best alone there: asking for lines ahead was
// slower). For more rows a tile is 4 channels x up to 4 rows, 16 accumulators; the 4 weight rows
// stay in L1 while the row tiles pass over them, and the rows are taken in blocks that stay in L2
// across a task's channels. Each tile rounds its sums to bfloat16 four at a time (vcvtneps2bf16):
// rounding each element with scalar code made 1024 rows 1.6x slower.
//
// On a machine with AMX (and a weight whose shape the tiles take, amx::fits) the tile kernel
// runs instead (cpu_amx.cpp): batch-invariant in the same way, with other bits than this kernel's,
// chosen by the machine and the weight's shape alone. At 16 rows it was 5-6x faster here.
//
// Built without AVX512-BF16 but with AVX2 + FMA (an older or AVX2-only machine), the same tiles run
// on 8 float32 lanes (shardline::dot_tile_bf16_avx2: 16 elements per chunk, 4 rows x 2 channels):
// batch-invariant in the same way, its own bits. torch's bfloat16 linear there had no fast path
// (~5 GFLOP/s on a 2-core AMD EPYC). Built with neither, dense_linear is torch's own linear and
// dense_linear_vectorized() says false: callers use F.linear themselves then.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <algorithm>

#include "cpu_amx.h"
#include "cpu_vec.h"

#if defined(SHARDLINE_AVX512) && defined(__AVX512BF16__)
#define SHARDLINE_GEMM_BF16 1
#endif
#if defined(SHARDLINE_GEMM_BF16) || defined(SHARDLINE_GEMM_AVX2)
#define SHARDLINE_GEMM 1
#endif

namespace {

#ifdef SHARDLINE_GEMM
#ifdef SHARDLINE_GEMM_BF16
constexpr int64_t kGroup = 4;              // output channels per reduce4
#else
constexpr int64_t kGroup = 2;              // AVX2's 16 registers: 4 rows x 2 channels of sums, 2 channels' chunk
#endif
constexpr int64_t kGroupsPerTask = 64 / kGroup;  // parallel grain: 64 channels (a few tens of KB of weights)
// activation rows per block: ~256 KB of x, held in L2 (32, 96 and 256 KB were within a few
// percent of each other at 256 and 1024 rows, 256 ahead)
constexpr int64_t kRowBlockBytes = 256 << 10;

constexpr int kRowChannels = 8;           // channels per tile when a block has a single row

#ifdef SHARDLINE_GEMM_BF16
// y rows [m, m + MB), channels [n, n + NB); NB below 4 only for the last channels of y (the tile
// then reads only the weight rows that exist). `prefetch`: see dot_tile_bf16.
template <int MB, int NB>
inline void tile(const uint16_t* x, const uint16_t* w, c10::BFloat16* y, int64_t K, int64_t N, int64_t m,
                 int64_t n, int64_t prefetch) {
  __m512 acc[MB][NB];
  shardline::dot_tile_bf16<MB, NB>(x + m * K, K, w + n * K, K, K, prefetch, acc);
  const __m512 zero = _mm512_setzero_ps();
  constexpr __mmask8 valid = static_cast<__mmask8>((1u << std::min(NB, 4)) - 1);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; j += kGroup) {
      auto lane = [&](int c) { return j + c < NB ? acc[i][j + c] : zero; };
      // the four sums rounded to bfloat16 (to nearest even) in one instruction, stored as 8 bytes
      const __m128i bf = (__m128i)_mm_cvtneps_pbh(shardline::reduce4(lane(0), lane(1), lane(2), lane(3)));
      _mm_mask_storeu_epi16(y + (m + i) * N + n + j, valid, bf);
    }
}
#else
// AVX2 + FMA: each sum's 8 lanes folded by hsum8 and rounded to bfloat16 alone. `prefetch`: unused
// (the AVX-512 kernel's hint for the next channels).
template <int MB, int NB>
inline void tile(const uint16_t* x, const uint16_t* w, c10::BFloat16* y, int64_t K, int64_t N, int64_t m,
                 int64_t n, int64_t /*prefetch*/) {
  __m256 acc[MB][NB];
  shardline::dot_tile_bf16_avx2<MB, NB>(x + m * K, K, w + n * K, K, K, acc);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      shardline::Elem<c10::BFloat16>::store(y + (m + i) * N + n + j, shardline::hsum8(acc[i][j]));
}
#endif  // SHARDLINE_GEMM_BF16

// rows [m0, m1) against channels [n, n + NB): 4-row tiles, then the 1..3 left. The first row tile
// reads the weights from memory, the others find them in L1; one row tile (the second, or the
// only one) asks for the next channels' weights meanwhile (NB rows ahead), so that the next first
// tile finds them in cache. At 2 to 16 rows that was 1.4x to 1.7x faster than leaving it to the
// hardware prefetcher.
template <int NB>
inline void channel_tile(const uint16_t* x, const uint16_t* w, c10::BFloat16* y, int64_t K, int64_t N,
                         int64_t m0, int64_t m1, int64_t n) {
  const int64_t fetcher = m1 - m0 > 4 ? m0 + 4 : m0;
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) tile<4, NB>(x, w, y, K, N, m, n, m == fetcher ? NB * K : 0);
  const int64_t pf = m == fetcher ? NB * K : 0;
  switch (m1 - m) {
    case 3: tile<3, NB>(x, w, y, K, N, m, n, pf); break;
    case 2: tile<2, NB>(x, w, y, K, N, m, n, pf); break;
    case 1: tile<1, NB>(x, w, y, K, N, m, n, pf); break;
    default: break;
  }
}

// channels [n0, n1) of every row (n0 a multiple of kGroup; n1 = N or a multiple of kGroup)
void channels(const uint16_t* x, const uint16_t* w, c10::BFloat16* y, int64_t M, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  const int64_t block = std::max<int64_t>(4, kRowBlockBytes / (2 * K) / 4 * 4);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    int64_t n = n0;
    if (m1 - m0 == 1) {  // one row: 8 channels per tile, more weight loads in flight
      for (; n + kRowChannels <= n1; n += kRowChannels) tile<1, kRowChannels>(x, w, y, K, N, m0, n, 0);
    }
    for (; n + kGroup <= n1; n += kGroup) channel_tile<kGroup>(x, w, y, K, N, m0, m1, n);
    switch (n1 - n) {
      case 3: channel_tile<3>(x, w, y, K, N, m0, m1, n); break;
      case 2: channel_tile<2>(x, w, y, K, N, m0, m1, n); break;
      case 1: channel_tile<1>(x, w, y, K, N, m0, m1, n); break;
      default: break;
    }
  }
}
#endif  // SHARDLINE_GEMM

}  // namespace

// x [M, K] bfloat16 (any strides: made contiguous), w [N, K] bfloat16 contiguous -> y [M, N] bfloat16
at::Tensor dense_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "dense_linear: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_linear: x [M, K] and w [N, K], got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "dense_linear: bfloat16 x and w, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "dense_linear: w must be contiguous");
#ifdef SHARDLINE_GEMM
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const uint16_t* xp = static_cast<const uint16_t*>(xc.data_ptr());
  const uint16_t* wp = static_cast<const uint16_t*>(w.data_ptr());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
#ifdef SHARDLINE_GEMM_BF16
  if (shardline::amx::ready() && shardline::amx::fits(K, N)) {
    const at::Tensor packed = shardline::amx::pack(xc);
    const uint16_t* pp = static_cast<const uint16_t*>(packed.data_ptr());
    // tasks of whole 16-channel tiles, four or more each
    at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
      shardline::amx::channels(wp + b0 * 16 * K, K, pp, M, K, nullptr, yp, N, b0 * 16, b1 - b0);
      shardline::amx::end();
    });
    return y;
  }
#endif
  // over groups of kGroup channels, so that a task's range ends on a group (or at N)
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t g0, int64_t g1) {
    channels(xp, wp, yp, M, K, N, g0 * kGroup, std::min(N, g1 * kGroup));
  });
  return y;
#else
  return at::linear(x, w);
#endif
}

// A row-parallel layer's fixed k-chunks in the layout-invariant numerics: x's columns
// [j*W, (j+1)*W) times chunks[j] ([N, W]) for each j, each through dense_linear (the same bits
// whichever rank computes it). With ``sum`` the products are added in float32 in chunk order
// and rounded to bfloat16 once; without, the products come back as [C, M, N], for a caller that
// gathers every rank's and adds them in the same order (services/modeling/parallel/layers.py).
at::Tensor dense_linear_chunks(at::Tensor x, const std::vector<at::Tensor>& chunks, bool sum) {
  TORCH_CHECK(!chunks.empty() && x.dim() == 2, "dense_linear_chunks: x [M, K] and at least one chunk");
  const int64_t width = chunks[0].size(1);
  TORCH_CHECK(x.size(1) == width * static_cast<int64_t>(chunks.size()),
              "dense_linear_chunks: x has ", x.size(1), " columns for ", chunks.size(), " chunks of ", width);
  std::vector<at::Tensor> parts;
  parts.reserve(chunks.size());
  for (size_t j = 0; j < chunks.size(); ++j) {
    parts.push_back(dense_linear(x.narrow(1, static_cast<int64_t>(j) * width, width), chunks[j]));
  }
  if (!sum) {
    at::Tensor out = at::empty({static_cast<int64_t>(parts.size()), x.size(0), chunks[0].size(0)}, x.options());
    for (size_t j = 0; j < parts.size(); ++j) out.select(0, static_cast<int64_t>(j)).copy_(parts[j]);
    return out;
  }
  at::Tensor total = parts[0].to(at::kFloat);
  for (size_t j = 1; j < parts.size(); ++j) total.add_(parts[j]);  // bfloat16 widens exactly
  return total.to(at::kBFloat16);
}

// whether a kernel was compiled in, AVX512-BF16 or AVX2 (dense_linear is torch's linear otherwise)
bool dense_linear_vectorized() {
#ifdef SHARDLINE_GEMM
  return true;
#else
  return false;
#endif
}
