// Internal to the fused one-query attention kernels: the sparse outliers' corrections of the
// dense scores and outputs (KVQuant's dense-and-sparse split). Include only from kvq_fused_impl.h.
#pragma once

#include <immintrin.h>

#include <type_traits>

#include "kernels/cpu/kvq/kvq_fused_tile.h"

namespace xctx::cpu::impl::fused {
namespace {

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

}  // namespace
}  // namespace xctx::cpu::impl::fused
