// int8 x int8 matmul (W8A8): int8 weights with one scale per output channel, activations
// quantized to int8 at each call with one scale per 32 consecutive values of a row (llama.cpp's
// Q8_0 grouping), integer dot products per group, float32 across groups:
//
//   y[m, n] = wscale[n] * sum_g d[m, g] * sum_{k in g} xq[m, k] * q[n, k]
//
// with d[m, g] = max_{k in g} |x[m, k]| / 127 and xq = round_half_even(x / d), clamped to
// [-127, 127] (0 where d = 0). The group sums are exact in int32 (|sum| <= 32 * 127 * 127), so
// every path below computes the same bits: the groups are added in order, each with one fused
// multiply-add fa = fma(float(int sum), d, fa); the last step multiplies by wscale[n] and rounds
// to the output dtype.
//
// Weights are repacked once, at load (w8a8_pack), into the layout the integer dot-product
// instructions want: blocks of 16 output channels, and within a block, for each 4 consecutive k,
// the 16 channels' 4 bytes side by side (64 bytes: one zmm). Each byte is q + 128 (unsigned), so
// that AVX512-VNNI's vpdpbusd (unsigned x signed bytes, 4 products into each int32 lane) takes the
// weights as its unsigned operand; the 128 * sum_k xq[m, k] it adds is subtracted by starting
// the group's accumulator at -128 * that sum (computed with the activations). The AVX2 path flips
// the bytes back to signed and uses vpmaddubsw on |xq| and the weights with xq's signs (so no
// pair of products overflows int16: 2 * 127 * 127 < 2^15). N is padded to 16 and K to 32 with
// zero weights (byte 128); padded activations are zero.
//
// In chunks (w8a8_linear_chunks, the layout-invariant numerics' row-parallel sum): K cut into C
// equal chunks of whole groups; each chunk's product is its own groups' sum times wscale, rounded
// to the output dtype, as w8a8_linear gives for the chunk alone (the activations' groups are the
// same ones); the products are written out, or added in float32 in chunk order as each chunk ends
// and the total rounded to the output dtype.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "cpu_w8a8.h"

using shardline::Elem;
using shardline::w8a8::chunk_end_lanes;
using shardline::w8a8::Chunks;
using shardline::w8a8::kBlockCols;
using shardline::w8a8::kGroup;
using shardline::w8a8::kGroupSteps;
using shardline::w8a8::round_up;
using shardline::w8a8::store_lanes;

namespace {

#ifdef SHARDLINE_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return shardline::load_bf16(reinterpret_cast<const uint16_t*>(p));
}

// one whole group of 32 values, as the scalar loop below quantizes it (the same division, the
// same rounding: the default round-to-nearest-even of vcvtps2dq)
template <typename T>
inline void quantize_group16(const T* x, int8_t* q, float* d, int32_t* bias) {
  const __m512 lo = load16(x), hi = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float dg = amax / 127.0f;
  __m512i qlo = _mm512_setzero_si512(), qhi = _mm512_setzero_si512();
  if (dg > 0.f) {
    const __m512 dv = _mm512_set1_ps(dg);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    qlo = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(lo, dv)), bottom), top);
    qhi = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(hi, dv)), bottom), top);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  *d = dg;
  *bias = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
}
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// the same on 8 lanes: 4 vectors per group
template <typename T>
inline void quantize_group8(const T* x, int8_t* q, float* d, int32_t* bias) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
  const float dg = _mm_cvtss_f32(t) / 127.0f;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_setzero_si256();
  if (dg > 0.f) {
    const __m256 dv = _mm256_set1_ps(dg);
    const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
    for (int i = 0; i < 4; ++i)
      qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_div_ps(v[i], dv)), lo), hi);
  }
  // packs interleave the 128-bit lanes: dwords come out as 0 2 4 6 1 3 5 7 of the 32 bytes in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i sum4 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum4), _mm256_extracti128_si256(sum4, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  *d = dg;
  *bias = -128 * _mm_cvtsi128_si32(s);
}
#endif

// The activations, quantized: xq [M, Kp] int8, d [M, G] float32, bias [M, G] int32 (-128 times
// the group's sum of xq: what the unsigned weight bytes add). One row at a time, in order.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t Kp, int8_t* xq, float* d, int32_t* bias) {
  const int64_t G = Kp / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* xm = x + m * K;
      int64_t g = 0;
