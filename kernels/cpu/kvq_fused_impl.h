// Internal to the fused one-query attention kernels (kvq_fused_avx2.cpp, kvq_fused_avx512.cpp):
// the instruction-set-independent parts -- a tile's runs of storage kinds, the value parameters
// in f32, the sparse outlier corrections, the per-head steps that work on memory (the softmax
// update, the value-scale fold) and the driver over a unit's tiles. Each including file instantiates them with its own compile flags (the
// anonymous namespace keeps the copies apart); it supplies the per-head vector code.
// Include only from *_avx2.cpp / *_avx512.cpp files.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "common/error.h"
#include "kernels/cpu/fast_exp_avx2.h"
#include "kernels/cpu/kvq_codes_avx2.h"
#include "kernels/cpu/kvq_impl.h"
#include "kernels/softmax_acc.h"

namespace xctx::cpu::impl::fused {
namespace {

constexpr int kT = kFusedTile;
constexpr int kSS = kFusedScoreStride;  // score row stride: a block of keys stores whole 4- or 8-lane groups
constexpr int kMaxRB = kFusedMaxHeadsPerBlock;
constexpr int kMaxRuns = 2 + kFusedTile / 8 + 1;  // sink, key groups (>= 8 rows each), window

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

// Every query row turned by one key rotation (turn_query without the scales), kept across the
// unit's tiles: SelfExtend's grouped side puts whole tiles at one rotation.
struct turned_rows {
  float* q = nullptr;  // [n_head, hd]: (R(o)ᵀ q'_r)_c = q'_c·cos2_c + q'_{c^1}·sin2_{c^1}
  int32_t rot = 0;     // o · hd, the table row they were turned by
  bool valid = false;
};

// A block of query rows turned by a key rotation with the channel scales folded in (turn_query),
// for the scores; kept across the unit's tiles (rot and sc say what it holds, sc null: nothing).
struct turned_block {
  float* q;          // [RB, hd]
  float* z;          // [RB]
  int32_t* rot;      // the rotation's table row (o · hd)
  const float** sc;  // the key scales it was made with
};

// What scoring 16 keys with the keys in the lanes needs (AVX-512, nuq keys): the kv head's
// channel level tables and the pair-major rotation tables; ctab null: keys one at a time.
struct key_tables {
  const float* ctab;   // [hd, 16]: channel c's 16-entry table, lut16[i]·sc_c + zc_c (one FMA, as per key)
  const float* cos_t;  // [hd / 2, kUnitAngleStride]
  const float* sin_t;
};

struct tile_ctx {
  const kvq_layer_view* L;
  int hd, C, g;
  int nt;
  const float* qr;    // [n_head, hd] the query rotated back by the unit's first position
  const float* cos2;  // [kAttnUnit, hd] rotation by an offset in the unit
  const float* sin2;
  const float* cos_t;  // [hd / 2, kUnitAngleStride] (kvq_fused_args::off_cos_t)
  const float* sin_t;
  const float* ktab = nullptr;  // [C, 16] channel level tables (key_tables::ctab), null: not built
  int32_t rot[kFusedTile];  // tile row j: its offset in the unit times hd (a row of cos2/sin2)
  alignas(64) float lut_k[16], lut_v[16];  // the level tables (load_lut's layout)
  run runs[kMaxRuns];
  int n_runs = 0;
  // Value parameters of the tile rows in f32 (value_params), shared by the heads: nuq per row,
  // uniform per row and channel group.
  float* v_scale = nullptr;  // [kT]
  float* v_zero = nullptr;   // [kT]
  float* vg = nullptr;       // [kT, n_vg, 2]
  int n_vg = 0;
  bool outliers = false;  // the layer keeps sparse outliers (nuq -1%)
  int32_t* entry_row = nullptr;  // [kT·C + 8] scratch of add_key_outliers
  turned_rows* turned = nullptr;  // add_key_outliers' turned query rows
  // turn_query's blocks, indexed by the block's first query row: q [n_head, hd], z [n_head],
  // rot [n_head], sc [n_head].
  float* tq = nullptr;
  float* tz = nullptr;
  int32_t* trot = nullptr;
  const float** tsc = nullptr;
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

// ---- sparse outliers: corrections of the dense result, straight from the layer's lists ------
// (KVQuant's dense-and-sparse split: an entry stores δ = its element − the element's dense
// decode, kvq_outlier_delta, so a correction needs δ alone, not the element's code.)
// Everything the loops read is copied to locals first: the stores could alias the view.
// The per-entry loops over a kv head's G query rows are unrolled for the usual G; GCC's
// vectorized versions of such short loops with their scalar remainders cost more than they save
// (callgrind, AVX2 build), so the run-time-G fallback stays scalar.
#if defined(__GNUC__) && !defined(__clang__)
#define XCTX_SCALAR_LOOPS __attribute__((optimize("no-tree-vectorize")))
#else
#define XCTX_SCALAR_LOOPS
#endif

// Key outliers, all query rows r = h·g + u of the tile: δ at channel c of row j adds
// δ·(q'_r·R(o_j)e_c) to score s_all[r][j]. s_all: [n_head, kSS]; tok: [kT·C + 8] scratch.
// A run's entries are contiguous in the compressed columns, so they are walked as one flat range
// with each entry's row found beforehand without branches (rows hold 0-5 entries: a loop per row
// mispredicts its exit almost every row). HD: head_dim (a power of 2: the kv head and channel
// of an entry are a shift and a mask); G: query heads per kv head, 0 = t.g at run time.
template <int HD, int G>
__attribute__((noinline)) XCTX_SCALAR_LOOPS void add_key_outliers(const tile_ctx& t, float* s_all, int32_t* tok) {
  static_assert((HD & (HD - 1)) == 0, "head_dim must be a power of 2");
  constexpr int shift = __builtin_ctz((unsigned)HD), hmask = HD - 1;
  const kvq_layer_view& L = *t.L;
  const int g = G > 0 ? G : t.g;
  const uint32_t* off = L.k_out_off;
  const uint16_t *idx = L.k_out_idx, *val = L.k_out_val;
  const float *qr = t.qr, *cos2 = t.cos2, *sin2 = t.sin2;
  const int32_t* rot = t.rot;
  for (int r = 0; r < t.n_runs; ++r) {
    const run R = t.runs[r];  // a copy: the stores to tok could alias it
    if (!R.quant) continue;
    const uint32_t e0 = off[R.first], n_e = off[R.first + (R.jb - R.ja)] - e0;
    // tok[e] = the tile row of entry e0 + e: each row stores its index over the 8 entries from
    // its first with one vector store, and the next row overwrites what lies past its own; a
    // row of more than 8 entries (rare) stores more. tok has room for 8 past the last entry.
    for (int j = R.ja; j < R.jb; ++j) {
      const uint32_t a = off[R.first + (j - R.ja)] - e0, b = off[R.first + (j - R.ja) + 1] - e0;
      const __m256i jj = _mm256_set1_epi32(j);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(tok + a), jj);
      for (uint32_t e = a + 8; e < b; e += 8) _mm256_storeu_si256(reinterpret_cast<__m256i*>(tok + e), jj);
    }
    const uint16_t *ie = idx + e0, *ve = val + e0;
    // The run's rows at one rotation (grouped positions): a correction is δ times the turned
    // query's channel, one FMA per query row, the turned rows made once per rotation.
    bool shared = true;
    for (int j = R.ja + 1; j < R.jb; ++j) shared &= rot[j] == rot[R.ja];
    if (shared && n_e > 0) {
      turned_rows& T = *t.turned;
      if (!T.valid || T.rot != rot[R.ja]) {
        const int n_head = L.n_head_kv * g;
        const float *c2 = cos2 + rot[R.ja], *s2 = sin2 + rot[R.ja];
        for (int r = 0; r < n_head; ++r)
          for (int c = 0; c < HD; c += 8) {
            const __m256 x = _mm256_loadu_ps(qr + (size_t)r * HD + c);
            const __m256 sw = _mm256_permute_ps(_mm256_loadu_ps(s2 + c), 0xB1);
            _mm256_storeu_ps(T.q + (size_t)r * HD + c, _mm256_fmadd_ps(x, _mm256_loadu_ps(c2 + c),
                                                                       _mm256_mul_ps(_mm256_permute_ps(x, 0xB1), sw)));
          }
        T.rot = rot[R.ja], T.valid = true;
      }
      const float* tq = T.q;
      for (uint32_t e = 0; e < n_e; ++e) {
        const int j = tok[e], ch = ie[e];
        const float delta = _cvtsh_ss(ve[e]);
        const float* q = tq + (size_t)(ch >> shift) * g * HD + (ch & hmask);
        float* s = s_all + (size_t)(ch >> shift) * g * kSS + j;
        for (int u = 0; u < g; ++u) s[(size_t)u * kSS] += delta * q[(size_t)u * HD];
      }
      continue;
    }
    for (uint32_t e = 0; e < n_e; ++e) {
      const int j = tok[e], ch = ie[e], c = ch & hmask;
      const float delta = _cvtsh_ss(ve[e]);
      const float a = delta * cos2[rot[j] + c], b = delta * sin2[rot[j] + (c ^ 1)];
      const float* q = qr + (size_t)(ch >> shift) * g * HD;
      float* s = s_all + (size_t)(ch >> shift) * g * kSS + j;
      for (int u = 0; u < g; ++u) s[(size_t)u * kSS] += q[(size_t)u * HD + c] * a + q[(size_t)u * HD + (c ^ 1)] * b;
    }
  }
}

// Value outliers, after the dense values: o_r[c] += p_r[j]·δ for the rows r of the outlier's kv
// head. p_all: [n_head, kSS] probabilities; o: [n_head, HD]. HD, G as above.
template <int HD, int G>
__attribute__((noinline)) XCTX_SCALAR_LOOPS void add_value_outliers(const tile_ctx& t, const float* p_all, float* o) {
  constexpr int shift = __builtin_ctz((unsigned)HD), hmask = HD - 1;
  const kvq_layer_view& L = *t.L;
  const int g = G > 0 ? G : t.g;
  const int per = L.v_out_per_tok;
  const uint16_t *idx = L.v_out_idx, *val = L.v_out_val;
  for (int r = 0; r < t.n_runs; ++r) {
    const run& R = t.runs[r];
    if (!R.quant) continue;
    const uint16_t *ie = idx + (size_t)R.first * per, *ve = val + (size_t)R.first * per;
    for (int j = R.ja; j < R.jb; ++j, ie += per, ve += per) {
      for (int e = 0; e < per; ++e) {
        const int ch = ie[e];
        const float delta = _cvtsh_ss(ve[e]);
        const float* p = p_all + (size_t)(ch >> shift) * g * kSS + j;
        float* oc = o + (size_t)(ch >> shift) * g * HD + (ch & hmask);
        for (int u = 0; u < g; ++u) oc[(size_t)u * HD] += p[(size_t)u * kSS] * delta;
      }
    }
  }
}

// f(std::integral_constant<int, G>) for the tile's query heads per kv head: G = g for 1..4 (the
// unrolled loops), 0 (run time) otherwise.
template <class F>
void with_heads_per_kv(int g, F&& f) {
  switch (g) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}
template <int HD>
void add_key_outliers(const tile_ctx& t, float* s_all) {
  if (t.L->k_out_off == nullptr) return;
  with_heads_per_kv(t.g, [&](auto G) { add_key_outliers<HD, G()>(t, s_all, t.entry_row); });
}
template <int HD>
void add_value_outliers(const tile_ctx& t, const float* p_all, float* o) {
  if (t.L->v_out_per_tok == 0) return;
  with_heads_per_kv(t.g, [&](auto G) { add_value_outliers<HD, G()>(t, p_all, o); });
}

// The 16-entry level table of load_lut (entries repeat with period 2^bits; lut = null: the
// identity, uniform codes), for each instruction set to load into its registers.
inline void fill_lut(const float* lut, int bits, float* t16) {
  const int n = 1 << bits;
  for (int i = 0; i < 16; ++i) t16[i] = lut != nullptr ? lut[i % n] : (float)(i % n);
}

// x rotated pairwise by the angles whose cos2/sin2 rows are given (sin2 = (-s, +s)).
inline __m256 rotate8(__m256 x, const float* cos2, const float* sin2) {
  return _mm256_fmadd_ps(x, _mm256_loadu_ps(cos2), _mm256_mul_ps(_mm256_permute_ps(x, 0xB1), _mm256_loadu_ps(sin2)));
}

// Keys that share one rotation (SelfExtend's grouped side: G consecutive positions attend at one
// floor(pos / G)) need not be rotated one by one: q·R(o)(lvl ⊙ sc + zc) = (Rᵀ(o)q ⊙ sc)·lvl +
// Rᵀ(o)q·zc. For RB query rows and the rotation at cos2/sin2 (one table row), qs[u] = Rᵀq_u ⊙ sc
// and z[u] = Rᵀq_u · zc; a key then costs its levels and one FMA per query row and vector.
// (Rᵀq)_c = q_c·cos2_c + q_{c^1}·sin2_{c^1}: the adjoint of rotate8.
template <int RB>
inline void turn_query(int hd, const float* q /*[RB, hd]*/, const float* cos2, const float* sin2, const float* sc,
                       const float* zc, float* qs /*[RB, hd]*/, float* z /*[RB]*/) {
  for (int u = 0; u < RB; ++u) {
    __m256 zs = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
      const __m256 x = _mm256_loadu_ps(q + u * hd + d);
      const __m256 t = _mm256_fmadd_ps(x, _mm256_loadu_ps(cos2 + d),
                                       _mm256_mul_ps(_mm256_permute_ps(x, 0xB1), _mm256_permute_ps(_mm256_loadu_ps(sin2 + d), 0xB1)));
      _mm256_storeu_ps(qs + u * hd + d, _mm256_mul_ps(t, _mm256_loadu_ps(sc + d)));
      zs = _mm256_fmadd_ps(t, _mm256_loadu_ps(zc + d), zs);
    }
    z[u] = avx2::hsum8(zs);
  }
}

// ---- per-head steps on memory (s: [RB, kSS] scores, then probabilities; o: [RB, hd]) ----------

// Online softmax over the tile's nt scores of RB rows: s becomes the probabilities, m and l are
// updated, o (hd wide) rescaled -- unless the running maximum held (alpha = 1, most tiles after
// the first few): multiplying by 1 changes no bit, so the pass over o is skipped.
// With AVX-512 (the *_avx512.cpp includer) 16 lanes with masked tails, else 8 lanes.
#if defined(__AVX512F__)
inline __mmask16 first_lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// The tile's maximum of row u's scores and the factor alpha = exp(m_old − m_new) the row's running
// sums take; m[u] becomes m_new. A maximum that held gives alpha = 1 without the call (the most
// common case after a unit's first tiles; exp(0) is 1 exactly).
inline float tile_max_update(const float* su, int nt, float& m, float& m_new) {
  __m512 mv = _mm512_set1_ps(-__builtin_inff());
  for (int j = 0; j < nt; j += 16) {
    const __mmask16 k = first_lanes(nt - j);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, su + j));
  }
  const float mt = _mm512_reduce_max_ps(mv);
  m_new = mt > m ? mt : m;
  const float alpha = m_new == m ? 1.0f : std::exp(m - m_new);  // 0 on the first tile (m = -inf)
  m = m_new;
  return alpha;
}

