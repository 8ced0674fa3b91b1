// CPU attention: dispatch, the decode (split-K, flash-decoding style) and prefill (BLAS tiles)
// drivers, the scalar fallbacks, and merge_partials. AVX2 bodies live in attention_avx2.cpp.
//
// OpenBLAS threading: the sgemm calls run inside our own OpenMP region, one tile per thread.
// The Debian OpenBLAS is the pthreads build, whose own pool would otherwise split each (large
// enough) tile again from every OpenMP thread at once. We pin it to one thread for the region
// and restore the caller's setting afterwards. Measured on the 2-core dev VM (causal prefill,
// 9/3 heads, hd 64, n = 512 / 2048): pinned 52 / 84 GFLOP/s; OpenBLAS left at 2 threads inside
// the region 11 / 20 (and as low as 4 when the machine was busy) — oversubscription.
#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/cpu/attention/attention_units.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/attention/rope_tile.h"

namespace xctx::cpu {
namespace impl {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// kDecodeMaxQueries (elementwise_attention_impl.h): measured single-threaded on 4096 f16 keys,
// 9/3 heads: the decode kernel costs ~125 us per query at any n_q <= 64, the BLAS tiles 630 us at
// n_q = 1 and 110-190 us per query from 16 on, so the switch point is not sharp; BLAS tiles also
// skip whole masked tiles in causal prefill.
// Shortest kv chunk one decode work item streams: below this, per-item set-up and the final
// merge cost more than the extra parallelism returns.
constexpr int64_t kDecodeMinChunk = 256;

size_t kv_elt_bytes(kv_dtype t) {
  switch (t) {
    case kv_dtype::kv_f32: return 4;
    case kv_dtype::kv_f16: return 2;
  }
  return 4;
}

// ---- scalar fallbacks ----------------------------------------------------------------------

void f16_to_f32_scalar(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}
float max_scalar(const float* x, int64_t n) {
  float m = kNegInf;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}
float exp_sub_sum_scalar(float* x, int64_t n, float m) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += (x[i] = std::exp(x[i] - m));
  return s;
}
void scale_scalar(float* x, int64_t n, float a) {
  for (int64_t i = 0; i < n; ++i) x[i] *= a;
}
const row_ops kScalarRowOps = {f16_to_f32_scalar, max_scalar, exp_sub_sum_scalar, scale_scalar};

void decode_block_scalar(const decode_job& jb) {
  const int hd = jb.hd, R = jb.R, T = kDecodeTile;
  const int vw = jb.v_width > 0 ? jb.v_width : hd;
  const int64_t vld = jb.v_ld > 0 ? jb.v_ld : jb.ld, vstride = jb.v_head_stride >= 0 ? jb.v_head_stride : hd;
  XCTX_ASSERT((vw == hd && vld == jb.ld && vstride == hd) || jb.type == kv_dtype::kv_f32,
              "decode: a value layout unlike the keys' needs f32 values");
  float* kt = jb.scratch;
  float* vt = kt + (int64_t)T * hd;
  float* s = vt + (int64_t)T * hd;
  float* m = s + T;
  float* l = m + R;
  int64_t j_end = jb.j0;
  for (int r = 0; r < R; ++r) {
    m[r] = kNegInf, l[r] = 0.0f;
    std::fill(jb.o + (int64_t)r * vw, jb.o + (int64_t)(r + 1) * vw, 0.0f);
    j_end = std::max(j_end, std::min(jb.row_end[r], jb.j1));
  }
  const size_t elt = kv_elt_bytes(jb.type);
  const int rows_per_head = R / jb.n_kvh;
  for (int64_t t0 = jb.j0; t0 < j_end; t0 += T) {
    const int nt = (int)std::min<int64_t>(T, j_end - t0);
    for (int h = 0; h < jb.n_kvh; ++h) {
      const char* kb = (const char*)jb.k + (t0 * jb.ld + (int64_t)h * hd) * elt;
      const char* vb = (const char*)jb.v + (t0 * vld + (int64_t)h * vstride) * elt;
      const float *kp = (const float*)kb, *vp = (const float*)vb;
      int64_t ldk = jb.ld, ldv = vld;
      switch (jb.type) {
        case kv_dtype::kv_f32: break;
        case kv_dtype::kv_f16:
          for (int j = 0; j < nt; ++j) {
            f16_to_f32_scalar((const uint16_t*)kb + j * jb.ld, hd, kt + (int64_t)j * hd);
            f16_to_f32_scalar((const uint16_t*)vb + j * jb.ld, hd, vt + (int64_t)j * hd);
          }
          kp = kt, vp = vt, ldk = hd, ldv = hd;
          break;
      }
      for (int r = h * rows_per_head; r < (h + 1) * rows_per_head; ++r) {
        const int n = (int)std::min<int64_t>(nt, jb.row_end[r] - t0);
        if (n <= 0) continue;
        const float* q = jb.q + (int64_t)r * hd;
        for (int j = 0; j < n; ++j) {
          float acc = 0.0f;
          for (int d = 0; d < hd; ++d) acc += q[d] * kp[j * ldk + d];
          s[j] = acc;
        }
        const float m_new = std::max(m[r], max_scalar(s, n));
        const float alpha = std::exp(m[r] - m_new);
        l[r] = l[r] * alpha + exp_sub_sum_scalar(s, n, m_new);
        m[r] = m_new;
        float* o = jb.o + (int64_t)r * vw;
        for (int d = 0; d < vw; ++d) o[d] *= alpha;
        for (int j = 0; j < n; ++j)
          for (int d = 0; d < vw; ++d) o[d] += s[j] * vp[j * ldv + d];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (l[r] == 0.0f) {
      jb.lse[r] = kNegInf;
      continue;
    }
    scale_scalar(jb.o + (int64_t)r * vw, vw, 1.0f / l[r]);
    jb.lse[r] = m[r] + std::log(l[r]);
  }
}

void merge_row_scalar(const float* parts, int64_t part_stride, const float* coef, int n_part, int hd, float* o) {
  for (int d = 0; d < hd; ++d) {
    float acc = 0.0f;
    for (int p = 0; p < n_part; ++p) acc += coef[p] * parts[p * part_stride + d];
    o[d] = acc;
  }
}

// ---- drivers -------------------------------------------------------------------------------

// Where a work item's rows go: straight into a.o / a.lse, or into part `c` of the split buffers.
struct out_target {
  float* o;    // [n_q, n_head, head_dim]
  float* lse;  // [n_q, n_head]
};

// Keys [j0, j1) of every kv head, split into chunks that become separate work items (each its
// own partial) when the natural work items are too few to keep the threads busy.
struct kv_split {
  int64_t n_chunk = 1;
  int64_t chunk_len = 0;
};
kv_split plan_split(int64_t kv_len, int64_t n_items, int64_t min_chunk, int64_t align) {
  kv_split sp;
  const int64_t threads = omp_get_max_threads();
  // ~4 items per thread balance uneven chunks; one thread gains nothing from splitting.
  const int64_t want = threads == 1 ? 1 : (4 * threads + n_items - 1) / n_items;
  const int64_t most = std::max<int64_t>(1, kv_len / min_chunk);
  sp.n_chunk = std::clamp<int64_t>(want, 1, most);
  sp.chunk_len = (kv_len + sp.n_chunk - 1) / sp.n_chunk;
  sp.chunk_len = (sp.chunk_len + align - 1) / align * align;
  sp.n_chunk = std::max<int64_t>(1, (kv_len + sp.chunk_len - 1) / sp.chunk_len);
  return sp;
}

void attention_decode(isa v, const attn_args& a, const std::vector<int64_t>& q_end, int64_t kv_len) {
  const int g = a.n_head / a.n_head_kv, hd = a.head_dim;
  const int R = (int)(a.n_q * a.n_head);
  const int64_t n_row = a.n_q * a.n_head;
  // Work items are chunks of tokens covering every kv head: each streams one contiguous slab.
  const kv_split sp = plan_split(kv_len, 1, kDecodeMinChunk, kDecodeTile);
  std::vector<float> o_parts, lse_parts;  // [n_chunk, n_row, hd], [n_chunk, n_row]
  if (sp.n_chunk > 1) {
    o_parts.resize((size_t)(sp.n_chunk * n_row * hd));
    lse_parts.resize((size_t)(sp.n_chunk * n_row));
  }
  // Rows ordered by kv head: r = (kvh * n_q + i) * g + u is query i of head kvh * g + u.
  std::vector<float> qs((size_t)R * hd);  // [R, hd]
  std::vector<int64_t> row_end((size_t)R);  // [R]
  std::vector<int64_t> row_of((size_t)R);   // [R] -> row of o / lse
  for (int kvh = 0; kvh < a.n_head_kv; ++kvh)
    for (int64_t i = 0; i < a.n_q; ++i)
      for (int u = 0; u < g; ++u) {
        const int64_t r = ((int64_t)kvh * a.n_q + i) * g + u;
        row_of[r] = i * a.n_head + (int64_t)kvh * g + u;
        const float* q = a.q + row_of[r] * hd;
        for (int d = 0; d < hd; ++d) qs[r * hd + d] = q[d] * a.scale;
        row_end[r] = q_end[i];
      }
  const bool use_avx2 = v == isa::isa_avx2 && hd % 8 == 0;
  const bool parallel = (int64_t)R * kv_len * hd >= (1 << 16) && sp.n_chunk > 1;
#pragma omp parallel if (parallel)
  {
    std::vector<float> o_tmp((size_t)R * hd), lse_tmp((size_t)R);  // [R, hd], [R]
    std::vector<float> scratch((size_t)decode_scratch_floats(R, hd));
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < sp.n_chunk; ++c) {
      decode_job jb;
      jb.q = qs.data(), jb.row_end = row_end.data(), jb.R = R, jb.n_kvh = a.n_head_kv, jb.hd = hd;
      jb.k = a.k, jb.v = a.v, jb.type = a.kv_type, jb.ld = (int64_t)a.n_head_kv * hd;
      jb.j0 = c * sp.chunk_len, jb.j1 = std::min(kv_len, (c + 1) * sp.chunk_len);
      jb.o = o_tmp.data(), jb.lse = lse_tmp.data(), jb.scratch = scratch.data();
      if (use_avx2)
        avx2::decode_block(jb);
      else
        decode_block_scalar(jb);
      const out_target dst = sp.n_chunk == 1 ? out_target{a.o, a.lse}
                                             : out_target{o_parts.data() + c * n_row * hd, lse_parts.data() + c * n_row};
      for (int r = 0; r < R; ++r) {
        std::copy(o_tmp.begin() + (int64_t)r * hd, o_tmp.begin() + (int64_t)(r + 1) * hd, dst.o + row_of[r] * hd);
        dst.lse[row_of[r]] = lse_tmp[r];
      }
    }
  }
  if (sp.n_chunk > 1) merge_partials(v, o_parts.data(), lse_parts.data(), (int)sp.n_chunk, n_row, hd, a.o, a.lse);
}

void attention_prefill(isa v, const attn_args& a, const std::vector<int64_t>& q_end, int64_t kv_len) {
  const int g = a.n_head / a.n_head_kv, hd = a.head_dim;
  const int BQ = kPrefillQTile, BK = kPrefillKTile;
  const int64_t n_row = a.n_q * a.n_head;
  const int64_t n_qt = (a.n_q + BQ - 1) / BQ;
  const kv_split sp = plan_split(kv_len, n_qt * a.n_head_kv, 2 * BK, BK);
  std::vector<float> o_parts, lse_parts;  // [n_chunk, n_row, hd], [n_chunk, n_row]
  if (sp.n_chunk > 1) {
    o_parts.resize((size_t)(sp.n_chunk * n_row * hd));
    lse_parts.resize((size_t)(sp.n_chunk * n_row));
  }
  const row_ops& ops = v == isa::isa_avx2 ? avx2::prefill_row_ops() : kScalarRowOps;
  const size_t elt = kv_elt_bytes(a.kv_type);
  const int64_t ld = (int64_t)a.n_head_kv * hd;
  const int64_t n_item = n_qt * a.n_head_kv * sp.n_chunk;
  const int M_max = g * BQ;

  // Small calls (short chunks, few queries) finish before a second thread would have started.
  const bool parallel = n_item > 1 && a.n_q * a.n_head * kv_len * hd >= (1 << 20);
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
#pragma omp parallel if (parallel)
  {
    std::vector<float> qp((size_t)M_max * hd), op((size_t)M_max * hd);  // [M, hd]
    std::vector<float> s((size_t)M_max * BK);                           // [M, BK] scores, then P
    std::vector<float> kc((size_t)BK * hd), vc((size_t)BK * hd);         // [BK, hd] converted f16 tiles
    std::vector<float> m((size_t)M_max), l((size_t)M_max);
    std::vector<int64_t> row_end((size_t)M_max);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_item; ++it) {
      const int64_t c = it % sp.n_chunk;
      const int kvh = (int)((it / sp.n_chunk) % a.n_head_kv);
      const int64_t i0 = (it / sp.n_chunk / a.n_head_kv) * BQ;
      const int nq = (int)std::min<int64_t>(BQ, a.n_q - i0);
      const int M = g * nq;
      // Row rr = u * nq + ii holds query i0 + ii of head kvh * g + u, pre-scaled.
      int64_t hi_end = 0;
      for (int u = 0; u < g; ++u)
        for (int ii = 0; ii < nq; ++ii) {
          const int rr = u * nq + ii;
          const float* q = a.q + ((i0 + ii) * a.n_head + (int64_t)kvh * g + u) * hd;
          for (int d = 0; d < hd; ++d) qp[(size_t)rr * hd + d] = q[d] * a.scale;
          row_end[rr] = q_end[i0 + ii];
          hi_end = std::max(hi_end, row_end[rr]);
        }
      std::fill(m.begin(), m.begin() + M, kNegInf);
      std::fill(l.begin(), l.begin() + M, 0.0f);
      std::fill(op.begin(), op.begin() + (size_t)M * hd, 0.0f);
      const int64_t j0 = c * sp.chunk_len, j1 = std::min(hi_end, (c + 1) * sp.chunk_len);
      // Key tiles at or beyond every row's end are skipped: causal masks are prefixes.
      for (int64_t t0 = j0; t0 < j1; t0 += BK) {
        const int nk = (int)std::min<int64_t>(BK, j1 - t0);
        const char* kb = (const char*)a.k + ((size_t)t0 * ld + (size_t)kvh * hd) * elt;
        const char* vb = (const char*)a.v + ((size_t)t0 * ld + (size_t)kvh * hd) * elt;
        const float *kp = (const float*)kb, *vp = (const float*)vb;
        int ldk = (int)ld;
        switch (a.kv_type) {
          case kv_dtype::kv_f32: break;
          case kv_dtype::kv_f16:
            for (int j = 0; j < nk; ++j) {
              ops.f16_to_f32((const uint16_t*)kb + j * ld, hd, kc.data() + (size_t)j * hd);
              ops.f16_to_f32((const uint16_t*)vb + j * ld, hd, vc.data() + (size_t)j * hd);
            }
            kp = kc.data(), vp = vc.data(), ldk = hd;
            break;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, nk, hd, 1.0f, qp.data(), hd, kp, ldk, 0.0f, s.data(),
                    BK);
        for (int rr = 0; rr < M; ++rr) {
          float* srow = s.data() + (size_t)rr * BK;
          const int vis = (int)std::clamp<int64_t>(row_end[rr] - t0, 0, nk);
          if (vis == 0) {  // this row sees none of the tile: P = 0, state unchanged
            std::fill(srow, srow + nk, 0.0f);
            continue;
          }
          const float m_new = std::max(m[rr], ops.max(srow, vis));
          const float alpha = std::exp(m[rr] - m_new);
          l[rr] = l[rr] * alpha + ops.exp_sub_sum(srow, vis, m_new);
          std::fill(srow + vis, srow + nk, 0.0f);
          m[rr] = m_new;
          if (alpha != 1.0f) ops.scale(op.data() + (size_t)rr * hd, hd, alpha);
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, hd, nk, 1.0f, s.data(), BK, vp, ldk, 1.0f, op.data(),
                    hd);
      }
      const out_target dst = sp.n_chunk == 1 ? out_target{a.o, a.lse}
                                             : out_target{o_parts.data() + c * n_row * hd, lse_parts.data() + c * n_row};
      for (int u = 0; u < g; ++u)
        for (int ii = 0; ii < nq; ++ii) {
          const int rr = u * nq + ii;
          const int64_t row = (i0 + ii) * a.n_head + (int64_t)kvh * g + u;
          float* o = dst.o + row * hd;
          if (l[rr] == 0.0f) {
            std::fill(o, o + hd, 0.0f);
            dst.lse[row] = kNegInf;
            continue;
          }
          const float inv = 1.0f / l[rr];
          for (int d = 0; d < hd; ++d) o[d] = op[(size_t)rr * hd + d] * inv;
          dst.lse[row] = m[rr] + std::log(l[rr]);
        }
    }
  }
  openblas_set_num_threads(blas_threads);
  if (sp.n_chunk > 1) merge_partials(v, o_parts.data(), lse_parts.data(), (int)sp.n_chunk, n_row, hd, a.o, a.lse);
}

// Rows per kv head from which the AVX-512 kernel takes a job: its key transpose per tile is
// shared by the head's rows (the unit path's blocked queries have kQueryBlock x g of them; a
// decode step g). Measured (bench_attention BM_units_rows, one 256-key unit, hd 64, f16, Xeon
// Ice Lake, 2026-11-30): 3 rows per head 1.4x slower than AVX2, 6 even, 12 1.05-1.3x faster,
// 48 1.3x faster.
constexpr int kAvx512MinRowsPerHead = 12;

}  // namespace

