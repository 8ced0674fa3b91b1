// Internal to the fused one-query attention kernels (kvq_fused_avx2.cpp, kvq_fused_avx512.cpp):
// the instruction-set-independent driver -- the unit's set-up, its tiles' runs, and the loop over
// a tile's heads that calls the instruction set's vector code. The tile context is in
// kvq_fused_tile.h, the outlier corrections in kvq_fused_outliers.h, the softmax and value-scale
// steps in kvq_fused_softmax.h. Each including file instantiates them with its own compile flags
// (the anonymous namespace keeps the copies apart). Include only from *_avx2.cpp / *_avx512.cpp.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "common/error.h"
#include "kernels/cpu/kvq/kvq_fused_outliers.h"
#include "kernels/cpu/kvq/kvq_fused_softmax.h"
#include "kernels/cpu/kvq/kvq_fused_tile.h"
#include "kernels/cpu/kvq/kvq_impl.h"

namespace xctx::cpu::impl::fused {
namespace {

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
  const int G = a.pos_group, P = a.pos_period;
  const auto rot_pos = [G, P](int32_t p) { return (int32_t)grouped_key_pos(p, G, P); };
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
