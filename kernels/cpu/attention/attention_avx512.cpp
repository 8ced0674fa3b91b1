// decode_block for many query rows per kv head -- the unit path's blocked queries (prefill:
// kQueryBlock queries x g heads per kv head) -- with 16-lane vectors, bitwise the AVX2 kernel's
// results (attention_avx2.cpp): the rank- and split-invariance of the unit path rests on every
// row's arithmetic being one function of its query and the unit, whichever kernel runs it.
//
// The AVX2 kernel scores a key per 8-lane accumulator: lane l sums q_d k_d over d = l, l+8, ...
// (one FMA chain), and the 8 lanes are added in one of two fixed orders -- the KB-key blocks'
//   A = ((P0+P1)+(P2+P3)) + ((P4+P5)+(P6+P7))
// and the tail keys' (hsum8)
//   B = ((P0+P4)+(P2+P6)) + ((P1+P5)+(P3+P7)),
// the tail being the last n_max mod KB keys of a 3-row block (KB = 8, 4, 3 for 1, 2, 3 rows).
// Here the lanes hold 16 keys instead: the tile's keys are transposed once per (tile, kv head)
// into channel rows, every lane-class chain P_l is one FMA per channel with the query channel
// broadcast, and the A tree is 7 vector adds per 16 keys -- no horizontal sums, and the
// transpose is shared by all the head's rows. Tail keys add the same partials in the B order.
// The softmax is the AVX2 kernel's (row_max, exp_sub_sum) on 16 lanes with the same sums, the
// values the same FMA chain per element over the keys in order, 16 lanes wide and converted
// once per tile. tests/kernels/test_attention.cpp compares the two kernels bit for bit.
//
// Raw pointers only: no std containers here, so no AVX-512-compiled template copies can be
// picked by the linker for the portable files.
#if defined(__GNUC__) && !defined(__clang__)  // GCC bug 105593: its own AVX-512 intrinsics
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "common/error.h"
#include "kernels/cpu/matmul/decode_rows_impl.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/simd/fast_exp_avx2.h"

namespace xctx::cpu::impl::avx512 {
namespace {

using avx2::exp16;
using avx2::hsum8;
using avx2::load_f16x8;

constexpr int kT = kDecodeTile;  // keys per tile, as the AVX2 kernel (softmax tiles are part of the arithmetic)
constexpr int kSS = kT + 8;
constexpr int kRowBlock = 3;  // the AVX2 kernel's row blocks: they fix each key's lane order
constexpr int kKeyVecs = kT / 16;
static_assert(kT % 16 == 0, "tiles of whole 16-key vectors");

// The AVX2 kernel's keys per block for a block of rb rows; keys past the last whole block of
// the block's n_max take the B order.
inline int keys_per_block(int rb) { return rb == 1 ? 8 : rb == 2 ? 4 : 3; }

template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<uint16_t>(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<uint16_t>(const uint16_t* p) { return load_f16x8(p); }

// Lanes [0, n) (n may be <= 0 or >= 16).
inline __mmask16 lanes_below(int n) { return n <= 0 ? (__mmask16)0 : n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// x as a register operand from here on: GCC otherwise folds a vector loaded once and used by
// several FMAs into each of them as a memory operand, one load per use (measured: the score
// and value loops became load-bound, 18 loads per 12 FMAs).
inline void in_register(__m512& x) { asm volatile("" : "+v"(x)); }

// In-register 16x16 transpose: r[i] lane j becomes r[j] lane i.
inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);  // per 128-bit piece: (r_i, r_i+1) lanes 0, 1
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);  // rows i..i+3, piece lane 0
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // u[4a + c] piece p: rows 4a..4a+3 of column 4p + c. Gather the four pieces p of columns c.
  for (int c = 0; c < 4; ++c) {
    const __m512 a01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);  // pieces 0, 2 of rows 0-3, 4-7
    const __m512 b01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);  // pieces 1, 3
    const __m512 a23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 b23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_f32x4(a01, a23, 0x88);       // column c
    r[8 + c] = _mm512_shuffle_f32x4(a01, a23, 0xDD);   // column 8 + c
    r[4 + c] = _mm512_shuffle_f32x4(b01, b23, 0x88);   // column 4 + c
    r[12 + c] = _mm512_shuffle_f32x4(b01, b23, 0xDD);  // column 12 + c
  }
}

