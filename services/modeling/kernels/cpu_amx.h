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
#include <vector>

#include "cpu_attention_rows.h"

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

// the thread's tiles 0-7 shaped (rows, bytes per row) for another kernel, which names its shapes
// by a negative `key`; nothing is loaded when they are the thread's current ones (loading zeroes
// every tile)
void load_tiles(int64_t key, const uint8_t (&rows)[8], const uint16_t (&colsb)[8]);

// Paged attention on tiles (cpu_amx_attention.cpp): the contract in cpu_attention_rows.h, the 16
// tokens of a tile (t a multiple of 16) rows of one cache block, ldk elements apart. Its order of
// summation: q . k in 32-wide chunks of d, p . v in 32-token chunks, each chunk one tile
// instruction. Called inside a parallel task; end() after the task's last call.
bool attention_fits(int64_t d, int64_t block_size, int64_t G);
void attend_rows(const c10::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, int64_t R, int64_t G,
                 const int64_t* ctx, const c10::BFloat16* k, const c10::BFloat16* v, const int64_t* off, int64_t ldk,
                 int64_t d, float scale, c10::BFloat16* out, int64_t out_row_stride, rows::ValuePairs& pairs);

// the task's tiles released (the thread's tile state off again)
void end();

}  // namespace shardline::amx
