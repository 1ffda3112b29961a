// The dense bfloat16 matmul on a repacked weight (cpu_gemm_packed.cpp): the layout dense_linear
// takes on a machine without AMX (AVX512-BF16, or AVX2 + FMA), made once when the model first
// multiplies by a weight (LinearBase.kernel_weight), in place of the [N, K] rows.
//
// Layout: [N / 16, K / 2, 16, 2] bfloat16, blocks of 16 output channels with each pair of
// consecutive k side by side: one vdpbf16ps multiplies a broadcast pair of an activation row's
// values by the 16 channels' pairs and adds into 16 float32 lanes, one lane per channel (on AVX2,
// two 8-lane halves and two fused multiply-adds).
//
// Order of summation: each output's float32 sum is one chain over its k-pairs in order, each step
// adding a pair's two products (vdpbf16ps's own order; on AVX2 the even k's then the odd k's), whatever M is, however the rows and
// channels are tiled or split across threads and however K is taken in panels (the sums go to
// memory in float32 between panels and come back unchanged). So a row of a prefill batch gets the
// bits it would get alone in a decode step, as with the [N, K] kernel (other bits than its own).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <cstdint>

namespace shardline::packed {

// built with AVX512-BF16 or AVX2 + FMA: the kernel below exists
bool built();

// w [N, K] bfloat16 -> the layout above, where dense_linear takes it here (built, no AMX at run
// time, N % 16 == 0, K even); w itself otherwise
at::Tensor pack(const at::Tensor& w);

// whether w is a packed weight (4-D); its output channels
inline bool is_packed(const at::Tensor& w) { return w.dim() == 4; }
inline int64_t channels(const at::Tensor& w) { return is_packed(w) ? w.size(0) * 16 : w.size(0); }

// y [M, ldy >= 16 * b1] rows = x [M, 2 * pairs] (rows ldx apart) times the packed weight's k-pairs
// [p0, p0 + pairs), for its 16-channel blocks [b0, b1), rounded to bfloat16. w: the packed
// weight's data, kp its k-pairs per block (size(1)). Called inside a parallel task.
// With chunk_pairs (dividing pairs): the layout-invariant sum of fixed k-chunks instead, each
// chunk's product (its own chain, rounded to bfloat16) added in float32 in chunk order and the
// total rounded to bfloat16: the bits of each chunk multiplied alone and summed so, with no
// chunk's product written out.
void blocks(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t kp, int64_t p0, int64_t pairs,
            c10::BFloat16* y, int64_t ldy, int64_t b0, int64_t b1, int64_t chunk_pairs = 0);

// From 5 to this many rows on AVX512-BF16, blocks hands the product to stream_blocks (the same
// arguments, the same bits: cpu_gemm_stream.cpp). Above them the 4-row tiles with the activations in
// L2 were faster (the 1B-class weights).
constexpr int64_t kStreamRows = 64;
void stream_blocks(const uint16_t* x, int64_t ldx, int64_t M, const uint16_t* w, int64_t kp, int64_t p0, int64_t pairs,
                   c10::BFloat16* y, int64_t ldy, int64_t b0, int64_t b1, int64_t chunk_pairs = 0);

}  // namespace shardline::packed
