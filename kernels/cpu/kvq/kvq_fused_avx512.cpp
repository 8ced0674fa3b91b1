// The fused one-query attention over a quantized layer (kvq_fused_avx2.cpp explains the
// arithmetic) with 16-lane vectors, for CPUs with AVX-512 F/BW/VL/DQ and VBMI (cpu::has_avx512).
// What the wider registers buy besides twice the lanes:
//  - 16 codes per unpack: one 8-byte broadcast, then vpmultishiftqb moves each code's bits to the
//    bottom of its lane (no per-lane shift count vector, no mask), and vpermps with a 16-entry
//    table looks the levels up -- 4-bit codes included (AVX2 needs two permutes and a blend);
//  - 32 registers: 8 keys × 3 query heads of accumulators stay in registers.
// Per-head steps that work on memory (outlier corrections, softmax, the value-scale fold) are the
// shared ones (kvq_fused_impl.h). Uniform value groups must hold whole 16-lane vectors here
// (group a multiple of 16, kvq_fused_avx512_supported); other shapes take the AVX2 kernel.
//
// Raw pointers only: no std containers here, so no AVX-512-compiled template copies can be
// picked by the linker for the portable files.
// GCC 12 warns about the deliberately undefined inputs inside its own AVX-512 intrinsics
// (GCC bug 105593), not about this file's code.
#if defined(__GNUC__) && !defined(__clang__)  // clang has no -Wmaybe-uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels/cpu/kvq/kvq_fused_impl.h"

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
// ending where the group ends: not its first) or exactly. One more group covers the 8 - 2·BITS
// extra bytes only for BITS >= 2, so 1-bit groups are always read exactly, as there.
template <int BITS, code_read R>
inline __m512i codes16(const uint8_t* p) {
  uint64_t w = 0;
  if constexpr ((R == code_read::read_forward && BITS > 1) || BITS == 4) {
    std::memcpy(&w, p, 8);
    return _mm512_multishift_epi64_epi8(shift_control<BITS, 0>(), _mm512_set1_epi64((long long)w));
  } else if constexpr (R == code_read::read_backward && BITS > 1) {
    std::memcpy(&w, p + 2 * BITS - 8, 8);
    return _mm512_multishift_epi64_epi8(shift_control<BITS, 8 * (8 - 2 * BITS)>(), _mm512_set1_epi64((long long)w));
  } else {
    std::memcpy(&w, p, 2 * BITS);
    return _mm512_multishift_epi64_epi8(shift_control<BITS, 0>(), _mm512_set1_epi64((long long)w));
  }
}

// Vector d (16 channels) of a head row of NV16 vectors: forward reads but for the last vector,
// which reads backward (NV16 >= 2) or exactly (a 16-channel head; 1-bit codes, 2 bytes).
template <int BITS, int NV16>
inline __m512 level_at(const uint8_t* head_row, int d, __m512 table) {
  const uint8_t* p = head_row + d * 2 * BITS;
  __m512i c;
  if constexpr (NV16 == 1 || BITS == 1)
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
  static constexpr int kBits = BITS;
  const uint8_t* base;  // the run's first row at the head's first channel
  size_t rb;
  const float* sc;  // [hd]
  const float* zc;  // [hd]
  __m512 table;
  static constexpr bool kTurnable = true;  // keys sharing a rotation may take turn_query
  const uint8_t* row(int r) const { return base + (size_t)r * rb; }
  __m512 level(const uint8_t* head_row, int d) const { return level_at<BITS, NV16>(head_row, d, table); }
  __m512 load(const uint8_t* head_row, int d) const {
    return _mm512_fmadd_ps(level(head_row, d), _mm512_loadu_ps(sc + 16 * d), _mm512_loadu_ps(zc + 16 * d));
  }
};

template <int BITS, int NV16>
struct quant_values {
  const uint8_t* base;
  size_t rb;
  __m512 table;
  const uint8_t* row(int r) const { return base + (size_t)r * rb; }
  size_t stride() const { return rb; }
  __m512 load(const uint8_t* head_row, int d) const { return level_at<BITS, NV16>(head_row, d, table); }
};

