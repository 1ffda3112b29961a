// Fused CPU kernels for the decoder layer's element-wise work (see __init__.py).
//
// Each kernel does in one pass what the reference does in several PyTorch ops, and rounds where
// the reference rounds: for bfloat16/float16 every intermediate the reference materialises in
// the low-precision dtype is rounded to it here too, so outputs match the op-by-op reference.
// Rows are independent; large row counts run in parallel (at::parallel_for). Inner loops are
// written to vectorise (cpu_vec.h; `omp simd` lets a sum be split across lanes).

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>

#include "cpu_vec.h"

using shardline::Elem;
using shardline::fast_exp;
using shardline::round_to;

namespace {

constexpr int64_t kGrain = 16;  // rows per task

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t d, float eps) {
  using E = Elem<T>;
  float ss = 0.f;
SHARDLINE_SIMD_SUM(ss)
  for (int64_t i = 0; i < d; ++i) { const float v = E::load(x + i); ss += v * v; }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
SHARDLINE_SIMD
  for (int64_t i = 0; i < d; ++i) E::store(out + i, round_to<T>(E::load(x + i) * r) * E::load(w + i));
}

// r += x, rounded on store. A loop of its own over one row: written inline over the flat index
// range of the row, GCC left it scalar (three quarters of add_rms_norm_'s time at 128 rows).
template <typename T>
void add_row(T* __restrict r, const T* __restrict x, int64_t d) {
  using E = Elem<T>;
SHARDLINE_SIMD
  for (int64_t i = 0; i < d; ++i) E::store(r + i, E::load(r + i) + E::load(x + i));
}

#if defined(SHARDLINE_AVX512) && defined(__AVX512BF16__)
#define SHARDLINE_OPS_BF16 1
// rotary_'s and silu_and_mul's loops for bfloat16, 16 lanes at a time (cpu_vec.h's helpers), with
// the portable loops' arithmetic and roundings: each product rounded to bfloat16 where the
// reference materialises it, the result rounded on store. What the compiler made of the portable
// rotary loop took ~5 ns per pair of elements (a third of a 16-row decode step's element-wise
// time); this takes well under one.
using shardline::fast_exp16;
using shardline::load_bf16;
using shardline::round_bf16;
using shardline::store_bf16;

// silu_and_mul's loop for one bfloat16 row, 16 lanes at a time (the rest: the scalar loop), with
// the scalar loop's arithmetic and roundings
int64_t silu_and_mul_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t inter) {
  int64_t i = 0;
  for (; i + 16 <= inter; i += 16) {
    const __m512 x = load_bf16(g + i);
    const __m512 e = fast_exp16(_mm512_castsi512_ps(  // -x: the sign bit flipped
        _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)))));
    const __m512 act = round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    store_bf16(o + i, _mm512_mul_ps(act, load_bf16(u + i)));
  }
  return i;
}

void rotary_bf16(uint16_t* q, const uint16_t* c, const uint16_t* s, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 ci = load_bf16(c + i), si = load_bf16(s + i);
    for (int64_t h = 0; h < heads; ++h) {
      uint16_t* x = q + h * d;
      const __m512 x1 = load_bf16(x + i), x2 = load_bf16(x + i + half);
      store_bf16(x + i, _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, ci)), round_bf16(_mm512_mul_ps(x2, si))));
      store_bf16(x + i + half, _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, ci)), round_bf16(_mm512_mul_ps(x1, si))));
    }
  }
}
#endif

}  // namespace

// y = w * (x / sqrt(mean(x^2) + eps)), statistics in float32
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_rows(x, "x");
  const int64_t d = x.size(-1), n = x.numel() / d;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(xp + r * d, wp, op + r * d, d, static_cast<float>(eps));
    });
  });
  return out;
}

// In place, as vLLM's fused_add_rms_norm: residual <- x + residual, x <- rms_norm(residual, w).
// Both are this step's own activations, so nothing is allocated per layer.
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must match");
  const int64_t d = x.size(-1), n = x.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        add_row(rp + r * d, xp + r * d, d);
        rms_row(rp + r * d, wp, xp + r * d, d, static_cast<float>(eps));
      }
    });
  });
}

// In place on the first `heads` heads of qkv [n, total_heads, d] (NeoX half-split layout):
// [x1, x2] -> [x1*c - x2*s, x2*c + x1*s] with cos/sin [n, d/2] (already in qkv's dtype)
void rotary_(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t n = qkv.size(0), total = qkv.size(1), d = qkv.size(2), half = d / 2;
  TORCH_CHECK(heads <= total, "rotary_: heads > qkv heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_", [&] {
    scalar_t* qp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      using E = Elem<scalar_t>;
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* c = cp + t * half;
        const scalar_t* s = sp + t * half;
#ifdef SHARDLINE_OPS_BF16
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (half % 16 == 0) {
            rotary_bf16(reinterpret_cast<uint16_t*>(qp + t * total * d), reinterpret_cast<const uint16_t*>(c),
                        reinterpret_cast<const uint16_t*>(s), heads, d);
            continue;
          }
        }
#endif
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* x = qp + (t * total + h) * d;
SHARDLINE_SIMD
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = E::load(x + i), x2 = E::load(x + i + half), ci = E::load(c + i), si = E::load(s + i);
            const float a = round_to<scalar_t>(x1 * ci), bb = round_to<scalar_t>(x2 * si);
            const float cc = round_to<scalar_t>(x2 * ci), dd = round_to<scalar_t>(x1 * si);
            E::store(x + i, a - bb);
            E::store(x + i + half, cc + dd);
          }
        }
      }
    });
  });
}

// gate_up [n, 2I] -> silu(gate) * up [n, I]
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1), inter = two_i / 2, n = gate_up.numel() / two_i;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
      using E = Elem<scalar_t>;
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = gp + r * two_i;
        const scalar_t* u = g + inter;
        scalar_t* o = op + r * inter;
        int64_t start = 0;
#ifdef SHARDLINE_OPS_BF16
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
          start = silu_and_mul_bf16(reinterpret_cast<const uint16_t*>(g), reinterpret_cast<const uint16_t*>(u),
                                    reinterpret_cast<uint16_t*>(o), inter);
#endif
SHARDLINE_SIMD
        for (int64_t i = start; i < inter; ++i) {
          const float x = E::load(g + i);
          const float act = round_to<scalar_t>(x / (1.0f + fast_exp(-x)));
          E::store(o + i, act * E::load(u + i));
        }
      }
    });
  });
  return out;
}

// Write this step's keys and values ([n, kv_heads, d], any row stride) into the paged caches
// ([blocks * block_size, kv_heads, d] viewed flat) at their slots.
void write_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v,
              at::Tensor slots) {
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slots must be int64");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2),
              "k/v rows must be [kv_heads, d] contiguous");
  const int64_t n = k.size(0), row = k.size(1) * k.size(2);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t bytes = row * k.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(kc + sp[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vc + sp[t] * bytes, vp + t * vs, bytes);
  }
}
