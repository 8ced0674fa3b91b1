// Fused one-query attention over a quantized layer (the decode step): codes are unpacked, looked
// up and scaled in registers and consumed there -- no f32 copy of keys or values, not even of a
// tile. See kvq_impl.h (kvq_fused_args) for the contract; the arithmetic, per tile of
// kFusedTile slots and per kv head:
//
//  scores   s_j = q'·R(o_j)·k_j with k_j = deq(code)·sc + zc (pre-RoPE, dense part). RoPE is
//           split as R(p0 + o) = R(p0)·R(o) with p0 the unit's first position: the query is
//           rotated back by p0 once per unit (q' = R(p0)ᵀ q) and each key only by its offset
//           o_j = pos_j − p0 < kAttnUnit, from a static table -- one rotation per key vector and
//           no angle arithmetic per token. A function of positions alone (the unit's slots are
//           the same on any number of ranks). Keys that share one offset (SelfExtend's grouped
//           side, G >= a block of keys) take the rotation and channel scale onto the query
//           instead: s_j = (R(o)ᵀq' ⊙ sc)·deq(code) + R(o)ᵀq'·zc (turn_query), made once per offset.
//  outliers KVQuant's dense-and-sparse split: a key outlier adds δ·(q'·R(o_j)e_c) to its score, a
//           value outlier p_j·δ to o, with δ = stored value − dense decode of the same element.
//  values   o += Σ_j (p_j·s_j)·lvl_j + (Σ_j p_j·z_j): the per-token value scale is folded into
//           the probability and the zero point summed once per tile, so a value vector costs an
//           unpack, a lookup and one FMA per query head.
//  softmax  online, natural log, merged per tile.
// Up to four query heads of a kv head share each decoded vector. The head's channel vectors are
// a compile-time count (NV = head_dim / 8), so every loop over them unrolls and the code reads
// and constants stay in registers or fold into the instructions.
//
// Raw pointers only: no std containers here, so no AVX2-compiled template copies can be picked
// by the linker for the portable files.
#include <immintrin.h>

#include "kernels/cpu/kvq/kvq_fused_impl.h"

