// Reference (scalar, single-threaded) encoder and attention of the quantized KV cache: the
// oracles the cpu and cuda kernels are compared against. Per-element math is in kv_quant.h.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"

namespace xctx::ref {
namespace {

void check_job(const kvq_encode_job& j) {
  XCTX_CHECK(j.bits >= 2 && j.bits <= kKvqMaxBits, "kvq_encode: bits must be 2..", kKvqMaxBits, ", got ", j.bits);
  XCTX_CHECK(j.channels > 0 && j.channels % 8 == 0, "kvq_encode: channels must be a positive multiple of 8, got ",
             j.channels);
  XCTX_CHECK(j.channels <= 65536, "kvq_encode: channels ", j.channels, " exceed the 16-bit outlier index");
  XCTX_CHECK(j.n >= 0, "kvq_encode: negative row count ", j.n);
}

}  // namespace

void kvq_encode(const kvq_encode_job& job) {
  check_job(job);
  std::vector<float> widened;
  kvq_encode_job j = job;
  j.x = kvq_input_rows(job, widened);
  const int C = j.channels, bits = j.bits;
  const size_t row_bytes = kvq_row_bytes(C, bits);
  std::vector<uint8_t> codes((size_t)C);
  switch (j.tensor) {
    case kvq_tensor::kvq_uniform_keys: {
      XCTX_CHECK(j.n == j.group, "kvq_encode: uniform keys are encoded one full group at a time (n=", j.n,
                 ", group=", j.group, ")");
      std::vector<uint8_t> all((size_t)j.n * C);  // [n, C]
      for (int c = 0; c < C; ++c) {
        float lo = j.x[c], hi = j.x[c];
        for (int64_t t = 1; t < j.n; ++t) lo = std::min(lo, j.x[t * C + c]), hi = std::max(hi, j.x[t * C + c]);
        const kvq_affine p = kvq_uniform_params(lo, hi, bits);
        j.affine[c] = p;
        for (int64_t t = 0; t < j.n; ++t) all[(size_t)t * C + c] = kvq_uniform_encode(j.x[t * C + c], p, bits);
      }
      for (int64_t t = 0; t < j.n; ++t) kvq_pack_row(all.data() + (size_t)t * C, C, bits, j.codes + t * row_bytes);
      return;
    }
    case kvq_tensor::kvq_uniform_values: {
      XCTX_CHECK(j.group > 0, "kvq_encode: group must be positive, got ", j.group);
      const int n_g = (C + j.group - 1) / j.group;
      for (int64_t t = 0; t < j.n; ++t) {
        const float* x = j.x + t * C;
        for (int g = 0; g < n_g; ++g) {
          const int c0 = g * j.group, c1 = std::min(C, c0 + j.group);
          float lo = x[c0], hi = x[c0];
          for (int c = c0 + 1; c < c1; ++c) lo = std::min(lo, x[c]), hi = std::max(hi, x[c]);
          const kvq_affine p = kvq_uniform_params(lo, hi, bits);
          j.affine[t * n_g + g] = p;
          for (int c = c0; c < c1; ++c) codes[c] = kvq_uniform_encode(x[c], p, bits);
        }
        kvq_pack_row(codes.data(), C, bits, j.codes + t * row_bytes);
      }
      return;
    }
    case kvq_tensor::kvq_lut_keys: {
      const int n_lut = 1 << bits;
      for (int64_t t = 0; t < j.n; ++t) {
        const float* x = j.x + t * C;
        uint32_t n_out = 0;
        for (int c = 0; c < C; ++c) {
          codes[c] = kvq_lut_encode(kvq_normalize(x[c], j.ch_scale[c], j.ch_zero[c]), j.lut, n_lut);
          if (j.ch_lo != nullptr && (x[c] < j.ch_lo[c] || x[c] > j.ch_hi[c])) {
            j.out_idx[t * C + n_out] = (uint16_t)c;
            j.out_val[t * C + n_out] = kvq_outlier_delta(x[c], j.lut, codes[c], j.ch_scale[c], j.ch_zero[c]);
            ++n_out;
          }
        }
        if (j.out_count != nullptr) j.out_count[t] = n_out;
        kvq_pack_row(codes.data(), C, bits, j.codes + t * row_bytes);
      }
      return;
    }
    case kvq_tensor::kvq_lut_values: {
      const int n_lut = 1 << bits, side = j.v_out_side;
      XCTX_CHECK(side >= 0 && 2 * side < C, "kvq_encode: ", side, " outliers per side leave nothing of a row of ", C);
      std::vector<int> order((size_t)C);
      for (int64_t t = 0; t < j.n; ++t) {
        const float* x = j.x + t * C;
        // Full sort by (value, channel): the smallest and largest `side` are the outliers.
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int a, int b) { return x[a] < x[b] || (x[a] == x[b] && a < b); });
        const float lo = x[order[side]], hi = x[order[C - 1 - side]];
        const kvq_affine p = kvq_midrange_params(lo, hi);
        j.affine[t] = p;
        const float scale = fp16_to_fp32(p.scale), zero = fp16_to_fp32(p.zero);
        for (int c = 0; c < C; ++c) codes[c] = kvq_lut_encode(kvq_normalize(x[c], scale, zero), j.lut, n_lut);
        kvq_pack_row(codes.data(), C, bits, j.codes + t * row_bytes);
        if (side > 0) {
          std::vector<int> out(order.begin(), order.begin() + side);
          out.insert(out.end(), order.end() - side, order.end());
          std::sort(out.begin(), out.end());  // entries stored by channel
          for (int e = 0; e < 2 * side; ++e) {
            j.out_idx[t * 2 * side + e] = (uint16_t)out[e];
            j.out_val[t * 2 * side + e] = kvq_outlier_delta(x[out[e]], j.lut, codes[out[e]], scale, zero);
          }
        }
      }
      return;
    }
  }
  XCTX_ASSERT(false, "kvq_encode: bad tensor kind ", (int)j.tensor);
}

