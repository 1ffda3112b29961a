// The fp8 matmul, weight-only (W8A16): y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
//
// q is float8 e4m3 ([N, K], one byte per weight, see services/modeling/quant.py); x is float32 or
// bfloat16 [M, K]; scale is float32 [N]. (int8 weights multiply int8 activations: cpu_w8a8.cpp,
// which quant_linear hands them to.) The weights are read once per call, one byte
// each, and turned into float32 in registers; nothing the size of the weight is ever written.
// A decode step at small M is bound by the bytes it reads, so half the bytes of bfloat16 is
// (close to) half the time.
//
// Blocking: 4 output channels x up to 4 activation rows per tile, 16 accumulators (AVX-512: one
// zmm each). Each 16-wide chunk of the 4 weight rows is dequantized once per tile and used by every
// activation row of it; for M > 4 the next row tile re-reads the same 4 weight rows from L1.
// Output channels are split across threads.
//
// The e4m3 -> float conversion: e4m3 is s.eeee.mmm with exponent bias 7; placing those bits at
// float16's s.eeeee.mmmmmmmmmm positions (sign at bit 15, the rest shifted left by 7) gives a
// float16 with exponent bias 15, i.e. the same value times 2^-8 — exactly, subnormals included
// (e4m3's subnormals land on float16 normals). The kernel converts float16 -> float32 in hardware
// and folds the 2^8 into the channel's scale. (e4m3fn's NaN, 0x7f, would become a finite float16;
// quantize never writes it.)

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_amx.h"
#include "cpu_kernels.h"
#include "cpu_vec.h"

#ifdef SHARDLINE_AVX512
#define SHARDLINE_QUANT_AVX512 1
#endif

using shardline::Elem;

namespace {

constexpr int64_t kRowsPerTask = 64;  // output channels per parallel task (a few KB of weights)

// float value of every e4m3 byte: the portable path's dequantization (a table lookup)
struct ByteTable {
  float v[256];
  ByteTable() {
    for (int b = 0; b < 256; ++b) {
      c10::Float8_e4m3fn f;
      f.x = static_cast<uint8_t>(b);
      v[b] = static_cast<float>(f);
    }
  }
};
const ByteTable& table() { static const ByteTable t; return t; }

// channel n's weights as float32 in w[0..K): the table's values exactly
inline void dequant_row(const uint8_t* qn, int64_t K, float* w) {
  const float* values = table().v;
  int64_t k = 0;
#if defined(__AVX2__) && defined(__F16C__)
  // 8 bytes at a time in registers (by way of float16, see the top, times 2^8: exact too); the
  // lookup alone had kept an AVX2 machine's decode at ~14 GFLOP/s
  for (; k + 8 <= K; k += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qn + k));
    const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8), 1),
                                    _mm_set1_epi16(static_cast<short>(0xBFFF)));
    _mm256_storeu_ps(w + k, _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f)));
  }
