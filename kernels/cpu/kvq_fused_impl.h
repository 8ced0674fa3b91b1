// Internal to the fused one-query attention kernels (kvq_fused_avx2.cpp, kvq_fused_avx512.cpp):
// the instruction-set-independent parts -- a tile's runs of storage kinds, the value parameters
// in f32, the sparse outliers sorted per head with their corrections, the per-head steps that
// work on memory (outlier corrections, the softmax update, the value-scale fold) and the driver
// over a unit's tiles. Each including file instantiates them with its own compile flags (the
// anonymous namespace keeps the copies apart); it supplies the per-head vector code.
// Include only from *_avx2.cpp / *_avx512.cpp files.
#pragma once

#include <immintrin.h>

#include <cmath>

#include "common/error.h"
#include "kernels/cpu/fast_exp_avx2.h"
#include "kernels/cpu/kvq_codes_avx2.h"
#include "kernels/cpu/kvq_impl.h"
#include "kernels/softmax_acc.h"

namespace xctx::cpu::impl::fused {
namespace {

constexpr int kT = kFusedTile;
constexpr int kSS = kT + 16;  // score row stride: a block of keys stores whole 4- or 8-lane groups
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

struct tile_ctx {
  const kvq_layer_view* L;
  int hd, C, g;
  int nt;
  const float* qr;    // [n_head, hd] the query rotated back by the unit's first position
  const float* cos2;  // [kAttnUnit, hd] rotation by an offset in the unit
  const float* sin2;
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
  const auto code = [rb](const uint8_t* row, int ch) { return avx2::code_at<BITS>(row, rb, ch); };
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

// ---- per-head steps on memory (s: [RB, kSS] scores, then probabilities; o: [RB, hd]) ----------

// Key outliers: δ at channel c of row j adds δ·(q'·R(o_j)e_c) to the score.
template <int RB>
inline void key_outlier_corrections(const tile_ctx& t, int h, const float* q /*[RB, hd]*/, float* s) {
  const int hd = t.hd;
  for (int e = h * t.cap; e < h * t.cap + t.k_count[h]; ++e) {
    const int j = t.k_jc[e] >> 16, c = t.k_jc[e] & 0xffff;
    const float* c2 = t.cos2 + t.rot[j];
    const float* s2 = t.sin2 + t.rot[j];
    for (int u = 0; u < RB; ++u) s[u * kSS + j] += t.k_delta[e] * (q[u * hd + c] * c2[c] + q[u * hd + (c ^ 1)] * s2[c ^ 1]);
  }
}

// Value outliers: o += p·δ at their channel (after the dense values).
template <int RB>
inline void value_outlier_corrections(const tile_ctx& t, int h, const float* s, float* o) {
  for (int e = h * t.cap; e < h * t.cap + t.v_count[h]; ++e) {
    const int j = t.v_jc[e] >> 16, c = t.v_jc[e] & 0xffff;
    for (int u = 0; u < RB; ++u) o[u * t.hd + c] += s[u * kSS + j] * t.v_delta[e];
  }
}

// Online softmax over the tile's nt scores of RB rows: s becomes the probabilities, m and l are
// updated, o (hd wide) rescaled.
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
    const float alpha = std::exp(m[u] - m_new);  // 0 on the first tile (m = -inf)
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
    l[u] = l[u] * alpha + avx2::hsum8(sum);
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

// One tile's heads: kv head h, query rows u0 .. u0 + rb of it, for every (h, block).
using heads_fn = void (*)(const tile_ctx&, float* m, float* l, float* o, float* work);

// The unit's tiles: runs, value parameters, outliers, then the instruction set's heads.
inline void attend_unit(const kvq_fused_args& a, heads_fn run_heads) {
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
      _mm256_storeu_ps(qr + (size_t)r * hd + d, rotate8(_mm256_loadu_ps(a.q + (size_t)r * hd + d), bcos2 + d, bsin2 + d));

  tile_ctx t;
  t.L = &L, t.hd = hd, t.C = C, t.g = g;
  t.qr = qr, t.cos2 = a.off_cos2, t.sin2 = a.off_sin2;
  fill_lut(lut ? L.lut_k : nullptr, L.bits, t.lut_k);
  fill_lut(lut ? L.lut_v : nullptr, L.bits, t.lut_v);
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

}  // namespace
}  // namespace xctx::cpu::impl::fused