// kt[d * kT + j] = key j's channel d (f32) for the tile's first 16 * n_vec keys (keys at
// kp + j * ld; those at or past nt are 0).
template <typename T>
void transpose_keys(const T* kp, int64_t ld, int nt, int hd, int n_vec, float* kt) {
  for (int v = 0; v < n_vec; ++v)
    for (int d0 = 0; d0 < hd; d0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        const int j = 16 * v + i;
        r[i] = j < nt ? load16(kp + j * ld + d0) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (size_t)(d0 + i) * kT + 16 * v, r[i]);
    }
}

// s[r * kSS + j] = q_r . k_j in the A order for r < RB, j < 16 * KV, from the transposed tile.
// The lane classes go in pairs (l, l+1), each pair's sum folded into the A tree at once:
// 2·RB·KV chains in flight plus two partial trees per (row, key vector).
// parts (null: not wanted) receives every lane-class partial P_l, [8][RB][KV][16], for the
// B-order keys (scores_b).
template <int RB, int KV, int HD>
void scores_a(const float* q /*[RB, HD]*/, const float* kt /*[HD, kT]*/, float* s /*[RB, kSS]*/, float* parts) {
  // The partial trees wait in memory (s, and t45 for T45): held in registers they push the
  // 2·RB·KV chains, key and query vectors past the 32 registers.
  alignas(64) float t45[RB][KV][16];
#pragma GCC unroll 4
  for (int c = 0; c < 8; c += 2) {
    __m512 a0[RB][KV], a1[RB][KV];
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < KV; ++v) a0[r][v] = a1[r][v] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int i = 0; i < HD / 8; ++i) {
      const int d = c + 8 * i;
      __m512 k0[KV], k1[KV];
      for (int v = 0; v < KV; ++v) {
        k0[v] = _mm512_loadu_ps(kt + (size_t)d * kT + 16 * v);
        k1[v] = _mm512_loadu_ps(kt + (size_t)(d + 1) * kT + 16 * v);
        in_register(k0[v]), in_register(k1[v]);
      }
      for (int r = 0; r < RB; ++r) {
        const __m512 b0 = _mm512_set1_ps(q[r * HD + d]), b1 = _mm512_set1_ps(q[r * HD + d + 1]);
        for (int v = 0; v < KV; ++v) {
          a0[r][v] = _mm512_fmadd_ps(b0, k0[v], a0[r][v]);
          a1[r][v] = _mm512_fmadd_ps(b1, k1[v], a1[r][v]);
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int v = 0; v < KV; ++v) {
        if (parts != nullptr) {
          _mm512_store_ps(parts + (((size_t)c * RB + r) * KV + v) * 16, a0[r][v]);
          _mm512_store_ps(parts + (((size_t)(c + 1) * RB + r) * KV + v) * 16, a1[r][v]);
        }
        const __m512 pair = _mm512_add_ps(a0[r][v], a1[r][v]);  // T01, T23, T45, T67
        float* sv = s + r * kSS + 16 * v;
        if (c == 0)
          _mm512_storeu_ps(sv, pair);
        else if (c == 2)
          _mm512_storeu_ps(sv, _mm512_add_ps(_mm512_loadu_ps(sv), pair));  // T0123
        else if (c == 4)
          _mm512_store_ps(t45[r][v], pair);
        else  // T0123 + (T45 + T67)
          _mm512_storeu_ps(sv, _mm512_add_ps(_mm512_loadu_ps(sv), _mm512_add_ps(_mm512_load_ps(t45[r][v]), pair)));
      }
  }
}