namespace xctx::cpu::impl::avx2 {
namespace {

using namespace fused;

inline lut_regs load_lut16(const float* t16) { return {_mm256_load_ps(t16), _mm256_load_ps(t16 + 8)}; }

inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// ---- vector sources: vector d (8 channels) of one kv head's row --------------------------------

// Codes of vector d of a head row of NV vectors: every vector but the last reads forward, the
// last backward, so no read leaves the row (NV >= 2); 1-bit codes are one byte per vector.
template <int BITS, bool LUT, int NV>
struct quant_row {
  static __m256 level_at(const uint8_t* head_row, int d, const lut_regs& L) {
    const uint8_t* p = head_row + d * BITS;
    if constexpr (BITS == 1) return level<BITS, LUT>(codes8_shifted<BITS, code_read::read_exact>(p), L);
    return d + 1 < NV ? level<BITS, LUT>(codes8_shifted<BITS, code_read::read_forward>(p), L)
                      : level<BITS, LUT>(codes8_shifted<BITS, code_read::read_backward>(p), L);
  }
};

// Keys of a run of quantized rows: row r's head codes at base + r * rb.
template <int BITS, bool LUT, int NV>
struct quant_keys {
  const uint8_t* base;
  size_t rb;
  const float* sc;  // [hd] the head's channel scales (uniform: of the run's key group)
  const float* zc;  // [hd]
  lut_regs L;
  static constexpr bool kTurnable = true;  // keys sharing a rotation may take turn_query
  const uint8_t* row(int r) const { return base + (size_t)r * rb; }
  __m256 level(const uint8_t* head_row, int d) const { return quant_row<BITS, LUT, NV>::level_at(head_row, d, L); }
  __m256 load(const uint8_t* head_row, int d) const {
    return _mm256_fmadd_ps(level(head_row, d), _mm256_loadu_ps(sc + 8 * d), _mm256_loadu_ps(zc + 8 * d));
  }
};

// fp16 rows (sink, residual window): row r at base + r * ld elements.
struct f16_keys {
  const uint16_t* base;
  int64_t ld;
  static constexpr bool kTurnable = false;
  const uint16_t* row(int r) const { return base + r * ld; }
  __m256 load(const uint16_t* head_row, int d) const { return load_f16x8(head_row + 8 * d); }
};

template <int BITS, bool LUT, int NV>
struct quant_values {
  const uint8_t* base;
  size_t rb;
  lut_regs L;
  const uint8_t* row(int r) const { return base + (size_t)r * rb; }
  __m256 load(const uint8_t* head_row, int d) const { return quant_row<BITS, LUT, NV>::level_at(head_row, d, L); }
};
using f16_values = f16_keys;

// ---- scores -------------------------------------------------------------------------------

// s[u * kSS + j0 + b] = q_u · R(o) k for u < RB, b < TB; keys are rows r0 + b of the run, rotated
// by the rows of cos2/sin2 at rot[j0 + b] (= offset · hd). TURNED: the keys share one rotation;
// q and z are turn_query's, s = q_u · lvl + z_u.
template <int NV, int RB, int TB, bool TURNED = false, class K>
inline void score_block(const K& keys, int j0, int r0, const float* q /*[RB, hd]*/, const float* cos2,
                        const float* sin2, const int32_t* rot /*[kT]*/, float* s /*[RB, kSS]*/,
                        const float* z = nullptr) {
  constexpr int hd = 8 * NV;
  __m256 acc[RB][TB];
  for (int u = 0; u < RB; ++u)
    for (int b = 0; b < TB; ++b) acc[u][b] = _mm256_setzero_ps();
  decltype(keys.row(0)) rows[TB];
  for (int b = 0; b < TB; ++b) rows[b] = keys.row(r0 + b);
  const float* c2[TB];
  const float* s2[TB];
  for (int b = 0; b < TB; ++b) c2[b] = cos2 + rot[j0 + b], s2[b] = sin2 + rot[j0 + b];
#pragma GCC unroll 16
  for (int d = 0; d < NV; ++d)
    for (int b = 0; b < TB; ++b) {
      const size_t a = 8 * d;
      __m256 k;
      if constexpr (TURNED)
        k = keys.level(rows[b], d);
      else
        k = rotate8(keys.load(rows[b], d), c2[b] + a, s2[b] + a);
      for (int u = 0; u < RB; ++u) acc[u][b] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q + u * hd + 8 * d), acc[u][b]);
    }
  const __m256 z0 = _mm256_setzero_ps();
  for (int u = 0; u < RB; ++u) {
    // Lanes past TB hold 0 (TURNED: z_u) and land on later keys' slots (written after) or the
    // row's padding.
    const auto plus_z = [&](__m128 x) { return TURNED ? _mm_add_ps(x, _mm_set1_ps(z[u])) : x; };
    if constexpr (TB == 8) {
      _mm_storeu_ps(s + u * kSS + j0, plus_z(reduce4(acc[u][0], acc[u][1], acc[u][2], acc[u][3])));
      _mm_storeu_ps(s + u * kSS + j0 + 4, plus_z(reduce4(acc[u][4], acc[u][5], acc[u][6], acc[u][7])));
    } else {
      _mm_storeu_ps(s + u * kSS + j0, plus_z(reduce4(acc[u][0], TB > 1 ? acc[u][TB > 1 ? 1 : 0] : z0,
                                                     TB > 2 ? acc[u][TB > 2 ? 2 : 0] : z0,
                                                     TB > 3 ? acc[u][TB > 3 ? 3 : 0] : z0)));
    }
  }
}

// Keys per block: RB·TB accumulators plus the key, its rotation and the decode constants fit
// the 16 registers.
template <int RB>
constexpr int kKeysPerBlock = RB == 1 ? 8 : RB == 2 ? 4 : RB == 3 ? 3 : 2;

// Scores of tile rows [ja, jb) from one run (row ja of the tile is row 0 of the run), in
// increasing order so a short block's zero lanes are overwritten by the keys after it.
template <int NV, int RB, class K>
void score_run(const K& keys, int ja, int jb, const float* q, const float* cos2, const float* sin2,
               const int32_t* rot, float* s, const turned_block& tb) {
  constexpr int TB = kKeysPerBlock<RB>;
  int j = ja;
  if constexpr (K::kTurnable) {
    // TB keys at one rotation (grouped positions) take the turned query, made once per rotation
    // and key scales (kept across the unit's tiles in tb).
    constexpr int hd = 8 * NV;
    for (; j + TB <= jb; j += TB) {
      bool shared = true;  // positions need not be monotone: every key checked
      for (int b = 1; b < TB; ++b) shared &= rot[j + b] == rot[j];
      if (!shared) {
        score_block<NV, RB, TB>(keys, j, j - ja, q, cos2, sin2, rot, s);
        continue;
      }
      if (*tb.sc != keys.sc || *tb.rot != rot[j]) {
        turn_query<RB>(hd, q, cos2 + rot[j], sin2 + rot[j], keys.sc, keys.zc, tb.q, tb.z);
        *tb.rot = rot[j], *tb.sc = keys.sc;
      }
      score_block<NV, RB, TB, true>(keys, j, j - ja, tb.q, cos2, sin2, rot, s, tb.z);
    }
  }
  for (; j + TB <= jb; j += TB) score_block<NV, RB, TB>(keys, j, j - ja, q, cos2, sin2, rot, s);
  for (; j < jb; ++j) score_block<NV, RB, 1>(keys, j, j - ja, q, cos2, sin2, rot, s);
}

