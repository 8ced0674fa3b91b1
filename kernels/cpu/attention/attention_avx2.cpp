// AVX2/FMA/F16C attention pieces; entered only after cpu::has_avx2() (see attention.cpp).
// Raw pointers only: no std containers here, so no AVX2-compiled template copies can be picked
// by the linker for the portable files.
#include <immintrin.h>

#include <cmath>

#include "common/error.h"
#include "kernels/cpu/matmul/decode_rows_impl.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/simd/fast_exp_avx2.h"

namespace xctx::cpu::impl::avx2 {

namespace {

constexpr int kT = kDecodeTile;
constexpr int kSS = kT + 8;  // score row stride: a 3-key block stores 4 lanes, one past its keys
constexpr int kRowBlock = 3; // query rows sharing each loaded K/V vector (AVX2 has 16 registers)

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<uint16_t>(const uint16_t* p) { return load_f16x8(p); }

// [sum a0, sum a1, sum a2, sum a3]: hadd twice leaves per-lane sums, adding the lanes ends it.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// s[r * kSS + jj] = q_r . k_jj for r < RB, jj < n (keys at kp + jj * ld, f32 or f16). KB keys
// are loaded (converted) once per 8 dims and reused by all RB rows: RB * KB accumulators + KB
// keys + one query vector fit the 16 AVX2 registers.
template <typename T, int RB, int KB>
void scores_block(const float* q /*[RB, hd]*/, const T* kp, int64_t ld, int n, int hd, float* s /*[RB, kSS]*/) {
  static_assert(KB == 8 || KB <= 4);
  int jj = 0;
  for (; jj + KB <= n; jj += KB) {
    __m256 acc[RB][KB];
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < KB; ++b) acc[r][b] = _mm256_setzero_ps();
    const T* k0 = kp + jj * ld;
    for (int d = 0; d < hd; d += 8) {
      __m256 kv[KB];
      for (int b = 0; b < KB; ++b) kv[b] = load8(k0 + b * ld + d);
      for (int r = 0; r < RB; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * hd + d);
        for (int b = 0; b < KB; ++b) acc[r][b] = _mm256_fmadd_ps(qv, kv[b], acc[r][b]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      if constexpr (KB == 8) {
        const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][0], acc[r][1]), _mm256_hadd_ps(acc[r][2], acc[r][3]));
        const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[r][4], acc[r][5]), _mm256_hadd_ps(acc[r][6], acc[r][7]));
        _mm256_storeu_ps(s + r * kSS + jj,
                         _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
      } else {
        const __m256 z = _mm256_setzero_ps();
        _mm_storeu_ps(s + r * kSS + jj, reduce4(acc[r][0], KB > 1 ? acc[r][1] : z, KB > 2 ? acc[r][2] : z,
                                                KB > 3 ? acc[r][3] : z));
      }
    }
  }
  for (; jj < n; ++jj) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    const T* kr = kp + jj * ld;
    for (int d = 0; d < hd; d += 8) {
      const __m256 kv = load8(kr + d);
      for (int r = 0; r < RB; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * hd + d), kv, acc[r]);
    }
    for (int r = 0; r < RB; ++r) s[r * kSS + jj] = hsum8(acc[r]);
  }
}

