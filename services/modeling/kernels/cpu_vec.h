// Scalar helpers written so that GCC vectorises the loops they sit in (-O3 -march=native
// -fopenmp-simd): no branches, no library calls, bfloat16 handled as its bits.
//
// c10::BFloat16's own conversions test for NaN with a branch and std::exp is a libm call; either
// one keeps a loop scalar, and a decode step spends most of its element-wise time in such loops
// (SiLU over batch x intermediate, softmax in attention, logsumexp over the vocabulary).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>

// `#pragma` cannot sit inside a macro argument (AT_DISPATCH_... lambdas); _Pragma can
#define SHARDLINE_PRAGMA(x) _Pragma(#x)
#define SHARDLINE_SIMD SHARDLINE_PRAGMA(omp simd)
#define SHARDLINE_SIMD_SUM(var) SHARDLINE_PRAGMA(omp simd reduction(+ : var))

namespace shardline {

inline float bits_to_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// Load and store one element as float, rounding to nearest even on store (what c10 does,
// NaN included, without the branch).
template <typename T> struct Elem {
  static inline float load(const T* p) { return static_cast<float>(*p); }
  static inline void store(T* p, float v) { *p = static_cast<T>(v); }
};
template <> struct Elem<float> {
  static inline float load(const float* p) { return *p; }
  static inline void store(float* p, float v) { *p = v; }
};
template <> struct Elem<c10::BFloat16> {
  static inline float load(const c10::BFloat16* p) {
    uint16_t h; std::memcpy(&h, p, 2); return bits_to_f(static_cast<uint32_t>(h) << 16);
  }
  static inline uint16_t bits(float v) {
    const uint32_t u = f_to_bits(v);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return v != v ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
  }
  static inline void store(c10::BFloat16* p, float v) { const uint16_t h = bits(v); std::memcpy(p, &h, 2); }
};

// v rounded to T and back: the value the reference holds after an op in dtype T
template <typename T> inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }
template <> inline float round_to<float>(float v) { return v; }
template <> inline float round_to<c10::BFloat16>(float v) {
  return bits_to_f(static_cast<uint32_t>(Elem<c10::BFloat16>::bits(v)) << 16);
}

// exp(x) for float, within 2 ulp over the whole range, branch-free (Cephes' expf reduction:
// x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n put into the exponent bits).
// Inputs below -87.3 give ~1e-38 instead of 0 and above 88.3 give ~2e38 instead of inf; callers
// subtract a maximum first (softmax, logsumexp) or divide by 1 + exp (SiLU), where that's exact
// to the output's precision. NaN in gives NaN out.
inline float fast_exp(float x) {
  const float lo = x < -87.3f ? -87.3f : x;
  const float xc = lo > 88.3f ? 88.3f : lo;
  const float shift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (xc * 1.44269504088896341f + shift) - shift;
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float y = 1.9875691500e-4f;
  y = std::fma(y, r, 1.3981999507e-3f);
  y = std::fma(y, r, 8.3334519073e-3f);
  y = std::fma(y, r, 4.1665795894e-2f);
  y = std::fma(y, r, 1.6666665459e-1f);
  y = std::fma(y, r, 5.0000001201e-1f);
  y = std::fma(y, r * r, r + 1.0f);
  const float scale = bits_to_f(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return (x != x) ? x : y * scale;
}

}  // namespace shardline
