// The AMX bfloat16 matmul (see cpu_amx.h for what it computes and why transposed).
//
// Tiles: 0-3 accumulate y^T for up to four 16-channel blocks (16 channels x the row block's
// rows, float32), 4 and 5 take the weights (16 channels x 32 k, alternately, so that one loads
// while the other multiplies), 6 the packed activations (16 k-pairs x the block's rows). A row
// block is 16 rows of x, the last one M % 16: the tiles are configured to the block's rows, so
// a single decode row multiplies a 16 x 1 tile and its activations need no packing at all (a
// row's k-pairs are already the tile's rows).
//
// At one row the tile instruction is far from its rate, and the step is the weights' streaming
// read; at 16 rows and more one instruction does 16 x 16 x 32 multiply-adds and the weights
// are read once per block of rows from L1/L2.

#include "cpu_amx.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SHARDLINE_AMX 1
#endif

namespace shardline::amx {

#ifdef SHARDLINE_AMX
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;     // the AMX tile data

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row
  uint8_t rows[16];
};

// the tile shapes for a block of `rows` activation rows, loaded when the thread's current
// configuration is another (loading one zeroes every tile); a negative key: another kernel's (load_tiles)
thread_local int64_t configured_rows = 0;

void configure(int64_t rows) {
  if (configured_rows == rows) return;
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(rows * 4);
  for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  c.rows[6] = 16, c.colsb[6] = static_cast<uint16_t>(rows * 4);
  _tile_loadconfig(&c);
  configured_rows = rows;
}

// y^T tiles -> y: column m of each 16 x rows tile is row m's 16 channels
template <int NB>
inline void store(float (&acc)[4][256], int64_t rows, const float* scale, c10::BFloat16* y, int64_t N, int64_t m0,
                  int64_t n0) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int j = 0; j < NB; ++j) {
    const __m512 s = scale ? _mm512_loadu_ps(scale + n0 + 16 * j) : _mm512_set1_ps(1.0f);
    for (int64_t m = 0; m < rows; ++m) {
      __m512 v = _mm512_i32gather_ps(column, acc[j] + m, 4);
      if (scale) v = _mm512_mul_ps(v, s);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + n0 + 16 * j),
                          (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// NB (1-4) channel blocks from n0 against one block of `rows` activation rows
template <int NB>
inline void group(const uint16_t* w, int64_t ldw, const uint16_t* xb, int64_t rows, int64_t K, const float* scale,
                  c10::BFloat16* y, int64_t N, int64_t m0, int64_t n0) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const int64_t stride = ldw * 2, block = 16 * ldw;
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(6, xb + k * rows, rows * 4);  // chunk k/32: 16 k-pairs x rows, rows * 2 elements each
    _tile_loadd(4, w + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(5, w + block + k, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(4, w + 2 * block + k, stride);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (NB > 3) {
      _tile_loadd(5, w + 3 * block + k, stride);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  alignas(64) float acc[4][256];
  _tile_stored(0, acc[0], 64);
  if constexpr (NB > 1) _tile_stored(1, acc[1], 64);
  if constexpr (NB > 2) _tile_stored(2, acc[2], 64);
  if constexpr (NB > 3) _tile_stored(3, acc[3], 64);
  store<NB>(acc, rows, scale, y, N, m0, n0);
}

bool granted() {
  if (const char* v = std::getenv("SHARDLINE_AMX"); v && (!std::strcmp(v, "0") || !std::strcmp(v, "false")))
    return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

}  // namespace

bool ready() {
  static const bool ok = granted();
  return ok;
}

at::Tensor pack(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2;
  at::Tensor packed = at::empty({M * K}, x.options());
  const uint32_t* src = static_cast<const uint32_t*>(x.data_ptr());
  uint32_t* dst = static_cast<uint32_t*>(packed.data_ptr());
  auto block = [&](int64_t b) {
    const int64_t m0 = b * 16, rows = std::min<int64_t>(16, M - m0);
    const uint32_t* s = src + m0 * pairs;
    uint32_t* d = dst + m0 * pairs;
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t m = 0; m < rows; ++m) d[p * rows + m] = s[m * pairs + p];
  };
  const int64_t blocks = (M + 15) / 16;
  if (M == 1) std::memcpy(dst, src, K * 2);  // one row: already the layout
  else if (blocks < 4) for (int64_t b = 0; b < blocks; ++b) block(b);
  else at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { for (int64_t b = b0; b < b1; ++b) block(b); });
  return packed;
}

void channels(const uint16_t* w, int64_t ldw, const uint16_t* xp, int64_t M, int64_t K, const float* scale,
              c10::BFloat16* y, int64_t N, int64_t n0, int64_t blocks) {
  for (int64_t g = 0; g < blocks; g += 4) {
    const int64_t nb = std::min<int64_t>(4, blocks - g), n = n0 + 16 * g;
    const uint16_t* wg = w + 16 * g * ldw;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int64_t rows = std::min<int64_t>(16, M - m0);
      configure(rows);
      const uint16_t* xb = xp + m0 * K;
      switch (nb) {
        case 4: group<4>(wg, ldw, xb, rows, K, scale, y, N, m0, n); break;
        case 3: group<3>(wg, ldw, xb, rows, K, scale, y, N, m0, n); break;
        case 2: group<2>(wg, ldw, xb, rows, K, scale, y, N, m0, n); break;
        default: group<1>(wg, ldw, xb, rows, K, scale, y, N, m0, n); break;
      }
    }
  }
}

void load_tiles(int64_t key, const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  if (configured_rows == key) return;
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = rows[t], c.colsb[t] = colsb[t];
  // the stores above must reach memory first: GCC dropped them as dead (ldtilecfg then faulted
  // on the stale stack bytes), the intrinsic's read of the struct not being seen
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
  configured_rows = key;
}

void end() {
  if (configured_rows == 0) return;
  _tile_release();
  configured_rows = 0;
}

#else  // no AMX here: ready() is false and nothing else is called

bool ready() { return false; }
at::Tensor pack(const at::Tensor& x) { return x; }
void channels(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, const float*, c10::BFloat16*, int64_t,
              int64_t, int64_t) {}
void load_tiles(int64_t, const uint8_t (&)[8], const uint16_t (&)[8]) {}
void end() {}

#endif  // SHARDLINE_AMX

}  // namespace shardline::amx
