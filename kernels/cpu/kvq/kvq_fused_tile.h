// Internal to the fused one-query attention kernels (kvq_fused_impl.h and its includers): what
// one tile of a unit is -- its runs of storage kinds, the per-tile context the heads read, and
// the value parameters in f32. Include only from the kvq_fused_* files.
#pragma once

#include <immintrin.h>

#include "kernels/cpu/kvq/kvq_codes_avx2.h"
#include "kernels/cpu/kvq/kvq_impl.h"
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

}  // namespace
}  // namespace xctx::cpu::impl::fused