#if defined(SHARDLINE_AVX512)
      for (; g < K / kGroup; ++g) quantize_group16(xm + g * kGroup, xq + m * Kp + g * kGroup, d + m * G + g,
                                                   bias + m * G + g);
#elif defined(__AVX2__)
      for (; g < K / kGroup; ++g) quantize_group8(xm + g * kGroup, xq + m * Kp + g * kGroup, d + m * G + g,
                                                  bias + m * G + g);
#endif
      for (; g < G; ++g) {
        float v[kGroup];
        const int64_t k0 = g * kGroup, n = std::min(kGroup, K - k0);
        float amax = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) {
          v[i] = i < n ? Elem<T>::load(xm + k0 + i) : 0.f;
          amax = std::max(amax, std::fabs(v[i]));
        }
        const float dg = amax / 127.0f;
        int32_t sum = 0;
        int8_t* q = xq + m * Kp + k0;
        for (int64_t i = 0; i < kGroup; ++i) {
          const float r = dg > 0.f ? std::nearbyint(v[i] / dg) : 0.f;
          q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
          sum += q[i];
        }
        d[m * G + g] = dg;
        bias[m * G + g] = -128 * sum;
      }
    }
  });
}

// The portable path: the packed bytes read back as signed int8, the same sums in the same order.
template <typename T>
void blocks_portable(const int8_t* xq, const float* d, const uint8_t* w, const float* wscale, T* y, int64_t M,
                     int64_t Kp, int64_t N, int64_t b0, int64_t b1, const Chunks<T>& ch) {
  const int64_t G = Kp / kGroup;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * kBlockCols * Kp;
    const int64_t n0 = b * kBlockCols, count = std::min(kBlockCols, N - n0);
    for (int64_t m = 0; m < M; ++m) {
      float fa[kBlockCols] = {}, total[kBlockCols];
      const int8_t* xm = xq + m * Kp;
      for (int64_t g = 0; g < G; ++g) {
        int32_t acc[kBlockCols] = {};
        for (int64_t s = g * kGroupSteps; s < (g + 1) * kGroupSteps; ++s)
          for (int64_t c = 0; c < kBlockCols; ++c)
            for (int64_t j = 0; j < 4; ++j)
              acc[c] += static_cast<int32_t>(xm[s * 4 + j]) * (static_cast<int32_t>(wb[s * 64 + c * 4 + j]) - 128);
        const float dg = d[m * G + g];
        for (int64_t c = 0; c < kBlockCols; ++c) fa[c] = std::fma(static_cast<float>(acc[c]), dg, fa[c]);
        if (ch.ends(g, G)) {
          chunk_end_lanes(fa, wscale, total, y, ch, g / ch.gpc, g + 1 == G, m, N, n0, count);
          std::fill(fa, fa + kBlockCols, 0.0f);
        }
      }
      if (ch.gpc == G) store_lanes(fa, wscale, y + m * N + n0, n0, count);
    }
  }
}

#if defined(SHARDLINE_W8A8_VNNI)
using shardline::w8a8::product16;
using shardline::w8a8::store16;
using shardline::w8a8::store16_raw;

