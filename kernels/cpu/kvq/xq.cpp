// CPU kernels of the X caches (contracts in kernels/x_quant.h): the encoder (OpenMP over
// independent rows / groups, codes identical to ref::xq_encode because each piece is encoded by
// the same scalar code) and the fused rebuild-attention.
//
// Decode (n_q <= kDecodeMaxQueries): the visible rows are split into chunks (one work item per
// thread, OpenBLAS pinned to one thread inside the region as in attention.cpp). Per tile of kTile
// rows: decode the latent tile, K = Z_k·M_k + b_k (sgemm), rotate it, scores S = Q·Kᵀ per kv head
// (sgemm), online softmax, and U += P·Z_v (sgemm) in the latent space. The chunk partials are
// merged in the latent space (a linear map commutes with the merge) and projected once by M_v.
// Prefill (more queries): blocks of kBlock rows rebuilt explicitly (K and V, sgemm) and handed to
// the BLAS-tiled attention core, merged by log-sum-exp; absorption would cost R·r per row and
// query instead of kv·r per row, which loses once R = n_q·n_head exceeds ~kv·r/(r - head_dim).
//
// With an accumulator (args.acc, the path the caches take) the same two strategies run unit by
// unit (kernels/cpu/attention/attention_units.h) with row-invariant products (cpu::gemm_rows), chosen by
// the caller's phase (args.absorb_v), so a token's result never depends on how the cache is
// split or how many queries share the call.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/attention/attention_units.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/kvq/kvq_impl.h"
#include "kernels/cpu/omp_errors.h"
#include "kernels/cpu/attention/rope_tile.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/x_quant.h"

namespace xctx::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTile = impl::kRopeTile;  // rows rebuilt at a time on the decode path
constexpr int64_t kMinChunk = 512;     // shortest run of rows one decode work item takes
constexpr int64_t kBlock = 512;        // rows rebuilt at a time on the prefill path
constexpr int kGemmRows = 64;          // rows per work item of the parallel row-invariant products

// C[n, n_out] = A[n, k]·B (+ C when beta = 1) with cpu::gemm_rows, whose rows do not depend on
// n or on their place in the call (a token's latent must not depend on its batch: the
// rank-count-invariant caches need that). OpenMP over row blocks outside parallel regions.
void gemm_fixed_rows(const float* a, int64_t n, int k, const float* b, bool b_trans, int n_out, float beta, float* c,
                     int64_t ldc) {
  const int64_t n_blk = (n + kGemmRows - 1) / kGemmRows;
  // gemm_rows packs a transposed B on every call: transpose it once here instead (the same
  // chains of FMAs, so the same bits), or each block of kGemmRows rows would pay k·n_out copies.
  std::vector<float> bt;
  if (b_trans && n_blk > 1) {
    bt.resize((size_t)k * n_out);
    for (int o = 0; o < n_out; ++o)
      for (int j = 0; j < k; ++j) bt[(size_t)j * n_out + o] = b[(size_t)o * k + j];
    b = bt.data(), b_trans = false;
  }
#pragma omp parallel for schedule(static) if (n_blk > 1 && !omp_in_parallel())
  for (int64_t blk = 0; blk < n_blk; ++blk) {
    const int64_t r0 = blk * kGemmRows;
    gemm_rows(a + r0 * k, std::min<int64_t>(kGemmRows, n - r0), k, b, b_trans, n_out, beta, c + r0 * ldc, ldc);
  }
}

// ---- stream decode --------------------------------------------------------------------------
// Rows [t0, t0 + nt) to f32, parameters converted once per group instead of per element.
void decode_rows(const xq_stream& s, int64_t t0, int nt, float* out /*[nt, C]*/, std::vector<float>& sc,
                 std::vector<float>& zc) {
  const int C = s.channels;
  if (s.dense != nullptr) {
    std::copy(s.dense + t0 * C, s.dense + (t0 + nt) * C, out);
    return;
  }
  const size_t rb = kvq_row_bytes(C, s.bits);
  const bool fast = impl::best_isa() == impl::isa::isa_avx2;
  sc.resize(C), zc.resize(C);
  int64_t cached_group = -1;
  for (int r = 0; r < nt; ++r) {
    const int64_t t = t0 + r;
    float* o = out + (size_t)r * C;
    if (t >= s.nq) {
      const uint16_t* src = s.tail + (t - s.nq) * C;
      for (int c = 0; c < C; ++c) o[c] = fp16_to_fp32(src[c]);
      continue;
    }
    if (s.axis == xq_axis::xq_per_channel) {
      const int64_t g = t / s.group;
      if (g != cached_group) {
        for (int c = 0; c < C; ++c) {
          const kvq_affine p = s.params[(size_t)g * C + c];
          sc[c] = fp16_to_fp32(p.scale), zc[c] = fp16_to_fp32(p.zero);
        }
        cached_group = g;
      }
    } else {
      const int n_g = s.n_groups_per_row();
      for (int g = 0; g < n_g; ++g) {
        const kvq_affine p = s.params[(size_t)t * n_g + g];
        const float a = fp16_to_fp32(p.scale), z = fp16_to_fp32(p.zero);
        for (int c = g * s.group; c < std::min(C, (g + 1) * s.group); ++c) sc[c] = a, zc[c] = z;
      }
    }
    const uint8_t* row = s.codes + (size_t)t * rb;
    if (fast)
      impl::avx2::affine_codes_row(row, C, s.bits, sc.data(), zc.data(), o);
    else
      for (int c = 0; c < C; ++c) o[c] = (float)kvq_get_code(row, s.bits, c) * sc[c] + zc[c];
    if (s.ch0 != nullptr) o[0] = fp16_to_fp32(s.ch0[t]);
  }
}

