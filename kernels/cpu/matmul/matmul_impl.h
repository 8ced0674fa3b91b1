// Internals of the CPU matmul shared by matmul.cpp (dispatch, threading, scalar kernels),
// matmul_avx2.cpp (SIMD kernels), the tests and the benchmark. Not part of the backend API.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"

namespace xctx::cpu::detail {

// Activations for the integer dot products: every 32-element block of a row quantized
// symmetrically to Code (d = max|x| / L, q = round-half-even(x / d), L = 127 for int8 (act_q8),
// 32767 for int16 (act_q16)), with the block sum kept so weight formats with an offset (Q4_0:
// q - 8, Q4_1: + m, ...) cost one multiply per block. Scales stay in float (not fp16 as GGML's
// Q8_1 has them) so the only error is the rounding of x to the grid: |x - d q| <= d / 2.
template <typename Code>
struct int_act {
  static constexpr int levels = std::numeric_limits<Code>::max();  // 127 or 32767
  const Code* qs = nullptr;  // [n_tok, n_cols]
  const float* d = nullptr;  // [n_tok, n_blocks]
  const float* s = nullptr;  // [n_tok, n_blocks]  d * sum(q) of the block
  int64_t n_blocks = 0;      // per row: n_cols / 32
};
using q8_act = int_act<int8_t>;
using q16_act = int_act<int16_t>;

// Quantizes one row of n (multiple of 32) floats. The scalar and AVX2 versions give identical
// bits (same operations, round-half-even in both).
void quantize_act_scalar(const float* x /*[n]*/, int64_t n, int8_t* qs /*[n]*/, float* d /*[n/32]*/,
                         float* s /*[n/32]*/);
void quantize_act_scalar(const float* x, int64_t n, int16_t* qs, float* d, float* s);
void quantize_act_avx2(const float* x, int64_t n, int8_t* qs, float* d, float* s);
void quantize_act_avx2(const float* x, int64_t n, int16_t* qs, float* d, float* s);

// Rows [r0, r1) of a legacy-quant weight (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) against n_tok quantized
// activation rows: y[t * ldy + r] = dot(W[r], x[t]). Integer sums are exact (per block at most
// 32 * 128 * 32767 < 2^31; the AVX2 kernel's int32 lanes hold 4 products, < 2^24, so their
// conversion to float is exact too).
void dot_rows_q_scalar(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok,
                       float* y /*[n_tok, ldy]*/, int64_t ldy);
void dot_rows_q_scalar(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                       int64_t ldy);
void dot_rows_q_avx2(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok,
                     float* y /*[n_tok, ldy]*/, int64_t ldy);
void dot_rows_q_avx2(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                     int64_t ldy);
// The same with AVX-512 VNNI (matmul_avx512.cpp): two blocks per register, VPDPBUSD / VPDPWSSD.
// False (nothing written) if w is not a legacy quant.
bool dot_rows_q_avx512(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok, float* y,
                       int64_t ldy);
bool dot_rows_q_avx512(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                       int64_t ldy);
// The AVX2 kernels built for AVX-VNNI (matmul_avxvnni.cpp): the same bits as dot_rows_q_avx2.
// False (nothing written) if w is not a legacy quant.
bool dot_rows_q_avxvnni(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok, float* y,
                        int64_t ldy);
bool dot_rows_q_avxvnni(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                        int64_t ldy);

// Rows [r0, r1) of a legacy-quant weight against n_tok float activation rows (the act_f32
// decode path): each block's codes are widened to floats in registers and FMA'd with x, so
// nothing but float accumulation separates the result from the exact product with the
// dequantized weights. x_sum[t * n_blocks + b] = Σ of block b of x[t], used by the AVX2 kernel
// for the Q4_1/Q5_1 offset (m · Σx); the scalar kernel dequantizes each weight instead.
void dot_rows_qf_scalar(const weight_view& w, int64_t r0, int64_t r1, const float* x /*[n_tok, n_cols]*/,
                        int64_t n_tok, float* y /*[n_tok, ldy]*/, int64_t ldy);
void dot_rows_qf_avx2(const weight_view& w, int64_t r0, int64_t r1, const float* x /*[n_tok, n_cols]*/,
                      const float* x_sum /*[n_tok, n_cols / 32]*/, int64_t n_tok, float* y /*[n_tok, ldy]*/,
                      int64_t ldy);

// Rows [r0, r1) of an F32 / F16 / BF16 weight against float activations.
void dot_rows_f_scalar(const weight_view& w, int64_t r0, int64_t r1, const float* x /*[n_tok, n_cols]*/,
                       int64_t n_tok, float* y /*[n_tok, ldy]*/, int64_t ldy);
void dot_rows_f_avx2(const weight_view& w, int64_t r0, int64_t r1, const float* x /*[n_tok, n_cols]*/,
                     int64_t n_tok, float* y /*[n_tok, ldy]*/, int64_t ldy);

// AVX2 dequantizers, bit-identical to ref::dequantize_row; false if `type` has none (then the
// caller falls back to the reference one).
bool dequantize_row_avx2(ggml_type type, const void* src, float* dst /*[n]*/, int64_t n);

// Whether the integer path applies (legacy block quants) or the float path (F32/F16/BF16).
bool is_legacy_quant(ggml_type type);
bool is_float_type(ggml_type type);

// The two matmul strategies behind cpu::matmul, callable directly by tests and benchmarks.
// `act` matters only for legacy quants (the other types always use float activations).
void matmul_decode(const weight_view& w, const float* x /*[n_tok, n_cols]*/, int64_t n_tok,
                   float* y /*[n_tok, n_rows]*/, decode_activations act);
// Both prefill modes dequantize weights to f32 strips and run the row-invariant GEMM of
// matmul.cpp (every y[t, r] one fused multiply-add chain in column order), so they give the
// same bits as each other and for every n_tok, row offset and thread count. OpenBLAS sgemm was
// dropped here: its result for a row depends on the row's index inside the call (see
// matmul.cpp). cpu::matmul uses split_rows; whole_matrix stays for the benchmark's comparison.
enum class prefill_mode : uint8_t {
  // Each OpenMP thread dequantizes panels of its own weight rows and multiplies them.
  prefill_split_rows,
  // The whole matrix is dequantized (OpenMP over strips), then the threads split its rows.
  prefill_whole_matrix,
};
void matmul_prefill(const weight_view& w, const float* x /*[n_tok, n_cols]*/, int64_t n_tok,
                    float* y /*[n_tok, n_rows]*/, prefill_mode mode = prefill_mode::prefill_split_rows);
// n_tok at which cpu::matmul switches from matmul_decode (with activations `act`) to
// matmul_prefill.
int64_t prefill_min_tokens(ggml_type type, decode_activations act);

// Scalar view of one legacy block: w_j = d * q[j] + c (Q8_0: q signed, c = 0).
void block_codes(ggml_type type, const uint8_t* p, int32_t* q /*[32]*/, float* d, float* c);

// ---- the integer prefill GEMM (prefill_activations::pre_q8, matmul_prefill_int*.cpp) -------
// Weight rows packed for VPDPBUSD in strips of 16 rows; per strip and 32-element block b:
//   codes [8 groups g][16 rows i][4 bytes k]: u of row i, column 32 b + 4 g + k, unsigned
//   (w = d u + c: Q4_0 u = q, c = -8 d; Q4_1 c = m; Q5_0 c = -16 d; Q5_1 c = m; Q8_0 u = q + 128,
//   c = -128 d), then d [16] and c [16] as floats. Rows past the weight are zero (d = c = 0).
constexpr int k_q8_strip = 16;
constexpr size_t k_q8_block_bytes = 8 * 16 * 4 + 2 * 16 * sizeof(float);  // 640 per strip and block
// The AMX kernel reads the same strips with each row's 32 codes contiguous (its tiles' A rows):
// codes [16 rows i][32 columns j], then d and c as above.
enum class q8_layout : uint8_t { vnni, amx };
// Rows [r0, r0 + n) of a legacy quant into ceil(n / 16) strips of n_cols / 32 blocks each.
void pack_q8_strips(const weight_view& w, int64_t r0, int64_t n, uint8_t* dst, q8_layout layout = q8_layout::vnni);
// y[t * ldy + i] for t < n_tok and the n real rows i of the packed strips, against the q8
// activations: for each (row, token) acc = 0, then per block in order
//   acc = fma((float) Σ u·q, d_w · d_x, acc);  acc = fma(c_w, s_x, acc)
// (integer sums exact: < 32 * 255 * 127 < 2^24). The scalar and AVX-512 versions do exactly
// these float operations, so they give the same bits.
void gemm_q8_strips_scalar(const uint8_t* packed, int64_t n, int64_t n_blocks, const q8_act& xq, int64_t n_tok,
                           float* y, int64_t ldy);
// The same with 16-bit activation codes (prefill_activations::pre_q16): Σ u·q is still exact in
// int32 (< 32 * 255 * 32767 < 2^31) but may exceed 2^24, so its conversion to float can round.
void gemm_q8_strips_scalar(const uint8_t* packed, int64_t n, int64_t n_blocks, const q16_act& xq, int64_t n_tok,
                           float* y, int64_t ldy);
void gemm_q8_strips_avx512(const uint8_t* packed, int64_t n, int64_t n_blocks, const q8_act& xq, int64_t n_tok,
                           float* y, int64_t ldy);
// The q8 activations as the AMX kernel's B tiles and row vectors, tokens padded to 16 (zero
// codes, d = s = 0): b [n_tok_pad / 16][n_blocks][8 rows kk][16 tokens n][4 bytes]: bytes
// 4 kk .. 4 kk + 3 of token 16 g + n's block; d and s block-major [n_blocks][n_tok_pad].
struct q8_tiles {
  const int8_t* b = nullptr;
  const float* d = nullptr;
  const float* s = nullptr;
  int64_t n_tok_pad = 0;
};
struct q8_tiles_storage {
  std::vector<int8_t> b;
  std::vector<float> d, s;
};
q8_tiles make_q8_tiles(const q8_act& xq, int64_t n_tok, q8_tiles_storage& st);
// The AMX version (matmul_prefill_int_amx.cpp), strips in q8_layout::amx: per 16 rows, 16 tokens
// and block one TDPBUSD into a 16x16 int32 tile, then the same two FMAs per element as the
// scalar kernel (lanes = tokens), so again the same bits.
void gemm_q8_strips_amx(const uint8_t* packed, int64_t n, int64_t n_blocks, const q8_tiles& xt, int64_t n_tok,
                        float* y, int64_t ldy);
// The 16-bit codes as two byte planes, x = 256 hi + lo (hi signed, lo unsigned), so the 8-bit
// dot-product instructions take them: Σ u x = 256 Σ u hi + Σ u lo, both sums exact in int32.
struct q16_planes {
  const int8_t* hi = nullptr;  // [n_tok, n_cols]
  const uint8_t* lo = nullptr; // [n_tok, n_cols]
  const float* d = nullptr;
  const float* s = nullptr;
  int64_t n_blocks = 0;
};
q16_planes split_q16_planes(const q16_act& xq, int64_t n_tok, std::vector<int8_t>& storage);
// VNNI, q16 (matmul_prefill_int_avx512.cpp): VPDPBUSD(u, hi) and VPDPBUSD(lo, u) (the codes as
// the signed operand: valid for codes <= 127, so not Q8_0), 8 tokens per weight load.
void gemm_q16_strips_avx512(const uint8_t* packed, int64_t n, int64_t n_blocks, const q16_planes& xp, int64_t n_tok,
                            float* y, int64_t ldy);
// B tiles of any byte plane (make_q8_tiles is the q8 codes' case).
q8_tiles make_byte_tiles(const void* plane /*[n_tok, n_cols] bytes*/, const float* d, const float* s, int64_t n_blocks,
                         int64_t n_tok, q8_tiles_storage& st);
// AMX, q16: TDPBUSD(u, hi) and TDPBUUD(u, lo) per block, any legacy type (Q8_0 included).
void gemm_q16_strips_amx(const uint8_t* packed, int64_t n, int64_t n_blocks, const q8_tiles& hi, const q8_tiles& lo,
                         int64_t n_tok, float* y, int64_t ldy);
// Whether cpu::matmul's prefill takes the integer GEMM for this type under `act` on this CPU
// (AVX-512 VNNI; q16 Q8_0 also needs AMX).
bool prefill_int_applies(ggml_type type, prefill_activations act);
// The whole integer prefill product (quantize, pack per thread panel, multiply) with q8 or q16
// activations; `simd` false runs the scalar kernel (tests). Requires a legacy quant.
void matmul_prefill_int(const weight_view& w, const float* x /*[n_tok, n_cols]*/, int64_t n_tok,
                        float* y /*[n_tok, n_rows]*/, prefill_activations act, bool simd);

// Row range of thread ith of nth, cut at multiples of 16 rows so two threads never write the
// same 64-byte line of y.
void thread_rows(int64_t n_rows, int ith, int nth, int64_t* r0, int64_t* r1);

}  // namespace xctx::cpu::detail