inline void scale_row(float* o, int hd, float alpha) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int d = 0; d < hd; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), a));
}

// Online softmax over the tile's nt scores of RB rows: s becomes the probabilities, m and the
// denominator lanes of l (lanes [0, 16) of each row's kFusedSumLanes) are updated, o (hd wide)
// rescaled -- unless the running maximum held (alpha = 1): multiplying by 1 changes no bit.
template <int RB>
inline void softmax_update(float* s, int nt, float* m, float* l, float* o, int hd) {
  for (int u = 0; u < RB; ++u) {
    float* su = s + u * kSS;
    float m_new;
    const float alpha = tile_max_update(su, nt, m[u], m_new);
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nt; j += 16) {
      const __mmask16 k = first_lanes(nt - j);
      const __m512 p = _mm512_maskz_mov_ps(k, avx2::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, su + j), mn)));
      _mm512_mask_storeu_ps(su + j, k, p);
      sum = _mm512_add_ps(sum, p);
    }
    float* lu = l + u * kFusedSumLanes;
    _mm512_storeu_ps(lu, _mm512_fmadd_ps(_mm512_loadu_ps(lu), _mm512_set1_ps(alpha), sum));
    if (alpha != 1.0f) scale_row(o + u * hd, hd, alpha);
  }
}