// Z·M (+ b) into out [nt, kv]; M null = identity (Z is already [nt, kv]).
void rebuild(const float* z, int nt, int cz, const float* m, int64_t ldm, const float* b, int kv, float* out) {
  if (m != nullptr) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nt, kv, cz, 1.0f, z, cz, m, (int)ldm, 0.0f, out, kv);
  } else {
    std::copy(z, z + (size_t)nt * kv, out);
  }
  if (b != nullptr)
    for (int t = 0; t < nt; ++t)
      for (int c = 0; c < kv; ++c) out[(size_t)t * kv + c] += b[c];
}

void check(const xq_attn_args& a) {
  const int kv = a.n_head_kv * a.head_dim;
  XCTX_CHECK(a.n_head_kv > 0 && a.head_dim > 0 && a.n_head % a.n_head_kv == 0, "attention_xq: bad heads n_head=",
             a.n_head, " n_head_kv=", a.n_head_kv, " head_dim=", a.head_dim);
  for (const xq_stream* s : {&a.zk, &a.zv}) {
    XCTX_CHECK(s->channels > 0 && s->channels % 8 == 0, "attention_xq: stream of ", s->channels, " channels");
    if (s->dense == nullptr)
      XCTX_CHECK(s->bits >= 1 && s->bits <= kXqMaxBits && s->group > 0 &&
                     (s->axis != xq_axis::xq_per_channel || s->nq % s->group == 0) && s->nq <= a.n,
                 "attention_xq: bad stream (bits ", s->bits, ", group ", s->group, ", nq ", s->nq, ", n ", a.n, ")");
  }
  XCTX_CHECK((a.m_k != nullptr || a.zk.channels == kv) && (a.m_v != nullptr || a.zv.channels == kv),
             "attention_xq: identity rebuild needs ", kv, " channels");
  XCTX_CHECK(a.rope.head_dim == a.head_dim && a.rope.n_rot <= a.head_dim && a.rope.n_rot % 2 == 0,
             "attention_xq: rope head_dim ", a.rope.head_dim, " / n_rot ", a.rope.n_rot, " do not fit ", a.head_dim);
}

