// Optimized CPU kernels (OpenMP threads; AVX2/FMA/F16C paths chosen at run time, scalar
// fallbacks otherwise). Same contracts as kernels/ref/ref_ops.h; tests compare against it.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/kv_quant.h"
#include "kernels/ops.h"

namespace xctx::cpu {

bool has_avx2();  // AVX2 + FMA + F16C present on this CPU (cached)
// Tests and benchmarks: while on, has_avx2() reports false so every kernel takes its scalar
// fallback. The environment variable XCTX_NO_AVX2 (read once) has the same effect.
void set_force_scalar(bool on);
// AVX-512 F/BW/VL/DQ + VBMI + VNNI on top of has_avx2(): the few kernels with a 16-lane variant
// (the fused decode step over quantized caches, the integer decode matvecs) take it. set_force_avx2(true) or XCTX_NO_AVX512 in
// the environment keep them on AVX2.
bool has_avx512();
void set_force_avx2(bool on);
// AVX-VNNI (256-bit VEX VPDPBUSD / VPDPWSSD) on top of has_avx2(): the integer decode matvecs
// use it where has_avx512() is false. set_force_avx2(true) or XCTX_NO_AVXVNNI turn it off.
bool has_avx_vnni();
// Tests and benchmarks: while on, has_avx512() reports false, so the kernels with an AVX-VNNI
// variant take it on CPUs that have both.
void set_force_avx_vnni(bool on);
// AMX tiles with int8 dot products (TDPBUSD) on top of has_avx512(), granted by the kernel
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once here): the integer prefill GEMM takes them.
// XCTX_NO_AMX, set_force_no_amx(true), and everything that turns has_avx512() off turn it off.
bool has_amx();
void set_force_no_amx(bool on);

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
// Process-wide; XCTX_DECODE_ACT=f32|q16|q8 in the environment (read once) selects one.
enum class decode_activations : uint8_t { act_f32, act_q8, act_q16 };
void set_decode_activations(decode_activations act);
decode_activations get_decode_activations();
// "f32" / "q16" / "q8"; parse throws an Error naming `what` (e.g. "--decode-act") and the choices.
const char* decode_activations_name(decode_activations act);
decode_activations parse_decode_activations(std::string_view name, const char* what);

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
// Process-wide; XCTX_PREFILL_ACT=f32|q16|q8 in the environment (read once) selects one.
enum class prefill_activations : uint8_t { pre_f32, pre_q8, pre_q16 };
void set_prefill_activations(prefill_activations act);
prefill_activations get_prefill_activations();
prefill_activations default_prefill_activations();  // q16 where prefill_q8_supported(), else f32
// "f32" / "q16" / "q8"; parse throws an Error naming `what` (e.g. "--prefill-act") and the choices.
const char* prefill_activations_name(prefill_activations act);
prefill_activations parse_prefill_activations(std::string_view name, const char* what);
// Whether integer prefill activations take the integer GEMM on this CPU (AVX-512 VNNI; see
// detail::prefill_int_applies for the per-type rule).
bool prefill_q8_supported();

void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y);
// n_w products of the same x (q, k and v; gate and up): y[i] = x·W[i]ᵀ, bitwise what n_w
// cpu::matmul calls give. On the integer decode paths x is quantized once and all run in one
// parallel region over their concatenated rows (one fork/join and barrier instead of n_w).
void matmul_n(const weight_view* w, int n_w, const float* x, int64_t n_tok, float* const* y);
// The pair form of matmul_n.
void matmul2(const weight_view& a, const weight_view& b, const float* x, int64_t n_tok, float* ya, float* yb);
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
// Decode (few queries): one pass over the cache per kv head with an online softmax, all query
// heads of a GQA group together. Prefill (many queries): tiles through BLAS with the same
// online-softmax merge, never materializing the full score matrix.
void attention_partial(const attn_args& a);
void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim,
                    float* o, float* lse);

// ---- quantized KV cache (kernels/cpu/kvq/kvq*.cpp) ------------------------------------------
// Encoder: OpenMP over rows/channels, codes bit-identical to ref::kvq_encode. Attention: the
// layer streamed in tiles of slots (decode to f32 in L1/L2, outliers patched, RoPE applied,
// then the decode/prefill attention core), never the whole shard in f32.
void kvq_encode(const kvq_encode_job& job);
void attention_kvq(const kvq_attn_args& a);

}  // namespace xctx::cpu
