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
// A weight packed by shardline::packed::pack (4-D: a machine without AMX, see
// LinearBase.kernel_weight) takes the packed kernel instead (cpu_gemm_packed.cpp), in this file's
// two entry points alike.
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
#include <ATen/ops/bmm.h>
#include <algorithm>
#include <vector>

#include "cpu_amx.h"
#include "cpu_gemm_packed.h"
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
// A K longer than this is taken in panels of it (AVX-512 path): 4 weight rows' panel is 16 KB, in
// L1 with the row tiles' 16 KB of x. At 2048 (1024, 4096 tried) the 1B shape's down projection
// (K = 8192) ran 1.16x faster and K = 4096 1.30x; shorter K are not split.
constexpr int64_t kPanel = 2048;
#else
constexpr int64_t kPanel = 0;  // the AVX2 tiles: not measured split
#endif
constexpr int64_t kPanelRows = 128;  // the most rows of a block that takes K in panels

// One product's operands: y [M, N] (rows N apart) = x [M, K] times w [N, K]^T, x's rows ldx
// elements apart and w's ldw (a whole matrix, or a k-range of a wider one)
struct Operands {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;
  int64_t ldw;
  c10::BFloat16* y;
  int64_t M, K, N;
};

#ifdef SHARDLINE_GEMM_BF16
// y rows [m, m + MB), channels [n, n + NB) from their sums; NB below 4 only for the last channels
// of y (the tile then reads only the weight rows that exist)
template <int MB, int NB>
inline void store_tile(const Operands& o, int64_t m, int64_t n, __m512 (&acc)[MB][NB]) {
  const __m512 zero = _mm512_setzero_ps();
  constexpr __mmask8 valid = static_cast<__mmask8>((1u << std::min(NB, 4)) - 1);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; j += kGroup) {
      auto lane = [&](int c) { return j + c < NB ? acc[i][j + c] : zero; };
      // the four sums rounded to bfloat16 (to nearest even) in one instruction, stored as 8 bytes
      const __m128i bf = (__m128i)_mm_cvtneps_pbh(shardline::reduce4(lane(0), lane(1), lane(2), lane(3)));
      _mm_mask_storeu_epi16(o.y + (m + i) * o.N + n + j, valid, bf);
    }
}

// the whole of K at once. `prefetch`: see dot_tile_bf16.
template <int MB, int NB>
inline void tile(const Operands& o, int64_t m, int64_t n, int64_t prefetch) {
  __m512 acc[MB][NB];
  shardline::dot_tile_bf16<MB, NB>(o.x + m * o.ldx, o.ldx, o.w + n * o.ldw, o.ldw, o.K, prefetch, acc);
  store_tile<MB, NB>(o, m, n, acc);
}

// K's panel [k0, k1) only, the sums so far kept in `kept` (MB x NB registers' worth) between
// panels: from zero at the first, stored at the last. The same bits as tile (dot_range_bf16).
template <int MB, int NB>
inline void tile_panel(const Operands& o, int64_t m, int64_t n, int64_t k0, int64_t k1, int64_t prefetch,
                       __m512* kept) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = k0 == 0 ? _mm512_setzero_ps() : kept[i * NB + j];
  shardline::dot_range_bf16<MB, NB>(o.x + m * o.ldx, o.ldx, o.w + n * o.ldw, o.ldw, k0, k1, o.K, prefetch, acc);
  if (k1 == o.K) {
    store_tile<MB, NB>(o, m, n, acc);
    return;
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) kept[i * NB + j] = acc[i][j];
}
#else
// AVX2 + FMA: each sum's 8 lanes folded by hsum8 and rounded to bfloat16 alone. `prefetch`: unused
// (the AVX-512 kernel's hint for the next channels).
template <int MB, int NB>
inline void tile(const Operands& o, int64_t m, int64_t n, int64_t /*prefetch*/) {
  __m256 acc[MB][NB];
  shardline::dot_tile_bf16_avx2<MB, NB>(o.x + m * o.ldx, o.ldx, o.w + n * o.ldw, o.ldw, o.K, acc);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      shardline::Elem<c10::BFloat16>::store(o.y + (m + i) * o.N + n + j, shardline::hsum8(acc[i][j]));
}
#endif  // SHARDLINE_GEMM_BF16

