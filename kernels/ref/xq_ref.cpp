// Reference (scalar) kernels of the X caches: the oracles of kernels/cpu/kvq/xq.cpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/softmax_acc.h"
#include "kernels/x_quant.h"

namespace xctx::ref {
namespace {

void check_stream(const xq_stream& s, const char* what) {
  XCTX_CHECK(s.channels > 0 && s.channels % 8 == 0, "xq ", what, ": channels must be a positive multiple of 8, got ",
             s.channels);
  if (s.dense != nullptr) return;
  XCTX_CHECK(s.bits >= 1 && s.bits <= kXqMaxBits, "xq ", what, ": bits must be 1..", kXqMaxBits, ", got ", s.bits);
  XCTX_CHECK(s.group > 0, "xq ", what, ": group must be positive, got ", s.group);
  XCTX_CHECK(s.axis != xq_axis::xq_per_channel || s.nq % s.group == 0, "xq ", what, ": ", s.nq,
             " quantized rows are not whole groups of ", s.group);
}

}  // namespace

void xq_encode(const xq_encode_job& j) {
  XCTX_CHECK(j.bits >= 1 && j.bits <= kXqMaxBits, "xq_encode: bits must be 1..", kXqMaxBits, ", got ", j.bits);
  XCTX_CHECK(j.channels > 0 && j.channels % 8 == 0, "xq_encode: channels must be a positive multiple of 8, got ",
             j.channels);
  XCTX_CHECK(j.group > 0 && j.n >= 0, "xq_encode: group ", j.group, " / rows ", j.n, " invalid");
  XCTX_CHECK(j.eta >= 0.0f && j.eta < 0.5f, "xq_encode: calibration eta must be in [0, 0.5), got ", j.eta);
  XCTX_CHECK(j.n == 0 || ((j.x != nullptr) != (j.x16 != nullptr) && j.params != nullptr),
             "xq_encode: exactly one of x / x16, and params, must be given");
  const int C = j.channels, b = j.bits;
  const size_t rb = kvq_row_bytes(C, b);
  const auto in = [&](int64_t t, int c) { return xq_encode_input(j, t, c); };
  if (j.ch0 != nullptr)
    for (int64_t t = 0; t < j.n; ++t) j.ch0[t] = xq_encode_ch0(j, t);
  std::vector<uint8_t> codes((size_t)C);
  if (j.axis == xq_axis::xq_per_channel) {
    XCTX_CHECK(j.n % j.group == 0, "xq_encode: per-channel rows ", j.n, " are not whole groups of ", j.group);
    std::vector<uint8_t> all((size_t)j.group * C);  // [group, C]
    for (int64_t g = 0; g < j.n / j.group; ++g) {
      const int64_t t0 = g * j.group;
      for (int c = 0; c < C; ++c) {
        float lo = in(t0, c), hi = lo;
        for (int t = 1; t < j.group; ++t) lo = std::min(lo, in(t0 + t, c)), hi = std::max(hi, in(t0 + t, c));
        const kvq_affine p = kvq_uniform_params(lo, hi, b);
        j.params[g * C + c] = xq_calibrate(p, b, j.eta);
        for (int t = 0; t < j.group; ++t) all[(size_t)t * C + c] = kvq_uniform_encode(in(t0 + t, c), p, b);
      }
      if (j.codes == nullptr) continue;
      for (int t = 0; t < j.group; ++t)
        for (int c = 0; c < C; c += 8)
          kvq_pack8(all.data() + (size_t)t * C + c, b, j.codes + (size_t)(t0 + t) * rb + (size_t)c / 8 * b);
    }
    return;
  }
  const int n_g = (C + j.group - 1) / j.group;
  for (int64_t t = 0; t < j.n; ++t) {
    for (int g = 0; g < n_g; ++g) {
      const int c0 = g * j.group, c1 = std::min(C, c0 + j.group);
      float lo = in(t, c0), hi = lo;
      for (int c = c0 + 1; c < c1; ++c) lo = std::min(lo, in(t, c)), hi = std::max(hi, in(t, c));
      const kvq_affine p = kvq_uniform_params(lo, hi, b);
      j.params[t * n_g + g] = xq_calibrate(p, b, j.eta);
      for (int c = c0; c < c1; ++c) codes[c] = kvq_uniform_encode(in(t, c), p, b);
    }
    if (j.codes != nullptr)
      kvq_pack_row(codes.data(), C, b, j.codes + t * rb);
  }
}

void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out) {
  for (int64_t t = 0; t < nt; ++t)
    for (int c = 0; c < s.channels; ++c) out[t * s.channels + c] = xq_element(s, t0 + t, c);
}

void xq_add_projected(const float* z, const float* u, int64_t n, int r, int d, float* acc) {
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      double s = 0.0;
      for (int j = 0; j < r; ++j) s += (double)z[t * r + j] * u[(size_t)i * r + j];
      acc[t * d + i] = (float)((double)acc[t * d + i] + s);
    }
}

