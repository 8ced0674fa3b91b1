// Scalar reference kernels: the oracles every optimized (cpu, cuda) kernel is tested against.
// Plain loops, double accumulation where it makes the oracle meaningfully more exact.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "kernels/softmax_acc.h"

namespace xctx::ref {

// Runs an attention call that has an accumulator (args.acc) as a plain (o, lse) call and adds
// each row's partial to the accumulator as one deposit: exact, but not split into the units
// the CPU kernels use, so the oracle is not rank-count invariant (it is not meant to be).
template <class Args, class Fn>
void with_accumulator(const Args& a, int64_t n_row, int width, Fn run) {
  std::vector<float> o((size_t)n_row * width), lse((size_t)n_row);
  Args b = a;
  b.acc = nullptr, b.o = o.data(), b.lse = lse.data();
  run(b);
  for (int64_t r = 0; r < n_row; ++r) a.acc->add_partial(r, lse[(size_t)r], o.data() + (size_t)r * width);
}

// ---- quantization (kernels/ref/quant_ref.cpp) --------------------------------------------
// Dequantizes n elements (a multiple of the type's block size) of one row.
void dequantize_row(ggml_type type, const void* src, float* dst /*[n]*/, int64_t n);
// Quantizes n elements into blocks of `type`, rounding as GGML's reference quantizers do, so
// codes match files written by llama.cpp. Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
// Q8_0, Q8_1, Q8_K (the K-quant weight types are dequantize-only). Throws for others.
void quantize_row(ggml_type type, const float* src /*[n]*/, void* dst, int64_t n);
bool can_quantize(ggml_type type);

// ---- matmul (kernels/ref/matmul_ref.cpp) -------------------------------------------------
void matmul(const weight_view& w, const float* x /*[n_tok, n_cols]*/, int64_t n_tok, float* y /*[n_tok, n_rows]*/);
void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out /*[n, n_cols]*/);

// ---- elementwise (kernels/ref/elementwise_ref.cpp) ---------------------------------------
void rms_norm(const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y);
// theta for rotary pair i (0 <= i < n_rot/2) at position pos, including the scaling option.
double rope_theta(const rope_config& cfg, int32_t pos, int pair);
void rope(float* x /*[n_tok, n_head, head_dim]*/, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg);
void swiglu(const float* gate, const float* up, int64_t n, float* out);
void add(float* y, const float* x, int64_t n);

// ---- attention (kernels/ref/attention_ref.cpp) -------------------------------------------
// q·k for a query rotated to q_pos and a key rotated to k_pos (k_pos <= q_pos), in double. With
// SelfExtend on (kernels/ops.h) and q_pos - k_pos >= W, both as if rotated to their grouped
// positions instead: k turned by floor(k_pos / G) - k_pos, q by its grouped shift.
double rope_score(const float* q /*[head_dim]*/, const double* k /*[head_dim]*/, const rope_config& cfg,
                  int32_t q_pos, int32_t k_pos);
void attention_partial(const attn_args& a);
void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim,
                    float* o, float* lse);

// ---- quantized KV cache (kernels/ref/kvq_ref.cpp; layouts in kernels/kv_quant.h) ---------
void kvq_encode(const kvq_encode_job& job);
// Every slot of a quantized layer decoded to f32 (pre-RoPE keys), outliers applied.
void kvq_decode_layer(const kvq_layer_view& v, float* k /*[n, C]*/, float* v_out /*[n, C]*/);
// Decode everything, rope(), attention_partial(): the oracle of the fused kernels.
void attention_kvq(const kvq_attn_args& a);

}  // namespace xctx::ref