void decode_block(isa v, const decode_job& jb) {
  if (v == isa::isa_avx2 && jb.hd % 8 == 0 && (jb.v_width <= 0 || jb.v_width % 8 == 0)) {
    if (jb.n_kvh > 0 && jb.R / jb.n_kvh >= kAvx512MinRowsPerHead && has_avx512() && jb.avx512_rows &&
        avx512::decode_block_supported(jb))
      avx512::decode_block(jb);
    else
      avx2::decode_block(jb);
  } else {
    decode_block_scalar(jb);
  }
}

// Plain caches need no decoding: a unit is a window of the cache itself.
class plain_loader final : public unit_loader {
 public:
  explicit plain_loader(const attn_args& a) : a_(a), ld_((int64_t)a.n_head_kv * a.head_dim) {}
  unit_kv load(int64_t s0, int, float*, float*) override {
    const size_t off = (size_t)(s0 * ld_) * kv_elt_bytes(a_.kv_type);
    return unit_kv{(const char*)a_.k + off, (const char*)a_.v + off, a_.kv_type, ld_};
  }
  // Post-RoPE keys turned from p to floor(p / G): f32 copies of K (turned) and V.
  unit_kv load_grouped(int64_t s0, int n, float* kbuf, float* vbuf) override {
    const size_t elems = (size_t)n * ld_;
    const size_t off = (size_t)(s0 * ld_);
    to_f32((const char*)a_.k, off, elems, kbuf);
    to_f32((const char*)a_.v, off, elems, vbuf);
    const impl::rope_table& tab = impl::rope_table_for(a_.rope);
    int32_t turn[impl::kRopeTile];
    for (int h = 0; h < n; h += impl::kRopeTile) {
      const int nt = std::min(impl::kRopeTile, n - h);
      for (int j = 0; j < nt; ++j) {
        const int64_t p = a_.kv_pos[s0 + h + j];
        turn[j] = (int32_t)(self_extend_key_pos(a_.rope, p) - p);
      }
      impl::rope_tile(impl::best_isa(), kbuf + (size_t)h * ld_, turn, nt, a_.n_head_kv, tab, cur_);
    }
    return unit_kv{kbuf, vbuf, kv_dtype::kv_f32, ld_};
  }
  // The first decode tile of the next unit into L2, so the stream does not stall at unit seams.
  void prefetch(int64_t s0, int n) override {
    const size_t elt = kv_elt_bytes(a_.kv_type);
    const size_t bytes = (size_t)std::min(n, kDecodeTile) * (size_t)ld_ * elt;
    const char* k = (const char*)a_.k + (size_t)(s0 * ld_) * elt;
    const char* v = (const char*)a_.v + (size_t)(s0 * ld_) * elt;
    for (size_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(k + b, _MM_HINT_T1);
      _mm_prefetch(v + b, _MM_HINT_T1);
    }
  }