// The softmax update and the value-scale fold in one pass, for values with one (scale, zero) per
// row (nuq): s becomes p (the value outliers' weights), w = p·s_j, and Σ_j p_j·z_j is kept in
// lanes [16, 32) of l, rescaled with the row's other sums and added to o once per unit
// (attend_unit) instead of once per tile.
template <int RB>
inline void softmax_fold(float* s, const float* ps /*[kT]*/, const float* pz /*[kT]*/, int nt, float* m, float* l,
                         float* o, int hd, float* w) {
  for (int u = 0; u < RB; ++u) {
    float* su = s + u * kSS;
    float m_new;
    const float alpha = tile_max_update(su, nt, m[u], m_new);
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps(), zs = _mm512_setzero_ps();
    for (int j = 0; j < nt; j += 16) {
      const __mmask16 k = first_lanes(nt - j);
      const __m512 p = _mm512_maskz_mov_ps(k, avx2::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, su + j), mn)));
      _mm512_mask_storeu_ps(su + j, k, p);
      _mm512_mask_storeu_ps(w + u * kSS + j, k, _mm512_mul_ps(p, _mm512_maskz_loadu_ps(k, ps + j)));
      sum = _mm512_add_ps(sum, p);
      zs = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(k, pz + j), zs);
    }
    float* lu = l + u * kFusedSumLanes;
    const __m512 a = _mm512_set1_ps(alpha);
    _mm512_storeu_ps(lu, _mm512_fmadd_ps(_mm512_loadu_ps(lu), a, sum));
    _mm512_storeu_ps(lu + 16, _mm512_fmadd_ps(_mm512_loadu_ps(lu + 16), a, zs));
    if (alpha != 1.0f) scale_row(o + u * hd, hd, alpha);
  }
}