// ---- values -------------------------------------------------------------------------------

// o_u[8 d0, 8 (d0 + W)) += Σ_j w[u][j] · level_j for tile rows [ja, jb) (run rows from 0).
template <int NV, int RB, int W, class V>
inline void pv_slice(const V& vals, int ja, int jb, int d0, const float* w /*[RB, kSS]*/, float* o /*[RB, hd]*/) {
  constexpr int hd = 8 * NV;
  __m256 acc[RB][W];
  for (int u = 0; u < RB; ++u)
    for (int c = 0; c < W; ++c) acc[u][c] = _mm256_loadu_ps(o + u * hd + 8 * (d0 + c));
  for (int j = ja; j < jb; ++j) {
    const auto row = vals.row(j - ja);
    __m256 wj[RB];
    for (int u = 0; u < RB; ++u) wj[u] = _mm256_broadcast_ss(w + u * kSS + j);
    for (int c = 0; c < W; ++c) {
      const __m256 x = vals.load(row, d0 + c);
      for (int u = 0; u < RB; ++u) acc[u][c] = _mm256_fmadd_ps(wj[u], x, acc[u][c]);
    }
  }
  for (int u = 0; u < RB; ++u)
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(o + u * hd + 8 * (d0 + c), acc[u][c]);
}

// RB·W accumulators + RB weights + the value in the 16 registers.
template <int RB>
constexpr int kValueSlice = RB == 1 ? 8 : RB == 4 ? 2 : RB == 3 ? 3 : 4;

// The whole head, slices at compile-time offsets (so each vector's read kind is known).
template <int NV, int RB, int D0 = 0, class V>
inline void pv_head(const V& vals, int ja, int jb, const float* w, float* o) {
  if constexpr (D0 < NV) {
    constexpr int W = NV - D0 < kValueSlice<RB> ? NV - D0 : kValueSlice<RB>;
    pv_slice<NV, RB, W>(vals, ja, jb, D0, w, o);
    pv_head<NV, RB, D0 + W>(vals, ja, jb, w, o);
  }
}

// A slice of width w_rt <= W at a run-time offset.
template <int NV, int RB, int W, class V>
inline void pv_slice_upto(const V& vals, int ja, int jb, int d0, int w_rt, const float* w, float* o) {
  if constexpr (W > 1) {
    if (w_rt < W) return pv_slice_upto<NV, RB, W - 1>(vals, ja, jb, d0, w_rt, w, o);
  }
  pv_slice<NV, RB, W>(vals, ja, jb, d0, w, o);
}

// Vectors [da, db) only (uniform value groups narrower than the head: clkv's 32 channels), in
// slices as wide as the registers allow.
template <int NV, int RB, class V>
void pv_range(const V& vals, int ja, int jb, int da, int db, const float* w, float* o) {
  if (da == 0 && db == NV) return pv_head<NV, RB>(vals, ja, jb, w, o);
  constexpr int S = kValueSlice<RB> < NV ? kValueSlice<RB> : NV;
  for (int d = da; d < db;) {
    const int wd = db - d < S ? db - d : S;
    pv_slice_upto<NV, RB, S>(vals, ja, jb, d, wd, w, o);
    d += wd;
  }
}

// This instruction set's half of the kernel (kvq_fused_impl.h, heads).
struct ops {
  static constexpr int kLanes = 8;
  static constexpr bool kNarrowCodes = true;
  using table = lut_regs;
  static table load_table(const float* t16) { return load_lut16(t16); }
  template <int BITS, bool LUT, int NV>
  using quant_keys = avx2::quant_keys<BITS, LUT, NV>;
  template <int BITS, bool LUT, int NV>
  using quant_values = avx2::quant_values<BITS, LUT, NV>;
  using f16_rows = f16_keys;
  template <int NV, int RB, class K>
  static void score_run(const K& keys, int ja, int jb, const float* q, const float* cos2, const float* sin2,
                        const int32_t* rot, float* s, const turned_block& tb, const key_tables&) {
    avx2::score_run<NV, RB>(keys, ja, jb, q, cos2, sin2, rot, s, tb);  // 8 lanes: keys one at a time
  }
  template <int NV, int RB, class V>
  static void pv_range(const V& vals, int ja, int jb, int da, int db, const float* w, float* o) {
    avx2::pv_range<NV, RB>(vals, ja, jb, da, db, w, o);
  }
};

}  // namespace

void kvq_attend_fused(const kvq_fused_args& a) { attend_unit(a, pick_heads<ops>(*a.kv)); }

}  // namespace xctx::cpu::impl::avx2