// o_r[d0, d0 + 8 NV) = alpha_r o_r + sum_j p_r[j] v_j[d0, d0 + 8 NV) for r < RB: each V vector
// is loaded (converted) once for all RB rows, the accumulators stay in registers. o rows are vw
// wide (the value width), value rows ld apart.
template <typename T, int RB, int NV>
void pv_block(float* o /*[RB, vw]*/, int hd, const float* p /*[RB, kSS]*/, const float* alpha /*[RB]*/, const T* vp,
              int64_t ld, int n, int d0) {
  __m256 acc[RB][NV];
  for (int r = 0; r < RB; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(o + r * hd + d0 + 8 * c), a);
  }
  for (int j = 0; j < n; ++j) {
    __m256 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = load8(vp + j * ld + d0 + 8 * c);
    for (int r = 0; r < RB; ++r) {
      const __m256 pr = _mm256_set1_ps(p[r * kSS + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm256_fmadd_ps(pr, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + r * hd + d0 + 8 * c, acc[r][c]);
}

// Widest slice whose accumulators (RB x NV) plus NV values and one weight fit in registers.
template <int RB>
constexpr int kSliceVecs = RB == 1 ? 8 : RB == 2 ? 4 : 3;

// pv_block over the slice's nv (<= NV) vectors, NV fixed at compile time.
template <typename T, int RB, int NV>
void pv_slice(float* o /*[RB, vw]*/, int hd, const float* p /*[RB, kSS]*/, const float* alpha /*[RB]*/, const T* vp,
              int64_t ld, int n, int d0, int nv) {
  if constexpr (NV > 1) {
    if (nv < NV) return pv_slice<T, RB, NV - 1>(o, hd, p, alpha, vp, ld, n, d0, nv);
  }
  pv_block<T, RB, NV>(o, hd, p, alpha, vp, ld, n, d0);
}

float row_max(const float* x /*[n]*/, int64_t n) {
  __m256 m = _mm256_set1_ps(-__builtin_inff());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float r = hmax8(m);
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

float exp_sub_sum(float* x /*[n]*/, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (i < n) {
    alignas(32) float buf[8];
    for (int t = 0; t < 8; ++t) buf[t] = i + t < n ? x[i + t] - m : -__builtin_inff();
    const __m256 e = exp8(_mm256_load_ps(buf));
    acc = _mm256_add_ps(acc, e);
    _mm256_store_ps(buf, e);
    for (int64_t t = i; t < n; ++t) x[t] = buf[t - i];
  }
  return hsum8(acc);
}

void scale(float* x /*[n]*/, int64_t n, float a) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), av));
  for (; i < n; ++i) x[i] *= a;
}

void f16_to_f32(const uint16_t* src /*[n]*/, int64_t n, float* dst /*[n]*/) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_f16x8(src + i));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

// One block of RB query rows of one kv head against keys [t0, t0 + nt) of that head: scores,
// the online-softmax update of (m, l), and the rescaled P.V accumulation into o.
template <typename T, int RB>
void decode_rows(const float* q /*[RB, hd]*/, const int64_t* row_end /*[RB]*/, const T* kp, const T* vp, int64_t ld,
                 int64_t vld, int vw, int64_t t0, int nt, int hd, float* m /*[RB]*/, float* l /*[RB]*/,
                 float* o /*[RB, vw]*/, float* s /*[RB, kSS]*/) {
  int n_r[RB];
  int n_max = 0;
  for (int r = 0; r < RB; ++r) {
    n_r[r] = decode_rows::visible_in_tile(row_end[r], t0, nt);
    n_max = n_r[r] > n_max ? n_r[r] : n_max;
  }
  if (n_max == 0) return;
  scores_block<T, RB, RB == 1 ? 8 : RB == 2 ? 4 : 3>(q, kp, ld, n_max, hd, s);
  float alpha[RB];
  for (int r = 0; r < RB; ++r) {
    float* sr = s + r * kSS;
    alpha[r] = 1.0f;
    if (n_r[r] > 0) {
      const float mt = row_max(sr, n_r[r]);
      const float m_new = mt > m[r] ? mt : m[r];
      alpha[r] = std::exp(m[r] - m_new);  // 0 on a row's first visible tile (m = -inf)
      l[r] = l[r] * alpha[r] + exp_sub_sum(sr, n_r[r], m_new);
      m[r] = m_new;
    }
    for (int j = n_r[r]; j < n_max; ++j) sr[j] = 0.0f;  // masked for this row, visible to another
  }
  constexpr int NV = kSliceVecs<RB>;
  for (int d0 = 0; d0 < vw; d0 += 8 * NV) {
    const int nv = (vw - d0) / 8 < NV ? (vw - d0) / 8 : NV;
    pv_slice<T, RB, NV>(o, vw, s, alpha, vp, vld, n_max, d0, nv);
  }
}

template <typename T>
void decode_rows_any(int rb, const float* q /*[rb, hd]*/, const int64_t* row_end /*[rb]*/, const T* kp, const T* vp,
                     int64_t ld, int64_t vld, int vw, int64_t t0, int nt, int hd, float* m /*[rb]*/, float* l /*[rb]*/,
                     float* o /*[rb, vw]*/, float* s /*[rb, kSS]*/) {
  switch (rb) {
    case 1: decode_rows<T, 1>(q, row_end, kp, vp, ld, vld, vw, t0, nt, hd, m, l, o, s); break;
    case 2: decode_rows<T, 2>(q, row_end, kp, vp, ld, vld, vw, t0, nt, hd, m, l, o, s); break;
    case 3: decode_rows<T, 3>(q, row_end, kp, vp, ld, vld, vw, t0, nt, hd, m, l, o, s); break;
  }
}