void attention_decode(const xq_attn_args& a, const std::vector<int64_t>& q_end, int64_t kv_len) {
  const int hd = a.head_dim, kv = a.n_head_kv * hd, g = a.n_head / a.n_head_kv;
  const int ck = a.zk.channels, cv = a.zv.channels;
  const int nqg = (int)a.n_q * g;          // rows per kv head
  const int R = a.n_head_kv * nqg;         // r = (kvh * n_q + i) * g + u
  const impl::rope_table& tab = impl::rope_table_for(a.rope);
  std::vector<float> qs((size_t)R * hd);
  std::vector<int64_t> row_of((size_t)R), row_end((size_t)R);
  for (int kvh = 0; kvh < a.n_head_kv; ++kvh)
    for (int64_t i = 0; i < a.n_q; ++i)
      for (int u = 0; u < g; ++u) {
        const int64_t r = ((int64_t)kvh * a.n_q + i) * g + u;
        row_of[r] = i * a.n_head + (int64_t)kvh * g + u;
        for (int d = 0; d < hd; ++d) qs[r * hd + d] = a.q[row_of[r] * hd + d] * a.scale;
        row_end[r] = q_end[i];
      }
  const int64_t threads = omp_get_max_threads();
  int64_t n_chunk = std::clamp<int64_t>(threads, 1, std::max<int64_t>(1, kv_len / kMinChunk));
  int64_t chunk = (kv_len + n_chunk - 1) / n_chunk;
  chunk = (chunk + kTile - 1) / kTile * kTile;
  n_chunk = (kv_len + chunk - 1) / chunk;
  std::vector<float> m_p((size_t)n_chunk * R), l_p((size_t)n_chunk * R), u_p((size_t)n_chunk * R * cv);
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
#pragma omp parallel if (n_chunk > 1)
  {
    std::vector<float> zk((size_t)kTile * ck), zv((size_t)kTile * cv), kt((size_t)kTile * kv);
    std::vector<float> s((size_t)R * kTile), sc, zc;
    const impl::isa isa = impl::best_isa();
#pragma omp for schedule(dynamic, 1)
    for (int64_t ch = 0; ch < n_chunk; ++ch) {
      impl::rope_cursor cur;  // exact angles at the chunk's first row, then advanced tile by tile
      float* m = m_p.data() + ch * R;
      float* l = l_p.data() + ch * R;
      float* u = u_p.data() + (size_t)ch * R * cv;
      std::fill(m, m + R, kNegInf), std::fill(l, l + R, 0.0f), std::fill(u, u + (size_t)R * cv, 0.0f);
      const int64_t end = std::min(kv_len, (ch + 1) * chunk);
      for (int64_t t0 = ch * chunk; t0 < end; t0 += kTile) {
        const int nt = (int)std::min<int64_t>(kTile, end - t0);
        decode_rows(a.zk, t0, nt, zk.data(), sc, zc);
        rebuild(zk.data(), nt, ck, a.m_k, a.ld_mk, a.b_k, kv, kt.data());
        impl::rope_tile(isa, kt.data(), a.pos + t0, nt, a.n_head_kv, tab, cur);
        const float* zvp = zk.data();
        if (!a.same_stream) {
          decode_rows(a.zv, t0, nt, zv.data(), sc, zc);
          zvp = zv.data();
        }
        for (int kvh = 0; kvh < a.n_head_kv; ++kvh)  // S[rows of kvh, nt] = Q·Kᵀ
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nqg, nt, hd, 1.0f, qs.data() + (size_t)kvh * nqg * hd,
                      hd, kt.data() + kvh * hd, kv, 0.0f, s.data() + (size_t)kvh * nqg * kTile, kTile);
        for (int r = 0; r < R; ++r) {
          float* sr = s.data() + (size_t)r * kTile;
          const int vis = (int)std::clamp<int64_t>(row_end[r] - t0, 0, nt);
          float mx = m[r];
          for (int t = 0; t < vis; ++t) mx = std::max(mx, sr[t]);
          if (vis == 0 || mx == kNegInf) {
            std::fill(sr, sr + nt, 0.0f);
            continue;
          }
          const float alpha = m[r] == kNegInf ? 0.0f : std::exp(m[r] - mx);
          float sum = 0.0f;
          for (int t = 0; t < vis; ++t) sum += (sr[t] = std::exp(sr[t] - mx));
          std::fill(sr + vis, sr + nt, 0.0f);
          l[r] = l[r] * alpha + sum;
          m[r] = mx;
          if (alpha != 1.0f)
            for (int j = 0; j < cv; ++j) u[(size_t)r * cv + j] *= alpha;
        }
        // U[R, cv] += P[R, nt]·Z_v[nt, cv]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, cv, nt, 1.0f, s.data(), kTile, zvp, cv, 1.0f, u, cv);
      }
    }
  }
  openblas_set_num_threads(blas_threads);
  // Merge the chunks in the latent space, then project once per row.
  std::vector<double> ur((size_t)cv);
  for (int r = 0; r < R; ++r) {
    float M = kNegInf;
    for (int64_t ch = 0; ch < n_chunk; ++ch) M = std::max(M, m_p[ch * R + r]);
    float* o = a.o + row_of[r] * hd;
    if (M == kNegInf) {
      std::fill(o, o + hd, 0.0f);
      a.lse[row_of[r]] = kNegInf;
      continue;
    }
    double L = 0.0;
    std::fill(ur.begin(), ur.end(), 0.0);
    for (int64_t ch = 0; ch < n_chunk; ++ch) {
      if (m_p[ch * R + r] == kNegInf) continue;
      const double w = std::exp((double)m_p[ch * R + r] - M);
      L += w * l_p[ch * R + r];
      const float* uc = u_p.data() + ((size_t)ch * R + r) * cv;
      for (int j = 0; j < cv; ++j) ur[j] += w * uc[j];
    }
    const int kvh = r / nqg;
    for (int e = 0; e < hd; ++e) {
      const int c = kvh * hd + e;
      double acc = 0.0;
      if (a.m_v != nullptr)
        for (int j = 0; j < cv; ++j) acc += ur[j] * a.m_v[j * a.ld_mv + c];
      else
        acc = ur[c];
      o[e] = (float)(acc / L) + (a.b_v ? a.b_v[c] : 0.0f);
    }
    a.lse[row_of[r]] = M + (float)std::log(L);
  }
}

