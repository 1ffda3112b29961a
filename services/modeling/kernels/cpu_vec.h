// Scalar helpers written so that GCC vectorises the loops they sit in (-O3 -march=native
// -fopenmp-simd): no branches, no library calls, bfloat16 handled as its bits.
//
// c10::BFloat16's own conversions test for NaN with a branch and std::exp is a libm call; either
// one keeps a loop scalar, and a decode step spends most of its element-wise time in such loops
// (SiLU over batch x intermediate, softmax in attention, logsumexp over the vocabulary).
//
// With AVX-512, the matmul kernels' shared pieces too (cpu_quant.cpp, cpu_gemm.cpp): reduce4 and
// store4 for a tile's sums, and with AVX512-BF16 the bfloat16 dot-product tile; without
// AVX512-BF16 but with AVX2 + FMA, cpu_gemm.cpp's bfloat16 tile on 8 lanes.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SHARDLINE_AVX512 1
#endif

// `#pragma` cannot sit inside a macro argument (AT_DISPATCH_... lambdas); _Pragma can
#define SHARDLINE_PRAGMA(x) _Pragma(#x)
#define SHARDLINE_SIMD SHARDLINE_PRAGMA(omp simd)
#define SHARDLINE_SIMD_SUM(var) SHARDLINE_PRAGMA(omp simd reduction(+ : var))

// The matmul tiles and their loops are inlined whatever the template instances' count (left to GCC,
// once the packed kernel's streaming columns were added it stopped inlining the 4-row path, whose
// products at 128-256 rows then took 1.13-1.16x the time)
#define SHARDLINE_INLINE inline __attribute__((always_inline))
#define SHARDLINE_LAMBDA_INLINE __attribute__((always_inline))  // a lambda's, after its parameters

