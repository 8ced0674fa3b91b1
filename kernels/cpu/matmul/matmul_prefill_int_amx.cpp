// The AMX kernel of the integer prefill GEMM (compiled with the *_amx.cpp flags, entered after
// cpu::has_amx(), which also asked the kernel for the tile state). Per strip of 16 weight rows,
// 16 tokens and 32-element block: one TDPBUSD of A (16 rows x 32 unsigned codes) with B (the
// tokens' signed activation bytes in 8 rows of 4-byte groups) into a 16x16 int32 tile, stored
// and turned into floats row by row (lanes = tokens) with the scalar kernel's two FMAs. q8 keeps
// two blocks in flight (tiles 0/1 for C, 2/3 for A, 4/5 for B); issuing four at once measured
// slower (3.15 vs 2.69 ms, Q4_1 1536x576, 512 tokens, 1 thread). q16 runs TDPBUSD on the high
// bytes and TDPBUUD on the low ones of each block into tiles 0 and 1 and adds 256 hi + lo before
// the conversion. Each thread loads the tile configuration itself (it is per thread state) and
// releases it at the end.
// No error reporting or library containers here (see matmul_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/matmul/matmul_impl.h"

namespace xctx::cpu::detail {

namespace {

// The LDTILECFG operand (palette 1): colsb[i] bytes per row and rows[i] rows of tile i.
struct alignas(64) tile_config {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int k_a_bytes = k_q8_strip * qk_small;  // one block's codes in the packed strip

// acc[i] (lane n = token t0 + n) += the block's products for row i, as gemm_q8_strips_scalar;
// the integer sums are c, or 256 c + c_lo for q16's two planes.
template <bool Q16>
__attribute__((always_inline)) inline void block_epilogue(const int32_t* c /*[16][16]*/, const int32_t* c_lo,
                                                          const uint8_t* blk, const q8_tiles& xt, int64_t b,
                                                          int64_t t0, __m512* acc) {
  const float* dw = (const float*)(blk + k_a_bytes);
  const float* cw = dw + k_q8_strip;
  const __m512 dx = _mm512_loadu_ps(xt.d + b * xt.n_tok_pad + t0);
  const __m512 sx = _mm512_loadu_ps(xt.s + b * xt.n_tok_pad + t0);
#pragma GCC unroll 16
  for (int i = 0; i < k_q8_strip; ++i) {
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dw[i]), dx);
    __m512i sum = _mm512_load_si512(c + i * 16);
    if constexpr (Q16) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 8), _mm512_load_si512(c_lo + i * 16));
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[i]);
    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(cw[i]), sx, acc[i]);
  }
}

// Tiles 0/1: C (16 rows x 16 int32), 2/3: A (16 rows x 32 codes), 4/5: B (8 rows x 16 tokens x
// 4 bytes).
void load_tile_config() {
  tile_config cfg;
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = qk_small;
  for (int t : {4, 5}) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12's version tells the compiler it reads only 8 bytes of the
  // 64-byte operand, which let it drop the stores of rows and colsb above (SIGILL at the first
  // tile instruction). The whole struct as the memory operand keeps them.
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// y[t0 + t, 16 s + i] for the group's real tokens and the strip's real rows (acc lanes = tokens).
void store_group(const __m512* acc, int64_t t0, int64_t n_tok, int rows, float* y /*at the strip's column*/,
                 int64_t ldy) {
  alignas(64) float out[16 * 16];
  for (int i = 0; i < k_q8_strip; ++i) _mm512_store_ps(out + i * 16, acc[i]);
  const int64_t n_here = n_tok - t0 < 16 ? n_tok - t0 : 16;
  for (int64_t t = 0; t < n_here; ++t) {
    float* yt = y + (t0 + t) * ldy;
    for (int i = 0; i < rows; ++i) yt[i] = out[i * 16 + t];
  }
}

}  // namespace