// The value-scale fold: w = p·s_j per row, and the returned Σ_j p_j·z_j per row (zsum [RB]).
template <int RB>
inline void fold_value_scales(const float* s, const float* ps /*[kT]*/, const float* pz /*[kT]*/, int nt, float* w,
                              float* zsum) {
  for (int u = 0; u < RB; ++u) {
    __m512 zs = _mm512_setzero_ps();
    for (int j = 0; j < nt; j += 16) {
      const __mmask16 k = first_lanes(nt - j);
      const __m512 p = _mm512_maskz_loadu_ps(k, s + u * kSS + j);
      _mm512_mask_storeu_ps(w + u * kSS + j, k, _mm512_mul_ps(p, _mm512_maskz_loadu_ps(k, ps + j)));
      zs = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(k, pz + j), zs);
    }
    zsum[u] = _mm512_reduce_add_ps(zs);
  }
}
#else
template <int RB>
inline void softmax_update(float* s, int nt, float* m, float* l, float* o, int hd) {
  for (int u = 0; u < RB; ++u) {
    float* su = s + u * kSS;
    __m256 mv = _mm256_set1_ps(-__builtin_inff());
    int j = 0;
    for (; j + 8 <= nt; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(su + j));
    float mt = avx2::hmax8(mv);
    for (; j < nt; ++j) mt = su[j] > mt ? su[j] : mt;
    const float m_new = mt > m[u] ? mt : m[u];
    const float alpha = m_new == m[u] ? 1.0f : std::exp(m[u] - m_new);  // 0 on the first tile (m = -inf)
    m[u] = m_new;
    const __m256 mn = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= nt; j += 8) {
      const __m256 p = avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(su + j), mn));
      _mm256_storeu_ps(su + j, p);
      sum = _mm256_add_ps(sum, p);
    }
    if (j < nt) {  // the tile's last partial group of 8: lanes past nt give exp(-inf) = 0
      alignas(32) float buf[8];
      for (int e = 0; e < 8; ++e) buf[e] = j + e < nt ? su[j + e] - m_new : -__builtin_inff();
      const __m256 p = avx2::exp8(_mm256_load_ps(buf));
      sum = _mm256_add_ps(sum, p);
      _mm256_store_ps(buf, p);
      for (int e = 0; j + e < nt; ++e) su[j + e] = buf[e];
    }
    l[u * kFusedSumLanes] = l[u * kFusedSumLanes] * alpha + avx2::hsum8(sum);
    if (alpha == 1.0f) continue;
    const __m256 a = _mm256_set1_ps(alpha);
    for (int d = 0; d < hd; d += 8) _mm256_storeu_ps(o + u * hd + d, _mm256_mul_ps(_mm256_loadu_ps(o + u * hd + d), a));
  }
}

