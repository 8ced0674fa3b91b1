// The fused one-query attention over a quantized layer (kvq_fused_avx2.cpp explains the
// arithmetic) with 16-lane vectors, for CPUs with AVX-512 F/BW/VL/DQ and VBMI (cpu::has_avx512).
// What the wider registers buy besides twice the lanes:
//  - 16 codes per unpack: one 8-byte broadcast, then vpmultishiftqb moves each code's bits to the
//    bottom of its lane (no per-lane shift count vector, no mask), and vpermps with a 16-entry
//    table looks the levels up -- 4-bit codes included (AVX2 needs two permutes and a blend);
//  - 32 registers: 8 keys × 3 query heads of accumulators stay in registers.
// Per-head steps that work on memory (outlier corrections, softmax, the value-scale fold) are the
// shared ones (kvq_fused_impl.h). Uniform value groups must hold whole heads here (group a
// multiple of head_dim, kvq_fused_avx512_supported); other shapes take the AVX2 kernel.
//
// Raw pointers only: no std containers here, so no AVX-512-compiled template copies can be
// picked by the linker for the portable files.
// GCC 12 warns about the deliberately undefined inputs inside its own AVX-512 intrinsics
// (GCC bug 105593), not about this file's code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/kvq_fused_impl.h"

namespace xctx::cpu::impl::avx512 {
namespace {

using namespace fused;
using avx2::code_read;

// ---- 16 codes ------------------------------------------------------------------------------

// vpmultishiftqb control: dword lane i takes the 8 bits from bit extra + i·BITS of its qword.
struct bytes64 {
  uint8_t b[64];
};
template <int BITS, int EXTRA>
constexpr bytes64 make_shift_control() {
  bytes64 r{};
  for (int i = 0; i < 16; ++i) r.b[4 * i] = (uint8_t)(EXTRA + BITS * i);
  return r;
}
template <int BITS, int EXTRA>
alignas(64) inline constexpr bytes64 kShiftControl = make_shift_control<BITS, EXTRA>();
template <int BITS, int EXTRA>
inline __m512i shift_control() {
  return _mm512_load_si512(kShiftControl<BITS, EXTRA>.b);
}

// 16 codes of BITS bits starting at p, code i in the low bits of dword lane i (bits above it are
// the next codes'; the tables repeat with period 2^BITS). The group's 2·BITS bytes are read as in
// kvq_codes_avx2.h: forward (8 bytes from p: not the row's last group), backward (8 bytes
// ending where the group ends: not its first) or exactly.
template <int BITS, code_read R>
inline __m512i codes16(const uint8_t* p) {
  uint64_t w = 0;
  if constexpr (R == code_read::read_forward || BITS == 4) {
    std::memcpy(&w, p, 8);
    return _mm512_multishift_epi64_epi8(shift_control<BITS, 0>(), _mm512_set1_epi64((long long)w));
  } else if constexpr (R == code_read::read_backward) {
    std::memcpy(&w, p + 2 * BITS - 8, 8);
    return _mm512_multishift_epi64_epi8(shift_control<BITS, 8 * (8 - 2 * BITS)>(), _mm512_set1_epi64((long long)w));
  } else {
    std::memcpy(&w, p, 2 * BITS);
    return _mm512_multishift_epi64_epi8(shift_control<BITS, 0>(), _mm512_set1_epi64((long long)w));
  }
}

// Vector d (16 channels) of a head row of NV16 vectors: forward reads but for the last vector,
// which reads backward (NV16 >= 2) or exactly (a 16-channel head).
template <int BITS, int NV16>
inline __m512 level_at(const uint8_t* head_row, int d, __m512 table) {
  const uint8_t* p = head_row + d * 2 * BITS;
  __m512i c;
  if constexpr (NV16 == 1)
    c = codes16<BITS, code_read::read_exact>(p);
  else if (d + 1 < NV16)
    c = codes16<BITS, code_read::read_forward>(p);
  else
    c = codes16<BITS, code_read::read_backward>(p);
  return _mm512_permutexvar_ps(c, table);
}

inline __m512 rotate16(__m512 x, const float* cos2, const float* sin2) {
  return _mm512_fmadd_ps(x, _mm512_loadu_ps(cos2), _mm512_mul_ps(_mm512_permute_ps(x, 0xB1), _mm512_loadu_ps(sin2)));
}

// ---- vector sources (as in the AVX2 file, 16 lanes) ----------------------------------------

template <int BITS, int NV16>
struct quant_keys {
  const uint8_t* base;  // the run's first row at the head's first channel
  size_t rb;
  const float* sc;  // [hd]
  const float* zc;  // [hd]
  __m512 table;
  const uint8_t* row(int r) const { return base + (size_t)r * rb; }
  __m512 load(const uint8_t* head_row, int d) const {
    return _mm512_fmadd_ps(level_at<BITS, NV16>(head_row, d, table), _mm512_loadu_ps(sc + 16 * d),
                           _mm512_loadu_ps(zc + 16 * d));
  }
};

template <int BITS, int NV16>
struct quant_values {
  const uint8_t* base;
  size_t rb;
  __m512 table;
  const uint8_t* row(int r) const { return base + (size_t)r * rb; }
  __m512 load(const uint8_t* head_row, int d) const { return level_at<BITS, NV16>(head_row, d, table); }
};

struct f16_rows {
  const uint16_t* base;
  int64_t ld;
  const uint16_t* row(int r) const { return base + r * ld; }
  __m512 load(const uint16_t* head_row, int d) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(head_row + 16 * d)));
  }
};