void kvq_decode_layer(const kvq_layer_view& v, float* k, float* vo) {
  const int C = v.channels();
  for (int64_t s = 0; s < v.n; ++s) {
    float* kr = k + s * C;
    float* vr = vo + s * C;
    if (s < v.n_sink || s >= v.q_end) {
      const uint16_t* ks = s < v.n_sink ? v.k_sink + s * C : v.k_tail + (s - v.q_end) * C;
      const uint16_t* vs = s < v.n_sink ? v.v_sink + s * C : v.v_tail + (s - v.q_end) * C;
      for (int c = 0; c < C; ++c) kr[c] = fp16_to_fp32(ks[c]), vr[c] = fp16_to_fp32(vs[c]);
      continue;
    }
    const int64_t i = s - v.n_sink;
    for (int c = 0; c < C; ++c) kr[c] = kvq_dense_key(v, i, c), vr[c] = kvq_dense_value(v, i, c);
    if (v.k_out_off != nullptr)
      for (uint32_t e = v.k_out_off[i]; e < v.k_out_off[i + 1]; ++e) kr[v.k_out_idx[e]] += fp16_to_fp32(v.k_out_val[e]);
    for (int e = 0; e < v.v_out_per_tok; ++e) {
      const size_t at = (size_t)i * v.v_out_per_tok + e;
      vr[v.v_out_idx[at]] += fp16_to_fp32(v.v_out_val[at]);
    }
  }
}

void attention_kvq(const kvq_attn_args& a) {
  if (a.acc != nullptr) {
    with_accumulator(a, a.n_q * a.n_head, a.kv.head_dim, [](const kvq_attn_args& b) { attention_kvq(b); });
    return;
  }
  const kvq_layer_view& v = a.kv;
  const int C = v.channels();
  std::vector<float> k((size_t)v.n * C), val((size_t)v.n * C);  // [n, C]
  kvq_decode_layer(v, k.data(), val.data());
  rope(k.data(), v.pos, v.n, v.n_head_kv, a.rope);
  attn_args at;
  at.q = a.q, at.q_pos = a.q_pos, at.n_q = a.n_q;
  at.k = k.data(), at.v = val.data(), at.kv_pos = v.pos, at.n_kv = v.n, at.kv_type = kv_dtype::kv_f32;
  at.n_head = a.n_head, at.n_head_kv = v.n_head_kv, at.head_dim = v.head_dim, at.scale = a.scale;
  at.o = a.o, at.lse = a.lse, at.rope = a.rope, at.select = a.select;
  attention_partial(at);
}

}  // namespace xctx::ref
