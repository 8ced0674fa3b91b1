// The choices a backend is made with (make_backend, registry/registry.h): how its matmuls round
// activations (--decode-act / --prefill-act or XCTX_DECODE_ACT / XCTX_PREFILL_ACT), and the A/B
// switches between kernels a benchmark compares in one binary. The caller resolves them once;
// no kernel reads a process-wide setting or the environment for them. The arithmetic of each
// choice and its error: kernels/cpu/cpu_ops.h, docs/engine.md; the variables: docs/env_vars.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace xctx {

// Decode (few-token) matmuls over legacy block quants: f32 activations, or rounded to 16-bit /
// 8-bit blocks for integer dot products.
enum class decode_activations : uint8_t { act_f32, act_q8, act_q16 };
// Prefill (many-token) matmuls: the row-invariant f32 GEMM, or the integer GEMM on 16-/8-bit
// activation blocks where the CPU has it.
enum class prefill_activations : uint8_t { pre_f32, pre_q8, pre_q16 };

// "f32" / "q16" / "q8"; parse throws an Error naming `what` (e.g. "--decode-act") and the choices.
const char* decode_activations_name(decode_activations act);
decode_activations parse_decode_activations(std::string_view name, const char* what);
const char* prefill_activations_name(prefill_activations act);
prefill_activations parse_prefill_activations(std::string_view name, const char* what);

struct backend_settings {
  // Unset: the registry reads XCTX_DECODE_ACT / XCTX_PREFILL_ACT, else the backend's default
  // (decode q16; prefill q16 on AVX-512 VNNI CPUs, f32 elsewhere). The CPU backend applies
  // them; ref (exact arithmetic) and CUDA (dequantized weights, cuBLAS) have no such choice.
  std::optional<decode_activations> decode;
  std::optional<prefill_activations> prefill;
  // Unset: the registry reads the variable named, else on. Each pair gives the same bits.
  std::optional<bool> attn_avx512_rows;  // cpu: many-row exact attention on AVX-512 (XCTX_ATTN_AVX512)
  std::optional<bool> kvq_key_lanes;     // cpu: fused nuq decode scores keys in lanes (XCTX_KVQ_KEY_LANES)
  // cuda: decode segments replayed as CUDA graphs (XCTX_CUDA_GRAPHS); the same bits as eager.
  std::optional<bool> cuda_graphs;
  // cuda: prefill GEMMs in TF32 (XCTX_CUDA_TF32; off: fp32). Not the same bits: 10-bit mantissas.
  std::optional<bool> cuda_tf32;
};

}  // namespace xctx