namespace shardline {

// Where a matmul tile's sums start and where they go (the packed bfloat16 kernels', the W8A8
// streaming columns'). A call's K is one chunk, or (the layout-invariant sum) several: each chunk's
// sums times its scale, rounded to the output dtype, are that chunk's product, and the products are
// added in float32 in chunk order into `total`.
struct ChunkFlags {
  bool fresh;  // the tile's first k starts a chunk: the sums start at zero (else from `kept`)
  bool end;    // its last k ends the chunk (else the sums go back to `kept`, float32)
  bool first;  // the call's first chunk: `total` takes its product (else adds it)
  bool last;   // the call's last chunk: the total goes to y rounded (else back to `total`)
};

// rows: a tile of MB = `rows` rows (1 to MB): tile(MB, First, args...), both std::integral_constant
template <int MB, bool First, typename Tile, typename... Args>
SHARDLINE_INLINE void tile_of_rows(int64_t rows, const Tile& tile, Args... args) {
  if constexpr (MB > 0) {
    if (rows == MB) return tile(std::integral_constant<int, MB>{}, std::bool_constant<First>{}, args...);
    tile_of_rows<MB - 1, First>(rows, tile, args...);
  }
}

// The streaming columns' walk over one column of weights (cpu_gemm_stream.cpp, cpu_w8a8_stream.cpp):
// K's n steps in chunks of `chunk` and panels of at most `panel`, and in each panel the M rows in
// tiles of RowTile. The first tile (First) asks for its own lines ahead; the other full tiles share
// out the next panel's lines (next_of(k1): its first, a step `step` apart; tile r asks from r steps
// on, every `others` steps); the rows left go in one tile. tile(MB, First, m, k0, k1, flags, chunk
// index, next or nullptr, every), MB and First as std::integral_constant.
template <int RowTile, typename NextOf, typename Tile>
SHARDLINE_INLINE void walk_column(int64_t M, int64_t n, int64_t chunk, int64_t panel, int64_t step,
                                  const NextOf& next_of, const Tile& tile) {
  using Line = decltype(next_of(int64_t{0}));
  const int64_t others = M / RowTile - 1;  // full row tiles after the first
  for (int64_t c = 0; c < n; c += chunk)
    for (int64_t k0 = c; k0 < c + chunk; k0 += panel) {
      const int64_t k1 = std::min(c + chunk, k0 + panel);
      const ChunkFlags s{k0 == c, k1 == c + chunk, c == 0, c + chunk == n};
      const int64_t index = c / chunk;
      if (M < RowTile) {
        tile_of_rows<RowTile - 1, true>(M, tile, int64_t{0}, k0, k1, s, index, Line{nullptr}, int64_t{1});
        continue;
      }
      tile(std::integral_constant<int, RowTile>{}, std::true_type{}, int64_t{0}, k0, k1, s, index, Line{nullptr},
           int64_t{1});
      const Line next = next_of(k1);
      int64_t m = RowTile;
      for (int64_t r = 0; m + RowTile <= M; m += RowTile, ++r)
        tile(std::integral_constant<int, RowTile>{}, std::false_type{}, m, k0, k1, s, index, next + r * step, others);
      tile_of_rows<RowTile - 1, false>(M - m, tile, m, k0, k1, s, index, Line{nullptr}, int64_t{1});
    }
}

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

// y[m, n] for n in [n0, n1) = the parts' [C, M, N] products at (m, n) added in float32 in order 0,
// 1, ..., C - 1 (bfloat16 widens exactly), rounded to T once: the layout-invariant numerics' sum of
// a row-parallel layer's fixed k-chunks, each task summing its own channels while in cache
template <typename T>
inline void sum_parts(const T* parts, int64_t C, int64_t M, int64_t N, T* y, int64_t n0, int64_t n1) {
  using E = Elem<T>;
  std::vector<float> acc(static_cast<size_t>(n1 - n0));
  float* a = acc.data();
  for (int64_t m = 0; m < M; ++m) {
    const T* row = parts + m * N + n0;
    SHARDLINE_SIMD
    for (int64_t n = 0; n < n1 - n0; ++n) a[n] = E::load(row + n);
    for (int64_t c = 1; c < C; ++c) {
      const T* part = row + c * M * N;
      SHARDLINE_SIMD
      for (int64_t n = 0; n < n1 - n0; ++n) a[n] += E::load(part + n);
    }
    T* out = y + m * N + n0;
    SHARDLINE_SIMD
    for (int64_t n = 0; n < n1 - n0; ++n) E::store(out + n, a[n]);
  }
}

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

#ifdef SHARDLINE_AVX512
// The sums of four accumulators at once, {Σa, Σb, Σc, Σd}: 13 shuffles and adds instead of four
// full reductions (~36); at K = 576 the reductions were a fifth of a 16-row tile's work. Each sum
// takes its own accumulator's lanes in a fixed order, whatever the other three hold.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit group g: ab = {a0+a2, b0+b2, a1+a3, b1+b3}, cd likewise
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per group: {a_g, b_g, c_g, d_g}, each the sum of that group's four elements
  const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m512 r1 = _mm512_add_ps(r, _mm512_shuffle_f32x4(r, r, 0x4E));  // + the other 256-bit half
  const __m512 r2 = _mm512_add_ps(r1, _mm512_shuffle_f32x4(r1, r1, 0xB1));  // + the neighbouring group
  return _mm512_castps512_ps128(r2);
}

// y[0..count) = the first count of v, rounded to T
template <typename T>
inline void store4(T* y, __m128 v, int count = 4) {
  alignas(16) float out[4];
  _mm_store_ps(out, v);
  for (int j = 0; j < count; ++j) Elem<T>::store(y + j, out[j]);
}

// 16 bfloat16 (as bits) -> 16 float32, exactly
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fast_exp on 16 lanes, op for op, so that each lane has the scalar function's bits (keep the two
// in step)
inline __m512 fast_exp16(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), shift), shift);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), xc);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512 scale = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_mul_ps(y, scale), nan, x);
}