// Keys [ja, jb) of the block (within the first 16·KV) in the B order, from scores_a's lane-class
// partials: the AVX2 kernel's hsum8, ((P0+P4)+(P2+P6)) + ((P1+P5)+(P3+P7)), on 16 keys at once.
template <int RB, int KV>
void scores_b(const float* parts, int ja, int jb, float* s /*[RB, kSS]*/) {
  const auto p = [&](int l, int r, int v) { return _mm512_load_ps(parts + (((size_t)l * RB + r) * KV + v) * 16); };
  for (int v = ja / 16; v <= (jb - 1) / 16; ++v) {
    const __mmask16 keys = lanes_below(jb - 16 * v) & ~lanes_below(ja - 16 * v);
    for (int r = 0; r < RB; ++r) {
      const __m512 b0 = _mm512_add_ps(_mm512_add_ps(p(0, r, v), p(4, r, v)), _mm512_add_ps(p(2, r, v), p(6, r, v)));
      const __m512 b1 = _mm512_add_ps(_mm512_add_ps(p(1, r, v), p(5, r, v)), _mm512_add_ps(p(3, r, v), p(7, r, v)));
      _mm512_mask_storeu_ps(s + r * kSS + 16 * v, keys, _mm512_add_ps(b0, b1));
    }
  }
}

// The AVX2 kernel's softmax step (row_max, exp_sub_sum) on the RB rows' visible scores (n[r],
// 0: the row sees none of the tile and keeps its state, alpha 1): s becomes the probabilities,
// m and l move on. Same bits: max is exact; exp16 is exp8 per lane; the sum keeps exp8's 8 lane
// sums, each over its elements in key order (masked lanes add +0, as the AVX2 tail's exp(-inf)
// does), then hsum8. The rows go in lockstep, stage by stage: each is a chain of dependent
// reductions, and one row at a time leaves the core waiting on it (measured: 2x the time).
template <int RB>
inline void softmax_rows(float* s /*[RB, kSS]*/, const int* n, float* m, float* l, float* alpha) {
  const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
  __mmask16 k0[RB], k1[RB];
  __m512 x0[RB], x1[RB];
  float m_new[RB];
  for (int r = 0; r < RB; ++r) {
    k0[r] = lanes_below(n[r]), k1[r] = lanes_below(n[r] - 16);
    x0[r] = _mm512_mask_loadu_ps(ninf, k0[r], s + r * kSS);
    x1[r] = _mm512_mask_loadu_ps(ninf, k1[r], s + r * kSS + 16);
  }
  for (int r = 0; r < RB; ++r) {
    const float mt = _mm512_reduce_max_ps(_mm512_max_ps(x0[r], x1[r]));
    m_new[r] = n[r] > 0 && mt > m[r] ? mt : m[r];
    // exp(0) = 1 and exp(-inf) = 0 exactly: the call only where the maximum moved from a finite one.
    alpha[r] = m_new[r] == m[r] ? 1.0f : m[r] == -__builtin_inff() ? 0.0f : std::exp(m[r] - m_new[r]);
  }
  __m256 acc[RB];
  for (int r = 0; r < RB; ++r) {
    const __m512 mn = _mm512_set1_ps(m_new[r]);
    const __m512 e0 = _mm512_maskz_mov_ps(k0[r], exp16(_mm512_sub_ps(x0[r], mn)));
    const __m512 e1 = _mm512_maskz_mov_ps(k1[r], exp16(_mm512_sub_ps(x1[r], mn)));
    _mm512_mask_storeu_ps(s + r * kSS, k0[r], e0);
    _mm512_mask_storeu_ps(s + r * kSS + 16, k1[r], e1);
    acc[r] = _mm256_add_ps(_mm512_castps512_ps256(e0), _mm512_extractf32x8_ps(e0, 1));
    acc[r] = _mm256_add_ps(acc[r], _mm512_castps512_ps256(e1));
    acc[r] = _mm256_add_ps(acc[r], _mm512_extractf32x8_ps(e1, 1));
  }
  for (int r = 0; r < RB; ++r) {
    if (n[r] == 0) continue;
    l[r] = l[r] * alpha[r] + hsum8(acc[r]);
    m[r] = m_new[r];
  }
}