// rows [m0, m1) against channels [n, n + NB): 4-row tiles, then the 1..3 left. The first row tile
// reads the weights from memory, the others find them in L1; one row tile (the second, or the
// only one) asks for the next channels' weights meanwhile (NB rows ahead), so that the next first
// tile finds them in cache. At 2 to 16 rows that was 1.4x to 1.7x faster than leaving it to the
// hardware prefetcher.
template <int NB>
inline void channel_tile(const Operands& o, int64_t m0, int64_t m1, int64_t n) {
  const int64_t fetcher = m1 - m0 > 4 ? m0 + 4 : m0;
  const int64_t ahead = NB * o.ldw;
#ifdef SHARDLINE_GEMM_BF16
  if (kPanel && o.K > kPanel && m1 - m0 > 1 && m1 - m0 <= kPanelRows) {
    // a long K in panels: one panel of the NB weight rows stays in L1 while every row tile of the
    // block passes over it (the whole rows of K = 8192 did not fit, and came from L2 for each tile)
    alignas(64) __m512 kept[kPanelRows / 4][4 * NB];
    for (int64_t k0 = 0; k0 < o.K; k0 += kPanel) {
      const int64_t k1 = std::min(o.K, k0 + kPanel);
      int64_t m = m0;
      for (; m + 4 <= m1; m += 4)
        tile_panel<4, NB>(o, m, n, k0, k1, m == fetcher ? ahead : 0, kept[(m - m0) / 4]);
      const int64_t pf = m == fetcher ? ahead : 0;
      __m512* rest = kept[(m - m0) / 4];
      switch (m1 - m) {
        case 3: tile_panel<3, NB>(o, m, n, k0, k1, pf, rest); break;
        case 2: tile_panel<2, NB>(o, m, n, k0, k1, pf, rest); break;
        case 1: tile_panel<1, NB>(o, m, n, k0, k1, pf, rest); break;
        default: break;
      }
    }
    return;
  }
#endif
  int64_t m = m0;
  for (; m + 4 <= m1; m += 4) tile<4, NB>(o, m, n, m == fetcher ? ahead : 0);
  const int64_t pf = m == fetcher ? ahead : 0;
  switch (m1 - m) {
    case 3: tile<3, NB>(o, m, n, pf); break;
    case 2: tile<2, NB>(o, m, n, pf); break;
    case 1: tile<1, NB>(o, m, n, pf); break;
    default: break;
  }
}

// channels [n0, n1) of every row (n0 a multiple of kGroup; n1 = N or a multiple of kGroup)
void channels(const Operands& o, int64_t n0, int64_t n1) {
  // rows per block: ~256 KB of x, or of one panel of it when K is taken in panels
  const bool panels = kPanel && o.K > kPanel;
  const int64_t rows = std::max<int64_t>(4, kRowBlockBytes / (2 * (panels ? kPanel : o.K)) / 4 * 4);
  const int64_t block = panels ? std::min(kPanelRows, rows) : rows;
  for (int64_t m0 = 0; m0 < o.M; m0 += block) {
    const int64_t m1 = std::min(o.M, m0 + block);
    int64_t n = n0;
    if (m1 - m0 == 1) {  // one row: 8 channels per tile, more weight loads in flight
      for (; n + kRowChannels <= n1; n += kRowChannels) tile<1, kRowChannels>(o, m0, n, 0);
    }
    for (; n + kGroup <= n1; n += kGroup) channel_tile<kGroup>(o, m0, m1, n);
    switch (n1 - n) {
      case 3: channel_tile<3>(o, m0, m1, n); break;
      case 2: channel_tile<2>(o, m0, m1, n); break;
      case 1: channel_tile<1>(o, m0, m1, n); break;
      default: break;
    }
  }
}

// Whether the AMX tile kernel takes a product of K columns into N channels here
bool on_amx(int64_t K, int64_t N) {
#ifdef SHARDLINE_GEMM_BF16
  return shardline::amx::ready() && shardline::amx::fits(K, N);
#else
  (void)K, (void)N;
  return false;
#endif
}

