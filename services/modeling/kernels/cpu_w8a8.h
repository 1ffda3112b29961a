// The W8A8 matmul's shared pieces (cpu_w8a8.cpp: the arithmetic, the packed layout and the order
// of summation; cpu_w8a8_stream.cpp: the streaming columns).
#pragma once

#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_vec.h"

namespace shardline::w8a8 {

constexpr int64_t kGroup = 32;     // activation values per scale
constexpr int64_t kBlockCols = 16;  // output channels per packed block
constexpr int64_t kGroupSteps = kGroup / 4;  // 4-byte k-steps per group

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// A call's k-chunks: gpc groups each (all G groups: one chunk). With parts, chunk c's product goes
// to parts + c * M * N; without, the chunks' products are summed into y.
template <typename T>
struct Chunks {
  int64_t gpc;
  T* parts;
  int64_t M;
  bool ends(int64_t g, int64_t G) const { return gpc < G && (g + 1) % gpc == 0; }
};

// a chunk's product at its end (fa * wscale rounded to T) goes to its part, or into the total
// (first chunk: taken; then added in float32); the last chunk's total goes to y rounded to T
template <typename T>
inline void chunk_end_lanes(const float* fa, const float* wscale, float* total, T* y, const Chunks<T>& c,
                            int64_t chunk, bool last, int64_t m, int64_t N, int64_t n0, int64_t count) {
  for (int64_t l = 0; l < count; ++l) {
    const float v = shardline::round_to<T>(fa[l] * wscale[n0 + l]);
    if (c.parts != nullptr) {
      Elem<T>::store(c.parts + chunk * c.M * N + m * N + n0 + l, v);
      continue;
    }
    total[l] = chunk == 0 ? v : total[l] + v;
    if (last) Elem<T>::store(y + m * N + n0 + l, total[l]);
  }
}

// y[m, n] for n in [n0, n0 + count) of a block's lanes: fa * wscale rounded to T
template <typename T>
inline void store_lanes(const float* fa, const float* wscale, T* y, int64_t n0, int64_t count) {
  for (int64_t l = 0; l < count; ++l) Elem<T>::store(y + l, fa[l] * wscale[n0 + l]);
}

#if defined(SHARDLINE_AVX512) && defined(__AVX512VNNI__)
#define SHARDLINE_W8A8_VNNI 1

inline __mmask16 lanes(int64_t count) { return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1); }

// y[0, count) = r rounded to T
template <typename T>
inline void store16_raw(const __m512 r, T* y, int64_t count) {
  const __mmask16 mask = lanes(count);
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(r));
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(y, mask, r);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, r);
    for (int64_t l = 0; l < count; ++l) Elem<T>::store(y + l, tmp[l]);
  }
}

template <typename T>
inline void store16(const __m512 v, const float* wscale, T* y, int64_t n0, int64_t count) {
  store16_raw(_mm512_mul_ps(v, _mm512_maskz_loadu_ps(lanes(count), wscale + n0)), y, count);
}

// a chunk's product on 16 lanes: v * wscale rounded to T, as float32 (lanes past count: 0)
template <typename T>
inline __m512 product16(const __m512 v, const float* wscale, int64_t n0, int64_t count) {
  const __m512 r = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(lanes(count), wscale + n0));
  if constexpr (std::is_same_v<T, float>) {
    return r;
  } else {
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16>) return shardline::round_bf16(r);
#endif
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, r);
    for (int l = 0; l < 16; ++l) tmp[l] = shardline::round_to<T>(tmp[l]);
    return _mm512_load_ps(tmp);
  }
}

#elif defined(__AVX2__)
#define SHARDLINE_W8A8_AVX2 1
#endif

#if defined(SHARDLINE_W8A8_VNNI) || defined(SHARDLINE_W8A8_AVX2)
// On AVX512-VNNI (rows 2 and more, and a row's blocks left by its 8-block tiles) or AVX2 (every row
// count): blocks [b0, b1) of y = the quantized rows (xq [M, Kp], d and bias
// [M, G]) times the packed weight w, the weights streamed in under the arithmetic
// (cpu_w8a8_stream.cpp); the sums and order of cpu_w8a8.cpp, the same bits. Called inside a
// parallel task.
template <typename T>
void stream_blocks(const int8_t* xq, const float* d, const int32_t* bias, const uint8_t* w, const float* wscale,
                   T* y, int64_t M, int64_t Kp, int64_t N, int64_t b0, int64_t b1, const Chunks<T>& ch);
#endif

}  // namespace shardline::w8a8
