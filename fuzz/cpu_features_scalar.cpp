// The fuzz build's stand-in for kernels/cpu/simd/cpu_features.cpp: every kernel takes its scalar path.
// The parsers under test do not need SIMD, scalar runs are the same on every machine, and
// clang 14 rejects __builtin_cpu_supports("f16c") in the original.
#include "kernels/cpu/cpu_ops.h"

namespace xctx::cpu {

bool has_avx2() { return false; }
void set_force_scalar(bool) {}
bool has_avx512() { return false; }
void set_force_avx2(bool) {}
bool has_avx_vnni() { return false; }
void set_force_avx_vnni(bool) {}
bool has_amx() { return false; }
void set_force_no_amx(bool) {}

}  // namespace xctx::cpu