void attention_prefill(const xq_attn_args& a, int64_t kv_len) {
  const int hd = a.head_dim, kv = a.n_head_kv * hd, ck = a.zk.channels, cv = a.zv.channels;
  const impl::rope_table& tab = impl::rope_table_for(a.rope);
  const impl::isa v = impl::best_isa();
  std::vector<float> zk((size_t)kBlock * ck), zv((size_t)kBlock * cv), kb((size_t)kBlock * kv), vb((size_t)kBlock * kv);
  attn_args qa;
  qa.q = a.q, qa.q_pos = a.q_pos, qa.n_q = a.n_q;
  qa.n_head = a.n_head, qa.n_head_kv = a.n_head_kv, qa.head_dim = hd, qa.scale = a.scale;
  impl::streamed_attention acc(v, qa);
  for (int64_t b0 = 0; b0 < kv_len; b0 += kBlock) {
    const int nb = (int)std::min<int64_t>(kBlock, kv_len - b0);
    const int n_tiles = (nb + kTile - 1) / kTile;
#pragma omp parallel if (n_tiles > 1)
    {
      std::vector<float> sc, zc;
#pragma omp for schedule(static)
      for (int ti = 0; ti < n_tiles; ++ti) {
        const int r0 = ti * kTile, nt = std::min(kTile, nb - r0);
        decode_rows(a.zk, b0 + r0, nt, zk.data() + (size_t)r0 * ck, sc, zc);
        if (!a.same_stream) decode_rows(a.zv, b0 + r0, nt, zv.data() + (size_t)r0 * cv, sc, zc);
      }
    }
    rebuild(zk.data(), nb, ck, a.m_k, a.ld_mk, a.b_k, kv, kb.data());
    rebuild(a.same_stream ? zk.data() : zv.data(), nb, cv, a.m_v, a.ld_mv, a.b_v, kv, vb.data());
#pragma omp parallel for schedule(static) if (n_tiles > 1)
    for (int ti = 0; ti < n_tiles; ++ti) {
      const int r0 = ti * kTile;
      impl::rope_cursor cur;  // each tile from exact angles
      impl::rope_tile(impl::best_isa(), kb.data() + (size_t)r0 * kv, a.pos + b0 + r0, std::min(kTile, nb - r0),
                      a.n_head_kv, tab, cur);
    }
    acc.add(kb.data(), vb.data(), a.pos + b0, nb);
  }
  acc.finish(a.o, a.lse);
}

}  // namespace

void xq_encode(const xq_encode_job& j) {
  XCTX_CHECK(j.group > 0 && j.n >= 0, "xq_encode: group ", j.group, " / rows ", j.n, " invalid");
  const bool per_ch = j.axis == xq_axis::xq_per_channel;
  const int64_t unit = per_ch ? j.group : 1;  // rows encoded together
  const int64_t n_units = per_ch ? j.n / j.group : j.n;
  if (n_units <= 1 || (per_ch && j.n % j.group != 0)) {  // nothing to split (or let ref report the error)
    ref::xq_encode(j);
    return;
  }
  const size_t rb = kvq_row_bytes(j.channels, j.bits);
  const int64_t params_per_unit = per_ch ? j.channels : (j.channels + j.group - 1) / j.group;
  const int64_t n_piece = std::min<int64_t>(n_units, 4 * (int64_t)omp_get_max_threads());
#pragma omp parallel for schedule(static) if ((int64_t)j.n * j.channels >= 16384)
  for (int64_t p = 0; p < n_piece; ++p) {
    const int64_t u0 = n_units * p / n_piece, u1 = n_units * (p + 1) / n_piece;
    xq_encode_job sub = j;
    sub.n = (u1 - u0) * unit;
    sub.x = j.x != nullptr ? j.x + u0 * unit * j.channels : nullptr;
    sub.x16 = j.x16 != nullptr ? j.x16 + u0 * unit * j.channels : nullptr;
    sub.ch0 = j.ch0 != nullptr ? j.ch0 + u0 * unit : nullptr;
    sub.codes = j.codes ? j.codes + u0 * unit * rb : nullptr;
    sub.params = j.params + u0 * params_per_unit;
    ref::xq_encode(sub);
  }
}

void xq_add_projected(const float* z, const float* u, int64_t n, int r, int d, float* acc) {
  gemm_fixed_rows(z, n, r, u, true, d, 1.0f, acc, d);
}

void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out) {
  const int64_t n_piece = (nt + kTile - 1) / kTile;
#pragma omp parallel if (n_piece > 1 && nt * s.channels >= 65536)
  {
    std::vector<float> sc, zc;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < n_piece; ++p) {
      const int64_t r0 = p * kTile;
      decode_rows(s, t0 + r0, (int)std::min<int64_t>(kTile, nt - r0), out + r0 * s.channels, sc, zc);
    }
  }
}

void xq_project(const float* x, const float* u, int64_t n, int d, int r, float* out) {
  gemm_fixed_rows(x, n, d, u, false, r, 0.0f, out, r);
}

