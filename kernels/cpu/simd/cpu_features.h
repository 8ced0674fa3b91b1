// What this CPU offers the kernels, detected once per process (cpu_features.cpp), and the test
// hooks that hide an ISA. A header of its own so that code asking only "which ISA?" (xctx
// doctor, the test mains' ISA coverage, results files) does not depend on the kernel entry
// points of cpu_ops.h and rebuild with them.
#pragma once

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
// Whether integer prefill activations take the integer GEMM on this CPU (AVX-512 VNNI; see
// detail::prefill_int_applies for the per-type rule). Defined beside the GEMM
// (matmul/matmul_prefill_int.cpp).
bool prefill_q8_supported();

}  // namespace xctx::cpu
