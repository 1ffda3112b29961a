// The Python module: every kernel of cpu_*.cpp bound under its name (see __init__.py).
//
// Only this file includes the PyTorch-Python glue (tensor <-> at::Tensor casters); the kernels
// include ATen alone. The glue is a large header: compiled once here instead of in each kernel's
// file, the module builds in about half the time.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

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
at::Tensor quant_linear(at::Tensor x, at::Tensor q, at::Tensor scale);
bool quant_linear_vectorized();
at::Tensor dense_linear(at::Tensor x, at::Tensor w);
bool dense_linear_vectorized();
// cpu_layers.cpp
std::vector<at::Tensor> decoder_layers(at::Tensor h, at::Tensor residual, const std::vector<at::Tensor>& weights,
                                       const std::vector<at::Tensor>& k_caches,
                                       const std::vector<at::Tensor>& v_caches, at::Tensor cos, at::Tensor sin,
                                       at::Tensor slots, at::Tensor tables, at::Tensor context_lens, double eps,
                                       double scale, int64_t heads, int64_t kv_heads, int64_t head_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a matmul, attention or a stage of layers runs, so that a worker's
  // gRPC threads serve meanwhile; not for the short element-wise kernels, where handing it over
  // would cost more than they take.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rotary_", &rotary_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("write_kv", &write_kv);
  m.def("decode_attention", &decode_attention, "paged decode attention", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("vectorized") = true, nogil());
  m.def("greedy_logsumexp", &greedy_logsumexp, nogil());
  m.def("quant_linear", &quant_linear, nogil());
  m.def("quant_linear_vectorized", &quant_linear_vectorized);
  m.def("dense_linear", &dense_linear, nogil());
  m.def("dense_linear_vectorized", &dense_linear_vectorized);
  m.def("decoder_layers", &decoder_layers, nogil());
}