// one row x blocks [b, b + NB): int32 group sums by vpdpbusd (weights unsigned, the activations'
// 4 bytes broadcast), then the group's float32 fused multiply-add
template <int NB, typename T>
inline void row_vnni(const int8_t* xq, const float* d, const int32_t* bias, const uint8_t* w, const float* wscale,
                     T* y, int64_t Kp, int64_t N, int64_t b, const Chunks<T>& ch) {
  const int64_t G = Kp / kGroup, stride = kBlockCols * Kp;
  const uint8_t* wb = w + b * stride;
  __m512 total[NB];  // the chunks' sum so far (in chunks only)
  __m512 fa[NB];
  for (int j = 0; j < NB; ++j) fa[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[NB];
    const __m512i start = _mm512_set1_epi32(bias[g]);
    for (int j = 0; j < NB; ++j) acc[j] = start;
    const uint8_t* wg = wb + g * kGroup * kBlockCols;
    const int8_t* xg = xq + g * kGroup;
#pragma GCC unroll 8
    for (int s = 0; s < kGroupSteps; ++s) {
      int32_t four;
      std::memcpy(&four, xg + s * 4, 4);
      const __m512i a = _mm512_set1_epi32(four);
      for (int j = 0; j < NB; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_loadu_si512(wg + j * stride + s * 64), a);
    }
    const __m512 dg = _mm512_set1_ps(d[g]);
    for (int j = 0; j < NB; ++j) fa[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), dg, fa[j]);
    if (ch.ends(g, G)) {  // as chunk_end_lanes, on 16 lanes
      const int64_t c = g / ch.gpc;
      for (int j = 0; j < NB; ++j) {
        const int64_t n0 = (b + j) * kBlockCols, count = std::min(kBlockCols, N - n0);
        const __m512 v = product16<T>(fa[j], wscale, n0, count);
        fa[j] = _mm512_setzero_ps();
        if (ch.parts != nullptr) {
          store16_raw(v, ch.parts + c * ch.M * N + n0, count);
          continue;
        }
        total[j] = c == 0 ? v : _mm512_add_ps(total[j], v);
        if (g + 1 == G) store16_raw(total[j], y + n0, count);
      }
    }
  }
  if (ch.gpc < G) return;
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (b + j) * kBlockCols;
    store16(fa[j], wscale, y + n0, n0, std::min(kBlockCols, N - n0));
  }
}

// One row: 8 blocks per tile, 8 weight streams and 8 chains in flight (the streaming columns were
// 1.12-1.18x its time there). The blocks left, and every call of more rows: the streaming columns
// (cpu_w8a8_stream.cpp: 0.68-0.80x the time of 4-row tiles through all of K at 8-64 rows, 0.90-0.99x
// at 2-4 and 128-1,024).
template <typename T>
void blocks_vnni(const int8_t* xq, const float* d, const int32_t* bias, const uint8_t* w, const float* wscale, T* y,
                 int64_t M, int64_t Kp, int64_t N, int64_t b0, int64_t b1, const Chunks<T>& ch) {
  int64_t b = b0;
  if (M == 1)
    for (; b + 8 <= b1; b += 8) row_vnni<8>(xq, d, bias, w, wscale, y, Kp, N, b, ch);
  if (b < b1) shardline::w8a8::stream_blocks(xq, d, bias, w, wscale, y, M, Kp, N, b, b1, ch);
}
#endif  // SHARDLINE_W8A8_VNNI


constexpr int64_t kBlocksPerTask = 4;

template <typename T>
void run(const at::Tensor& x, const uint8_t* w, const float* wscale, T* y, int64_t M, int64_t K, int64_t Kp,
         int64_t N, bool vectorized, const Chunks<T>& ch) {
  const int64_t G = Kp / kGroup;
  const at::Tensor xq_t = at::empty({M * Kp}, x.options().dtype(at::kChar));  // quantize_rows writes it all
  const at::Tensor d_t = at::empty({M * G}, x.options().dtype(at::kFloat));
  const at::Tensor bias_t = at::empty({M * G}, x.options().dtype(at::kInt));
  int8_t* xq = xq_t.data_ptr<int8_t>();
  float* d = d_t.data_ptr<float>();
  int32_t* bias = bias_t.data_ptr<int32_t>();
  quantize_rows(x.data_ptr<T>(), M, K, Kp, xq, d, bias);
  at::parallel_for(0, round_up(N, kBlockCols) / kBlockCols, kBlocksPerTask, [&](int64_t b0, int64_t b1) {
    if (!vectorized) return blocks_portable(xq, d, w, wscale, y, M, Kp, N, b0, b1, ch);
#if defined(SHARDLINE_W8A8_VNNI)
    blocks_vnni(xq, d, bias, w, wscale, y, M, Kp, N, b0, b1, ch);
#elif defined(SHARDLINE_W8A8_AVX2)  // every row count: the streaming columns (cpu_w8a8_stream.cpp)
    shardline::w8a8::stream_blocks(xq, d, bias, w, wscale, y, M, Kp, N, b0, b1, ch);
#else
    blocks_portable(xq, d, w, wscale, y, M, Kp, N, b0, b1, ch);
#endif
  });
}

}  // namespace

