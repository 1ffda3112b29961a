// How a packed tile's float32 sums end: the one rule of cpu_gemm_packed.cpp's tiles and
// cpu_gemm_stream.cpp's (layout and order of summation: cpu_gemm_packed.h).
#pragma once

#include <cstdint>

#include "cpu_vec.h"

namespace shardline::packed {

#if defined(SHARDLINE_AVX512) && defined(__AVX512BF16__)
// 16 channels' sums of one row: to `kept`, or (a chunk's end) to y (`out`) or the running `total`
SHARDLINE_INLINE void finish_sums(__m512 acc, ChunkFlags s, float* kept, float* total, uint16_t* out) {
  if (!s.end) {
    _mm512_storeu_ps(kept, acc);
  } else if (s.first && s.last) {
    store_bf16(out, acc);
  } else {  // a chunk's product, rounded to bfloat16, into the float32 total in chunk order
    const __m512 v = s.first ? round_bf16(acc) : _mm512_add_ps(_mm512_loadu_ps(total), round_bf16(acc));
    if (s.last)
      store_bf16(out, v);
    else
      _mm512_storeu_ps(total, v);
  }
}
#elif defined(SHARDLINE_GEMM_AVX2)
// 8 channels' sums of one row (half a block, AVX2): as above
SHARDLINE_INLINE void finish_sums(__m256 acc, ChunkFlags s, float* kept, float* total, c10::BFloat16* out) {
  if (!s.end) {
    _mm256_storeu_ps(kept, acc);
    return;
  }
  using E = Elem<c10::BFloat16>;
  alignas(32) float sums[8];
  _mm256_store_ps(sums, acc);
  if (s.first && s.last) {
    for (int l = 0; l < 8; ++l) E::store(out + l, sums[l]);
    return;
  }
  for (int l = 0; l < 8; ++l) {
    const float v = s.first ? round_to<c10::BFloat16>(sums[l]) : total[l] + round_to<c10::BFloat16>(sums[l]);
    if (s.last)
      E::store(out + l, v);
    else
      total[l] = v;
  }
}
#endif

}  // namespace shardline::packed
