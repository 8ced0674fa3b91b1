// Optimized CPU kernels (OpenMP threads; AVX2/FMA/F16C paths chosen at run time, scalar
// fallbacks otherwise). Same contracts as kernels/ref/ref_ops.h; tests compare against it.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/backend_settings.h"
#include "kernels/cpu/simd/cpu_features.h"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"

namespace xctx::cpu {

// ---- matmul (kernels/cpu/matmul/matmul*.cpp) ----------------------------------------------------
// Small n_tok (decode): fused dequantize-and-dot on the quantized weights. Large n_tok
// (prefill): weight row panels dequantized to f32 and multiplied by a row-invariant GEMM (a
// token row's bits do not depend on n_tok, its offset, the other rows or the thread count).
//
// Activations of the decode path for legacy block quants (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0):
//  * act_f32: the weight codes are widened to floats in registers and multiplied
//    with the f32 activations, so the result differs from the exact product of the dequantized
//    weights only by float accumulation (~1e-7 relative), like the sgemm prefill path.
//    The result is a continuous function of x: splitting a sequence over a different number of
//    ranks (which changes float summation orders upstream by ~1e-6) moves the logits by ~1e-6.
//  * act_q16 (default): activations rounded to 16-bit blocks (step max|x_b| / 32767) and integer dot
//    products (pmaddwd): the codes are widened to int16 once per block for all tokens, so a
//    block costs 2 multiply-adds per token instead of 4 conversions and 4 FMAs: as fast as
//    act_q8 and 1.5x act_f32 per matvec on AVX2. The rounding error is 1/256 of act_q8's (on
//    SmolLM2 decode logits <= 0.005 from exact arithmetic, every greedy token unchanged); like
//    act_q8 it is discontinuous in x (see below).
//  * act_q8: activations rounded to 8-bit blocks and integer dot products, mirroring
//    llama.cpp's arithmetic (fastest). The rounding is discontinuous: a 1e-6 change of one
//    activation can flip a rounding and move the logits by ~0.5 (measured), so results are no
//    longer continuous in upstream float summation orders.
// Rank counts: the integer paths keep multi-rank runs bitwise equal to one rank, because the
// attention they follow is bitwise rank-count invariant (tests/mpi run under each setting).
// The choice is the backend's (backend_settings, kernels/backend_settings.h: --decode-act,
// XCTX_DECODE_ACT), passed to every call in matmul_settings; no process-wide state.
using xctx::decode_activations;
using xctx::decode_activations_name;
using xctx::parse_decode_activations;

// Activations of the prefill matmuls (n_tok at or above detail::prefill_min_tokens) for the
// legacy block quants:
//  * f32 (the default where the CPU lacks AVX-512 VNNI): the weights dequantized to float strips and one FMA chain per element in
//    column order (row-invariant GEMM, matmul.cpp).
//  * q8: each token's activations rounded to 8-bit blocks (as act_q8) and multiplied with the
//    weight codes by VPDPBUSD on AVX-512 VNNI hosts, AMX TDPBUSD where granted
//    (matmul_prefill_int*.cpp); elsewhere, and for other weight types, the f32 path. Still one
//    chain per element in block order, so row- and rank-count invariant; the error is act_q8's
//    rounding (<= d/2 per activation).
//  * q16: the same with 16-bit blocks (act_q16's rounding, 1/258 of q8's), split into two byte
//    planes: twice the integer products of q8. Q8_0 weights take it only with AMX. The default
//    on AVX-512 VNNI hosts (default_prefill_activations).
// Chosen like the decode activations (--prefill-act, XCTX_PREFILL_ACT).
using xctx::prefill_activations;
using xctx::prefill_activations_name;
using xctx::parse_prefill_activations;
prefill_activations default_prefill_activations();  // q16 where prefill_q8_supported(), else f32

// The activations cpu::matmul rounds to: the CPU backend holds the ones it was made with and
// passes them to every call; a default-constructed one is the backend's defaults.
struct matmul_settings {
  decode_activations decode = decode_activations::act_q16;
  prefill_activations prefill = default_prefill_activations();
};

void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y, const matmul_settings& s = {});
// n_w products of the same x (q, k and v; gate and up): y[i] = x·W[i]ᵀ, bitwise what n_w
// cpu::matmul calls give. On the integer decode paths x is quantized once and all run in one
// parallel region over their concatenated rows (one fork/join and barrier instead of n_w).
void matmul_n(const weight_view* w, int n_w, const float* x, int64_t n_tok, float* const* y,
              const matmul_settings& s = {});
// The pair form of matmul_n.
void matmul2(const weight_view& a, const weight_view& b, const float* x, int64_t n_tok, float* ya, float* yb,
             const matmul_settings& s = {});
// C = A·B (b_transposed false: B [k, n_out] row-major) or A·Bᵀ (true: B [n_out, k]), plus C
// itself when beta is 1 (beta must be 0 or 1). Row-invariant like the prefill matmul: every
// element is one chain of fused multiply-adds in k order, added to C last, so a row's bits do not
// depend on n, on the row's place in the call or on the other rows (sequence-parallel shards
// reproduce single-rank results). Runs on the calling thread only, so it may be called from
// inside an OpenMP region; the caller parallelizes.
void gemm_rows(const float* a /*[n, k]*/, int64_t n, int k, const float* b /*[k, n_out] or [n_out, k]*/,
               bool b_transposed, int n_out, float beta, float* c /*[n, ldc]*/, int64_t ldc);
void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out);
void dequantize_row(ggml_type type, const void* src, float* dst, int64_t n);

// ---- elementwise (kernels/cpu/elementwise*.cpp) ------------------------------------------
void rms_norm(const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y);
void rope(float* x, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg);
void swiglu(const float* gate, const float* up, int64_t n, float* out);
void add(float* y, const float* x, int64_t n);

// ---- attention (kernels/cpu/attention/attention*.cpp) ----------------------------------------------
// Which of two kernels that give the same bits an attention call takes: the A/B baselines a
// benchmark compares in one binary. The CPU backend binds the ones it was made with
// (backend_settings: attn_avx512_rows, kvq_key_lanes); the defaults are the faster kernels.
struct attention_switches {
  bool avx512_rows = true;    // many-row exact attention on the AVX-512 kernel (else AVX2)
  bool kvq_key_lanes = true;  // fused quantized decode: nuq keys scored 16 in lanes (else one at a time)
};
// Decode (few queries): one pass over the cache per kv head with an online softmax, all query
// heads of a GQA group together. Prefill (many queries): tiles through BLAS with the same
// online-softmax merge, never materializing the full score matrix.
void attention_partial(const attn_args& a);
void attention_partial(const attn_args& a, const attention_switches& s);
void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim,
                    float* o, float* lse);

// ---- quantized KV cache (kernels/cpu/kvq/kvq*.cpp) ------------------------------------------
// Encoder: OpenMP over rows/channels, codes bit-identical to ref::kvq_encode. Attention: the
// layer streamed in tiles of slots (decode to f32 in L1/L2, outliers patched, RoPE applied,
// then the decode/prefill attention core), never the whole shard in f32.
void kvq_encode(const kvq_encode_job& job);
void attention_kvq(const kvq_attn_args& a);
void attention_kvq(const kvq_attn_args& a, const attention_switches& s);

}  // namespace xctx::cpu