struct f16_rows {
  const uint16_t* base;
  int64_t ld;
  static constexpr bool kTurnable = false;
  const uint16_t* row(int r) const { return base + r * ld; }
  int64_t stride() const { return ld; }
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

// ---- scores of 16 keys: a reduction tree ---------------------------------------------------
// Each key's RB accumulators (16 channel lanes each) are folded with its neighbours' into one
// vector of 16 keys' dot products: level 1 adds the 256-bit halves of two keys (8 partial sums
// each), level 2 the 128-bit quarters of two such pairs (4 each), levels 3 and 4 lane pairs
// inside the quarters; a permute puts the keys in order. Built depth-first, one pending vector
// per level and query row is live at a time: ~3 instructions per key and row, no spills (holding
// TB keys' accumulators for one horizontal sum each costs ~3.3, and spills at RB = 3, TB = 8).
template <int LEVEL>
[[gnu::always_inline]] inline __m512 tree_combine(__m512 a, __m512 b) {
  if constexpr (LEVEL == 1)
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  else if constexpr (LEVEL == 2)
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  else if constexpr (LEVEL == 3)
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  else
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

// acc[u] = the 16-lane partial products of q_u · R(o) k for key row r (tile row j); TURNED: of
// q_u · lvl, q being turn_query's (the rotation and scales moved onto it).
template <int NV16, int RB, bool TURNED, class K>
[[gnu::always_inline]] inline void key_dots(const K& keys, int j, int r, const float* q, const float* cos2,
                                            const float* sin2, const int32_t* rot, __m512* acc /*[RB]*/) {
  constexpr int hd = 16 * NV16;
  const auto row = keys.row(r);
  const int o = TURNED ? 0 : rot[j];
  // The query is read from L1 as memory operands: an opaque copy of its address keeps GCC from
  // holding all RB·NV16 query vectors in registers across the 16 keys, which spills the tree.
  const float* qk = q;
  asm volatile("" : "+r"(qk));
  for (int d = 0; d < NV16; ++d) {
    __m512 k;
    if constexpr (TURNED)
      k = keys.level(row, d);
    else
      k = rotate16(keys.load(row, d), cos2 + o + 16 * d, sin2 + o + 16 * d);
    for (int u = 0; u < RB; ++u)
      acc[u] = d == 0 ? _mm512_mul_ps(k, _mm512_loadu_ps(qk + u * hd))
                      : _mm512_fmadd_ps(k, _mm512_loadu_ps(qk + u * hd + 16 * d), acc[u]);
  }
}

// N (a power of 2, <= 16) keys from tile row j / run row r folded to tree level log2(N).
// (always_inline here and below: GCC otherwise calls key_dots per key, spilling the tree.)
template <int N, int NV16, int RB, bool TURNED, class K>
[[gnu::always_inline]] inline void key_tree(const K& keys, int j, int r, const float* q, const float* cos2,
                                            const float* sin2, const int32_t* rot, __m512* out /*[RB]*/) {
  if constexpr (N == 1) {
    key_dots<NV16, RB, TURNED>(keys, j, r, q, cos2, sin2, rot, out);
  } else {
    constexpr int level = N == 2 ? 1 : N == 4 ? 2 : N == 8 ? 3 : 4;
    __m512 a[RB], b[RB];
    key_tree<N / 2, NV16, RB, TURNED>(keys, j, r, q, cos2, sin2, rot, a);
    key_tree<N / 2, NV16, RB, TURNED>(keys, j + N / 2, r + N / 2, q, cos2, sin2, rot, b);
    for (int u = 0; u < RB; ++u) out[u] = tree_combine<level>(a[u], b[u]);
  }
}

// s[u * kSS + j0 + b] for the 16 keys b of tile rows j0.. (run rows r0..). TURNED: the keys share
// one rotation, q and z are turn_query's.
template <int NV16, int RB, bool TURNED = false, class K>
inline void score_16(const K& keys, int j0, int r0, const float* q, const float* cos2, const float* sin2,
                     const int32_t* rot, float* s, const float* z = nullptr) {
  // After level 4, lane 4i + q holds key 4q + i.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512 v[RB];
  key_tree<16, NV16, RB, TURNED>(keys, j0, r0, q, cos2, sin2, rot, v);
  for (int u = 0; u < RB; ++u) {
    __m512 x = _mm512_permutexvar_ps(order, v[u]);
    if constexpr (TURNED) x = _mm512_add_ps(x, _mm512_set1_ps(z[u]));
    _mm512_storeu_ps(s + u * kSS + j0, x);
  }
}

// ---- scores of 16 keys with the keys in the lanes -----------------------------------------
// For 16 consecutive positions (the common case: a unit's keys at offsets o .. o + 15) the lanes
// hold keys instead of channels, and a channel is one vector over the 16 keys: its codes are a
// shift of the codes' 32-bit words transposed across the rows (vpermps reads the low 4 bits; the
// bits above a code are the next codes', and the tables repeat with period 2^BITS), its value is
// one vpermps from the channel's scaled level table (key_tables::ctab: lut·sc + zc, the FMA the
// per-key path applies), the rotation of a pair two multiplies and two FMAs against the
// pair-major angle rows of the 16 offsets, and each query row adds its two channels with two
// FMAs from broadcast scalars. No horizontal sums: per 16 keys and 64 channels this is 64
// shifts, 64 lookups and 320 FP operations, against the key-at-a-time path's 384 FP operations
// and ~285 shuffles (kvq_attention_notes.md). The rotated keys are bitwise the per-key path's;
// the dot products sum the channels in another order (one chain per query row and block, the
// channels in order). nuq keys only (their channel scales are the layer's, so the
// tables are built once per call: attend_unit); kivi keys change scales every group.

// Channel C's codes of the 16 rows in the low bits of each lane; w: the rows' 32-bit code words.
template <int BITS, int C>
[[gnu::always_inline]] inline __m512i channel_codes(const __m512i* w) {
  constexpr int bit = BITS * C, wi = bit / 32, sh = bit % 32;
  if constexpr (sh + BITS <= 32)
    return sh == 0 ? w[wi] : _mm512_srli_epi32(w[wi], sh);
  else  // the code spans two words
    return _mm512_or_si512(_mm512_srli_epi32(w[wi], sh), _mm512_slli_epi32(w[wi + 1], 32 - sh));
}

// Rotary pair P of NB blocks of 16 keys (block b at offset o[b], its code words wb[b]): the
// pair's two table rows are read once for the blocks, each query scalar is broadcast once for
// them (the broadcasts, one load each, bounded the one-block version: 12 loads per pair), and
// each query row adds the pair to one chain per block (two dependent FMAs per pair; the NB
// blocks' other work covers their latency).
template <int BITS, int NV16, int RB, int NB, int W, int P>
[[gnu::always_inline]] inline void lanes_pair(const __m512i (*wb)[W], const float* ctab, const float* cos_t,
                                              const float* sin_t, const int* o, const float* q, __m512 (*acc)[NB]) {
  constexpr int hd = 16 * NV16;
  const __m512 ta = _mm512_load_ps(ctab + 32 * P), tb = _mm512_load_ps(ctab + 32 * P + 16);
  __m512 ra[NB], rb[NB];
  for (int b = 0; b < NB; ++b) {
    const __m512 ka = _mm512_permutexvar_ps(channel_codes<BITS, 2 * P>(wb[b]), ta);
    const __m512 kb = _mm512_permutexvar_ps(channel_codes<BITS, 2 * P + 1>(wb[b]), tb);
    __m512 c = _mm512_loadu_ps(cos_t + P * kUnitAngleStride + o[b]);
    __m512 sn = _mm512_loadu_ps(sin_t + P * kUnitAngleStride + o[b]);
    asm("" : "+v"(c), "+v"(sn));  // one load each (GCC otherwise reads both twice as memory operands)
    // rotate16's arithmetic per lane pair: even k·cos − k'·sin, odd k'·cos + k·sin.
    ra[b] = _mm512_fmsub_ps(ka, c, _mm512_mul_ps(kb, sn));
    rb[b] = _mm512_fmadd_ps(kb, c, _mm512_mul_ps(ka, sn));
  }
  for (int u = 0; u < RB; ++u) {
    __m512 qe = _mm512_set1_ps(q[u * hd + 2 * P]), qo = _mm512_set1_ps(q[u * hd + 2 * P + 1]);
    if constexpr (NB > 1) asm("" : "+v"(qe), "+v"(qo));  // one broadcast each, not one per block
    for (int b = 0; b < NB; ++b) acc[u][b] = _mm512_fmadd_ps(rb[b], qo, _mm512_fmadd_ps(ra[b], qe, acc[u][b]));
  }
}

// w[i] = 32-bit word i (< W <= 8) of 16 rows' codes at row0 + r·rb, lane r = row r: rows r and
// r + 8 loaded into the two halves of one register (masked: nothing past a row is read), then
// an 8×8 transpose in each half (unpacks of dwords, then of qwords) and one two-source permute
// per word puts the 128-bit pieces in row order. ~30 shuffles per 16 rows; vpgatherdd was
// slower (microcoded on CPUs with the gather-data-sampling mitigation; measured 2026-11-29:
// a third of the scores' time stalled on the gathers).
template <int W>
[[gnu::always_inline]] inline void row_words(const uint8_t* row0, size_t rb, __m512i* w) {
  static_assert(W <= 8, "at most 8 words per row");
  constexpr __mmask16 lo = (1u << W) - 1, hi = (__mmask16)(lo << 8);
  __m512i z[8];
  for (int k = 0; k < 8; ++k) {
    z[k] = _mm512_maskz_loadu_epi32(lo, row0 + k * rb);
    z[k] = _mm512_mask_loadu_epi32(z[k], hi, row0 + (k + 8) * rb - 32);  // lanes 8.. = row k + 8
  }
  __m512i t[8], u[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm512_unpacklo_epi32(z[k], z[k + 1]);  // per 128-bit piece: (r_k, r_k+1) dwords 0, 1
    t[k + 1] = _mm512_unpackhi_epi32(z[k], z[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);  // rows k..k+3 of dword 0 (piece 0), 4 (piece 1)
    u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  // u[d] (d < 4) holds word d (pieces 0, 2) and d + 4 (pieces 1, 3) of rows 0-3 (pieces 0, 1)
  // and 8-11 (2, 3); u[d + 4] the same of rows 4-7 and 12-15.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);   // pieces 0 of u, 0 of u', 2, 2'
  const __m512i second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);  // pieces 1, 1', 3, 3'
  for (int d = 0; d < W; ++d)
    w[d] = _mm512_permutex2var_epi64(u[d % 4], d < 4 ? first : second, u[d % 4 + 4]);
}

// s[u * kSS + j0 + 16 b + i] for the 16 keys i of NB blocks b: run rows r0 + 16 b.., at offsets
// o[b] .. o[b] + 15 of the unit. NB = 2 where 32 keys qualify (registers: NB·RB chains, NB·W code
// words, NB pairs of rotated channels).
template <int NV16, int RB, int NB, class K>
inline void score_lanes(const K& keys, int j0, int r0, const int* o, const float* q, const key_tables& kt, float* s) {
  constexpr int BITS = K::kBits, hd = 16 * NV16, W = hd * BITS / 32;
  static_assert(hd * BITS % 32 == 0, "a head row's codes are whole 32-bit words");
  __m512i w[NB][W];
  // (The index-sequence lambdas are always inlined: called out of line, acc lives in memory.)
  for (int b = 0; b < NB; ++b)
    [&]<int... M>(std::integer_sequence<int, M...>) __attribute__((always_inline)) {  // 8 words at a time (hd 128: 12 or 16)
      (row_words<(W - 8 * M < 8 ? W - 8 * M : 8)>(keys.row(r0 + 16 * b) + 32 * M, keys.rb, w[b] + 8 * M), ...);
    }(std::make_integer_sequence<int, (W + 7) / 8>{});
  __m512 acc[RB][NB];
  for (int u = 0; u < RB; ++u)
    for (int b = 0; b < NB; ++b) acc[u][b] = _mm512_setzero_ps();
  [&]<int... P>(std::integer_sequence<int, P...>) __attribute__((always_inline)) {
    (lanes_pair<BITS, NV16, RB, NB, W, P>(w, kt.ctab, kt.cos_t, kt.sin_t, o, q, acc), ...);
  }(std::make_integer_sequence<int, hd / 2>{});
  for (int u = 0; u < RB; ++u)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(s + u * kSS + j0 + 16 * b, acc[u][b]);
}

// Whether tile rows j .. j + 15 sit at 16 consecutive offsets of the unit (rot = offset · hd).
inline bool consecutive16(const int32_t* rot, int j, int hd) {
  const __m512i want = _mm512_add_epi32(
      _mm512_set1_epi32(rot[j]),
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(hd)));
  return _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(rot + j), want) == 0xFFFF;
}

template <int NV16, int RB, class K>
void score_run(const K& keys, int ja, int jb, const float* q, const float* cos2, const float* sin2,
               const int32_t* rot, float* s, const turned_block& tb, const key_tables& kt) {
  constexpr int TB = kKeysPerBlock<RB>;
  int j = ja;
  if constexpr (K::kTurnable) {
    // 16 keys at one rotation (grouped positions) take the turned query, made once per rotation
    // and key scales (kept across the unit's tiles in tb).
    constexpr int hd = 16 * NV16;
    for (; j + 16 <= jb; j += 16) {
      const __m512i r16 = _mm512_loadu_si512(rot + j);  // positions need not be monotone: all 16 checked
      if (_mm512_cmpeq_epi32_mask(r16, _mm512_set1_epi32(rot[j])) == 0xFFFF) {
        if (*tb.sc != keys.sc || *tb.rot != rot[j]) {
          turn_query<RB>(hd, q, cos2 + rot[j], sin2 + rot[j], keys.sc, keys.zc, tb.q, tb.z);
          *tb.rot = rot[j], *tb.sc = keys.sc;
        }
        score_16<NV16, RB, true>(keys, j, j - ja, tb.q, cos2, sin2, rot, s, tb.z);
      } else {
        if constexpr (hd * K::kBits % 32 == 0) {
          if (kt.ctab != nullptr && consecutive16(rot, j, hd)) {
            const int o[2] = {rot[j] / hd, rot[j] / hd + 16};
            // Two blocks where their code words and chains leave room in the 32 registers
            // (hd 64 at 2-3 bits; wider rows would spill, so they are not even instantiated).
            constexpr int W = hd * K::kBits / 32;
            if constexpr (2 * W + 2 * RB <= 20) {
              if (j + 32 <= jb && consecutive16(rot, j + 16, hd) && rot[j + 16] == rot[j] + 16 * hd) {
                score_lanes<NV16, RB, 2>(keys, j, j - ja, o, q, kt, s);
                j += 16;  // and the loop's 16
                continue;
              }
            }
            score_lanes<NV16, RB, 1>(keys, j, j - ja, o, q, kt, s);
            continue;
          }
        }
        score_16<NV16, RB>(keys, j, j - ja, q, cos2, sin2, rot, s);
      }
    }
  }
  for (; j + 16 <= jb; j += 16) score_16<NV16, RB>(keys, j, j - ja, q, cos2, sin2, rot, s);
  for (; j + TB <= jb; j += TB) score_block<NV16, RB, TB>(keys, j, j - ja, q, cos2, sin2, rot, s);
  for (; j < jb; ++j) score_block<NV16, RB, 1>(keys, j, j - ja, q, cos2, sin2, rot, s);
}

// ---- values ------------------------------------------------------------------------------

// o_u[16 d0, 16 (d0 + W)) += Σ_j w[u][j] · level_j for tile rows [ja, jb) (run rows from 0).
// D0 >= 0 fixes d0 at compile time (whole heads: each vector's code read -- forward, backward --
// is then known without a test per row); D0 = -1 takes d0_rt.
template <int NV16, int RB, int W, int D0, class V>
inline void pv_slice(const V& vals, int ja, int jb, int d0_rt, const float* w /*[RB, kSS]*/, float* o /*[RB, hd]*/) {
  constexpr int hd = 16 * NV16;
  const int d0 = D0 >= 0 ? D0 : d0_rt;
  __m512 acc[RB][W];
  for (int u = 0; u < RB; ++u)
    for (int c = 0; c < W; ++c) acc[u][c] = _mm512_loadu_ps(o + u * hd + 16 * (d0 + c));
  auto row = vals.row(0);
  for (int j = ja; j < jb; ++j, row += vals.stride()) {
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
    pv_slice<NV16, RB, W, D0>(vals, ja, jb, D0, w, o);
    pv_head<NV16, RB, D0 + W>(vals, ja, jb, w, o);
  }
}

// A slice of width w_rt <= W at a run-time offset.
template <int NV16, int RB, int W, class V>
inline void pv_slice_upto(const V& vals, int ja, int jb, int d0, int w_rt, const float* w, float* o) {
  if constexpr (W > 1) {
    if (w_rt < W) return pv_slice_upto<NV16, RB, W - 1>(vals, ja, jb, d0, w_rt, w, o);
  }
  pv_slice<NV16, RB, W, -1>(vals, ja, jb, d0, w, o);
}

// Vectors [da, db) (8-lane indices, even: kvq_fused_avx512_supported keeps value groups to
// multiples of 16 channels) of the head; groups narrower than it (clkv's 32 channels) in slices.
template <int NV16, int RB, class V>
void pv_range(const V& vals, int ja, int jb, int da, int db, const float* w, float* o) {
  if (da == 0 && db == 2 * NV16) return pv_head<NV16, RB>(vals, ja, jb, w, o);
  XCTX_ASSERT(da % 2 == 0 && db % 2 == 0, "kvq fused avx512: a value group splits a 16-lane vector");
  constexpr int S = kValueSlice<RB> < NV16 ? kValueSlice<RB> : NV16;
  for (int d = da / 2; d < db / 2;) {
    const int wd = db / 2 - d < S ? db / 2 - d : S;
    pv_slice_upto<NV16, RB, S>(vals, ja, jb, d, wd, w, o);
    d += wd;
  }
}

// This instruction set's half of the kernel (kvq_fused_impl.h, heads).
struct ops {
  static constexpr int kLanes = 16;
  static constexpr bool kNarrowCodes = true;
  using table = __m512;
  static table load_table(const float* t16) { return _mm512_load_ps(t16); }
  template <int BITS, bool LUT, int NV16>
  using quant_keys = avx512::quant_keys<BITS, NV16>;  // uniform codes widen through an identity table
  template <int BITS, bool LUT, int NV16>
  using quant_values = avx512::quant_values<BITS, NV16>;
  using f16_rows = avx512::f16_rows;
  template <int NV16, int RB, class K>
  static void score_run(const K& keys, int ja, int jb, const float* q, const float* cos2, const float* sin2,
                        const int32_t* rot, float* s, const turned_block& tb, const key_tables& kt) {
    avx512::score_run<NV16, RB>(keys, ja, jb, q, cos2, sin2, rot, s, tb, kt);
  }
  template <int NV16, int RB, class V>
  static void pv_range(const V& vals, int ja, int jb, int da, int db, const float* w, float* o) {
    avx512::pv_range<NV16, RB>(vals, ja, jb, da, db, w, o);
  }
};

}  // namespace

void kvq_attend_fused(const kvq_fused_args& a) {
  XCTX_ASSERT(kvq_fused_avx512_supported(*a.kv), "kvq fused avx512: value groups of ", a.kv->group,
              " channels do not hold whole 16-lane vectors");
  attend_unit(a, pick_heads<ops>(*a.kv), /*channel_tables=*/a.keys_in_lanes);
}

}  // namespace xctx::cpu::impl::avx512