void gemm_q8_strips_amx(const uint8_t* packed, int64_t n, int64_t nb, const q8_tiles& xt, int64_t n_tok, float* y,
                        int64_t ldy) {
  load_tile_config();
  alignas(64) int32_t c0[16 * 16], c1[16 * 16];
  for (int64_t s = 0; s * k_q8_strip < n; ++s) {
    const uint8_t* strip = packed + (size_t)(s * nb) * k_q8_block_bytes;
    const int rows = (int)(n - s * k_q8_strip < k_q8_strip ? n - s * k_q8_strip : k_q8_strip);
    for (int64_t t0 = 0; t0 < n_tok; t0 += 16) {
      const int8_t* bg = xt.b + (size_t)(t0 / 16 * nb) * 512;
      __m512 acc[k_q8_strip];
#pragma GCC unroll 16
      for (int i = 0; i < k_q8_strip; ++i) acc[i] = _mm512_setzero_ps();
      int64_t b = 0;
      for (; b + 2 <= nb; b += 2) {
        const uint8_t* blk0 = strip + (size_t)b * k_q8_block_bytes;
        const uint8_t* blk1 = blk0 + k_q8_block_bytes;
        _tile_zero(0);
        _tile_loadd(2, blk0, qk_small);
        _tile_loadd(4, bg + b * 512, 64);
        _tile_dpbusd(0, 2, 4);
        _tile_zero(1);
        _tile_loadd(3, blk1, qk_small);
        _tile_loadd(5, bg + (b + 1) * 512, 64);
        _tile_dpbusd(1, 3, 5);
        _tile_stored(0, c0, 64);
        block_epilogue<false>(c0, nullptr, blk0, xt, b, t0, acc);
        _tile_stored(1, c1, 64);
        block_epilogue<false>(c1, nullptr, blk1, xt, b + 1, t0, acc);
      }
      if (b < nb) {
        const uint8_t* blk0 = strip + (size_t)b * k_q8_block_bytes;
        _tile_zero(0);
        _tile_loadd(2, blk0, qk_small);
        _tile_loadd(4, bg + b * 512, 64);
        _tile_dpbusd(0, 2, 4);
        _tile_stored(0, c0, 64);
        block_epilogue<false>(c0, nullptr, blk0, xt, b, t0, acc);
      }
      store_group(acc, t0, n_tok, rows, y + s * k_q8_strip, ldy);
    }
  }
  _tile_release();
}

void gemm_q16_strips_amx(const uint8_t* packed, int64_t n, int64_t nb, const q8_tiles& hi, const q8_tiles& lo,
                         int64_t n_tok, float* y, int64_t ldy) {
  load_tile_config();
  alignas(64) int32_t c_hi[16 * 16], c_lo[16 * 16];
  for (int64_t s = 0; s * k_q8_strip < n; ++s) {
    const uint8_t* strip = packed + (size_t)(s * nb) * k_q8_block_bytes;
    const int rows = (int)(n - s * k_q8_strip < k_q8_strip ? n - s * k_q8_strip : k_q8_strip);
    for (int64_t t0 = 0; t0 < n_tok; t0 += 16) {
      const int8_t* bh = hi.b + (size_t)(t0 / 16 * nb) * 512;
      const int8_t* bl = lo.b + (size_t)(t0 / 16 * nb) * 512;
      __m512 acc[k_q8_strip];
#pragma GCC unroll 16
      for (int i = 0; i < k_q8_strip; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = strip + (size_t)b * k_q8_block_bytes;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, blk, qk_small);
        _tile_loadd(4, bh + b * 512, 64);
        _tile_loadd(5, bl + b * 512, 64);
        _tile_dpbusd(0, 2, 4);  // codes x the signed high bytes
        _tile_dpbuud(1, 2, 5);  // codes x the unsigned low bytes
        _tile_stored(0, c_hi, 64);
        _tile_stored(1, c_lo, 64);
        block_epilogue<true>(c_hi, c_lo, blk, hi, b, t0, acc);
      }
      store_group(acc, t0, n_tok, rows, y + s * k_q8_strip, ldy);
    }
  }
  _tile_release();
}

}  // namespace xctx::cpu::detail
