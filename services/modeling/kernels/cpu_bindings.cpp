// The Python module: every kernel of cpu_*.cpp bound under its name (see __init__.py).
//
// Only this file includes the PyTorch-Python glue (tensor <-> at::Tensor casters); the kernels
// include ATen alone. The glue is a large header: compiled once here instead of in each kernel's
// file, the module builds in about half the time.

#include <torch/csrc/utils/pybind.h>

#include "cpu_amx.h"
#include "cpu_gemm_packed.h"
#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released while a matmul, attention or a stage of layers runs, so that a worker's
  // gRPC threads serve meanwhile; not for the short element-wise kernels, where handing it over
  // would cost more than they take.
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("quant_linear", &quant_linear, nogil());
  m.def("quant_linear_chunks", &quant_linear_chunks, nogil());
  m.def("quant_linear_vectorized", &quant_linear_vectorized);
  m.def("w8a8_pack", &w8a8_pack, nogil());
  m.def("w8a8_linear", &w8a8_linear, py::arg("x"), py::arg("packed"), py::arg("wscale"),
        py::arg("vectorized") = true, nogil());
  m.def("w8a8_linear_chunks", &w8a8_linear_chunks, py::arg("x"), py::arg("packed"), py::arg("wscale"),
        py::arg("chunks"), py::arg("sum"), py::arg("vectorized") = true, nogil());
  m.def("w8a8_path", &w8a8_path);
  m.def("dense_linear", &dense_linear, nogil());
  m.def("dense_linear_chunks", &dense_linear_chunks, nogil());
  m.def("dense_linear_vectorized", &dense_linear_vectorized);
  m.def("dense_pack", &shardline::packed::pack, nogil());
  m.def("amx_ready", &shardline::amx::ready);
  m.def("decode_attention", &decode_attention, "paged decode attention", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("vectorized") = true, nogil());
  // the kernels written per instruction set alone: a build of VECTOR_SOURCES (kernels/__init__.py)
#ifndef SHARDLINE_VECTOR_ONLY
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm_", &add_rms_norm_);
  m.def("rotary_", &rotary_);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("write_kv", &write_kv);
  m.def("greedy_logsumexp", &greedy_logsumexp, nogil());
  m.def("mask_tokens_", &mask_tokens_, nogil());
  m.def("decoder_layers", &decoder_layers, nogil());
#endif
}