#endif
  for (; k < K; ++k) w[k] = values[qn[k]];
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(SHARDLINE_QUANT_AVX512)
#define SHARDLINE_QUANT_AVX2 1
// An AVX2 machine's path: R rows x C channels (weights dequantized into w[c]) as independent
// chains of fused multiply-adds, R x C <= 8 so that they stay in registers. Every sum is taken the
// same way whatever the block: 8 lanes over k = l (mod 8) in order, hsum8, the K % 8 tail in
// order. One chain per row (the compiler's loop) ran at ~30 GFLOP/s a core: latency, not width.
template <typename T, int R, int C>
inline void dot_block(const float* x, const float* const* w, const float* scale, T* y, int64_t K, int64_t N,
                      int64_t m, int64_t n) {
  const int64_t body = K & ~int64_t{7};
  __m256 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < body; t += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w[c] + t);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + (m + r) * K + t);
      for (int c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(xv, wv[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float* xm = x + (m + r) * K;
      float acc = shardline::hsum8(a[r][c]);
      for (int64_t t = body; t < K; ++t) acc += xm[t] * w[c][t];
      Elem<T>::store(y + (m + r) * N + n + c, acc * scale[n + c]);
    }
}
#endif

// The portable path: channels dequantized into float32 (four at a time), then every row's dot
// products with them: by hand on AVX2 (dot_block), else a loop the compiler vectorises.
template <typename T>
void rows_portable(const float* x, const uint8_t* q, const float* scale, T* y, int64_t M, int64_t K,
                   int64_t N, int64_t n0, int64_t n1) {
  std::vector<float> buf(4 * K);
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t nc = std::min<int64_t>(4, n1 - n);
    const float* w[4] = {buf.data(), buf.data() + K, buf.data() + 2 * K, buf.data() + 3 * K};
    for (int64_t c = 0; c < nc; ++c) dequant_row(q + (n + c) * K, K, buf.data() + c * K);
#ifdef SHARDLINE_QUANT_AVX2
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      int64_t c = 0;
      for (; c + 2 <= nc; c += 2) dot_block<T, 4, 2>(x, w + c, scale, y, K, N, m, n + c);
      if (c < nc) dot_block<T, 4, 1>(x, w + c, scale, y, K, N, m, n + c);
    }
    for (; m < M; ++m) {
      if (nc == 4) {
        dot_block<T, 1, 4>(x, w, scale, y, K, N, m, n);
      } else {
        for (int64_t c = 0; c < nc; ++c) dot_block<T, 1, 1>(x, w + c, scale, y, K, N, m, n + c);
      }
    }
#else
    for (int64_t c = 0; c < nc; ++c) {
      const float* wc = w[c];
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * K;
        float acc = 0.f;
SHARDLINE_SIMD_SUM(acc)
        for (int64_t k = 0; k < K; ++k) acc += xm[k] * wc[k];
        Elem<T>::store(y + m * N + n + c, acc * scale[n + c]);
      }
    }
#endif
  }
}

#ifdef SHARDLINE_QUANT_AVX512
// 16 weights from bytes at p as float32: e4m3 times 2^-8 (see the header)
inline __m512 dequant16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  // the byte into bits 8..15, an arithmetic shift right by one (the sign lands on bits 15 and 14,
  // the rest on 7..13), bit 14 cleared: the float16 bits described at the top
  const __m256i w = _mm256_srai_epi16(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8), 1);
  return _mm512_cvtph_ps(_mm256_and_si256(w, _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}

#ifndef SHARDLINE_QUANT_PREFETCH
#define SHARDLINE_QUANT_PREFETCH 256
#endif
constexpr int64_t kPrefetchBytes = SHARDLINE_QUANT_PREFETCH;  // how far ahead in a weight row

constexpr float kUnit = 256.0f;  // dequant16's values times this are the weights

// y[0..3] = sums * scale[0..3] * unit, rounded to T
template <typename T>
inline void store_scaled4(T* y, __m128 sums, const float* scale, float unit) {
  const __m128 v = _mm_mul_ps(sums, _mm_mul_ps(_mm_loadu_ps(scale), _mm_set1_ps(unit)));
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // the four rounded to bfloat16 (to nearest even, as Elem::store) in one instruction: scalar
    // rounding was a third of a 16-row tile's time at K = 576
    _mm_mask_storeu_epi16(y, 0x0F, (__m128i)_mm_cvtneps_pbh(v));
    return;
  }
#endif
  shardline::store4(y, v);
}

