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

#include <cmath>

#include "common/error.h"
#include "kernels/cpu/fast_exp_avx2.h"
#include "kernels/cpu/kvq_codes_avx2.h"
#include "kernels/cpu/kvq_impl.h"
#include "kernels/softmax_acc.h"

namespace xctx::cpu::impl::avx2 {
namespace {

constexpr int kT = kFusedTile;
constexpr int kSS = kT + 8;  // score row stride: a block of keys stores whole 4-lane groups
constexpr int kMaxRB = kFusedMaxHeadsPerBlock;
constexpr int kMaxRuns = 2 + kFusedTile / 8 + 1;  // sink, key groups (>= 8 rows each), window

inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// x rotated pairwise by the angles whose cos2/sin2 rows are given (sin2 = (-s, +s)).
inline __m256 rotate(__m256 x, const float* cos2, const float* sin2) {
  return _mm256_fmadd_ps(x, _mm256_loadu_ps(cos2), _mm256_mul_ps(_mm256_permute_ps(x, 0xB1), _mm256_loadu_ps(sin2)));
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
      const __m256 k = rotate(keys.load(rows[b], d), c2[b] + a, s2[b] + a);
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

// ---- one tile -----------------------------------------------------------------------------

// A run of tile rows stored one way: fp16 (sink or residual window) or quantized (one key group).
struct run {
  int ja = 0, jb = 0;             // tile rows
  bool quant = false;
  int64_t first = 0;              // quant: index among the quantized rows of row ja; fp16: row in its array
  const uint16_t* k16 = nullptr;  // fp16 rows: the array holding them
  const uint16_t* v16 = nullptr;
  const float* sc = nullptr;      // quant: [C] key channel scale/zero (uniform: of the run's key group)
  const float* zc = nullptr;
};

struct tile_ctx {
  const kvq_layer_view* L;
  int hd, C, g;
  int nt;
  const float* qr;    // [n_head, hd] the query rotated back by the unit's first position
  const float* cos2;  // [kAttnUnit, hd] rotation by an offset in the unit
  const float* sin2;
  int32_t rot[kFusedTile];  // tile row j: its offset in the unit times hd (a row of cos2/sin2)
  lut_regs lk, lv;
  run runs[kMaxRuns];
  int n_runs = 0;
  // Value parameters of the tile rows in f32 (value_params), shared by the heads: nuq per row,
  // uniform per row and channel group.
  float* v_scale = nullptr;  // [kT]
  float* v_zero = nullptr;   // [kT]
  float* vg = nullptr;       // [kT, n_vg, 2]
  int n_vg = 0;
  // The tile's sparse outliers by kv head h: entries [h·cap, h·cap + count[h]) of (tile row j,
  // channel c in the head) packed as j << 16 | c, and δ = stored value − dense decode.
  int cap = 0;
  int32_t* k_jc = nullptr;
  float* k_delta = nullptr;
  int k_count[kFusedMaxKvHeads] = {};
  int32_t* v_jc = nullptr;
  float* v_delta = nullptr;
  int v_count[kFusedMaxKvHeads] = {};
};

// fp16 values [n] to f32, 8 at a time.
inline void halves_to_floats(const uint16_t* src, int n, float* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

// The tile rows' value (scale, zero) in f32: nuq per row into v_scale/v_zero; uniform per row and
// channel group into vg [kT, n_vg, 2]. fp16 rows get (1, 0).
void value_params(tile_ctx& t) {
  const kvq_layer_view& L = *t.L;
  const bool lut = L.scheme == kvq_scheme::kvq_lut;
  for (int r = 0; r < t.n_runs; ++r) {
    const run& R = t.runs[r];
    const int n = R.jb - R.ja;
    if (lut) {
      float* sj = t.v_scale + R.ja;
      float* zj = t.v_zero + R.ja;
      if (!R.quant) {
        for (int j = 0; j < n; ++j) sj[j] = 1.0f, zj[j] = 0.0f;
        continue;
      }
      // 8 (scale, zero) pairs at a time: deinterleave the halves, convert both.
      const kvq_affine* p = L.v_tok + R.first;
      const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12,
                                            13, 2, 3, 6, 7, 10, 11, 14, 15);
      int j = 0;
      for (; j + 8 <= n; j += 8) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + j));
        const __m256i sh = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(raw, pick), 0xD8);  // scales | zeros
        _mm256_storeu_ps(sj + j, _mm256_cvtph_ps(_mm256_castsi256_si128(sh)));
        _mm256_storeu_ps(zj + j, _mm256_cvtph_ps(_mm256_extracti128_si256(sh, 1)));
      }
      for (; j < n; ++j) sj[j] = _cvtsh_ss(p[j].scale), zj[j] = _cvtsh_ss(p[j].zero);
    } else {
      float* vg = t.vg + (size_t)R.ja * t.n_vg * 2;
      if (!R.quant) {
        for (int e = 0; e < n * t.n_vg; ++e) vg[2 * e] = 1.0f, vg[2 * e + 1] = 0.0f;
        continue;
      }
      halves_to_floats(reinterpret_cast<const uint16_t*>(L.v_group + (size_t)R.first * t.n_vg), 2 * n * t.n_vg, vg);
    }
  }
}