// The value-scale fold: w = p·s_j per row, and the returned Σ_j p_j·z_j per row (zsum [RB]).
template <int RB>
inline void fold_value_scales(const float* s, const float* ps /*[kT]*/, const float* pz /*[kT]*/, int nt, float* w,
                              float* zsum) {
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
    zsum[u] = avx2::hsum8(zs) + zt;
  }
}
#endif

// o_u[8 da, 8 db) += zsum_u: the zero points' share, once per tile.
template <int RB>
inline void add_zero_sums(const float* zsum, int da, int db, float* o, int hd) {
  for (int u = 0; u < RB; ++u) {
    const __m256 z = _mm256_set1_ps(zsum[u]);
    for (int d = da; d < db; ++d) _mm256_storeu_ps(o + u * hd + 8 * d, _mm256_add_ps(_mm256_loadu_ps(o + u * hd + 8 * d), z));
  }
}

// The channel-vector segments (8-wide) of head h sharing one value parameter group, in turn:
// calls f(da, db, ps, pz) with the rows' scale/zero for it (nuq: one segment, the per-row
// parameters; uniform: value groups narrower than the head split it). sj, zj: [kT] scratch.
template <bool LUT, class F>
inline void for_value_segments(const tile_ctx& t, int h, float* sj, float* zj, F&& f) {
  const int nv = t.hd / 8;
  for (int da = 0; da < nv;) {
    int db = nv;
    const float *ps = t.v_scale, *pz = t.v_zero;
    if constexpr (!LUT) {
      const int grp = (h * t.hd + 8 * da) / t.L->group;
      while ((h * t.hd + 8 * (db - 1)) / t.L->group != grp) --db;
      for (int j = 0; j < t.nt; ++j)
        sj[j] = t.vg[((size_t)j * t.n_vg + grp) * 2], zj[j] = t.vg[((size_t)j * t.n_vg + grp) * 2 + 1];
      ps = sj, pz = zj;
    }
    f(da, db, ps, pz);
    da = db;
  }
}

// ---- the driver ----------------------------------------------------------------------------

inline void prefetch_bytes(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  for (size_t b = 0; b < n; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
  if (n > 0) _mm_prefetch(c + n - 1, _MM_HINT_T0);
}

// The quantized rows of the tile at slot s (up to kT slots, before end): their codes, value
// parameters and outlier lists into L1 while this tile computes. Measured: the cold rows' first
// loads otherwise stall the value pass (the hardware prefetcher does not run a tile ahead).
inline void prefetch_next_tile(const kvq_layer_view& L, int64_t s, int64_t end) {
  const int64_t a = s > L.n_sink ? s : L.n_sink;
  int64_t b = s + kT < end ? s + kT : end;
  b = b < L.q_end ? b : L.q_end;
  if (a >= b) return;
  const int64_t i = a - L.n_sink, n = b - a;
  const int C = L.channels();
  const size_t rk = kvq_row_bytes(C, L.bits), rv = kvq_row_bytes(C, L.value_bits());
  prefetch_bytes(L.k_codes + (size_t)i * rk, (size_t)n * rk);
  prefetch_bytes(L.v_codes + (size_t)i * rv, (size_t)n * rv);
  if (L.v_tok != nullptr) prefetch_bytes(L.v_tok + i, (size_t)n * sizeof(kvq_affine));
  if (L.v_group != nullptr) {
    const size_t n_vg = (size_t)(C + L.group - 1) / L.group;
    prefetch_bytes(L.v_group + (size_t)i * n_vg, (size_t)n * n_vg * sizeof(kvq_affine));
  }
  if (L.k_out_off != nullptr) {
    prefetch_bytes(L.k_out_off + i, (size_t)(n + 1) * sizeof(uint32_t));
    const uint32_t e0 = L.k_out_off[i], e1 = L.k_out_off[i + n];  // the offsets were read for the current tile
    prefetch_bytes(L.k_out_idx + e0, (size_t)(e1 - e0) * sizeof(uint16_t));
    prefetch_bytes(L.k_out_val + e0, (size_t)(e1 - e0) * sizeof(uint16_t));
  }
  if (L.v_out_per_tok > 0) {
    const size_t e = (size_t)i * L.v_out_per_tok, ne = (size_t)n * L.v_out_per_tok;
    prefetch_bytes(L.v_out_idx + e, ne * sizeof(uint16_t));
    prefetch_bytes(L.v_out_val + e, ne * sizeof(uint16_t));
  }
}


// One tile's heads: scores of every query row into s_all, the key outliers' corrections, per
// kv head the softmax update and values, the value outliers' corrections. m: [n_head];
// l: [n_head, kFusedSumLanes];
// o: [n_head, hd]; work: [kvq_fused_work_floats(n_head)], s_all = its first n_head·kSS.
using heads_fn = void (*)(const tile_ctx&, float* m, float* l, float* o, float* work);

// ---- the tile's heads, for an instruction set's half of the kernel ------------------------------
// ISA provides, with NV = head_dim / kLanes vectors per head row:
//   kLanes                        floats per vector
//   kNarrowCodes                  whether quant_keys/quant_values also read 1-bit codes
//   table, load_table(t16)        a level table in registers (fill_lut's 16 floats)
//   quant_keys<BITS, LUT, NV>     {head row codes, row bytes, sc, zc, table}: key vectors d of row r
//   quant_values<BITS, LUT, NV>   {head row codes, row bytes, table}: value levels
//   f16_rows                      {first row, elements between rows}: fp16 sink / window rows
//   score_run<NV, RB>(keys, ja, jb, q, cos2, sin2, rot, s, tb, kt)   RB query rows' scores of tile
//                                 rows [ja, jb); tb: the rows' turned_block (keys at a shared
//                                 rotation); kt: the kv head's key_tables (ISAs may ignore them)
//   pv_range<NV, RB>(vals, ja, jb, da, db, w, o)             o += Σ w·level over vectors [da, db)
// (8-lane vector indices for da, db).

// Scores of query rows u0 .. u0 + RB of kv head h over the tile's rows into s ([RB, kSS]).
template <class ISA, int KB, bool LUT, int NV, int RB>
void head_scores(const tile_ctx& t, int h, int u0, float* s) {
  constexpr int hd = ISA::kLanes * NV;
  const kvq_layer_view& L = *t.L;
  const size_t rb = kvq_row_bytes(t.C, KB);
  const int row = h * t.g + u0;
  const float* q = t.qr + (size_t)row * hd;
  const turned_block tb{t.tq + (size_t)row * hd, t.tz + row, t.trot + row, t.tsc + row};
  const typename ISA::table lk = ISA::load_table(t.lut_k);
  const key_tables kt{t.ktab != nullptr ? t.ktab + (size_t)h * hd * 16 : nullptr, t.cos_t, t.sin_t};
  for (int r = 0; r < t.n_runs; ++r) {
    const run& R = t.runs[r];
    if (R.quant) {
      const typename ISA::template quant_keys<KB, LUT, NV> k{
          L.k_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * KB, rb, R.sc + h * hd, R.zc + h * hd, lk};
      ISA::template score_run<NV, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s, tb, kt);
    } else {
      const typename ISA::f16_rows k{R.k16 + (size_t)R.first * t.C + h * hd, t.C};
      ISA::template score_run<NV, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s, tb, kt);
    }
  }
}