 private:
  void to_f32(const char* base, size_t off, size_t elems, float* dst) const {
    if (a_.kv_type == kv_dtype::kv_f32) {
      std::copy((const float*)base + off, (const float*)base + off + elems, dst);
    } else {  // the grouped side converts every far key and value of every decode step: SIMD
      const row_ops& ops = impl::best_isa() == isa::isa_avx2 ? avx2::prefill_row_ops() : kScalarRowOps;
      ops.f16_to_f32((const uint16_t*)base + off, (int64_t)elems, dst);
    }
  }
  const attn_args& a_;
  int64_t ld_;
  impl::rope_cursor cur_;
};

int64_t visible_prefixes(const int32_t* q_pos, int64_t n_q, const int32_t* kv_pos, int64_t n_kv, int n_head,
                         int head_dim, float* o, float* lse, std::vector<int64_t>& q_end) {
  q_end.assign((size_t)n_q, 0);
  int64_t longest = 0;
  for (int64_t i = 0; i < n_q; ++i) {
    q_end[i] = std::upper_bound(kv_pos, kv_pos + n_kv, q_pos[i]) - kv_pos;
    longest = std::max(longest, q_end[i]);
  }
  if (longest == 0) {
    std::fill(o, o + n_q * n_head * head_dim, 0.0f);
    std::fill(lse, lse + n_q * n_head, kNegInf);
  }
  return longest;
}