// Sorts the tile's outliers into per-head lists with their corrections δ, once for all heads.
// Everything the loops touch is copied to locals first: the list stores could alias the view.
template <int BITS>
__attribute__((noinline)) void collect_outliers(tile_ctx& t) {
  const kvq_layer_view& L = *t.L;
  const int shift = __builtin_ctz((unsigned)t.hd), hmask = t.hd - 1;  // head_dim is a power of 2
  const size_t rb = kvq_row_bytes(t.C, BITS);
  const int n_kvh = L.n_head_kv, cap = t.cap, v_per = L.v_out_per_tok;
  const uint32_t* k_off = L.k_out_off;
  const uint16_t *k_idx = L.k_out_idx, *k_val = L.k_out_val, *v_idx = L.v_out_idx, *v_val = L.v_out_val;
  const uint8_t *k_codes = L.k_codes, *v_codes = L.v_codes;
  const float *lut_k = L.lut_k, *lut_v = L.lut_v, *vs = t.v_scale, *vz = t.v_zero;
  int32_t* k_jc = t.k_jc;
  int32_t* v_jc = t.v_jc;
  float* k_delta = t.k_delta;
  float* v_delta = t.v_delta;
  int kc[kFusedMaxKvHeads], vc[kFusedMaxKvHeads];
  for (int h = 0; h < n_kvh; ++h) kc[h] = vc[h] = 0;
  const auto code = [rb](const uint8_t* row, int ch) { return code_at<BITS>(row, rb, ch); };
  for (int r = 0; r < t.n_runs; ++r) {
    const run& R = t.runs[r];
    if (!R.quant) continue;
    const float *sc = R.sc, *zc = R.zc;
    for (int j = R.ja; j < R.jb; ++j) {
      const int64_t i = R.first + (j - R.ja);
      if (k_off != nullptr) {
        const uint8_t* row = k_codes + (size_t)i * rb;
        for (uint32_t e = k_off[i]; e < k_off[i + 1]; ++e) {
          const int ch = k_idx[e], h = ch >> shift;
          const int at = h * cap + kc[h]++;
          k_jc[at] = j << 16 | (ch & hmask);
          k_delta[at] = _cvtsh_ss(k_val[e]) - (lut_k[code(row, ch)] * sc[ch] + zc[ch]);
        }
      }
      const uint8_t* row = v_codes + (size_t)i * rb;
      for (int e = 0; e < v_per; ++e) {
        const size_t src = (size_t)i * v_per + e;
        const int ch = v_idx[src], h = ch >> shift;
        const int at = h * cap + vc[h]++;
        v_jc[at] = j << 16 | (ch & hmask);
        v_delta[at] = _cvtsh_ss(v_val[src]) - (lut_v[code(row, ch)] * vs[j] + vz[j]);
      }
    }
  }
  for (int h = 0; h < n_kvh; ++h) t.k_count[h] = kc[h], t.v_count[h] = vc[h];
}