// float32 path: y[m0:m0+MB, n0:n0+NB] for K a multiple of 16, weights dequantized in registers
template <int MB, int NB, typename T>
inline void tile_f32(const float* x, const uint8_t* q, const float* scale, T* y, int64_t K, int64_t N,
                     int64_t m0, int64_t n0) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const uint8_t* q0 = q + n0 * K;
  for (int64_t k = 0; k < K; k += 16) {
    __m512 w[NB];
    if (k % 64 == 0 && k + kPrefetchBytes < K) {  // a line per row, ahead of the hardware prefetcher
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(q0 + j * K + k + kPrefetchBytes), _MM_HINT_T0);
    }
    for (int j = 0; j < NB; ++j) w[j] = dequant16(q0 + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; j += 4)
      store_scaled4(y + (m0 + i) * N + n0 + j,
                    shardline::reduce4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]), scale + n0 + j,
                    kUnit);
}

template <typename T>
void rows_f32(const float* x, const uint8_t* q, const float* scale, T* y, int64_t M, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (M == 1) {  // one row: 8 channels per tile, more independent loads and FMA chains in flight
    for (; n + 8 <= n1; n += 8) tile_f32<1, 8>(x, q, scale, y, K, N, 0, n);
  }
  for (; n < n1; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile_f32<4, 4>(x, q, scale, y, K, N, m, n);
    switch (M - m) {
      case 3: tile_f32<3, 4>(x, q, scale, y, K, N, m, n); break;
      case 2: tile_f32<2, 4>(x, q, scale, y, K, N, m, n); break;
      case 1: tile_f32<1, 4>(x, q, scale, y, K, N, m, n); break;
      default: break;
    }
  }
}

#ifdef __AVX512BF16__
#define SHARDLINE_QUANT_BF16DOT 1
// bfloat16 path for several rows: a block of kBlockRows weight rows is converted to bfloat16 once
// (exact: e4m3 values fit bfloat16's 8 bits of precision) into an L1/L2-resident
// scratch, then every activation row's tile multiplies it with the bfloat16 dot product
// (vdpbf16ps: two products per float32 lane per instruction, twice the float32 FMA rate).
constexpr int64_t kBlockRows = 16;

void block_to_bf16(const uint8_t* q, uint16_t* out, int64_t rows, int64_t K) {
  // e4m3 -> bfloat16 bits with integer ops, exactly, 32 at a time: a normal e4m3 s.eeee.mmm is
  // bfloat16 s.(eeee + 120).mmm0000, i.e. (|bits| << 4) + (120 << 7); the 8 subnormal magnitudes
  // (eeee = 0: m * 2^-9) come from a table
  alignas(64) static const uint16_t kSubnormal[32] = {
      0x0000, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};  // bfloat16 of m * 2^-9
  const __m512i table = _mm512_load_si512(kSubnormal);
  const __m512i mag_mask = _mm512_set1_epi16(0x7F), bias = _mm512_set1_epi16(120 << 7);
  const __m512i sign_mask = _mm512_set1_epi16(0x80), eight = _mm512_set1_epi16(8);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * K + k)));
      const __m512i mag = _mm512_and_si512(w, mag_mask);
      __m512i bf = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), bias);
      bf = _mm512_mask_permutexvar_epi16(bf, _mm512_cmplt_epu16_mask(mag, eight), mag, table);
      bf = _mm512_or_si512(bf, _mm512_slli_epi16(_mm512_and_si512(w, sign_mask), 8));
      _mm512_storeu_si512(out + r * K + k, bf);
    }
}

template <int MB>
inline void tile_bf16(const uint16_t* x, const uint16_t* w0, const float* scale, float unit, c10::BFloat16* y,
                      int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m512 acc[MB][4];
  shardline::dot_tile_bf16<MB, 4>(x + m0 * K, K, w0, K, K, 0, acc);
  for (int i = 0; i < MB; ++i)
    store_scaled4(y + (m0 + i) * N + n0, shardline::reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]),
                  scale + n0, unit);
}