namespace {

// ---- unit paths (args.acc set; kernels/cpu/attention/attention_units.h) ---------------------------------

// Rows [t0, t0 + nt) of the layer rebuilt: K = Z_k·M_k + b_k rotated to its positions, and
// (unless only K is wanted) V = Z_v·M_v + b_v; or the latent Z_v kept for absorption.
struct unit_rebuilder {
  const xq_attn_args& a;
  const impl::rope_table& tab;
  int kv, ck, cv;
  std::vector<float> zk, zv, sc, zc;
  impl::rope_cursor cur;
  unit_rebuilder(const xq_attn_args& args, const impl::rope_table& t)
      : a(args), tab(t), kv(args.n_head_kv * args.head_dim), ck(args.zk.channels), cv(args.zv.channels) {
    zk.resize((size_t)kTile * ck), zv.resize((size_t)kTile * cv);
  }
  // kt: [nt, kv]; vt: [nt, kv] rebuilt V, or null; zvt: [nt, cv] latent values, or null.
  // grouped: keys rotated to SelfExtend's grouped positions floor(pos / G).
  void rows(int64_t t0, int nt, float* kt, float* vt, float* zvt, bool grouped = false) {
    int32_t gpos[kTile];
    for (int h = 0; h < nt; h += kTile) {
      const int m = std::min(kTile, nt - h);
      decode_rows(a.zk, t0 + h, m, zk.data(), sc, zc);
      rebuild_fixed(zk.data(), m, ck, a.m_k, a.ld_mk, a.b_k, kt + (size_t)h * kv);
      const int32_t* rot = a.pos + t0 + h;
      if (grouped) {
        for (int j = 0; j < m; ++j) gpos[j] = (int32_t)self_extend_key_pos(a.rope, rot[j]);
        rot = gpos;
      }
      impl::rope_tile(impl::best_isa(), kt + (size_t)h * kv, rot, m, a.n_head_kv, tab, cur);
      const float* zvp = zk.data();
      if (!a.same_stream) {
        decode_rows(a.zv, t0 + h, m, zv.data(), sc, zc);
        zvp = zv.data();
      }
      if (vt != nullptr) rebuild_fixed(zvp, m, cv, a.m_v, a.ld_mv, a.b_v, vt + (size_t)h * kv);
      if (zvt != nullptr) std::copy(zvp, zvp + (size_t)m * cv, zvt + (size_t)h * cv);
    }
  }
  // The latent rows alone: zkt [nt, ck]; zvt [nt, cv] unless null (or the streams are one).
  void latents(int64_t t0, int nt, float* zkt, float* zvt) {
    for (int h = 0; h < nt; h += kTile) {
      const int m = std::min(kTile, nt - h);
      decode_rows(a.zk, t0 + h, m, zkt + (size_t)h * ck, sc, zc);
      if (zvt == nullptr) continue;
      if (a.same_stream)
        std::copy(zkt + (size_t)h * ck, zkt + (size_t)(h + m) * ck, zvt + (size_t)h * cv);
      else
        decode_rows(a.zv, t0 + h, m, zvt + (size_t)h * cv, sc, zc);
    }
  }
  void rebuild_fixed(const float* z, int nt, int cz, const float* m, int64_t ldm, const float* b, float* out) const {
    if (m != nullptr) {
      // M is [cz, ldm] with the kv columns first: a row-invariant product over those columns.
      if (ldm == kv) {
        gemm_fixed_rows(z, nt, cz, m, false, kv, 0.0f, out, kv);
      } else {
        std::vector<float> mc((size_t)cz * kv);
        for (int j = 0; j < cz; ++j) std::copy(m + j * ldm, m + j * ldm + kv, mc.begin() + (size_t)j * kv);
        gemm_fixed_rows(z, nt, cz, mc.data(), false, kv, 0.0f, out, kv);
      }
    } else {
      std::copy(z, z + (size_t)nt * kv, out);
    }
    if (b != nullptr)
      for (int t = 0; t < nt; ++t)
        for (int c = 0; c < kv; ++c) out[(size_t)t * kv + c] += b[c];
  }
};

// Prefill: K and V rebuilt per unit, then the shared decode kernel.
class xq_unit_loader final : public unit_loader {
 public:
  xq_unit_loader(const xq_attn_args& a, const impl::rope_table& tab) : rb_(a, tab) {}
  unit_kv load(int64_t s0, int n, float* kbuf, float* vbuf) override {
    rb_.rows(s0, n, kbuf, vbuf, nullptr);
    return unit_kv{kbuf, vbuf, kv_dtype::kv_f32, rb_.kv};
  }
  unit_kv load_grouped(int64_t s0, int n, float* kbuf, float* vbuf) override {
    rb_.rows(s0, n, kbuf, vbuf, nullptr, true);
    return unit_kv{kbuf, vbuf, kv_dtype::kv_f32, rb_.kv};
  }