// o_r = alpha_r o_r + sum_{j < n} p_r[j] v_j over 16 * W channels from d0: the AVX2 pv_block's
// chain per element, 16 lanes wide. Value rows at vp + j * vld (f32).
template <int RB, int W>
void pv(float* o /*[RB, hd]*/, int hd, const float* p /*[RB, kSS]*/, const float* alpha, const float* vp,
        int64_t vld, int n, int d0) {
  __m512 acc[RB][W];
  for (int r = 0; r < RB; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < W; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * hd + d0 + 16 * c), a);
  }
  for (int j = 0; j < n; ++j) {
    __m512 v[W];
    for (int c = 0; c < W; ++c) v[c] = _mm512_loadu_ps(vp + j * vld + d0 + 16 * c), in_register(v[c]);
    for (int r = 0; r < RB; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * kSS + j]);
      for (int c = 0; c < W; ++c) acc[r][c] = _mm512_fmadd_ps(pr, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(o + r * hd + d0 + 16 * c, acc[r][c]);
}

template <int RB, int HD>
void pv_rows(float* o, const float* p, const float* alpha, const float* vp, int64_t vld, int n) {
  constexpr int W = HD / 16 < 4 ? HD / 16 : 4;  // RB·W accumulators + W values + RB weights
  for (int d0 = 0; d0 < HD; d0 += 16 * W) pv<RB, W>(o, HD, p, alpha, vp, vld, n, d0);
}

// One block of RB rows of one kv head against the tile (keys transposed in kt; values f32 at
// vp + j * vld): the AVX2 decode_rows' arithmetic. parts: [8, kRowBlock, kKeyVecs, 16] scratch.
template <int RB, int HD>
void block_rows(const float* q, const int64_t* row_end, const float* kt, const float* vp, int64_t vld, int64_t t0,
                int nt, float* m, float* l, float* o, float* s, float* parts) {
  int n_r[RB];
  int n_max = 0;
  for (int r = 0; r < RB; ++r) {
    n_r[r] = decode_rows::visible_in_tile(row_end[r], t0, nt);
    n_max = n_r[r] > n_max ? n_r[r] : n_max;
  }
  if (n_max == 0) return;
  const int kb = keys_per_block(RB), j_a = n_max / kb * kb;
  float* p_parts = j_a < n_max ? parts : nullptr;
  if (n_max > 16)
    scores_a<RB, 2, HD>(q, kt, s, p_parts);
  else
    scores_a<RB, 1, HD>(q, kt, s, p_parts);
  if (j_a < n_max) {
    if (n_max > 16)
      scores_b<RB, 2>(parts, j_a, n_max, s);
    else
      scores_b<RB, 1>(parts, j_a, n_max, s);
  }
  float alpha[RB];
  softmax_rows<RB>(s, n_r, m, l, alpha);
  for (int r = 0; r < RB; ++r)
    for (int j = n_r[r]; j < n_max; ++j) s[r * kSS + j] = 0.0f;  // masked for this row, visible to another
  pv_rows<RB, HD>(o, s, alpha, vp, vld, n_max);
}