// Rows u0 .. u0 + RB of kv head h: the softmax update over their tile scores s (which become
// probabilities), then the values: o += Σ (p·s_j)·level + Σ p·z_j. m [RB], l [RB, kFusedSumLanes];
// o [RB, hd] running (unnormalised by l); w [RB, kSS], sj, zj [kT]: scratch.
template <class ISA, int VB, bool LUT, int NV, int RB>
void head_values(const tile_ctx& t, int h, float* m, float* l, float* o, float* s, float* w, float* sj, float* zj) {
  constexpr int hd = ISA::kLanes * NV;
  const kvq_layer_view& L = *t.L;
  const size_t rb = kvq_row_bytes(t.C, VB);
  const typename ISA::table lv = ISA::load_table(t.lut_v);
  const auto values = [&](int da, int db) {
    for (int r = 0; r < t.n_runs; ++r) {
      const run& R = t.runs[r];
      if (R.quant) {
        const typename ISA::template quant_values<VB, LUT, NV> v{
            L.v_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * VB, rb, lv};
        ISA::template pv_range<NV, RB>(v, R.ja, R.jb, da, db, w, o);
      } else {
        const typename ISA::f16_rows v{R.v16 + (size_t)R.first * t.C + h * hd, t.C};
        ISA::template pv_range<NV, RB>(v, R.ja, R.jb, da, db, w, o);
      }
    }
  };
#if defined(__AVX512F__)
  if constexpr (LUT) {  // one value (scale, zero) per row: softmax and fold in one pass
    softmax_fold<RB>(s, t.v_scale, t.v_zero, t.nt, m, l, o, hd, w);
    return values(0, hd / 8);
  }
#endif
  softmax_update<RB>(s, t.nt, m, l, o, hd);
  for_value_segments<LUT>(t, h, sj, zj, [&](int da, int db, const float* ps, const float* pz) {
    float zsum[RB];
    fold_value_scales<RB>(s, ps, pz, t.nt, w, zsum);
    values(da, db);
    add_zero_sums<RB>(zsum, da, db, o, hd);
  });
}