 private:
  unit_rebuilder rb_;
};

// SelfExtend's grouped side rotates G consecutive keys alike (floor(pos / G)), so there the keys
// can be absorbed like the values: with w = R(gp)ᵀ q (the query turned back by the run's angle),
// q · R(gp)(M_kᵀ z + b_k) = (M_k w) · z + w · b_k, one turned query of ck latent channels per head
// and run instead of a rebuilt key of kv channels per row. Per row that is ck·n_head products
// instead of ck·kv, plus n_head·hd·ck per run for the turning; taken when the runs are long enough
// to repay the turning twice over (the skinny product runs at a fraction of the rebuild's rate).
bool far_keys_absorbed(const xq_attn_args& a) {
  const int64_t kv = (int64_t)a.n_head_kv * a.head_dim;
  const int64_t run = a.rope.se_period > 0 ? 1 : a.rope.se_group;  // with a period every key turns alone
  return self_extend_on(a.rope) && a.m_k != nullptr && a.m_v != nullptr &&
         run * (kv - a.n_head) > 2 * (int64_t)a.n_head * a.head_dim;
}

// One query's grouped-side partial over unit rows [b, e) with the keys absorbed (above): zk [n, ck]
// and zv [n, cv] the unit's latents (unit-relative rows), q the grouped-side query [n_head, hd]
// times the scale, mk [n_head_kv, hd, ck] M_k's columns per kv head, transposed. Writes the
// normalised latent o [n_head, cv] and lse [n_head]. Row-invariant products only, so the partial
// is a function of the query and the unit.
struct absorbed_far_side {
  const xq_attn_args& a;
  const impl::rope_table& tab;
  const float* mk;
  int g, hd, ck, cv;
  std::vector<float> w, qt, inv_l, s, p;  // turned queries, their latents, 1/Σp, scores, weights
  absorbed_far_side(const xq_attn_args& args, const impl::rope_table& t, const float* mk_heads)
      : a(args), tab(t), mk(mk_heads), g(args.n_head / args.n_head_kv), hd(args.head_dim), ck(args.zk.channels),
        cv(args.zv.channels) {
    w.resize((size_t)a.n_head * hd), qt.resize((size_t)a.n_head * ck), inv_l.resize((size_t)a.n_head);
    s.resize((size_t)kAttnUnit * a.n_head), p.resize((size_t)a.n_head * kAttnUnit);
  }
  void attend(const float* q, const float* zk, const float* zv, int64_t s0, int64_t b, int64_t e, float* o,
              float* lse) {
    const int H = a.n_head;
    for (int64_t r0 = b; r0 < e;) {  // runs of one grouped position
      const int64_t gp = self_extend_key_pos(a.rope, a.pos[s0 + r0]);
      int64_t r1 = r0 + 1;
      while (r1 < e && self_extend_key_pos(a.rope, a.pos[s0 + r1]) == gp) ++r1;
      std::copy(q, q + (size_t)H * hd, w.begin());
      const int64_t back = -gp;
      impl::rotate_rows(impl::best_isa(), w.data(), &back, 1, H, tab);
      for (int kvh = 0; kvh < a.n_head_kv; ++kvh)  // qt[h] = M_k[:, head kvh] · w[h] (B read in place)
        gemm_rows(w.data() + (size_t)kvh * g * hd, g, hd, mk + (size_t)kvh * hd * ck, false, ck, 0.0f,
                  qt.data() + (size_t)kvh * g * ck, ck);
      gemm_rows(zk + r0 * ck, r1 - r0, ck, qt.data(), true, H, 0.0f, s.data() + r0 * H, H);  // s[t, h]
      if (a.b_k != nullptr)
        for (int h = 0; h < H; ++h) {
          const float* bk = a.b_k + (h / g) * hd;
          float bh = 0.0f;
          for (int c = 0; c < hd; ++c) bh += w[(size_t)h * hd + c] * bk[c];
          for (int64_t t = r0; t < r1; ++t) s[t * H + h] += bh;
        }
      r0 = r1;
    }
    const int64_t m = e - b;
    for (int h = 0; h < H; ++h) {
      float mx = kNegInf;
      for (int64_t t = b; t < e; ++t) mx = std::max(mx, s[t * H + h]);
      float l = 0.0f;
      for (int64_t t = b; t < e; ++t) l += (p[h * m + t - b] = std::exp(s[t * H + h] - mx));
      inv_l[h] = 1.0f / l;
      lse[h] = mx + std::log(l);
    }
    gemm_rows(p.data(), H, (int)m, zv + b * cv, false, cv, 0.0f, o, cv);  // o[h] = Σ_t p[h, t] zv[t]
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < cv; ++c) o[(size_t)h * cv + c] *= inv_l[h];
  }
};

