// bfloat16 matmul on AMX tiles (Intel Sapphire Rapids and later), shared by the dense kernel
// (cpu_gemm.cpp) and the quantized kernel's bfloat16 path (cpu_quant.cpp).
//
// The product is computed transposed, y^T = w x^T: the weight [N, K] is the tile multiply's left
// operand as it lies in memory (16 output channels x 32 k per tile, rows K apart), and the
// activations are the right operand, packed once per call into the pairs-of-k layout the
// instruction wants (amx::pack). So no weight is repacked or copied: the weights stay the layout
// the model, the checkpoint and every other kernel use.
//
// Batch-invariant as the AVX-512 kernel is: every output element is the sum over k in 32-wide
// chunks, in order, each chunk summed by one tile instruction, whatever M is or what the other
// rows hold. Whether this kernel runs depends only on the machine and the weight's shape
// (amx::fits), never on M.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <cstdint>

namespace shardline::amx {

// compiled with AMX-BF16, the kernel granted this process the tile state, SHARDLINE_AMX not 0
bool ready();

// the shapes this kernel takes: K in whole 32-element chunks, N in whole 16-channel tiles
inline bool fits(int64_t K, int64_t N) { return K > 0 && K % 32 == 0 && N % 16 == 0; }

// x [M, K] (contiguous bfloat16) -> M x K elements: per block of 16 rows, the block's (row, k-pair)
// matrix transposed, so that a tile's row is one k-pair for each of the block's rows
at::Tensor pack(const at::Tensor& x);

// y[m, n] = scale[n] * sum_k x[m, k] w[n, k] for every row m < M and channels
// [n0, n0 + 16 * blocks), rounded to bfloat16 (scale null: no scaling). w: channel n0's row
// (rows ldw elements apart); xp: pack's output. Called inside a parallel task; end() after the
// task's last call.
void channels(const uint16_t* w, int64_t ldw, const uint16_t* xp, int64_t M, int64_t K, const float* scale,
              c10::BFloat16* y, int64_t N, int64_t n0, int64_t blocks);

// Attention scores on tiles: scores[n * stride + t] = scale * sum_i k_t[i] q_n[i] for the query
// heads n < N <= 16 (head n at q + n * q_stride) and the tokens t < ctx rounded up to 16 (the
// entries past ctx are garbage). Token t's key row is k + off[t]; the 16 tokens of a tile (t a
// multiple of 16) are rows of one cache block, ldk elements apart (a block size that is a
// multiple of 16). d a multiple of 32, at most 128. Every score is its own dot product, in 32-wide
// chunks in order, whatever N is or which other heads and tokens share its tiles: a query row's
// scores are the same bits in a decode step and in a prefill. Called inside a parallel task;
// end() after the task's last call.
bool attention_fits(int64_t d, int64_t block_size, int64_t N);
void attention_scores(const uint16_t* k, const int64_t* off, int64_t ldk, int64_t ctx, const uint16_t* q,
                      int64_t q_stride, int64_t N, int64_t d, float scale, float* scores, int64_t stride);

// the task's tiles released (the thread's tile state off again)
void end();

}  // namespace shardline::amx