void xq_project(const float* x, const float* u, int64_t n, int d, int r, float* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int j = 0; j < r; ++j) {
      double s = 0.0;
      for (int i = 0; i < d; ++i) s += (double)x[t * d + i] * u[(size_t)i * r + j];
      out[t * r + j] = (float)s;
    }
}

void attention_xq(const xq_attn_args& a, bool absorb) {
  if (a.acc != nullptr) {
    with_accumulator(a, a.n_q * a.n_head, a.head_dim,
                     [absorb](const xq_attn_args& b) { attention_xq(b, absorb || b.absorb_v); });
    return;
  }
  check_stream(a.zk, "keys");
  check_stream(a.zv, "values");
  const int kv = a.n_head_kv * a.head_dim, ck = a.zk.channels, cv = a.zv.channels;
  XCTX_CHECK(a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0 && a.head_dim > 0, "attention_xq: bad heads n_head=",
             a.n_head, " n_head_kv=", a.n_head_kv);
  XCTX_CHECK((a.m_k != nullptr || ck == kv) && (a.m_v != nullptr || cv == kv), "attention_xq: identity rebuild needs ",
             kv, " channels, streams have ", ck, " / ", cv);
  const int64_t n = a.n;
  std::vector<float> zk((size_t)n * ck), zv((size_t)n * cv);
  xq_decode_rows(a.zk, 0, n, zk.data());
  xq_decode_rows(a.zv, 0, n, zv.data());
  // K and V rebuilt explicitly: [n, kv].
  std::vector<float> k((size_t)n * kv), v((size_t)n * kv);
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < kv; ++c) {
      double sk = a.b_k ? a.b_k[c] : 0.0, sv = a.b_v ? a.b_v[c] : 0.0;
      if (a.m_k)
        for (int j = 0; j < ck; ++j) sk += (double)zk[t * ck + j] * a.m_k[j * a.ld_mk + c];
      else
        sk += zk[t * ck + c];
      if (a.m_v)
        for (int j = 0; j < cv; ++j) sv += (double)zv[t * cv + j] * a.m_v[j * a.ld_mv + c];
      else
        sv += zv[t * cv + c];
      k[t * kv + c] = (float)sk, v[t * kv + c] = (float)sv;
    }
  rope(k.data(), a.pos, n, a.n_head_kv, a.rope);
  if (!absorb) {
    attn_args at;
    at.q = a.q, at.q_pos = a.q_pos, at.n_q = a.n_q;
    at.k = k.data(), at.v = v.data(), at.kv_pos = a.pos, at.n_kv = n, at.kv_type = kv_dtype::kv_f32;
    at.n_head = a.n_head, at.n_head_kv = a.n_head_kv, at.head_dim = a.head_dim, at.scale = a.scale;
    at.o = a.o, at.lse = a.lse, at.rope = a.rope, at.select = a.select;
    attention_partial(at);
    return;
  }
  // Absorbed: o = (Σ p_t z_v,t)·M_v[:, head] / Σ p_t + b_v, all in double.
  if (a.select != nullptr) check_selection(*a.select, a.n_q, a.n_head_kv, "attention_xq");
  const int hd = a.head_dim, g = a.n_head / a.n_head_kv;
  std::vector<double> s((size_t)n), u((size_t)cv), kd((size_t)hd);
  for (int64_t i = 0; i < a.n_q; ++i)
    for (int h = 0; h < a.n_head; ++h) {
      const int kvh = h / g;
      const float* q = a.q + (i * a.n_head + h) * hd;
      double m = -std::numeric_limits<double>::infinity();
      int64_t vis = 0;
      for (int64_t t = 0; t < n && a.pos[t] <= a.q_pos[i]; ++t, ++vis) {
        if (a.select != nullptr && !a.select->sees(i, kvh, attn_unit_of(a.pos[t]))) {  // retrieval: not selected
          s[t] = -std::numeric_limits<double>::infinity();
          continue;
        }
        for (int e = 0; e < hd; ++e) kd[e] = k[t * kv + kvh * hd + e];
        s[t] = rope_score(q, kd.data(), a.rope, a.q_pos[i], a.pos[t]) * a.scale;
        m = std::max(m, s[t]);
      }
      float* o = a.o + (i * a.n_head + h) * hd;
      if (m == -std::numeric_limits<double>::infinity()) {
        std::fill(o, o + hd, 0.0f);
        a.lse[i * a.n_head + h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double l = 0.0;
      std::fill(u.begin(), u.end(), 0.0);
      for (int64_t t = 0; t < vis; ++t) {
        const double p = std::exp(s[t] - m);
        l += p;
        for (int j = 0; j < cv; ++j) u[j] += p * zv[t * cv + j];
      }
      for (int e = 0; e < hd; ++e) {
        const int c = kvh * hd + e;
        double acc = 0.0;
        if (a.m_v)
          for (int j = 0; j < cv; ++j) acc += u[j] * a.m_v[j * a.ld_mv + c];
        else
          acc = u[c];
        o[e] = (float)(acc / l + (a.b_v ? a.b_v[c] : 0.0));
      }
      a.lse[i * a.n_head + h] = (float)(m + std::log(l));
    }
}

}  // namespace xctx::ref