void attention_partial(isa v, const attn_args& a) { attention_partial(v, a, attention_switches{}); }

void attention_partial(isa v, const attn_args& a, const attention_switches& s) {
  if (a.acc != nullptr) {
    unit_queries qs{a.q, a.q_pos, a.n_q, a.n_head, a.n_head_kv, a.head_dim, a.scale, &a.rope, a.select};
    qs.avx512_rows = s.avx512_rows;
    attend_units(qs, a.kv_pos, a.n_kv, [&] { return std::make_unique<plain_loader>(a); }, *a.acc);
    return;
  }
  if (self_extend_on(a.rope) || a.select != nullptr)
    return attend_via_accumulator(a, a.n_q * a.n_head, a.head_dim,
                                  [&](const attn_args& b) { attention_partial(v, b, s); });
  XCTX_CHECK(a.n_q >= 0 && a.n_kv >= 0, "attention: negative sizes n_q=", a.n_q, " n_kv=", a.n_kv);
  XCTX_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0,
             "attention: n_head=", a.n_head, " must be a positive multiple of n_head_kv=", a.n_head_kv);
  XCTX_CHECK(a.head_dim > 0, "attention: head_dim must be positive, got ", a.head_dim);
  for (int64_t j = 1; j < a.n_kv; ++j)
    XCTX_CHECK(a.kv_pos[j - 1] <= a.kv_pos[j], "attention: kv_pos must be non-decreasing, kv_pos[", j - 1,
               "]=", a.kv_pos[j - 1], " > kv_pos[", j, "]=", a.kv_pos[j]);
  if (a.n_q == 0) return;
  std::vector<int64_t> q_end;  // [n_q]
  const int64_t kv_len = visible_prefixes(a.q_pos, a.n_q, a.kv_pos, a.n_kv, a.n_head, a.head_dim, a.o, a.lse, q_end);
  if (kv_len == 0) return;
  if (a.n_q <= kDecodeMaxQueries)
    attention_decode(v, a, q_end, kv_len);
  else
    attention_prefill(v, a, q_end, kv_len);
}

