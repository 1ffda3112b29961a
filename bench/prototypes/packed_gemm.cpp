// A candidate for the bfloat16 GEMM, not used by the model: the weight repacked once into blocks
// of 16 output channels with each pair of consecutive k side by side ([N/16][K/2][16][2]), so
// that one vdpbf16ps multiplies a broadcast pair of an activation row's values by 16 channels'
// pairs and adds into 16 float32 lanes, one lane per channel: no horizontal sums. A tile is
// 4 rows x 64 channels (16 accumulators, 4 weight vectors, 1 broadcast). K is walked in panels
// (each tile's accumulators go to memory between panels and come back, so every output's sum is
// one chain over k in order, whatever the row blocking: batch-invariant by construction).
// bench/gemm_packed.py builds and measures it; it needs M % 4 == 0, N % 64 == 0, K % 2 == 0.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstring>

namespace {

constexpr int kRows = 4;     // rows per tile
constexpr int kBlocks = 4;   // 16-channel blocks per tile

void tile(const uint16_t* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t k0, int64_t k1, bool first) {
  __m512 acc[kRows][kBlocks];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kBlocks; ++j) acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + i * N + j * 16);
  const int64_t stride = 16 * K;
  for (int64_t k = k0; k < k1; k += 2) {
    __m512 wv[kBlocks];
    for (int j = 0; j < kBlocks; ++j) wv[j] = (__m512)_mm512_loadu_si512(w + j * stride + k * 16);
    for (int i = 0; i < kRows; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * K + k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kBlocks; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, (__m512bh)wv[j]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < kBlocks; ++j) _mm512_storeu_ps(y + i * N + j * 16, acc[i][j]);
}

}  // namespace

at::Tensor pack(at::Tensor w) {
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.size(0) % 16 == 0 && w.size(1) % 2 == 0,
              "pack: a bfloat16 [N, K] with N % 16 == 0 and K even");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor out = at::empty({N / 16, K / 2, 16, 2}, w.options());
  const uint16_t* src = static_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(out.data_ptr());
  for (int64_t b = 0; b < N / 16; ++b)
    for (int64_t c = 0; c < 16; ++c)
      for (int64_t k = 0; k < K; ++k) dst[b * 16 * K + (k / 2) * 32 + c * 2 + (k % 2)] = src[(b * 16 + c) * K + k];
  return out;
}

// x [M, K] bfloat16, packed from pack() -> y [M, N] float32; K in panels of `panel`, rows in
// blocks of `rows_per_block` (the weights of a task's channels are re-read once per row block)
at::Tensor matmul(at::Tensor x, at::Tensor packed, int64_t panel, int64_t rows_per_block) {
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && M % kRows == 0 && N % (16 * kBlocks) == 0 &&
              packed.size(1) * 2 == K, "matmul: M % 4 == 0, N % 64 == 0, packed from a [N, K] weight");
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint16_t* xp = static_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = static_cast<const uint16_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / (16 * kBlocks), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += rows_per_block) {
      const int64_t m1 = std::min(M, m0 + rows_per_block);
      for (int64_t k0 = 0; k0 < K; k0 += panel) {
        const int64_t k1 = std::min(K, k0 + panel);
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t m = m0; m < m1; m += kRows)
            tile(xp + m * K, K, wp + t * kBlocks * 16 * K, yp + m * N + t * kBlocks * 16, N, k0, k1, k0 == 0);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack);
  m.def("matmul", &matmul, py::call_guard<py::gil_scoped_release>());
}