const row_ops kRowOps = {f16_to_f32, row_max, exp_sub_sum, scale};

}  // namespace

const row_ops& prefill_row_ops() { return kRowOps; }

void decode_block(const decode_job& jb) {
  const int hd = jb.hd, R = jb.R;
  const int vw = jb.v_width > 0 ? jb.v_width : hd;
  const int64_t vld = jb.v_ld > 0 ? jb.v_ld : jb.ld, vstride = jb.v_head_stride >= 0 ? jb.v_head_stride : hd;
  XCTX_ASSERT(hd % 8 == 0 && vw % 8 == 0, "avx2 decode needs head_dim and value width % 8 == 0, got ", hd, ", ", vw);
  XCTX_ASSERT((vw == hd && vld == jb.ld && vstride == hd) || jb.type == kv_dtype::kv_f32,
              "avx2 decode: a value layout unlike the keys' needs f32 values");
  float* s = jb.scratch;          // [kRowBlock, kSS] scores, then probabilities
  float* m = s + kRowBlock * kSS;  // [R] running max
  float* l = m + R;                // [R] running sum
  const int64_t j_end = decode_rows::start(jb, vw, m, l);
  const size_t elt = jb.type == kv_dtype::kv_f16 ? 2 : 4;
  const int rows_per_head = R / jb.n_kvh;
  // Tile-major over all heads: the item walks its slab of the cache once, front to back.
  for (int64_t t0 = jb.j0; t0 < j_end; t0 += kT) {
    const int nt = (int)(j_end - t0 < kT ? j_end - t0 : kT);
    const int n_next = (int)(j_end - t0 - nt < kT ? j_end - t0 - nt : kT);
    for (int h = 0; h < jb.n_kvh; ++h) {
      const char* kb = (const char*)jb.k + (t0 * jb.ld + (int64_t)h * hd) * elt;
      const char* vb = (const char*)jb.v + (t0 * vld + (int64_t)h * vstride) * elt;
      // The next tile of this head is requested now, so it is in cache when its turn comes.
      decode_rows::prefetch_next(kb, (size_t)jb.ld * elt, (size_t)hd * elt, vb, (size_t)vld * elt, (size_t)vw * elt, nt,
                                 n_next);
      for (int r0 = h * rows_per_head; r0 < (h + 1) * rows_per_head; r0 += kRowBlock) {
        const int rb = (h + 1) * rows_per_head - r0 < kRowBlock ? (h + 1) * rows_per_head - r0 : kRowBlock;
        switch (jb.type) {
          case kv_dtype::kv_f32:
            decode_rows_any<float>(rb, jb.q + r0 * hd, jb.row_end + r0, (const float*)kb, (const float*)vb, jb.ld, vld,
                                   vw, t0, nt, hd, m + r0, l + r0, jb.o + (int64_t)r0 * vw, s);
            break;
          case kv_dtype::kv_f16:
            decode_rows_any<uint16_t>(rb, jb.q + r0 * hd, jb.row_end + r0, (const uint16_t*)kb, (const uint16_t*)vb,
                                      jb.ld, vld, vw, t0, nt, hd, m + r0, l + r0, jb.o + (int64_t)r0 * vw, s);
            break;
        }
      }
    }
  }
  decode_rows::finish(jb, vw, m, l);
}

void merge_row(const float* parts, int64_t part_stride, const float* coef /*[n_part]*/, int n_part, int hd,
               float* o /*[hd]*/) {
  int d = 0;
  for (; d + 8 <= hd; d += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int p = 0; p < n_part; ++p)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(coef[p]), _mm256_loadu_ps(parts + p * part_stride + d), acc);
    _mm256_storeu_ps(o + d, acc);
  }
  for (; d < hd; ++d) {
    float acc = 0.0f;
    for (int p = 0; p < n_part; ++p) acc += coef[p] * parts[p * part_stride + d];
    o[d] = acc;
  }
}

}  // namespace xctx::cpu::impl::avx2