void rows_bf16(const uint16_t* x, const uint8_t* q, const float* scale, c10::BFloat16* y, int64_t M, int64_t K,
               int64_t N, int64_t n0, int64_t n1) {
  std::vector<uint16_t> scratch(kBlockRows * K);
  for (int64_t nb = n0; nb < n1; nb += kBlockRows) {
    const int64_t rows = std::min(kBlockRows, n1 - nb);  // a multiple of 4 (the caller's range is)
    block_to_bf16(q + nb * K, scratch.data(), rows, K);
    // the next block's weights, asked for while this block's tiles run: converted from memory
    // with nothing in flight, a block waited on each line in turn (1.3-1.6x slower than bfloat16
    // at 16 rows)
    const uint8_t* next = q + (nb + rows) * K;
    const int64_t ahead = std::min(kBlockRows, n1 - nb - rows) * K;
    for (int64_t b = 0; b < ahead; b += 64) _mm_prefetch(reinterpret_cast<const char*>(next + b), _MM_HINT_T0);
    for (int64_t j = 0; j < rows; j += 4) {
      const uint16_t* w = scratch.data() + j * K;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile_bf16<4>(x, w, scale, 1.0f, y, K, N, m, nb + j);
      switch (M - m) {
        case 3: tile_bf16<3>(x, w, scale, 1.0f, y, K, N, m, nb + j); break;
        case 2: tile_bf16<2>(x, w, scale, 1.0f, y, K, N, m, nb + j); break;
        case 1: tile_bf16<1>(x, w, scale, 1.0f, y, K, N, m, nb + j); break;
        default: break;
      }
    }
  }
}

// The same on AMX tiles: each block of 16 weight rows converted to bfloat16 as above, then the
// tile kernel multiplies it with every activation row (x packed once by the caller) and scales
// each channel. Blocks [b0, b1) of 16 channels.
void blocks_amx(const uint16_t* xp, const uint8_t* q, const float* scale, c10::BFloat16* y, int64_t M, int64_t K,
                int64_t N, int64_t b0, int64_t b1) {
  std::vector<uint16_t> scratch(kBlockRows * K);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n = b * kBlockRows;
    block_to_bf16(q + n * K, scratch.data(), kBlockRows, K);
    if (b + 1 < b1)
      for (int64_t i = 0; i < kBlockRows * K; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(q + (n + kBlockRows) * K + i), _MM_HINT_T0);
    shardline::amx::channels(scratch.data(), K, xp, M, K, scale, y, N, n, 1);
  }
  shardline::amx::end();
}
#endif  // __AVX512BF16__
#endif  // SHARDLINE_QUANT_AVX512

// Rows below this use the float32 path even for bfloat16 activations: converting a weight block
// to bfloat16 costs more than the faster dot product saves until a few rows share it.
constexpr int64_t kBf16MinRows = 4;

// One call's activations, made ready once for every task: packed for the AMX tiles where they run
// (bfloat16, a few rows, a shape they take), else as float32 for the float32 and portable paths
template <typename T>
struct Activations {
  at::Tensor x;         // [M, K], contiguous
  at::Tensor amx;       // packed for the tiles, where the AMX path runs
  at::Tensor f32;       // float32 copy (bfloat16 x), else undefined
  const float* xf = nullptr;
};

template <typename T>
Activations<T> prepare(const at::Tensor& x, int64_t M, int64_t K, int64_t N) {
  Activations<T> a{x};
#ifdef SHARDLINE_QUANT_BF16DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (M >= kBf16MinRows && shardline::amx::ready() && shardline::amx::fits(K, N)) {
      a.amx = shardline::amx::pack(x);
      return a;
    }
  }
#endif
  // a tensor (64-byte aligned, whole cache lines), not a std::vector: every thread reads it at
  // every step, and with a malloc'd buffer 3072x576 ran 3x slower than at neighbouring shapes
  // (measured; likely a line shared with memory another thread writes)
  if constexpr (std::is_same_v<T, float>) {
    a.xf = x.data_ptr<float>();
  } else {
    a.f32 = at::empty({M * K + 16}, x.options().dtype(at::kFloat));
    float* dst = static_cast<float*>(a.f32.data_ptr());
    const T* xs = x.data_ptr<T>();
SHARDLINE_SIMD
    for (int64_t i = 0; i < M * K; ++i) dst[i] = Elem<T>::load(xs + i);
    a.xf = dst;
  }
  return a;
}