void merge_partials(isa v, const float* o_parts /*[n_part, n_row, head_dim]*/, const float* lse_parts /*[n_part, n_row]*/,
                    int n_part, int64_t n_row, int head_dim, float* o /*[n_row, head_dim]*/, float* lse /*[n_row]*/) {
  XCTX_CHECK(n_part > 0, "merge_partials: need at least one part, got ", n_part);
  XCTX_CHECK(head_dim > 0 && n_row >= 0, "merge_partials: bad shape n_row=", n_row, " head_dim=", head_dim);
  const int64_t stride = n_row * head_dim;
#pragma omp parallel if (n_row * head_dim * n_part >= (1 << 16))
  {
    std::vector<float> coef((size_t)n_part);  // [n_part]
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_row; ++r) {
      float mx = kNegInf;
      for (int p = 0; p < n_part; ++p) mx = std::max(mx, lse_parts[p * n_row + r]);
      if (mx == kNegInf) {
        std::fill(o + r * head_dim, o + (r + 1) * head_dim, 0.0f);
        lse[r] = kNegInf;
        continue;
      }
      // Shifting by the largest lse keeps every weight in (0, 1] whatever the magnitudes.
      float sum = 0.0f;
      for (int p = 0; p < n_part; ++p) sum += (coef[p] = std::exp(lse_parts[p * n_row + r] - mx));
      const float inv = 1.0f / sum;
      for (int p = 0; p < n_part; ++p) coef[p] *= inv;
      switch (v) {
        case isa::isa_avx2: avx2::merge_row(o_parts + r * head_dim, stride, coef.data(), n_part, head_dim, o + r * head_dim); break;
        case isa::isa_scalar: merge_row_scalar(o_parts + r * head_dim, stride, coef.data(), n_part, head_dim, o + r * head_dim); break;
      }
      lse[r] = mx + std::log(sum);
    }
  }
}

