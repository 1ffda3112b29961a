// How a packed tile's float32 sums end: the one rule of cpu_gemm_packed.cpp's tiles and
// cpu_gemm_stream.cpp's (layout and order of summation: cpu_gemm_packed.h).
#pragma once

#include <cstdint>

#include "cpu_vec.h"

// The tiles and their loops are inlined whatever the template instances' count (left to GCC, once the
// streaming columns' instances were added it stopped inlining the 4-row path, whose products at
// 128-256 rows then took 1.13-1.16x the time)
#define SHARDLINE_INLINE inline __attribute__((always_inline))

namespace shardline::packed {

// Where a tile's sums start and where they go. A call's k-pairs are one chunk, or (the
// layout-invariant sum, see blocks) several: each chunk's sums rounded to bfloat16 are that chunk's
// product, and the products are added in float32 in chunk order into `total`.
struct ChunkFlags {
  bool fresh;  // the tile's first pair starts a chunk: the sums start at zero (else from `kept`)
  bool end;    // its last pair ends the chunk (else the sums go back to `kept`, float32)
  bool first;  // the call's first chunk: `total` takes its product (else adds it)
  bool last;   // the call's last chunk: the total goes to y rounded to bfloat16 (else back to `total`)
};

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
#endif

}  // namespace shardline::packed