// ---- scores ------------------------------------------------------------------------------

// Sums of the 16 lanes of TB (<= 8) accumulators in one 8-lane vector (lane b = acc b, 0 past TB).
template <int TB>
inline __m256 reduce8(const __m512* a) {
  __m256 h[8];
  for (int b = 0; b < 8; ++b)
    h[b] = b < TB ? _mm256_add_ps(_mm512_castps512_ps256(a[b < TB ? b : 0]), _mm512_extractf32x8_ps(a[b < TB ? b : 0], 1))
                  : _mm256_setzero_ps();
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[u * kSS + j0 + b] = q_u · R(o) k for u < RB, b < TB (keys rows r0 + b of the run; rotated by
// the rows of cos2/sin2 at rot[j0 + b]). Lanes past TB store 0 on later keys' slots (written
// after) or the row's padding.
template <int NV16, int RB, int TB, class K>
inline void score_block(const K& keys, int j0, int r0, const float* q /*[RB, hd]*/, const float* cos2,
                        const float* sin2, const int32_t* rot, float* s /*[RB, kSS]*/) {
  constexpr int hd = 16 * NV16;
  __m512 acc[RB][TB];
  for (int u = 0; u < RB; ++u)
    for (int b = 0; b < TB; ++b) acc[u][b] = _mm512_setzero_ps();
  // Row and table addresses are recomputed where used: kept in arrays, GCC's SLP vectorizer
  // packs them into vector registers and extracts every one (measured: half the block's work).
#pragma GCC unroll 8
  for (int d = 0; d < NV16; ++d)
    for (int b = 0; b < TB; ++b) {
      const __m512 k =
          rotate16(keys.load(keys.row(r0 + b), d), cos2 + rot[j0 + b] + 16 * d, sin2 + rot[j0 + b] + 16 * d);
      for (int u = 0; u < RB; ++u) acc[u][b] = _mm512_fmadd_ps(k, _mm512_loadu_ps(q + u * hd + 16 * d), acc[u][b]);
    }
  for (int u = 0; u < RB; ++u) _mm256_storeu_ps(s + u * kSS + j0, reduce8<TB>(acc[u]));
}

// RB·TB accumulators, the key, its rotation and the decode constants in 32 registers.
template <int RB>
constexpr int kKeysPerBlock = RB == 1 ? 8 : RB == 2 ? 8 : RB == 3 ? 8 : 4;

template <int NV16, int RB, class K>
void score_run(const K& keys, int ja, int jb, const float* q, const float* cos2, const float* sin2,
               const int32_t* rot, float* s) {
  constexpr int TB = kKeysPerBlock<RB>;
  int j = ja;
  for (; j + TB <= jb; j += TB) score_block<NV16, RB, TB>(keys, j, j - ja, q, cos2, sin2, rot, s);
  for (; j < jb; ++j) score_block<NV16, RB, 1>(keys, j, j - ja, q, cos2, sin2, rot, s);
}

// ---- values ------------------------------------------------------------------------------

// o_u[16 d0, 16 (d0 + W)) += Σ_j w[u][j] · level_j for tile rows [ja, jb) (run rows from 0).
template <int NV16, int RB, int W, class V>
inline void pv_slice(const V& vals, int ja, int jb, int d0, const float* w /*[RB, kSS]*/, float* o /*[RB, hd]*/) {
  constexpr int hd = 16 * NV16;
  __m512 acc[RB][W];
  for (int u = 0; u < RB; ++u)
    for (int c = 0; c < W; ++c) acc[u][c] = _mm512_loadu_ps(o + u * hd + 16 * (d0 + c));
  for (int j = ja; j < jb; ++j) {
    const auto row = vals.row(j - ja);
    __m512 wj[RB];
    for (int u = 0; u < RB; ++u) wj[u] = _mm512_set1_ps(w[u * kSS + j]);
    for (int c = 0; c < W; ++c) {
      const __m512 x = vals.load(row, d0 + c);
      for (int u = 0; u < RB; ++u) acc[u][c] = _mm512_fmadd_ps(wj[u], x, acc[u][c]);
    }
  }
  for (int u = 0; u < RB; ++u)
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(o + u * hd + 16 * (d0 + c), acc[u][c]);
}

template <int RB>
constexpr int kValueSlice = RB == 4 ? 4 : 8;  // RB·W accumulators + RB weights + 3 in 32 registers

template <int NV16, int RB, int D0 = 0, class V>
inline void pv_head(const V& vals, int ja, int jb, const float* w, float* o) {
  if constexpr (D0 < NV16) {
    constexpr int W = NV16 - D0 < kValueSlice<RB> ? NV16 - D0 : kValueSlice<RB>;
    pv_slice<NV16, RB, W>(vals, ja, jb, D0, w, o);
    pv_head<NV16, RB, D0 + W>(vals, ja, jb, w, o);
  }
}

// ---- one kv head's block of query heads over the tile ----------------------------------------

// Scores of query rows u0 .. u0 + RB of kv head h over the tile's rows into s ([RB, kSS]).
template <int BITS, bool LUT, int NV16, int RB>
void head_scores(const tile_ctx& t, int h, int u0, float* s) {
  constexpr int hd = 16 * NV16;
  const kvq_layer_view& L = *t.L;
  const size_t rb = kvq_row_bytes(t.C, BITS);
  const float* q = t.qr + (size_t)(h * t.g + u0) * hd;
  const __m512 lk = _mm512_load_ps(t.lut_k);
  for (int r = 0; r < t.n_runs; ++r) {
    const run& R = t.runs[r];
    if (R.quant) {
      const quant_keys<BITS, NV16> k{L.k_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * BITS, rb, R.sc + h * hd,
                                     R.zc + h * hd, lk};
      score_run<NV16, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s);
    } else {
      const f16_rows k{R.k16 + (size_t)R.first * t.C + h * hd, t.C};
      score_run<NV16, RB>(k, R.ja, R.jb, q, t.cos2, t.sin2, t.rot, s);
    }
  }
}

// Rows u0 .. u0 + RB of kv head h: the softmax update over their tile scores s (which become
// probabilities), then the values: o += Σ (p·s_j)·level + Σ p·z_j. m, l [RB]; o [RB, hd]
// running (unnormalised by l); w [RB, kSS], sj, zj [kT]: scratch.
template <int BITS, bool LUT, int NV16, int RB>
void head_values(const tile_ctx& t, int h, float* m, float* l, float* o, float* s, float* w, float* sj, float* zj) {
  constexpr int hd = 16 * NV16;
  const kvq_layer_view& L = *t.L;
  const size_t rb = kvq_row_bytes(t.C, BITS);
  const __m512 lv = _mm512_load_ps(t.lut_v);
  softmax_update<RB>(s, t.nt, m, l, o, hd);
  for_value_segments<LUT>(t, h, sj, zj, [&](int da, int db, const float* ps, const float* pz) {
    XCTX_ASSERT(da == 0 && db == hd / 8, "kvq fused avx512: a value group splits head ", h);
    float zsum[RB];
    fold_value_scales<RB>(s, ps, pz, t.nt, w, zsum);
    for (int r = 0; r < t.n_runs; ++r) {
      const run& R = t.runs[r];
      if (R.quant) {
        const quant_values<BITS, NV16> v{L.v_codes + (size_t)R.first * rb + (size_t)h * hd / 8 * BITS, rb, lv};
        pv_head<NV16, RB>(v, R.ja, R.jb, w, o);
      } else {
        const f16_rows v{R.v16 + (size_t)R.first * t.C + h * hd, t.C};
        pv_head<NV16, RB>(v, R.ja, R.jb, w, o);
      }
    }
    add_zero_sums<RB>(zsum, da, db, o, hd);
  });
}

// The tile: every query row's scores, the key outliers' corrections, per kv head and block of
// up to kMaxRB of its query heads the softmax and values, the value outliers' corrections.
template <int BITS, bool LUT, int NV16>
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
      case 1: head_scores<BITS, LUT, NV16, 1>(t, h, u0, s); break;
      case 2: head_scores<BITS, LUT, NV16, 2>(t, h, u0, s); break;
      case 3: head_scores<BITS, LUT, NV16, 3>(t, h, u0, s); break;
      default: head_scores<BITS, LUT, NV16, 4>(t, h, u0, s); break;
    }
  });
  if (t.outliers) add_key_outliers(t, s_all);
  blocks([&](int h, int, int rb, int row) {
    float* s = s_all + (size_t)row * kSS;
    float* oh = o + (size_t)row * t.hd;
    switch (rb) {
      case 1: head_values<BITS, LUT, NV16, 1>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
      case 2: head_values<BITS, LUT, NV16, 2>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
      case 3: head_values<BITS, LUT, NV16, 3>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
      default: head_values<BITS, LUT, NV16, 4>(t, h, m + row, l + row, oh, s, w, sj, zj); break;
    }
  });
  if (t.outliers) add_value_outliers(t, s_all, o);
}

template <int NV16>
heads_fn pick_bits(bool lut, int bits) {
  switch (bits) {
    case 2: return lut ? heads<2, true, NV16> : heads<2, false, NV16>;
    case 3: return lut ? heads<3, true, NV16> : heads<3, false, NV16>;
    default: return lut ? heads<4, true, NV16> : heads<4, false, NV16>;
  }
}

heads_fn pick(const kvq_layer_view& L) {
  const bool lut = L.scheme == kvq_scheme::kvq_lut;
  switch (L.head_dim) {
    case 16: return pick_bits<1>(lut, L.bits);
    case 32: return pick_bits<2>(lut, L.bits);
    case 64: return pick_bits<4>(lut, L.bits);
    default: return pick_bits<8>(lut, L.bits);  // 128 (kvq_fused_supported)
  }
}

}  // namespace

void kvq_attend_fused(const kvq_fused_args& a) {
  XCTX_ASSERT(kvq_fused_avx512_supported(*a.kv), "kvq fused avx512: unsupported value groups");
  attend_unit(a, pick(*a.kv));
}

}  // namespace xctx::cpu::impl::avx512
