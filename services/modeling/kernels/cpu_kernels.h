// The kernels every cpu_*.cpp defines, declared once: the Python module binds them
// (cpu_bindings.cpp) and the stage kernel calls them (cpu_layers.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

// cpu_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor w, double eps);
void rotary_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads);
at::Tensor silu_and_mul(at::Tensor gate_up);
void write_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v, at::Tensor slots);
// cpu_attention.cpp, cpu_sampling.cpp, cpu_quant.cpp, cpu_gemm.cpp
at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor tables, at::Tensor context_lens, double scale, bool vectorized);
std::vector<at::Tensor> greedy_logsumexp(at::Tensor logits);
void mask_tokens_(at::Tensor logits, at::Tensor masks);
at::Tensor quant_linear(at::Tensor x, at::Tensor q, at::Tensor scale);
at::Tensor quant_linear_chunks(at::Tensor x, at::Tensor q, at::Tensor scale, int64_t chunks, bool sum);
bool quant_linear_vectorized();
at::Tensor dense_linear(at::Tensor x, at::Tensor w);
at::Tensor dense_linear_chunks(at::Tensor x, at::Tensor w, int64_t chunks, bool sum);
at::Tensor sum_chunk_products(const at::Tensor& parts);
bool dense_linear_vectorized();
// cpu_w8a8.cpp
at::Tensor w8a8_pack(at::Tensor q);
at::Tensor w8a8_linear(at::Tensor x, at::Tensor packed, at::Tensor wscale, bool vectorized);
at::Tensor w8a8_linear_chunks(at::Tensor x, at::Tensor packed, at::Tensor wscale, int64_t chunks, bool sum,
                              bool vectorized);
std::string w8a8_path();
// cpu_layers.cpp
std::vector<at::Tensor> decoder_layers(at::Tensor h, at::Tensor residual, const std::vector<at::Tensor>& weights,
                                       const std::vector<at::Tensor>& k_caches,
                                       const std::vector<at::Tensor>& v_caches, at::Tensor cos, at::Tensor sin,
                                       at::Tensor slots, at::Tensor tables, at::Tensor context_lens, double eps,
                                       double scale, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t chunks);