// In a parallel task: the AMX kernel's channels [16 * b0, 16 * b1) of o (xp: o's x packed)
void amx_channels(const Operands& o, const uint16_t* xp, int64_t b0, int64_t b1) {
#ifdef SHARDLINE_GEMM_BF16
  shardline::amx::channels(o.w + b0 * 16 * o.ldw, o.ldw, xp, o.M, o.K, nullptr, o.y, o.N, b0 * 16, b1 - b0);
#else
  (void)o, (void)xp, (void)b0, (void)b1;
#endif
}

void amx_end() {
#ifdef SHARDLINE_GEMM_BF16
  shardline::amx::end();
#endif
}

// The products of x's chunks of K / C columns with w's, into parts [C, M, N] (chunk j: x's and
// w's columns [j*W, (j+1)*W)), each with the bits dense_linear gives it alone; with y, also their
// sum (sum_parts), each task summing its own channels while they are in cache. One parallel
// pass over the channels: a task takes each chunk of its weight rows in turn. packed_w: wp is a
// packed weight's data; its sum (y) is made in the kernel, chunk after chunk of each tile, and
// parts is not written.
void chunk_products(const at::Tensor& xc, const uint16_t* wp, bool packed_w, int64_t C, c10::BFloat16* parts,
                    int64_t N, c10::BFloat16* y) {
  const int64_t M = xc.size(0), K = xc.size(1), width = K / C;
  const uint16_t* xp = static_cast<const uint16_t*>(xc.data_ptr());
  auto chunk = [&](int64_t j) {
    return Operands{xp + j * width, K, wp + j * width, K, parts + j * M * N, M, width, N};
  };
  if (packed_w) {  // chunk j: the packed weight's k-pairs [j * width / 2, (j + 1) * width / 2)
    at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
      if (y != nullptr) {  // the sum in the kernel, chunk by chunk: no product written out
        shardline::packed::blocks(xp, K, M, wp, K / 2, 0, K / 2, y, N, b0, b1, width / 2);
        return;
      }
      for (int64_t j = 0; j < C; ++j)
        shardline::packed::blocks(xp + j * width, K, M, wp, K / 2, j * width / 2, width / 2, parts + j * M * N, N,
                                  b0, b1);
    });
    return;
  }
  if (on_amx(width, N)) {
    std::vector<at::Tensor> packed;  // each chunk's activations, packed once for the tiles
    for (int64_t j = 0; j < C; ++j)
      packed.push_back(shardline::amx::pack(xc.narrow(1, j * width, width).contiguous()));
    at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
      for (int64_t j = 0; j < C; ++j)
        amx_channels(chunk(j), static_cast<const uint16_t*>(packed[j].data_ptr()), b0, b1);
      amx_end();
      if (y != nullptr) shardline::sum_parts(parts, C, M, N, y, b0 * 16, b1 * 16);
    });
    return;
  }
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * kGroup, n1 = std::min(N, g1 * kGroup);
    for (int64_t j = 0; j < C; ++j) channels(chunk(j), n0, n1);
    if (y != nullptr) shardline::sum_parts(parts, C, M, N, y, n0, n1);
  });
}
#endif  // SHARDLINE_GEMM

}  // namespace

// x [M, K] bfloat16 (any strides: made contiguous), w [N, K] bfloat16 contiguous -> y [M, N] bfloat16
at::Tensor dense_linear(at::Tensor x, at::Tensor w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "dense_linear: CPU tensors");
  const bool packed_w = shardline::packed::is_packed(w);
  TORCH_CHECK(x.dim() == 2 && (packed_w ? x.size(1) == 2 * w.size(1) : w.dim() == 2 && x.size(1) == w.size(1)),
              "dense_linear: x [M, K] and w [N, K] (or packed [N / 16, K / 2, 16, 2]), got ", x.sizes(), " and ",
              w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "dense_linear: bfloat16 x and w, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "dense_linear: w must be contiguous");
#ifdef SHARDLINE_GEMM
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = shardline::packed::channels(w);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  if (packed_w) {
    const uint16_t* xp = static_cast<const uint16_t*>(xc.data_ptr());
    const uint16_t* wp = static_cast<const uint16_t*>(w.data_ptr());
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
    at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
      shardline::packed::blocks(xp, K, M, wp, K / 2, 0, K / 2, yp, N, b0, b1);
    });
    return y;
  }
  const Operands o{static_cast<const uint16_t*>(xc.data_ptr()), K, static_cast<const uint16_t*>(w.data_ptr()), K,
                   y.data_ptr<c10::BFloat16>(), M, K, N};
  if (on_amx(K, N)) {
    const at::Tensor packed = shardline::amx::pack(xc);
    // tasks of whole 16-channel tiles, four or more each
    at::parallel_for(0, N / 16, 4, [&](int64_t b0, int64_t b1) {
      amx_channels(o, static_cast<const uint16_t*>(packed.data_ptr()), b0, b1);
      amx_end();
    });
    return y;
  }
  // over groups of kGroup channels, so that a task's range ends on a group (or at N)
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, kGroupsPerTask, [&](int64_t g0, int64_t g1) {
    channels(o, g0 * kGroup, std::min(N, g1 * kGroup));
  });
  return y;