// Rows u0 .. u0 + RB of kv head h over the tile: scores, outlier corrections, softmax update,
// values. m, l [RB]; o [RB, hd] running (unnormalised by l); work: [kFusedWorkFloats].
template <int BITS, bool LUT, int NV, int RB>
void head_block(const tile_ctx& t, int h, int u0, float* m, float* l, float* o, float* work) {
  constexpr int hd = 8 * NV;
  const kvq_layer_view& L = *t.L;
  const int nt = t.nt;
  const size_t rb = kvq_row_bytes(t.C, BITS);
  const float* q = t.qr + (size_t)(h * t.g + u0) * hd;
  float* s = work;           // [RB, kSS] scores, then probabilities
  float* w = s + RB * kSS;   // [RB, kSS] probabilities times the row's value scale
  float* sj = w + RB * kSS;  // [kT]
  float* zj = sj + kT;       // [kT]

  for (int r = 0; r < t.n_runs; ++r) {
    const run& R = t.runs[r];
    if (R.quant) {
      const quant_keys<BITS, LUT, NV> k{L.k_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * BITS, rb,
                                        R.sc + h * hd, R.zc + h * hd, t.lk};
      score_run<NV, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s);
    } else {
      const f16_keys k{R.k16 + (size_t)R.first * t.C + h * hd, t.C};
      score_run<NV, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s);
    }
  }
  // Key outliers: δ at channel c of row j adds δ·(q'·R(o_j)e_c) to the score.
  for (int e = h * t.cap; e < h * t.cap + t.k_count[h]; ++e) {
    const int j = t.k_jc[e] >> 16, c = t.k_jc[e] & 0xffff;
    const float* c2 = t.cos2 + t.rot[j];
    const float* s2 = t.sin2 + t.rot[j];
    for (int u = 0; u < RB; ++u) s[u * kSS + j] += t.k_delta[e] * (q[u * hd + c] * c2[c] + q[u * hd + (c ^ 1)] * s2[c ^ 1]);
  }
  // Online softmax over the tile's nt scores; o rescaled.
  for (int u = 0; u < RB; ++u) {
    float* su = s + u * kSS;
    __m256 mv = _mm256_set1_ps(-__builtin_inff());
    int j = 0;
    for (; j + 8 <= nt; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(su + j));
    float mt = hmax8(mv);
    for (; j < nt; ++j) mt = su[j] > mt ? su[j] : mt;
    const float m_new = mt > m[u] ? mt : m[u];
    const float alpha = std::exp(m[u] - m_new);  // 0 on the first tile (m = -inf)
    m[u] = m_new;
    const __m256 mn = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= nt; j += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(su + j), mn));
      _mm256_storeu_ps(su + j, p);
      sum = _mm256_add_ps(sum, p);
    }
    if (j < nt) {  // the tile's last partial group of 8: lanes past nt give exp(-inf) = 0
      alignas(32) float buf[8];
      for (int e = 0; e < 8; ++e) buf[e] = j + e < nt ? su[j + e] - m_new : -__builtin_inff();
      const __m256 p = exp8(_mm256_load_ps(buf));
      sum = _mm256_add_ps(sum, p);
      _mm256_store_ps(buf, p);
      for (int e = 0; j + e < nt; ++e) su[j + e] = buf[e];
    }
    l[u] = l[u] * alpha + hsum8(sum);
    const __m256 a = _mm256_set1_ps(alpha);
    for (int d = 0; d < NV; ++d) _mm256_storeu_ps(o + u * hd + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(o + u * hd + 8 * d), a));
  }
  // Values, one parameter segment of the head at a time (nuq: one; uniform: value groups
  // narrower than the head split it): o += Σ (p·s_j)·level + Σ p·z_j.
  for (int da = 0; da < NV;) {
    int db = NV;
    const float *ps = t.v_scale, *pz = t.v_zero;
    if (!LUT) {  // the segment's group of every row
      const int grp = (h * hd + 8 * da) / L.group;
      while ((h * hd + 8 * (db - 1)) / L.group != grp) --db;
      for (int j = 0; j < nt; ++j) sj[j] = t.vg[((size_t)j * t.n_vg + grp) * 2], zj[j] = t.vg[((size_t)j * t.n_vg + grp) * 2 + 1];
      ps = sj, pz = zj;
    }
    float zsum[RB];
    for (int u = 0; u < RB; ++u) {
      __m256 zs = _mm256_setzero_ps();
      int j = 0;
      for (; j + 8 <= nt; j += 8) {
        const __m256 p = _mm256_loadu_ps(s + u * kSS + j);
        _mm256_storeu_ps(w + u * kSS + j, _mm256_mul_ps(p, _mm256_loadu_ps(ps + j)));
        zs = _mm256_fmadd_ps(p, _mm256_loadu_ps(pz + j), zs);
      }
      float zt = 0.0f;
      for (; j < nt; ++j) w[u * kSS + j] = s[u * kSS + j] * ps[j], zt += s[u * kSS + j] * pz[j];
      zsum[u] = hsum8(zs) + zt;
    }
    for (int r = 0; r < t.n_runs; ++r) {
      const run& R = t.runs[r];
      if (R.quant) {
        const quant_values<BITS, LUT, NV> v{L.v_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * BITS, rb, t.lv};
        pv_range<NV, RB>(v, R.ja, R.jb, da, db, w, o);
      } else {
        const f16_values v{R.v16 + (size_t)R.first * t.C + h * hd, t.C};
        pv_range<NV, RB>(v, R.ja, R.jb, da, db, w, o);
      }
    }
    for (int u = 0; u < RB; ++u) {
      const __m256 z = _mm256_set1_ps(zsum[u]);
      for (int d = da; d < db; ++d) _mm256_storeu_ps(o + u * hd + 8 * d, _mm256_add_ps(_mm256_loadu_ps(o + u * hd + 8 * d), z));
    }
    da = db;
  }
  // Value outliers: o += p·δ at their channel.
  for (int e = h * t.cap; e < h * t.cap + t.v_count[h]; ++e) {
    const int j = t.v_jc[e] >> 16, c = t.v_jc[e] & 0xffff;
    for (int u = 0; u < RB; ++u) o[u * hd + c] += s[u * kSS + j] * t.v_delta[e];
  }
}