// Decode steps: per unit, K rebuilt and rotated; V absorbed: each query head accumulates the
// normalised latent u = Σ_t p_t z_v,t / Σ_t p_t with the shared decode kernel (AVX2: the heads of
// a kv head share every key and latent load; impl::decode_job's value layout), then
// o = u·M_v[:, head] + b_v for all heads in one row-invariant product. Each (query, unit) is
// computed by the same code wherever the unit lives, and deposited exactly.
void attention_absorbed_units(const xq_attn_args& a, softmax_acc& acc, const attention_switches& sw) {
  const int hd = a.head_dim, g = a.n_head / a.n_head_kv, kv = a.n_head_kv * hd, cv = a.zv.channels;
  const int vw = a.m_v != nullptr ? cv : hd;  // values each query row accumulates
  const unit_queries qs{a.q, a.q_pos, a.n_q, a.n_head, a.n_head_kv, hd, a.scale, &a.rope, a.select};
  const query_ranges ranges(qs, a.pos, a.n);
  if (ranges.kv_len == 0) return;
  const std::vector<int64_t> ub = unit_bounds(a.pos, ranges.kv_len);
  const int64_t n_unit = (int64_t)ub.size() - 1;
  const impl::rope_table& tab = impl::rope_table_for(a.rope);
  std::vector<float> q_scaled((size_t)a.n_q * a.n_head * hd);  // [n_q, n_head, hd]
  for (size_t e = 0; e < q_scaled.size(); ++e) q_scaled[e] = a.q[e] * a.scale;
  std::vector<float> mv;  // [cv, kv] M_v's first kv columns, contiguous
  if (a.m_v != nullptr) {
    mv.resize((size_t)cv * kv);
    for (int c = 0; c < cv; ++c) std::copy(a.m_v + c * a.ld_mv, a.m_v + c * a.ld_mv + kv, mv.begin() + (size_t)c * kv);
  }
  const bool absorb_far = ranges.grouped && far_keys_absorbed(a);
  std::vector<float> mk_heads;  // [n_head_kv, hd, ck] M_k's columns per kv head, transposed, for absorb_far
  if (absorb_far) {
    const int ck = a.zk.channels;
    mk_heads.resize((size_t)ck * kv);
    for (int j = 0; j < ck; ++j)
      for (int c = 0; c < kv; ++c) mk_heads[(size_t)c * ck + j] = a.m_k[j * a.ld_mk + c];
  }
  const impl::isa isa = impl::best_isa();
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  omp_error_carrier errors;
#pragma omp parallel if (n_unit > 1)
  {
    unit_rebuilder rb(a, tab);
    std::unique_ptr<absorbed_far_side> far_side;
    std::vector<float> zk_unit;  // [unit, ck] latent keys, for absorb_far
    if (absorb_far) {
      far_side = std::make_unique<absorbed_far_side>(a, tab, mk_heads.data());
      zk_unit.resize((size_t)kAttnUnit * a.zk.channels);
    }
    // [unit, kv] keys (near side, grouped side), [unit, cv] latent values
    std::vector<float> kt((size_t)kAttnUnit * kv), kt_far(ranges.grouped && !absorb_far ? kt.size() : 0),
        zvt((size_t)kAttnUnit * cv);
    std::vector<float> ol((size_t)a.n_head * vw), lse((size_t)a.n_head), proj((size_t)a.n_head * kv), o(hd);
    std::vector<float> scratch((size_t)impl::decode_scratch_floats(a.n_head, hd));
    std::vector<int64_t> row_end((size_t)a.n_head);
    softmax_acc mine(acc.rows(), acc.width());
    // Query i's partial (ol, lse: normalised latents) projected by M_v and deposited.
    const auto deposit = [&](int64_t i, int64_t s0) {
      if (a.m_v != nullptr) gemm_rows(ol.data(), a.n_head, cv, mv.data(), false, kv, 0.0f, proj.data(), kv);
      for (int h = 0; h < a.n_head; ++h) {
        const int col0 = (h / g) * hd;
        const float* src = a.m_v != nullptr ? proj.data() + (size_t)h * kv + col0 : ol.data() + (size_t)h * hd;
        if (!ranges.head_sees(i, h / g, s0)) continue;  // per-KV-head selection: not this head's unit
        for (int c = 0; c < hd; ++c) o[c] = src[c] + (a.b_v ? a.b_v[col0 + c] : 0.0f);
        mine.add_partial(i * a.n_head + h, lse[(size_t)h], o.data());
      }
    };
    // Query i over the unit's slots [b, e) with keys k (near or grouped) and query rows qi.
    const auto run = [&](int64_t i, const float* qi, const float* k, int64_t s0, int64_t b, int64_t e) {
      if (b >= e) return;
      std::fill(row_end.begin(), row_end.end(), e);
      impl::decode_job jb;
      jb.q = qi, jb.row_end = row_end.data();
      jb.R = a.n_head, jb.n_kvh = a.n_head_kv, jb.hd = hd;
      jb.k = k, jb.v = zvt.data(), jb.type = kv_dtype::kv_f32, jb.ld = kv;
      if (a.m_v != nullptr) jb.v_width = cv, jb.v_ld = cv, jb.v_head_stride = 0;  // every head reads the latent
      jb.j0 = b, jb.j1 = e;
      jb.o = ol.data(), jb.lse = lse.data(), jb.scratch = scratch.data();
      jb.avx512_rows = sw.avx512_rows;
      impl::decode_block(isa, jb);
      deposit(i, s0);
    };
#pragma omp for schedule(dynamic, 2)
    for (int64_t un = 0; un < n_unit; ++un) {
      errors.run([&] {
        const int64_t s0 = ub[un];
        const int n = (int)(ub[un + 1] - s0);
        const bool near = ranges.any_near(s0, n), far = ranges.any_far(s0, n);
        if (near) rb.rows(s0, n, kt.data(), nullptr, zvt.data());
        if (far && absorb_far)
          rb.latents(s0, n, zk_unit.data(), near ? nullptr : zvt.data());
        else if (far)
          rb.rows(s0, n, kt_far.data(), nullptr, near ? nullptr : zvt.data(), true);
        for (int64_t i = 0; i < a.n_q; ++i) {
          const auto [nb, ne] = ranges.near(i, s0, n);
          run(i, q_scaled.data() + (size_t)i * a.n_head * hd, kt.data(), s0, nb, ne);
          if (!ranges.grouped) continue;
          const auto [fb, fe] = ranges.far(i, s0, n);
          const float* qf = ranges.q_far.data() + (size_t)i * a.n_head * hd;
          if (!absorb_far) {
            run(i, qf, kt_far.data(), s0, fb, fe);
          } else if (fb < fe) {
            far_side->attend(qf, zk_unit.data(), zvt.data(), s0, fb, fe, ol.data(), lse.data());
            deposit(i, s0);
          }
        }
      });
    }
#pragma omp critical(xctx_xq_absorbed_merge)
    errors.run([&] { acc.merge(mine); });
  }
  openblas_set_num_threads(blas_threads);
  errors.rethrow();
}

