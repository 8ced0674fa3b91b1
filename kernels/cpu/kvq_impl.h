// Internal to the cpu quantized-cache kernels (kvq.cpp drivers, kvq_avx2.cpp row decoders).
#pragma once

#include <cstdint>

#include "kernels/kv_quant.h"

namespace xctx::cpu::impl {

// Dense rows of a quantized layer decoded to f32 (no outliers, no RoPE). Rows are indices
// among the quantized rows: [i0, i0 + nt).
//   keys:   out[r, c] = deq(code) * sc[c] + zc[c]   (sc/zc: the channel scales of the row's group)
//   values: per row, the row's own scale/zero over channel groups
void kvq_decode_keys_scalar(const kvq_layer_view& v, int64_t i0, int nt, const float* sc /*[C]*/,
                            const float* zc /*[C]*/, float* out /*[nt, C]*/);
void kvq_decode_values_scalar(const kvq_layer_view& v, int64_t i0, int nt, float* out /*[nt, C]*/);

namespace avx2 {  // bits 2..4, C % 8 == 0
void kvq_decode_keys(const kvq_layer_view& v, int64_t i0, int nt, const float* sc, const float* zc, float* out);
void kvq_decode_values(const kvq_layer_view& v, int64_t i0, int nt, float* out);
// One row of C uniform codes (bits 1..4): out[c] = (float)code * sc[c] + zc[c], a product then a
// sum (no FMA), bitwise what the scalar X-cache decoder computes.
void affine_codes_row(const uint8_t* row, int C, int bits, const float* sc, const float* zc, float* out);
}  // namespace avx2

}  // namespace xctx::cpu::impl