// The tile: every query row's scores, the key outliers' corrections, per kv head and block of
// up to kMaxRB of its query heads the softmax and values, the value outliers' corrections.
template <class ISA, int KB, int VB, bool LUT, int NV>
void heads(const tile_ctx& t, float* m, float* l, float* o, float* work) {
  const int n_head = t.L->n_head_kv * t.g;
  float* s_all = work;                      // [n_head, kSS]
  float* w = s_all + (size_t)n_head * kSS;  // [kMaxRB, kSS]
  float* sj = w + (size_t)kMaxRB * kSS;     // [kT]
  float* zj = sj + kT;                      // [kT]
  const auto blocks = [&](auto&& f) {
    for (int h = 0; h < t.L->n_head_kv; ++h)
      for (int u0 = 0; u0 < t.g; u0 += kMaxRB) f(h, u0, t.g - u0 < kMaxRB ? t.g - u0 : kMaxRB, h * t.g + u0);
  };
  blocks([&](int h, int u0, int rb, int row) {
    float* s = s_all + (size_t)row * kSS;
    switch (rb) {
      case 1: head_scores<ISA, KB, LUT, NV, 1>(t, h, u0, s); break;
      case 2: head_scores<ISA, KB, LUT, NV, 2>(t, h, u0, s); break;
      case 3: head_scores<ISA, KB, LUT, NV, 3>(t, h, u0, s); break;
      default: head_scores<ISA, KB, LUT, NV, 4>(t, h, u0, s); break;
    }
  });
  if (t.outliers) add_key_outliers<NV * ISA::kLanes>(t, s_all);
  blocks([&](int h, int, int rb, int row) {
    float* s = s_all + (size_t)row * kSS;
    float* oh = o + (size_t)row * t.hd;
    float* lr = l + (size_t)row * kFusedSumLanes;
    switch (rb) {
      case 1: head_values<ISA, VB, LUT, NV, 1>(t, h, m + row, lr, oh, s, w, sj, zj); break;
      case 2: head_values<ISA, VB, LUT, NV, 2>(t, h, m + row, lr, oh, s, w, sj, zj); break;
      case 3: head_values<ISA, VB, LUT, NV, 3>(t, h, m + row, lr, oh, s, w, sj, zj); break;
      default: head_values<ISA, VB, LUT, NV, 4>(t, h, m + row, lr, oh, s, w, sj, zj); break;
    }
  });
  if (t.outliers) add_value_outliers<NV * ISA::kLanes>(t, s_all, o);
}

// kvq_fused_widths' (key, value) widths; the 1-bit and mixed ones (uniform) only where the
// instruction set reads them (ISA::kNarrowCodes).
template <class ISA, int HD>
heads_fn pick_bits(bool lut, int kb, int vb) {
  constexpr int NV = HD / ISA::kLanes;
  if (kb == vb) {
    switch (kb) {
      case 2: return lut ? heads<ISA, 2, 2, true, NV> : heads<ISA, 2, 2, false, NV>;
      case 3: return lut ? heads<ISA, 3, 3, true, NV> : heads<ISA, 3, 3, false, NV>;
      case 4: return lut ? heads<ISA, 4, 4, true, NV> : heads<ISA, 4, 4, false, NV>;
      default: break;
    }
  }
  if constexpr (ISA::kNarrowCodes) {
    if (!lut && kb == 1 && vb == 1) return heads<ISA, 1, 1, false, NV>;
    if (!lut && kb == 2 && vb == 1) return heads<ISA, 2, 1, false, NV>;
    if (!lut && kb == 1 && vb == 2) return heads<ISA, 1, 2, false, NV>;
  }
  XCTX_ASSERT(false, "kvq fused: no kernel for ", kb, "/", vb, "-bit codes");
  return nullptr;
}

// The instantiation for the layer's head_dim (16, 32, 64 or 128: kvq_fused_supported), code
// widths and scheme.
template <class ISA>
heads_fn pick_heads(const kvq_layer_view& L) {
  const bool lut = L.scheme == kvq_scheme::kvq_lut;
  const int kb = L.bits, vb = L.value_bits();
  switch (L.head_dim) {
    case 16: return pick_bits<ISA, 16>(lut, kb, vb);
    case 32: return pick_bits<ISA, 32>(lut, kb, vb);
    case 64: return pick_bits<ISA, 64>(lut, kb, vb);
    default: return pick_bits<ISA, 128>(lut, kb, vb);
  }
}