template <int BITS, bool LUT, int NV>
void heads(const tile_ctx& t, float* m, float* l, float* o, float* work) {
  for (int h = 0; h < t.L->n_head_kv; ++h)
    for (int u0 = 0; u0 < t.g; u0 += kMaxRB) {
      const int rb = t.g - u0 < kMaxRB ? t.g - u0 : kMaxRB;
      const int row = h * t.g + u0;
      float* oh = o + (size_t)row * t.hd;
      switch (rb) {
        case 1: head_block<BITS, LUT, NV, 1>(t, h, u0, m + row, l + row, oh, work); break;
        case 2: head_block<BITS, LUT, NV, 2>(t, h, u0, m + row, l + row, oh, work); break;
        case 3: head_block<BITS, LUT, NV, 3>(t, h, u0, m + row, l + row, oh, work); break;
        default: head_block<BITS, LUT, NV, 4>(t, h, u0, m + row, l + row, oh, work); break;
      }
    }
}

using heads_fn = void (*)(const tile_ctx&, float*, float*, float*, float*);

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

void kvq_attend_fused(const kvq_fused_args& a) {
  const kvq_layer_view& L = *a.kv;
  const int hd = L.head_dim, C = L.channels(), n_head = a.n_head;
  const int g = n_head / L.n_head_kv;
  XCTX_ASSERT(kvq_fused_supported(L, n_head, a.n_rot), "kvq fused: unsupported shape");
  // Scratch layout (kvq_fused_scratch_floats).
  float* qr = a.scratch;                      // [n_head, hd] rotated queries
  float* bcos2 = qr + (size_t)n_head * hd;    // [hd] the unit start's angles
  float* bsin2 = bcos2 + hd;                  // [hd] negated: rotates by -p0
  float* sc = bsin2 + hd;                     // [kScaleSlots, C] uniform key group scales
  float* zc = sc + (size_t)kScaleSlots * C;   // [kScaleSlots, C]
  float* m = zc + (size_t)kScaleSlots * C;    // [n_head]
  float* l = m + n_head;                      // [n_head]
  float* vsz = l + n_head;                    // [2, kT] nuq value scales, zeros
  float* work = vsz + 2 * kT;                 // [kFusedWorkFloats]
  float* outl = work + kFusedWorkFloats;      // [4, kT, C] outlier lists (collect_outliers)
  float* vg = outl + 4 * (size_t)kT * C;      // [kT, C / 4] uniform value (scale, zero) per group
  double* ac = a.angle_scratch;               // [hd / 2]
  double* as = ac + hd / 2;

  for (int r = 0; r < n_head; ++r) m[r] = -__builtin_inff(), l[r] = 0.0f;
  for (size_t e = 0; e < (size_t)n_head * hd; ++e) a.o[e] = 0.0f;
  if (a.n == 0) {
    for (int r = 0; r < n_head; ++r) a.lse[r] = -__builtin_inff();
    return;
  }
  const heads_fn run_heads = pick(L);
  const bool lut = L.scheme == kvq_scheme::kvq_lut;
  int64_t slot_group[kScaleSlots];
  for (int64_t& sg : slot_group) sg = -1;

  // RoPE (n_rot = hd): the query rotated back by the unit's first position, keys by their offset.
  const int32_t p0 = L.pos[a.s0];
  XCTX_ASSERT((int64_t)L.pos[a.s0 + a.n - 1] - p0 < kAttnUnit, "kvq fused: slots ", a.s0, "..", a.s0 + a.n,
              " are not one attention unit");
  a.angles(a.angle_table, p0, ac, as);
  for (int i = 0; i < hd / 2; ++i) {
    const float c = (float)ac[i], sn = (float)as[i];
    bcos2[2 * i] = bcos2[2 * i + 1] = c;
    bsin2[2 * i] = sn, bsin2[2 * i + 1] = -sn;
  }
  for (int r = 0; r < n_head; ++r)
    for (int d = 0; d < hd; d += 8)
      _mm256_storeu_ps(qr + (size_t)r * hd + d, rotate(_mm256_loadu_ps(a.q + (size_t)r * hd + d), bcos2 + d, bsin2 + d));

  tile_ctx t;
  t.L = &L, t.hd = hd, t.C = C, t.g = g;
  t.qr = qr, t.cos2 = a.off_cos2, t.sin2 = a.off_sin2;
  t.lk = load_lut(lut ? L.lut_k : nullptr, L.bits);
  t.lv = load_lut(lut ? L.lut_v : nullptr, L.bits);
  t.v_scale = vsz, t.v_zero = vsz + kT;
  t.vg = vg, t.n_vg = lut ? 0 : (C + L.group - 1) / L.group;
  const bool outliers = L.k_out_off != nullptr || L.v_out_per_tok > 0;
  t.cap = kT * hd;  // a head holds at most hd outliers per row
  t.k_jc = reinterpret_cast<int32_t*>(outl);
  t.k_delta = outl + (size_t)kT * C;
  t.v_jc = reinterpret_cast<int32_t*>(outl + 2 * (size_t)kT * C);
  t.v_delta = outl + 3 * (size_t)kT * C;
  for (int64_t t0 = a.s0; t0 < a.s0 + a.n; t0 += kT) {
    const int nt = (int)(a.s0 + a.n - t0 < kT ? a.s0 + a.n - t0 : kT);
    t.nt = nt;
    for (int j = 0; j < nt; ++j) t.rot[j] = (L.pos[t0 + j] - p0) * hd;
    // Runs: fp16 sink rows, quantized rows (split at uniform key groups), fp16 window rows.
    t.n_runs = 0;
    for (int j = 0; j < nt;) {
      const int64_t s = t0 + j;
      run R;
      R.ja = j;
      if (s < L.n_sink) {
        R.jb = (int)(L.n_sink - t0 < nt ? L.n_sink - t0 : nt);
        R.first = s, R.k16 = L.k_sink, R.v16 = L.v_sink;
      } else if (s >= L.q_end) {
        R.jb = nt;
        R.first = s - L.q_end, R.k16 = L.k_tail, R.v16 = L.v_tail;
      } else {
        const int64_t i = s - L.n_sink;
        int64_t end = L.q_end - t0 < nt ? L.q_end - t0 : nt;
        R.sc = L.k_ch_scale, R.zc = L.k_ch_zero;
        if (!lut) {
          // Consecutive groups take distinct slots (a tile spans at most kFusedTile / 8 + 1).
          const int64_t grp = i / L.group;
          const int64_t grp_end = L.n_sink + (grp + 1) * L.group - t0;
          end = grp_end < end ? grp_end : end;
          const int slot = (int)(grp % kScaleSlots);
          float* gs = sc + (size_t)slot * C;
          float* gz = zc + (size_t)slot * C;
          if (slot_group[slot] != grp) {
            for (int c = 0; c < C; ++c) {
              const kvq_affine p = L.k_group[(size_t)grp * C + c];
              gs[c] = _cvtsh_ss(p.scale), gz[c] = _cvtsh_ss(p.zero);
            }
            slot_group[slot] = grp;
          }
          R.sc = gs, R.zc = gz;
        }
        R.jb = (int)end;
        R.quant = true;
        R.first = i;
      }
      XCTX_ASSERT(t.n_runs < kMaxRuns && R.jb > R.ja, "kvq fused: bad tile runs");
      t.runs[t.n_runs++] = R;
      j = R.jb;
    }
    value_params(t);
    if (outliers) {
      switch (L.bits) {
        case 2: collect_outliers<2>(t); break;
        case 3: collect_outliers<3>(t); break;
        default: collect_outliers<4>(t); break;
      }
    }
    run_heads(t, m, l, a.o, work);
  }
  for (int r = 0; r < n_head; ++r) {
    if (l[r] == 0.0f) {
      a.lse[r] = -__builtin_inff();
      for (int d = 0; d < hd; ++d) a.o[(size_t)r * hd + d] = 0.0f;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / l[r]);
    for (int d = 0; d < hd; d += 8)
      _mm256_storeu_ps(a.o + (size_t)r * hd + d, _mm256_mul_ps(_mm256_loadu_ps(a.o + (size_t)r * hd + d), inv));
    a.lse[r] = m[r] + std::log(l[r]);
  }
}

}  // namespace xctx::cpu::impl::avx2