// y's channels [n0, n1) (multiples of kBlockRows on the AMX path), inside a parallel task
template <typename T>
void channels(const Activations<T>& a, const uint8_t* qp, const float* sp, T* yp, int64_t M, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
#ifdef SHARDLINE_QUANT_BF16DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (a.amx.defined()) {
      blocks_amx(static_cast<const uint16_t*>(a.amx.data_ptr()), qp, sp, yp, M, K, N, n0 / kBlockRows,
                 n1 / kBlockRows);
      return;
    }
  }
#endif
  const float* xf = a.xf;
#ifdef SHARDLINE_QUANT_AVX512
  if (K % 16 == 0) {
    const int64_t vec_end = n0 + (n1 - n0) / 4 * 4;
#ifdef SHARDLINE_QUANT_BF16DOT
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (M >= kBf16MinRows && K % 32 == 0) {
        const uint16_t* xb = static_cast<const uint16_t*>(a.x.data_ptr());
        rows_bf16(xb, qp, sp, yp, M, K, N, n0, vec_end);
        n0 = vec_end;
      }
    }
#endif
    if (n0 < vec_end) {
      rows_f32(xf, qp, sp, yp, M, K, N, n0, vec_end);
      n0 = vec_end;
    }
  }
#endif
  if (n0 < n1) rows_portable(xf, qp, sp, yp, M, K, N, n0, n1);
}

// every task's channels: blocks of kBlockRows on the AMX path, else any range (kRowsPerTask a task)
template <typename T, typename F>
void each_task(const Activations<T>& a, int64_t N, const F& task) {
#ifdef SHARDLINE_QUANT_BF16DOT
  if (a.amx.defined()) {
    at::parallel_for(0, N / kBlockRows, kRowsPerTask / kBlockRows,
                     [&](int64_t b0, int64_t b1) { task(b0 * kBlockRows, b1 * kBlockRows); });
    return;
  }
#endif
  at::parallel_for(0, N, kRowsPerTask, task);
}

template <typename T>
void run(const at::Tensor& x, const uint8_t* qp, const float* sp, T* yp, int64_t M, int64_t K, int64_t N) {
  const Activations<T> a = prepare<T>(x, M, K, N);
  each_task(a, N, [&](int64_t n0, int64_t n1) { channels(a, qp, sp, yp, M, K, N, n0, n1); });
}

// The layout-invariant numerics' fixed k-chunks of x times q [C, N, W] (chunk c's weights, each
// contiguous): every chunk's product as quant_linear gives it for that chunk alone, into parts
// [C, M, N]; with y, also their sum (sum_parts). One parallel pass: a task takes each chunk of its
// channels in turn, then sums them while in cache.
template <typename T>
void run_chunks(const at::Tensor& x, const uint8_t* qp, const float* sp, T* parts, T* y, int64_t M, int64_t C,
                int64_t W, int64_t N) {
  std::vector<Activations<T>> chunks;
  for (int64_t c = 0; c < C; ++c) chunks.push_back(prepare<T>(x.narrow(1, c * W, W).contiguous(), M, W, N));
  each_task(chunks[0], N, [&](int64_t n0, int64_t n1) {
    for (int64_t c = 0; c < C; ++c) channels(chunks[c], qp + c * N * W, sp, parts + c * M * N, M, W, N, n0, n1);
    if (y != nullptr) shardline::sum_parts(parts, C, M, N, y, n0, n1);
  });
}

}  // namespace