// The unit's tiles: runs, value parameters, outliers, then the instruction set's heads.
// channel_tables: build key_tables' level tables for nuq keys (the ISA scores keys in lanes).
inline void attend_unit(const kvq_fused_args& a, heads_fn run_heads, bool channel_tables = false) {
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
  float* l = m + n_head;                      // [n_head, kFusedSumLanes]
  float* vsz = l + (size_t)n_head * kFusedSumLanes;  // [2, kT] nuq value scales, zeros
  float* work = vsz + 2 * kT;                 // [kvq_fused_work_floats(n_head)]
  float* vg = work + kvq_fused_work_floats(n_head);  // [kT, C / 4] uniform value (scale, zero) per group
  int32_t* entry_row = reinterpret_cast<int32_t*>(vg + (size_t)kT * C / 4);  // [kT·C + 8]
  float* turned_q = reinterpret_cast<float*>(entry_row + (size_t)kT * C + 8);  // [n_head, hd]
  float* tq = turned_q + (size_t)n_head * hd;                                  // [n_head, hd]
  float* tz = tq + (size_t)n_head * hd;                                        // [n_head]
  int32_t* trot = reinterpret_cast<int32_t*>(tz + n_head);                     // [n_head]
  const float** tsc = reinterpret_cast<const float**>(  // [n_head], aligned up (the scratch has a float to spare)
      (reinterpret_cast<uintptr_t>(trot + n_head) + alignof(const float*) - 1) & ~(uintptr_t)(alignof(const float*) - 1));
  float* ktab = reinterpret_cast<float*>(  // [C, 16], 64-byte aligned (16 floats to spare)
      (reinterpret_cast<uintptr_t>(tsc + n_head) + 63) & ~(uintptr_t)63);
  double* ac = a.angle_scratch;               // [hd / 2]
  double* as = ac + hd / 2;

  for (int r = 0; r < n_head; ++r) m[r] = -__builtin_inff();
  for (size_t e = 0; e < (size_t)n_head * kFusedSumLanes; ++e) l[e] = 0.0f;
  for (size_t e = 0; e < (size_t)n_head * hd; ++e) a.o[e] = 0.0f;
  if (a.n == 0) {
    for (int r = 0; r < n_head; ++r) a.lse[r] = -__builtin_inff();
    return;
  }
  const bool lut = L.scheme == kvq_scheme::kvq_lut;
  int64_t slot_group[kScaleSlots];
  for (int64_t& sg : slot_group) sg = -1;

  // RoPE (n_rot = hd): the query rotated back by the unit's first position, keys by their offset.
  const int G = a.pos_group;
  const auto rot_pos = [G](int32_t p) { return (int32_t)floor_div(p, G); };
  const int32_t p0 = rot_pos(L.pos[a.s0]);
  XCTX_ASSERT((int64_t)rot_pos(L.pos[a.s0 + a.n - 1]) - p0 < kAttnUnit, "kvq fused: slots ", a.s0, "..", a.s0 + a.n,
              " are not one attention unit");
  a.angles(a.angle_table, p0, ac, as);
  for (int i = 0; i < hd / 2; ++i) {
    const float c = (float)ac[i], sn = (float)as[i];
    bcos2[2 * i] = bcos2[2 * i + 1] = c;
    bsin2[2 * i] = sn, bsin2[2 * i + 1] = -sn;
  }
  for (int r = 0; r < n_head; ++r)
    for (int d = 0; d < hd; d += 8)
      _mm256_storeu_ps(qr + (size_t)r * hd + d, rotate8(_mm256_loadu_ps(a.q + (size_t)r * hd + d), bcos2 + d, bsin2 + d));

  tile_ctx t;
  t.L = &L, t.hd = hd, t.C = C, t.g = g;
  t.qr = qr, t.cos2 = a.off_cos2, t.sin2 = a.off_sin2;
  t.cos_t = a.off_cos_t, t.sin_t = a.off_sin_t;
  fill_lut(lut ? L.lut_k : nullptr, L.bits, t.lut_k);
  if (channel_tables && lut && a.off_cos_t != nullptr) {
    // nuq keys share one channel scale/zero per layer: each channel's 16 levels scaled once per
    // call, with the FMA the per-key path applies (same bits), so a key costs one lookup.
    for (int c = 0; c < C; ++c) {
      const __m256 sc8 = _mm256_set1_ps(L.k_ch_scale[c]), zc8 = _mm256_set1_ps(L.k_ch_zero[c]);
      for (int i = 0; i < 16; i += 8)
        _mm256_store_ps(ktab + (size_t)c * 16 + i, _mm256_fmadd_ps(_mm256_load_ps(t.lut_k + i), sc8, zc8));
    }
    t.ktab = ktab;
  }
  fill_lut(lut ? L.lut_v : nullptr, L.value_bits(), t.lut_v);
  t.v_scale = vsz, t.v_zero = vsz + kT;
  t.vg = vg, t.n_vg = lut ? 0 : (C + L.group - 1) / L.group;
  t.outliers = L.k_out_off != nullptr || L.v_out_per_tok > 0;
  t.entry_row = entry_row;
  turned_rows turned;
  turned.q = turned_q;
  t.turned = &turned;
  // Rotations are offsets from the unit's start: what was turned in another unit does not hold.
  for (int r = 0; r < n_head; ++r) tsc[r] = nullptr;
  t.tq = tq, t.tz = tz, t.trot = trot, t.tsc = tsc;
  for (int64_t t0 = a.s0; t0 < a.s0 + a.n; t0 += kT) {
    const int nt = (int)(a.s0 + a.n - t0 < kT ? a.s0 + a.n - t0 : kT);
    t.nt = nt;
    if (G == 1)  // no division per slot (a 64-bit idiv: measured ~5% of the step)
      for (int j = 0; j < nt; ++j) t.rot[j] = (L.pos[t0 + j] - p0) * hd;
    else
      for (int j = 0; j < nt; ++j) t.rot[j] = (rot_pos(L.pos[t0 + j]) - p0) * hd;
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
            // A turned query made with the slot's old scales must not be taken for the new ones.
            for (int r = 0; r < n_head; ++r)
              if (tsc[r] >= gs && tsc[r] < gs + C) tsc[r] = nullptr;
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
    prefetch_next_tile(L, t0 + nt, a.s0 + a.n);
    value_params(t);
    run_heads(t, m, l, a.o, work);
  }
  for (int r = 0; r < n_head; ++r) {
    // The row's lane sums, in a fixed order (the same bits for any split of the cache).
    const float* lr = l + (size_t)r * kFusedSumLanes;
    float lsum = 0.0f, zsum = 0.0f;
    for (int e = 0; e < 16; ++e) lsum += lr[e], zsum += lr[16 + e];
    if (lsum == 0.0f) {
      a.lse[r] = -__builtin_inff();
      for (int d = 0; d < hd; ++d) a.o[(size_t)r * hd + d] = 0.0f;
      continue;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / lsum), z = _mm256_set1_ps(zsum);
    for (int d = 0; d < hd; d += 8) {
      float* od = a.o + (size_t)r * hd + d;
      _mm256_storeu_ps(od, _mm256_mul_ps(_mm256_add_ps(_mm256_loadu_ps(od), z), inv));
    }
    a.lse[r] = m[r] + std::log(lsum);
  }
}

}  // namespace
}  // namespace xctx::cpu::impl::fused
