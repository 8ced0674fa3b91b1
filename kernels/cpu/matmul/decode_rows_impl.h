// Internal to the decode kernels (attention_avx2.cpp, attention_avx512.cpp): the steps of a
// decode job that do not depend on the instruction set, so both kernels run the same ones (the
// AVX-512 kernel must give the AVX2 kernel's bits). Internal linkage: each includer compiles its
// own copy with its own flags, so the linker never hands a portable caller an AVX-512 body.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/elementwise_attention_impl.h"

namespace xctx::cpu::impl::decode_rows {
namespace {

// m = -inf, l = 0 and o = 0 (vw wide) for every row; returns the end of the keys any row sees.
inline int64_t start(const decode_job& jb, int vw, float* m, float* l) {
  int64_t j_end = jb.j0;
  for (int r = 0; r < jb.R; ++r) {
    m[r] = -__builtin_inff();
    l[r] = 0.0f;
    for (int d = 0; d < vw; ++d) jb.o[(int64_t)r * vw + d] = 0.0f;
    const int64_t e = jb.row_end[r] < jb.j1 ? jb.row_end[r] : jb.j1;
    j_end = e > j_end ? e : j_end;
  }
  return j_end;
}

// Keys of the tile [t0, t0 + nt) that a row ending at row_end sees (a prefix).
inline int visible_in_tile(int64_t row_end, int64_t t0, int nt) {
  const int64_t vis = row_end - t0;
  return vis <= 0 ? 0 : vis < nt ? (int)vis : nt;
}

// Requests rows [nt, nt + n_next) of one kv head's keys and values (row r at k + r·k_stride
// bytes, k_bytes long; values alike) while the current tile computes.
inline void prefetch_next(const char* k, size_t k_stride, size_t k_bytes, const char* v, size_t v_stride,
                          size_t v_bytes, int nt, int n_next) {
  for (int j = nt; j < nt + n_next; ++j) {
    for (size_t b = 0; b < k_bytes; b += 64) _mm_prefetch(k + (size_t)j * k_stride + b, _MM_HINT_T0);
    for (size_t b = 0; b < v_bytes; b += 64) _mm_prefetch(v + (size_t)j * v_stride + b, _MM_HINT_T0);
  }
}

// o = o · (1 / l) and lse = m + ln l per row; rows that saw nothing keep o = 0, lse = -inf.
inline void finish(const decode_job& jb, int vw, const float* m, const float* l) {
  for (int r = 0; r < jb.R; ++r) {
    if (l[r] == 0.0f) {
      jb.lse[r] = -__builtin_inff();
      continue;
    }
    const float inv = 1.0f / l[r];
    float* o = jb.o + (int64_t)r * vw;
    for (int d = 0; d < vw; ++d) o[d] = o[d] * inv;
    jb.lse[r] = m[r] + std::log(l[r]);
  }
}

}  // namespace
}  // namespace xctx::cpu::impl::decode_rows