streamed_attention::streamed_attention(isa v, const attn_args& queries) : isa_(v), a_(queries) {
  n_row_ = a_.n_q * a_.n_head;
  o_parts_.assign((size_t)(2 * n_row_ * a_.head_dim), 0.0f);
  lse_parts_.assign((size_t)(2 * n_row_), kNegInf);
}

void streamed_attention::add(const float* k, const float* v, const int32_t* kv_pos, int64_t n_kv) {
  attn_args t = a_;
  t.k = k, t.v = v, t.kv_pos = kv_pos, t.n_kv = n_kv, t.kv_type = kv_dtype::kv_f32;
  t.o = o_parts_.data() + n_row_ * a_.head_dim, t.lse = lse_parts_.data() + n_row_;
  attention_partial(isa_, t);
  merge_partials(isa_, o_parts_.data(), lse_parts_.data(), 2, n_row_, a_.head_dim, o_parts_.data(), lse_parts_.data());
}

void streamed_attention::finish(float* o, float* lse) const {
  std::copy(o_parts_.begin(), o_parts_.begin() + n_row_ * a_.head_dim, o);
  std::copy(lse_parts_.begin(), lse_parts_.begin() + n_row_, lse);
}

}  // namespace impl

void attention_partial(const attn_args& a) { impl::attention_partial(impl::best_isa(), a); }
void attention_partial(const attn_args& a, const attention_switches& s) {
  impl::attention_partial(impl::best_isa(), a, s);
}
void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim, float* o,
                    float* lse) {
  impl::merge_partials(impl::best_isa(), o_parts, lse_parts, n_part, n_row, head_dim, o, lse);
}

}  // namespace xctx::cpu