// q [N, K] int8 -> the packed weight: uint8 [ceil(N / 16), ceil(K / 32) * 8, 16, 4], q + 128. A
// code of -128 (llm-compressor's scale is max|row| / 127.5) is taken as -127: the AVX2 path's sign
// trick cannot make +128, and every path must give the same bits.
at::Tensor w8a8_pack(at::Tensor q) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar,
              "w8a8_pack: q must be a CPU int8 [N, K], got ", q.scalar_type(), " ", q.sizes());
  const at::Tensor qc = q.contiguous();
  const int64_t N = q.size(0), K = q.size(1), Kp = round_up(K, kGroup), blocks = round_up(N, kBlockCols) / kBlockCols;
  at::Tensor packed = at::empty({blocks, Kp / 4, kBlockCols, 4}, q.options().dtype(at::kByte));
  packed.fill_(128);
  const int8_t* src = qc.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < kBlockCols && b * kBlockCols + c < N; ++c) {
        const int8_t* row = src + (b * kBlockCols + c) * K;
        uint8_t* out = dst + b * kBlockCols * Kp + c * 4;
        for (int64_t k = 0; k < K; ++k)
          out[(k / 4) * 64 + k % 4] = static_cast<uint8_t>(std::max<int>(row[k], -127) + 128);
      }
  });
  return packed;
}

namespace {

// y (or the parts) of x times the packed weight in `chunks` k-chunks (1: the plain product)
at::Tensor w8a8_product(at::Tensor x, at::Tensor packed, at::Tensor wscale, bool vectorized, int64_t chunks,
                        bool sum) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "w8a8_linear: x must be a CPU [M, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "w8a8_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.dim() == 1 && wscale.is_contiguous(),
              "w8a8_linear: scale must be float32, contiguous, [N], got ", wscale.scalar_type(), " ", wscale.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = wscale.size(0), Kp = round_up(K, kGroup);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(0) == round_up(N, kBlockCols) / kBlockCols && packed.size(1) == Kp / 4 &&
                  packed.size(2) == kBlockCols && packed.size(3) == 4,
              "w8a8_linear: packed ", packed.sizes(), " is not w8a8_pack of an [", N, ", ", K, "] weight");
  TORCH_CHECK(chunks == 1 || (chunks > 1 && K % (kGroup * chunks) == 0),
              "w8a8_linear_chunks: K = ", K, " in ", chunks, " chunks of whole groups of ", kGroup);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = sum ? at::empty({M, N}, x.options()) : at::empty({chunks, M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = wscale.data_ptr<float>();
  const int64_t gpc = Kp / kGroup / chunks;
  if (x.scalar_type() == at::kFloat) {
    float* out = y.data_ptr<float>();
    run<float>(xc, w, s, out, M, K, Kp, N, vectorized, Chunks<float>{gpc, sum ? nullptr : out, M});
  } else {
    c10::BFloat16* out = y.data_ptr<c10::BFloat16>();
    run<c10::BFloat16>(xc, w, s, out, M, K, Kp, N, vectorized, Chunks<c10::BFloat16>{gpc, sum ? nullptr : out, M});
  }
  return y;
}

}  // namespace

// x [M, K] float32 or bfloat16; packed from w8a8_pack of an [N, K] weight; wscale float32 [N]
// -> y [M, N] in x's dtype; vectorized = false: the portable path (the same bits, for tests)
at::Tensor w8a8_linear(at::Tensor x, at::Tensor packed, at::Tensor wscale, bool vectorized) {
  return w8a8_product(x, packed, wscale, vectorized, 1, true);
}

// The layout-invariant numerics' row-parallel product (see the top): K (a multiple of 32 *
// chunks) in `chunks` fixed k-chunks; with sum, their float32 sum in chunk order -> y [M, N], else
// each chunk's product -> [chunks, M, N]; the bits of each chunk multiplied alone by w8a8_linear.
at::Tensor w8a8_linear_chunks(at::Tensor x, at::Tensor packed, at::Tensor wscale, int64_t chunks, bool sum,
                              bool vectorized) {
  return w8a8_product(x, packed, wscale, vectorized, chunks, sum);
}

// which path this build runs: "avx512-vnni", "avx2" or "portable"
std::string w8a8_path() {
#if defined(SHARDLINE_W8A8_VNNI)
  return "avx512-vnni";
#elif defined(SHARDLINE_W8A8_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}