#else
  return at::linear(x, w);
#endif
}

// parts [C, ...] summed in float32 in chunk order (bfloat16 widens exactly), in parts' dtype
at::Tensor sum_chunk_products(const at::Tensor& parts) {
  at::Tensor total = parts.select(0, 0).to(at::kFloat, false, true);  // a copy: the sum is made in it
  for (int64_t j = 1; j < parts.size(0); ++j) total.add_(parts.select(0, j));
  return total.to(parts.scalar_type());
}

// A row-parallel layer's fixed k-chunks in the layout-invariant numerics: w [N, K] is a rank's
// slice, K = chunks * W, and chunk j is x's columns [j*W, (j+1)*W) times w's. Each chunk's product
// is what dense_linear gives for the chunk alone (rounded to bfloat16), read in place from w: no
// copy of the weight. With ``sum`` the products are added in float32 in chunk order and rounded
// to bfloat16 once; without, they come back as [chunks, M, N], for a caller that gathers every
// rank's and adds them in the same order (services/modeling/parallel/layers.py). So TP1's sum and
// TP2's gathered sum are the same bits.
at::Tensor dense_linear_chunks(at::Tensor x, at::Tensor w, int64_t chunks, bool sum) {
  const bool packed_w = shardline::packed::is_packed(w);
  const int64_t K = x.size(1);
  TORCH_CHECK(x.dim() == 2 && (packed_w ? K == 2 * w.size(1) : w.dim() == 2 && K == w.size(1)) && chunks > 0 &&
              K % (packed_w ? 2 * chunks : chunks) == 0,
              "dense_linear_chunks: x [M, K] and w [N, K] (or packed, then with even chunks) with K a multiple of ",
              chunks, ", got ", x.sizes(), " and ", w.sizes());
  const int64_t M = x.size(0), N = shardline::packed::channels(w), width = K / chunks;
#ifdef SHARDLINE_GEMM
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && K > 0) {
    at::Tensor y = sum ? at::empty({M, N}, x.options()) : at::Tensor();
    // a packed weight's sum needs no products: the kernel adds each chunk's as it ends
    at::Tensor parts = at::empty(sum && packed_w ? at::IntArrayRef{0} : at::IntArrayRef{chunks, M, N}, x.options());
    if (M > 0 && N > 0)
      chunk_products(x.contiguous(), static_cast<const uint16_t*>(w.data_ptr()), packed_w, chunks,
                     parts.data_ptr<c10::BFloat16>(), N, sum ? y.data_ptr<c10::BFloat16>() : nullptr);
    return sum ? y : parts;
  }
#endif
  TORCH_CHECK(!packed_w, "dense_linear_chunks: a packed weight takes bfloat16 x");
  // other dtypes (float32), or no kernel here: every chunk's product in one batched matmul, chunk j
  // of x [C, M, W] times chunk j of w as [C, W, N]: one call where torch's linear chunk by chunk
  // took eight (3-5x the time at 1-16 rows; the same bits, tested), and at a TP rank the same
  // shapes for its chunks
  const at::Tensor parts = at::bmm(x.contiguous().view({M, chunks, width}).transpose(0, 1),
                                   w.reshape({N, chunks, width}).permute({1, 2, 0}));
  return sum ? sum_chunk_products(parts) : parts;
}

// whether a kernel was compiled in, AVX512-BF16 or AVX2 (dense_linear is torch's linear otherwise)
bool dense_linear_vectorized() {
#ifdef SHARDLINE_GEMM
  return true;
#else
  return false;
#endif
}