// clkv's streams are K and V themselves (no rebuild), quantized as KIVI does with key token
// groups as long as value channel groups: the quantized-KV layout (kernels/kv_quant.h, no sink,
// 1- or 2-bit codes) that the fused one-query kernel reads. False for any other streams.
bool as_kvq_layer(const xq_attn_args& a, kvq_layer_view& v) {
  const xq_stream &k = a.zk, &s = a.zv;
  if (a.m_k != nullptr || a.m_v != nullptr || a.b_k != nullptr || a.b_v != nullptr || a.same_stream) return false;
  if (k.dense != nullptr || s.dense != nullptr || k.ch0 != nullptr || s.ch0 != nullptr) return false;
  if (k.axis != xq_axis::xq_per_channel || s.axis != xq_axis::xq_per_token || k.group != s.group || k.nq != s.nq)
    return false;
  v.scheme = kvq_scheme::kvq_uniform;
  v.bits = k.bits, v.v_bits = s.bits;
  v.n_head_kv = a.n_head_kv, v.head_dim = a.head_dim, v.group = k.group;
  v.n = a.n, v.n_sink = 0, v.q_end = k.nq, v.pos = a.pos;
  v.k_tail = k.tail, v.v_tail = s.tail;
  v.k_codes = k.codes, v.v_codes = s.codes;
  v.k_group = k.params, v.v_group = s.params;
  return true;
}

// A clkv decode step through the fused one-query kernel over the quantized-KV layout (its
// rounding differs from the absorbed path's, so it is chosen by the phase, never by n_q: decode
// steps carry one query). False when the shape is not one it takes.
bool attend_decode_as_kvq(const xq_attn_args& a, const attention_switches& sw) {
  kvq_layer_view v;
  if (a.n_q != 1 || impl::best_isa() != impl::isa::isa_avx2 || !as_kvq_layer(a, v) ||
      !impl::kvq_fused_supported(v, a.n_head, a.rope.n_rot))
    return false;
  kvq_attn_args k;
  k.kv = v;
  k.q = a.q, k.q_pos = a.q_pos, k.n_q = a.n_q, k.n_head = a.n_head, k.scale = a.scale, k.rope = a.rope;
  k.acc = a.acc, k.decode_step = true, k.select = a.select;
  attention_kvq(k, sw);
  return true;
}

}  // namespace

void attention_xq(const xq_attn_args& a) { attention_xq(a, attention_switches{}); }

void attention_xq(const xq_attn_args& a, const attention_switches& sw) {
  check(a);
  if (a.acc != nullptr) {
    XCTX_CHECK(a.acc->rows() == a.n_q * a.n_head && a.acc->width() == a.head_dim, "attention_xq: accumulator of ",
               a.acc->rows(), " x ", a.acc->width(), " for ", a.n_q, " x ", a.n_head, " x ", a.head_dim);
    if (a.absorb_v) {
      if (!attend_decode_as_kvq(a, sw)) attention_absorbed_units(a, *a.acc, sw);
      return;
    }
    unit_queries qs{a.q, a.q_pos, a.n_q, a.n_head, a.n_head_kv, a.head_dim, a.scale, &a.rope, a.select};
    qs.avx512_rows = sw.avx512_rows;
    const impl::rope_table& tab = impl::rope_table_for(a.rope);
    const int blas_threads = openblas_get_num_threads();
    openblas_set_num_threads(1);
    attend_units(qs, a.pos, a.n, [&] { return std::make_unique<xq_unit_loader>(a, tab); }, *a.acc);
    openblas_set_num_threads(blas_threads);
    return;
  }
  if (self_extend_on(a.rope) || a.select != nullptr)
    return attend_via_accumulator(a, a.n_q * a.n_head, a.head_dim,
                                  [&](const xq_attn_args& b) { attention_xq(b, sw); });
  if (a.n_q == 0) return;
  std::vector<int64_t> q_end;  // [n_q]
  const int64_t kv_len = impl::visible_prefixes(a.q_pos, a.n_q, a.pos, a.n, a.n_head, a.head_dim, a.o, a.lse, q_end);
  if (kv_len == 0) return;
  if (a.n_q <= impl::kDecodeMaxQueries)
    attention_decode(a, q_end, kv_len);
  else
    attention_prefill(a, kv_len);
}

}  // namespace xctx::cpu