template <typename T, int HD>
void run_job(const decode_job& jb) {
  const int R = jb.R;
  // Scratch (decode_scratch_floats): [HD, kT] transposed keys, [kT, HD] f32 values, [3, kSS]
  // scores, m and l [R] -- within the AVX2 kernel's 2·kT·hd + 3·(kT + 8) + 2R (+16: alignment).
  float* kt = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(jb.scratch) + 63) & ~(uintptr_t)63);
  float* vf = kt + (size_t)HD * kT;
  float* s = vf + (size_t)kT * HD;
  float* m = s + kRowBlock * kSS;
  float* l = m + R;
  const int64_t j_end = decode_rows::start(jb, HD, m, l);
  const int rows_per_head = R / jb.n_kvh;
  alignas(64) float parts[8 * kRowBlock * kKeyVecs * 16];
  for (int64_t t0 = jb.j0; t0 < j_end; t0 += kT) {
    const int nt = (int)(j_end - t0 < kT ? j_end - t0 : kT);
    const int n_next = (int)(j_end - t0 - nt < kT ? j_end - t0 - nt : kT);
    for (int h = 0; h < jb.n_kvh; ++h) {
      const T* kp = static_cast<const T*>(jb.k) + t0 * jb.ld + (int64_t)h * HD;
      const T* vsrc = static_cast<const T*>(jb.v) + t0 * jb.ld + (int64_t)h * HD;
      decode_rows::prefetch_next(reinterpret_cast<const char*>(kp), jb.ld * sizeof(T), HD * sizeof(T),
                                 reinterpret_cast<const char*>(vsrc), jb.ld * sizeof(T), HD * sizeof(T), nt, n_next);
      const int r_head = h * rows_per_head;
      int n_head_max = 0;  // keys any row of the head sees in this tile
      for (int r = r_head; r < r_head + rows_per_head; ++r) {
        const int n = decode_rows::visible_in_tile(jb.row_end[r], t0, nt);
        n_head_max = n > n_head_max ? n : n_head_max;
      }
      if (n_head_max == 0) continue;
      transpose_keys(kp, jb.ld, n_head_max, HD, (n_head_max + 15) / 16, kt);
      const float* vp = reinterpret_cast<const float*>(vsrc);
      int64_t vld = jb.ld;
      if constexpr (sizeof(T) == 2) {
        for (int j = 0; j < n_head_max; ++j)
          for (int d = 0; d < HD; d += 16) _mm512_storeu_ps(vf + j * HD + d, load16(vsrc + j * jb.ld + d));
        vp = vf, vld = HD;
      }
      for (int r0 = r_head; r0 < r_head + rows_per_head; r0 += kRowBlock) {
        const int rb = r_head + rows_per_head - r0 < kRowBlock ? r_head + rows_per_head - r0 : kRowBlock;
        const float* q = jb.q + (size_t)r0 * HD;
        float* o = jb.o + (size_t)r0 * HD;
        switch (rb) {
          case 1: block_rows<1, HD>(q, jb.row_end + r0, kt, vp, vld, t0, nt, m + r0, l + r0, o, s, parts); break;
          case 2: block_rows<2, HD>(q, jb.row_end + r0, kt, vp, vld, t0, nt, m + r0, l + r0, o, s, parts); break;
          default: block_rows<3, HD>(q, jb.row_end + r0, kt, vp, vld, t0, nt, m + r0, l + r0, o, s, parts); break;
        }
      }
    }
  }
  decode_rows::finish(jb, HD, m, l);
}

template <typename T>
void run_typed(const decode_job& jb) {
  switch (jb.hd) {
    case 32: return run_job<T, 32>(jb);
    case 64: return run_job<T, 64>(jb);
    default: return run_job<T, 128>(jb);
  }
}

}  // namespace

bool decode_block_supported(const decode_job& jb) {
  const bool plain_values = (jb.v_width <= 0 || jb.v_width == jb.hd) && (jb.v_ld <= 0 || jb.v_ld == jb.ld) &&
                            (jb.v_head_stride < 0 || jb.v_head_stride == jb.hd);
  return plain_values && (jb.hd == 32 || jb.hd == 64 || jb.hd == 128) && jb.n_kvh > 0 && jb.R % jb.n_kvh == 0;
}

void decode_block(const decode_job& jb) {
  XCTX_ASSERT(decode_block_supported(jb), "avx512 decode: unsupported shape (hd ", jb.hd, ")");
  if (jb.type == kv_dtype::kv_f16)
    run_typed<uint16_t>(jb);
  else
    run_typed<float>(jb);
}

}  // namespace xctx::cpu::impl::avx512
