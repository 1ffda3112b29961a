// A pipeline stage's decoder layers in one call from Python, for a rank that holds whole layers
// (TP = 1: no all-reduce between the kernels).
//
// Per layer it calls the kernels the Python loop calls (LlamaDecoderLayer.forward), in the same
// order with the same arguments, so its outputs are the same bits; it only leaves out the Python
// between them. At batch 1 a SmolLM2 step runs ~300 kernel calls: the interpreter, the argument
// conversions and the attribute lookups around each were a quarter of the step.
//
// Weights come as kLayerTensors per layer, in this order: input norm, qkv, qkv scale, o, o scale,
// post-attention norm, gate_up, gate_up scale, down, down scale. A scale with no elements marks a
// dense weight (bfloat16: dense_linear; float32: torch's linear); otherwise the weight is int8
// (packed by w8a8_pack) or float8 with per-channel scales (quant_linear).
//
// In the layout-invariant numerics (`chunks` > 0) the row-parallel products (o and down) are
// summed over that many fixed k-chunks, as RowParallelLinear does at TP1: a dense weight through
// dense_linear_chunks, a quantized one through quant_linear_chunks (int8 packed whole, or a
// [chunks, N, W] weight), the products added in float32 in chunk order.

#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/stack.h>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr size_t kLayerTensors = 10;

// x [n, K] -> [n, N]: what LinearBase._matmul does for the weight's kind
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  if (scale.numel() > 0) return quant_linear(x, w, scale);
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 && w.is_contiguous())
    return dense_linear(x, w);
  return at::linear(x, w);
}

}  // namespace

// h [n, hidden]: the stage's input (embeddings or the previous stage's hidden states), residual
// undefined or empty at the stage's first layer (as the Python loop's None). cos/sin: this
// step's rotary tables; slots: each token's cache slot; tables/context_lens: the attention rows
// (per token for a prefill). Returns {h, residual} after the last layer, as the loop does.
std::vector<at::Tensor> decoder_layers(at::Tensor h, at::Tensor residual, const std::vector<at::Tensor>& weights,
                                       const std::vector<at::Tensor>& k_caches,
                                       const std::vector<at::Tensor>& v_caches, at::Tensor cos, at::Tensor sin,
                                       at::Tensor slots, at::Tensor tables, at::Tensor context_lens, double eps,
                                       double scale, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t chunks) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(weights.size() == layers * kLayerTensors && v_caches.size() == layers,
              "decoder_layers: ", kLayerTensors, " weights and one k and v cache per layer, got ", weights.size(),
              " weights, ", layers, " and ", v_caches.size(), " caches");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "decoder_layers: h must be a contiguous [tokens, hidden]");
  const at::Tensor cosc = cos.contiguous(), sinc = sin.contiguous();
  // a row-parallel layer's product: the fixed k-chunks' sum in the layout-invariant numerics
  auto row_parallel = [chunks](const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
    if (chunks == 0) return linear(x, w, scale);
    if (scale.numel() == 0) return dense_linear_chunks(x, w, chunks, true);
    return quant_linear_chunks(x, w, scale, chunks, true);
  };
  const int64_t n = h.size(0);
  bool first = !residual.defined() || residual.numel() == 0;
  for (size_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kLayerTensors;
    at::Tensor x;
    if (first) {
      residual = h;
      x = rms_norm(h, w[0], eps);
      first = false;
    } else {
      add_rms_norm_(h, residual, w[0], eps);  // residual += h; h = norm
      x = h;
    }
    at::Tensor qkv = linear(x, w[1], w[2]).view({n, heads + 2 * kv_heads, head_dim});
    rotary_(qkv, cosc, sinc, heads + kv_heads);  // q and k, in place
    const at::Tensor q = qkv.narrow(1, 0, heads);
    write_kv(k_caches[i], v_caches[i], qkv.narrow(1, heads, kv_heads), qkv.narrow(1, heads + kv_heads, kv_heads),
             slots);
    const at::Tensor attn = decode_attention(q, k_caches[i], v_caches[i], tables, context_lens, scale, true);
    x = row_parallel(attn.reshape({n, heads * head_dim}), w[3], w[4]);
    add_rms_norm_(x, residual, w[5], eps);
    h = row_parallel(silu_and_mul(linear(x, w[6], w[7])), w[8], w[9]);
  }
  return {h, residual};
}
