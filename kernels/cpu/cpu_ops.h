// Optimized CPU kernels (OpenMP threads; AVX2/FMA/F16C paths chosen at run time, scalar
// fallbacks otherwise). Same contracts as kernels/ref/ref_ops.h; tests compare against it.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace xctx::cpu {

bool has_avx2();  // AVX2 + FMA + F16C present on this CPU (cached)
// Tests and benchmarks: while on, has_avx2() reports false so every kernel takes its scalar
// fallback. The environment variable XCTX_NO_AVX2 (read once) has the same effect.
void set_force_scalar(bool on);

// ---- matmul (kernels/cpu/matmul*.cpp) ----------------------------------------------------
// Small n_tok (decode): fused dequantize-and-dot on the quantized weights (activations
// quantized to Q8_0/Q8_1 blocks, integer dot products, as llama.cpp does). Large n_tok
// (prefill): weight row panels dequantized to f32 and multiplied with OpenBLAS sgemm.
void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y);
void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out);
void dequantize_row(ggml_type type, const void* src, float* dst, int64_t n);

// ---- elementwise (kernels/cpu/elementwise*.cpp) ------------------------------------------
void rms_norm(const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y);
void rope(float* x, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg);
void swiglu(const float* gate, const float* up, int64_t n, float* out);
void add(float* y, const float* x, int64_t n);

// ---- attention (kernels/cpu/attention*.cpp) ----------------------------------------------
// Decode (few queries): one pass over the cache per kv head with an online softmax, all query
// heads of a GQA group together. Prefill (many queries): tiles through BLAS with the same
// online-softmax merge, never materializing the full score matrix.
void attention_partial(const attn_args& a);
void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim,
                    float* o, float* lse);

}  // namespace xctx::cpu