#ifdef __AVX512BF16__
// 16 float32 -> bfloat16 bits, rounded to nearest even as Elem::store (vcvtneps2bf16)
inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
// v rounded to bfloat16 and back (round_to<c10::BFloat16> on 16 lanes)
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// The bfloat16 dot products of MB activation rows with NB weight rows, as 16-lane float32
// partial sums: acc[i][j] lane l = sum over 32-wide chunks c of x[i][c + 2l] * w[j][c + 2l] +
// x[i][c + 2l + 1] * w[j][c + 2l + 1] (vdpbf16ps), chunks in order, a last partial chunk read
// zero-filled. Every accumulator sees the same instructions in the same order whatever MB and NB
// are, so a sum does not depend on the tile it was computed in. `prefetch` (elements, 0 for none)
// asks for each weight row's line that far ahead: weights streamed from memory arrive sooner.
// dot_range_bf16 adds the chunks of [k0, k1) only (k0 a multiple of 32, k1 = K or a multiple of
// 32) to acc as it is: consecutive ranges give the bits of the whole, since the chunks and their
// order are the same and float32 accumulators are kept exactly in between.
template <int MB, int NB>
inline void dot_range_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t k0, int64_t k1,
                           int64_t K, int64_t prefetch, __m512 (&acc)[MB][NB]) {
  const int64_t full = K & ~int64_t{31};
  const int64_t body = k1 < full ? k1 : full;
  for (int64_t k = k0; k < body; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k + prefetch), _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ldw + k);
    }
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (k1 == K && full < K) {  // the last K % 32 elements, the rest of the chunk zero (never read)
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << (K - full)) - 1);
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * ldw + full);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * ldx + full);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
}

template <int MB, int NB>
inline void dot_tile_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                          int64_t prefetch, __m512 (&acc)[MB][NB]) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  dot_range_bf16<MB, NB>(x, ldx, w, ldw, 0, K, K, prefetch, acc);
}
#endif  // __AVX512BF16__
#endif  // SHARDLINE_AVX512

#if defined(__AVX2__) && defined(__FMA__) && !(defined(SHARDLINE_AVX512) && defined(__AVX512BF16__))
#define SHARDLINE_GEMM_AVX2 1
// The bfloat16 dot products of MB activation rows with NB weight rows on AVX2 + FMA (machines
// without AVX512-BF16), as 8-lane float32 partial sums: acc[i][j] lane l = sum over 16-wide chunks
// c, in order, of x[i][c + 2l] * w[j][c + 2l] then x[i][c + 2l + 1] * w[j][c + 2l + 1], each a
// fused multiply-add, a last partial chunk zero-filled. A bfloat16 is the high half of a float32:
// 16 of them as 8 32-bit lanes hold the even elements in the low halves (shifted up: exact floats)
// and the odd ones in the high halves (the low halves masked off), so no shuffle is needed. As
// dot_tile_bf16, every accumulator sees the same operations in the same order whatever MB and NB.
inline __m256 even_bf16(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 odd_bf16(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int MB, int NB>
inline void dot_tile_bf16_avx2(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t K,
                               __m256 (&acc)[MB][NB]) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  auto chunk = [&](auto load_x, auto load_w) {
    if constexpr (MB == 1) {  // one row (decode): each weight chunk loaded where it is used
      const __m256i v = load_x(0);
      const __m256 xe = even_bf16(v), xo = odd_bf16(v);
      for (int j = 0; j < NB; ++j) {
        const __m256i u = load_w(j);
        acc[0][j] = _mm256_fmadd_ps(xo, odd_bf16(u), _mm256_fmadd_ps(xe, even_bf16(u), acc[0][j]));
      }
      return;
    }
    __m256 we[NB], wo[NB];
    for (int j = 0; j < NB; ++j) {
      const __m256i v = load_w(j);
      we[j] = even_bf16(v);
      wo[j] = odd_bf16(v);
    }
    for (int i = 0; i < MB; ++i) {
      const __m256i v = load_x(i);
      const __m256 xe = even_bf16(v), xo = odd_bf16(v);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xo, wo[j], _mm256_fmadd_ps(xe, we[j], acc[i][j]));
    }
  };
  const int64_t body = K & ~int64_t{15};
  for (int64_t k = 0; k < body; k += 16)
    chunk([&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * ldx + k)); },
          [&](int j) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * ldw + k)); });
  if (body < K) {  // the last K % 16 elements, copied next to zeros
    const int64_t tail = K - body;
    auto padded = [tail](const uint16_t* p) {
      alignas(32) uint16_t buf[16] = {};
      std::memcpy(buf, p, 2 * tail);
      return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
    };
    chunk([&](int i) { return padded(x + i * ldx + body); }, [&](int j) { return padded(w + j * ldw + body); });
  }
}
#endif  // SHARDLINE_GEMM_AVX2

#if defined(__AVX2__)
// the sum of v's 8 lanes, in one fixed order
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

}  // namespace shardline
