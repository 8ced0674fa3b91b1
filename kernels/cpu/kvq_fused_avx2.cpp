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
//           the same on any number of ranks).
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

#include "kernels/cpu/kvq_fused_impl.h"

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
// last backward, so no read leaves the row (NV >= 2).
template <int BITS, bool LUT, int NV>
struct quant_row {
  static __m256 level_at(const uint8_t* head_row, int d, const lut_regs& L) {
    const uint8_t* p = head_row + d * BITS;
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
  const uint8_t* row(int r) const { return base + (size_t)r * rb; }
  __m256 load(const uint8_t* head_row, int d) const {
    return _mm256_fmadd_ps(quant_row<BITS, LUT, NV>::level_at(head_row, d, L), _mm256_loadu_ps(sc + 8 * d),
                           _mm256_loadu_ps(zc + 8 * d));
  }
};

// fp16 rows (sink, residual window): row r at base + r * ld elements.
struct f16_keys {
  const uint16_t* base;
  int64_t ld;
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
// by the rows of cos2/sin2 at rot[j0 + b] (= offset · hd).
template <int NV, int RB, int TB, class K>
inline void score_block(const K& keys, int j0, int r0, const float* q /*[RB, hd]*/, const float* cos2,
                        const float* sin2, const int32_t* rot /*[kT]*/, float* s /*[RB, kSS]*/) {
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
      const __m256 k = rotate8(keys.load(rows[b], d), c2[b] + a, s2[b] + a);
      for (int u = 0; u < RB; ++u) acc[u][b] = _mm256_fmadd_ps(k, _mm256_loadu_ps(q + u * hd + 8 * d), acc[u][b]);
    }
  const __m256 z = _mm256_setzero_ps();
  for (int u = 0; u < RB; ++u) {
    // Lanes past TB hold 0 and land on later keys' slots (written after) or the row's padding.
    if constexpr (TB == 8) {
      _mm_storeu_ps(s + u * kSS + j0, reduce4(acc[u][0], acc[u][1], acc[u][2], acc[u][3]));
      _mm_storeu_ps(s + u * kSS + j0 + 4, reduce4(acc[u][4], acc[u][5], acc[u][6], acc[u][7]));
    } else {
      _mm_storeu_ps(s + u * kSS + j0, reduce4(acc[u][0], TB > 1 ? acc[u][TB > 1 ? 1 : 0] : z,
                                              TB > 2 ? acc[u][TB > 2 ? 2 : 0] : z, TB > 3 ? acc[u][TB > 3 ? 3 : 0] : z));
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
               const int32_t* rot, float* s) {
  constexpr int TB = kKeysPerBlock<RB>;
  int j = ja;
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

// Vectors [da, db) only (uniform value groups narrower than the head), one at a time.
template <int NV, int RB, class V>
void pv_range(const V& vals, int ja, int jb, int da, int db, const float* w, float* o) {
  if (da == 0 && db == NV) return pv_head<NV, RB>(vals, ja, jb, w, o);
  for (int d = da; d < db; ++d) pv_slice<NV, RB, 1>(vals, ja, jb, d, w, o);
}

// Scores of query rows u0 .. u0 + RB of kv head h over the tile's rows into s ([RB, kSS]).
template <int BITS, bool LUT, int NV, int RB>
void head_scores(const tile_ctx& t, int h, int u0, float* s) {
  constexpr int hd = 8 * NV;
  const kvq_layer_view& L = *t.L;
  const size_t rb = kvq_row_bytes(t.C, BITS);
  const float* q = t.qr + (size_t)(h * t.g + u0) * hd;
  const lut_regs lk = load_lut16(t.lut_k);
  for (int r = 0; r < t.n_runs; ++r) {
    const run& R = t.runs[r];
    if (R.quant) {
      const quant_keys<BITS, LUT, NV> k{L.k_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * BITS, rb,
                                        R.sc + h * hd, R.zc + h * hd, lk};
      score_run<NV, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s);
    } else {
      const f16_keys k{R.k16 + (size_t)R.first * t.C + h * hd, t.C};
      score_run<NV, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s);
    }
  }
}

// Rows u0 .. u0 + RB of kv head h: the softmax update over their tile scores s (which become
// probabilities), then the values: o += Σ (p·s_j)·level + Σ p·z_j. m, l [RB]; o [RB, hd]
// running (unnormalised by l); w [RB, kSS], sj, zj [kT]: scratch.
template <int BITS, bool LUT, int NV, int RB>
void head_values(const tile_ctx& t, int h, float* m, float* l, float* o, float* s, float* w, float* sj, float* zj) {
  constexpr int hd = 8 * NV;
  const kvq_layer_view& L = *t.L;
  const size_t rb = kvq_row_bytes(t.C, BITS);
  const lut_regs lv = load_lut16(t.lut_v);
  softmax_update<RB>(s, t.nt, m, l, o, hd);
  for_value_segments<LUT>(t, h, sj, zj, [&](int da, int db, const float* ps, const float* pz) {
    float zsum[RB];
    fold_value_scales<RB>(s, ps, pz, t.nt, w, zsum);
    for (int r = 0; r < t.n_runs; ++r) {
      const run& R = t.runs[r];
      if (R.quant) {
        const quant_values<BITS, LUT, NV> v{L.v_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * BITS, rb, lv};
        pv_range<NV, RB>(v, R.ja, R.jb, da, db, w, o);
      } else {
        const f16_values v{R.v16 + (size_t)R.first * t.C + h * hd, t.C};
        pv_range<NV, RB>(v, R.ja, R.jb, da, db, w, o);
      }
    }
    add_zero_sums<RB>(zsum, da, db, o, hd);
  });
}

// The tile: every query row's scores, the key outliers' corrections, per kv head and block of
// up to kMaxRB of its query heads the softmax and values, the value outliers' corrections.
template <int BITS, bool LUT, int NV>
void heads(const tile_ctx& t, float* m, float* l, float* o, float* work) {
  const int n_head = t.L->n_head_kv * t.g;
  float* s_all = work;                   // [n_head, kSS]
  float* w = s_all + (size_t)n_head * kSS;  // [kMaxRB, kSS]
  float* sj = w + (size_t)kMaxRB * kSS;  // [kT]
  float* zj = sj + kT;                   // [kT]
  const auto blocks = [&](auto&& f) {
    for (int h = 0; h < t.L->n_head_kv; ++h)
      for (int u0 = 0; u0 < t.g; u0 += kMaxRB) f(h, u0, t.g - u0 < kMaxRB ? t.g - u0 : kMaxRB, h * t.g + u0);
  };
  blocks([&](int h, int u0, int rb, int row) {
    float* s = s_all + (size_t)row * kSS;
    switch (rb) {
      case 1: head_scores<BITS, LUT, NV, 1>(t, h, u0, s); break;
      case 2: head_scores<BITS, LUT, NV, 2>(t, h, u0, s); break;
      case 3: head_scores<BITS, LUT, NV, 3>(t, h, u0, s); break;
      default: head_scores<BITS, LUT, NV, 4>(t, h, u0, s); break;
    }
  });
  if (t.outliers) add_key_outliers(t, s_all);
  blocks([&](int h, int, int rb, int row) {
    float* s = s_all + (size_t)row * kSS;
    float* oh = o + (size_t)row * t.hd;
    switch (rb) {
      case 1: head_values<BITS, LUT, NV, 1>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
      case 2: head_values<BITS, LUT, NV, 2>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
      case 3: head_values<BITS, LUT, NV, 3>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
      default: head_values<BITS, LUT, NV, 4>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
    }
  });
  if (t.outliers) add_value_outliers(t, s_all, o);
}

template <int NV>
heads_fn pick_bits(bool lut, int bits) {
  switch (bits) {
    case 2: return lut ? heads<2, true, NV> : heads<2, false, NV>;
    case 3: return lut ? heads<3, true, NV> : heads<3, false, NV>;
    default: return lut ? heads<4, true, NV> : heads<4, false, NV>;
  }
}

heads_fn pick(const kvq_layer_view& L) {
  const bool lut = L.scheme == kvq_scheme::kvq_lut;
  switch (L.head_dim) {
    case 16: return pick_bits<2>(lut, L.bits);
    case 32: return pick_bits<4>(lut, L.bits);
    case 64: return pick_bits<8>(lut, L.bits);
    default: return pick_bits<16>(lut, L.bits);  // 128 (kvq_fused_supported)
  }
}

}  // namespace

void kvq_attend_fused(const kvq_fused_args& a) { attend_unit(a, pick(*a.kv)); }

}  // namespace xctx::cpu::impl::avx2