// x [M, K] float32 or bfloat16; q [N, K] float8_e4m3fn, or int8 (the W8A8 kernel: cpu_w8a8.cpp),
// packed by w8a8_pack or not; scale [N] float32 -> y [M, N] in x's dtype
at::Tensor quant_linear(at::Tensor x, at::Tensor q, at::Tensor scale) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(), "quant_linear: CPU tensors");
  if (q.scalar_type() == at::kByte) return w8a8_linear(x, q, scale, true);  // int8, packed
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "quant_linear: x [M, K] and q [N, K], got ",
              x.sizes(), " and ", q.sizes());
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous(), "quant_linear: q and scale must be contiguous");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == q.size(0),
              "quant_linear: scale must be float32 [N], got ", scale.scalar_type(), " ", scale.sizes());
  if (q.scalar_type() == at::kChar) return w8a8_linear(x, w8a8_pack(q), scale, true);
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn, "quant_linear: q must be int8 or float8_e4m3fn, got ",
              q.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) run<float>(xc, qp, sp, y.data_ptr<float>(), M, K, N);
  else run<c10::BFloat16>(xc, qp, sp, y.data_ptr<c10::BFloat16>(), M, K, N);
  return y;
}

// The layout-invariant numerics' row-parallel product of a quantized weight: x [M, C * W] times
// the fixed k-chunks of a weight, in one call. q: fp8 [C, N, W] (each chunk's rows contiguous),
// int8 packed whole by w8a8_pack (W a multiple of 32: w8a8_linear_chunks), or int8 packed per
// chunk [C, ...]. Each chunk's product has the bits quant_linear gives that chunk alone; with sum,
// their float32 sum in chunk order -> y [M, N], else [C, M, N].
at::Tensor quant_linear_chunks(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t chunks, bool sum) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && x.dim() == 2 && chunks > 0 && x.size(1) % chunks == 0,
              "quant_linear_chunks: a CPU x [M, K] with K a multiple of ", chunks, ", got ", x.sizes());
  if (q.scalar_type() == at::kByte && q.dim() == 4) return w8a8_linear_chunks(x, q, scale, chunks, sum, true);
  TORCH_CHECK(q.dim() >= 3 && q.size(0) == chunks && q.is_contiguous(),
              "quant_linear_chunks: q as [", chunks, ", ...] (each chunk's weight), got ", q.sizes());
  const int64_t M = x.size(0), W = x.size(1) / chunks, N = scale.size(0);
  if (q.scalar_type() != at::kFloat8_e4m3fn) {  // int8 packed per chunk: quant_linear on each
    std::vector<at::Tensor> parts;
    for (int64_t c = 0; c < chunks; ++c) parts.push_back(quant_linear(x.narrow(1, c * W, W).contiguous(), q[c], scale));
    const at::Tensor all = at::stack(parts);
    return sum ? sum_chunk_products(all) : all;
  }
  TORCH_CHECK(q.dim() == 3 && q.size(1) == N && q.size(2) == W && scale.scalar_type() == at::kFloat &&
                  scale.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear_chunks: fp8 q [", chunks, ", N, ", W, "], a float32 scale [N] and float32 or bfloat16 x, "
              "got ", q.sizes(), ", ", scale.sizes(), " and ", x.scalar_type());
  at::Tensor parts = at::empty({chunks, M, N}, x.options());
  at::Tensor y = sum ? at::empty({M, N}, x.options()) : parts;
  if (M == 0) return y;
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    run_chunks<float>(x, qp, sp, parts.data_ptr<float>(), sum ? y.data_ptr<float>() : nullptr, M, chunks, W, N);
  else
    run_chunks<c10::BFloat16>(x, qp, sp, parts.data_ptr<c10::BFloat16>(),
                              sum ? y.data_ptr<c10::BFloat16>() : nullptr, M, chunks, W, N);
  return y;
}

// whether the AVX-512 path was compiled in (the portable path runs otherwise)
bool quant_linear_vectorized() {
#ifdef SHARDLINE_QUANT_AVX512
  return true;
#else
  return false;
#endif
}
