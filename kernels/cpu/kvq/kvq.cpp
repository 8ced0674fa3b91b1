// CPU kernels of the quantized KV cache: the encoder (OpenMP, codes bit-identical to
// ref::kvq_encode) and the fused attention over one quantized layer.
//
// Attention streams the layer in tiles of kTile slots: decode the tile's codes to f32 (L1/L2
// resident), patch its sparse outliers, rotate its pre-RoPE keys to their positions, and run
// the regular attention core on it, merging tile partials by log-sum-exp. Memory traffic is the
// compressed bytes; no f32 copy of the shard ever exists.
//
// RoPE on the fly: kernels/cpu/attention/rope_tile.h (exact angles per tile start, a float complex
// multiply per token inside the tile).
//
// With an accumulator (args.acc, the path the caches take) the layer is attended unit by unit
// instead (kernels/cpu/attention/attention_units.h): each unit decoded as above, then the same decode
// kernel per query, deposited exactly -- the result does not depend on how the cache is split.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/attention/attention_units.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/kvq/kvq_impl.h"
#include "kernels/cpu/attention/rope_tile.h"
#include "kernels/ref/ref_ops.h"

namespace xctx::cpu {
namespace impl {

void kvq_decode_keys_scalar(const kvq_layer_view& v, int64_t i0, int nt, const float* sc, const float* zc,
                            float* out) {
  const int C = v.channels();
  const size_t rb = kvq_row_bytes(C, v.bits);
  for (int r = 0; r < nt; ++r) {
    const uint8_t* row = v.k_codes + (size_t)(i0 + r) * rb;
    for (int c = 0; c < C; ++c) {
      const uint32_t code = kvq_get_code(row, v.bits, c);
      const float x = v.scheme == kvq_scheme::kvq_lut ? v.lut_k[code] : (float)code;
      out[(size_t)r * C + c] = x * sc[c] + zc[c];
    }
  }
}
void kvq_decode_values_scalar(const kvq_layer_view& v, int64_t i0, int nt, float* out) {
  const int C = v.channels();
  for (int r = 0; r < nt; ++r)
    for (int c = 0; c < C; ++c) out[(size_t)r * C + c] = kvq_dense_value(v, i0 + r, c);
}

}  // namespace impl

namespace {

using impl::isa;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kTile = impl::kRopeTile;      // slots decoded per tile (K + V f32: 2 * 64 * C floats)
constexpr int64_t kDecodeMinChunk = 1024;  // shortest run of slots one decode work item streams
constexpr int64_t kPrefillTile = 1024;     // slots per attention call on the prefill path

}  // namespace

// ---- encoder ---------------------------------------------------------------------------------

void kvq_encode(const kvq_encode_job& job) {
  std::vector<float> widened;
  kvq_encode_job j = job;
  j.x = kvq_input_rows(job, widened);
  XCTX_CHECK(j.bits >= 2 && j.bits <= kKvqMaxBits, "kvq_encode: bits must be 2..", kKvqMaxBits, ", got ", j.bits);
  XCTX_CHECK(j.channels > 0 && j.channels % 8 == 0 && j.channels <= 65536,
             "kvq_encode: channels must be a positive multiple of 8 up to 65536, got ", j.channels);
  const int C = j.channels, bits = j.bits;
  const size_t rb = kvq_row_bytes(C, bits);
  const bool par = j.n * C >= 16384;
  switch (j.tensor) {
    case kvq_tensor::kvq_uniform_keys: {
      XCTX_CHECK(j.n == j.group, "kvq_encode: uniform keys are encoded one full group at a time (n=", j.n,
                 ", group=", j.group, ")");
      // Channel ranges are independent; the min/max scan runs along rows (contiguous in c).
      std::vector<float> lo(j.x, j.x + C), hi(j.x, j.x + C);
      for (int64_t t = 1; t < j.n; ++t)
        for (int c = 0; c < C; ++c) lo[c] = std::min(lo[c], j.x[t * C + c]), hi[c] = std::max(hi[c], j.x[t * C + c]);
      for (int c = 0; c < C; ++c) j.affine[c] = kvq_uniform_params(lo[c], hi[c], bits);
#pragma omp parallel for schedule(static) if (par)
      for (int64_t t = 0; t < j.n; ++t) {
        uint8_t codes[8];
        for (int c = 0; c < C; c += 8) {
          for (int e = 0; e < 8; ++e) codes[e] = kvq_uniform_encode(j.x[t * C + c + e], j.affine[c + e], bits);
          kvq_pack8(codes, bits, j.codes + t * rb + (size_t)c / 8 * bits);
        }
      }
      return;
    }
    case kvq_tensor::kvq_uniform_values: {
      XCTX_CHECK(j.group > 0, "kvq_encode: group must be positive, got ", j.group);
      const int n_g = (C + j.group - 1) / j.group;
#pragma omp parallel for schedule(static) if (par)
      for (int64_t t = 0; t < j.n; ++t) {
        const float* x = j.x + t * C;
        std::vector<uint8_t> codes((size_t)C);
        for (int g = 0; g < n_g; ++g) {
          const int c0 = g * j.group, c1 = std::min(C, c0 + j.group);
          // std::min/std::max keep the first of equal extremes (as ref does; it decides the
          // sign a zero scale is stored with), unlike std::minmax_element's last maximum.
          float lo = x[c0], hi = x[c0];
          for (int c = c0 + 1; c < c1; ++c) lo = std::min(lo, x[c]), hi = std::max(hi, x[c]);
          const kvq_affine p = kvq_uniform_params(lo, hi, bits);
          j.affine[t * n_g + g] = p;
          for (int c = c0; c < c1; ++c) codes[c] = kvq_uniform_encode(x[c], p, bits);
        }
        kvq_pack_row(codes.data(), C, bits, j.codes + t * rb);
      }
      return;
    }
    case kvq_tensor::kvq_lut_keys: {
      const int n_lut = 1 << bits;
#pragma omp parallel for schedule(static) if (par)
      for (int64_t t = 0; t < j.n; ++t) {
        const float* x = j.x + t * C;
        std::vector<uint8_t> codes((size_t)C);
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
        kvq_pack_row(codes.data(), C, bits, j.codes + t * rb);
      }
      return;
    }
    case kvq_tensor::kvq_lut_values: {
      const int n_lut = 1 << bits, side = j.v_out_side;
      XCTX_CHECK(side >= 0 && 2 * side < C, "kvq_encode: ", side, " outliers per side leave nothing of a row of ", C);
#pragma omp parallel for schedule(static) if (par)
      for (int64_t t = 0; t < j.n; ++t) {
        const float* x = j.x + t * C;
        std::vector<uint8_t> codes((size_t)C);
        float lo, hi;
        std::vector<int> out;  // the outlier channels, ascending
        if (side == 0) {
          const auto [mn, mx] = std::minmax_element(x, x + C);
          lo = *mn, hi = *mx;
        } else {
          // Partial selection with the same (value, channel) order the reference sorts by.
          std::vector<int> order((size_t)C);
          std::iota(order.begin(), order.end(), 0);
          const auto less = [&](int a, int b) { return x[a] < x[b] || (x[a] == x[b] && a < b); };
          std::nth_element(order.begin(), order.begin() + side, order.end(), less);
          std::nth_element(order.begin() + side + 1, order.end() - 1 - side, order.end(), less);
          lo = x[order[side]], hi = x[order[C - 1 - side]];
          out.assign(order.begin(), order.begin() + side);
          out.insert(out.end(), order.end() - side, order.end());
          std::sort(out.begin(), out.end());
        }
        const kvq_affine p = kvq_midrange_params(lo, hi);
        j.affine[t] = p;
        const float scale = fp16_to_fp32(p.scale), zero = fp16_to_fp32(p.zero);
        for (int c = 0; c < C; ++c) codes[c] = kvq_lut_encode(kvq_normalize(x[c], scale, zero), j.lut, n_lut);
        kvq_pack_row(codes.data(), C, bits, j.codes + t * rb);
        for (int e = 0; e < (int)out.size(); ++e) {
          j.out_idx[t * 2 * side + e] = (uint16_t)out[e];
          j.out_val[t * 2 * side + e] = kvq_outlier_delta(x[out[e]], j.lut, codes[out[e]], scale, zero);
        }
      }
      return;
    }
  }
  XCTX_ASSERT(false, "kvq_encode: bad tensor kind ", (int)j.tensor);
}

namespace {

// ---- tile decode -----------------------------------------------------------------------------

// Key channel scales of the uniform group being decoded, converted from fp16 once per group.
struct group_scales {
  std::vector<float> sc, zc;  // [C]
  int64_t group = -1;
};

void convert_f16_rows(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(src[i]);
}

// Slots [s0, s0 + nt) of the layer, decoded, outliers patched, keys rotated to rot_pos (the
// slots' positions, or SelfExtend's grouped ones).
void decode_tile(isa v, const kvq_layer_view& L, const impl::rope_table& tab, int64_t s0, int nt,
                 float* kt /*[nt, C]*/, float* vt /*[nt, C]*/, group_scales& gs, impl::rope_cursor& cur,
                 const int32_t* rot_pos /*[nt]*/) {
  const int C = L.channels();
  // The AVX2 row decoders take the KV formats' widths (2..4 bits, keys and values alike).
  const bool fast = v == isa::isa_avx2 && L.bits >= 2 && L.value_bits() == L.bits;
  int r = 0;
  while (r < nt) {
    const int64_t s = s0 + r;
    if (s < L.n_sink || s >= L.q_end) {  // fp16 rows: the sink or the residual window
      const uint16_t* ks = s < L.n_sink ? L.k_sink + s * C : L.k_tail + (s - L.q_end) * C;
      const uint16_t* vs = s < L.n_sink ? L.v_sink + s * C : L.v_tail + (s - L.q_end) * C;
      convert_f16_rows(ks, C, kt + (size_t)r * C);
      convert_f16_rows(vs, C, vt + (size_t)r * C);
      ++r;
      continue;
    }
    // A run of quantized rows sharing one key group (uniform) or all of them (lut).
    const int64_t i = s - L.n_sink;
    int64_t run = std::min<int64_t>(nt - r, L.q_end - s);
    const float *sc = L.k_ch_scale, *zc = L.k_ch_zero;
    if (L.scheme == kvq_scheme::kvq_uniform) {
      const int64_t g = i / L.group;
      run = std::min<int64_t>(run, (g + 1) * L.group - i);
      if (gs.group != g) {
        gs.sc.resize(C), gs.zc.resize(C);
        for (int c = 0; c < C; ++c) {
          const kvq_affine p = L.k_group[(size_t)g * C + c];
          gs.sc[c] = fp16_to_fp32(p.scale), gs.zc[c] = fp16_to_fp32(p.zero);
        }
        gs.group = g;
      }
      sc = gs.sc.data(), zc = gs.zc.data();
    }
    if (fast) {
      impl::avx2::kvq_decode_keys(L, i, (int)run, sc, zc, kt + (size_t)r * C);
      impl::avx2::kvq_decode_values(L, i, (int)run, vt + (size_t)r * C);
    } else {
      impl::kvq_decode_keys_scalar(L, i, (int)run, sc, zc, kt + (size_t)r * C);
      impl::kvq_decode_values_scalar(L, i, (int)run, vt + (size_t)r * C);
    }
    for (int64_t q = 0; q < run; ++q) {  // sparse outliers: δ onto the dense element
      float* kr = kt + (size_t)(r + q) * C;
      float* vr = vt + (size_t)(r + q) * C;
      if (L.k_out_off != nullptr)
        for (uint32_t e = L.k_out_off[i + q]; e < L.k_out_off[i + q + 1]; ++e)
          kr[L.k_out_idx[e]] += fp16_to_fp32(L.k_out_val[e]);
      const size_t vo = (size_t)(i + q) * L.v_out_per_tok;
      for (int e = 0; e < L.v_out_per_tok; ++e) vr[L.v_out_idx[vo + e]] += fp16_to_fp32(L.v_out_val[vo + e]);
    }
    r += (int)run;
  }
  impl::rope_tile(v, kt, rot_pos, nt, L.n_head_kv, tab, cur);
}

void check_args(const kvq_attn_args& a) {
  const kvq_layer_view& L = a.kv;
  XCTX_CHECK(kvq_widths_ok(L), "attention_kvq: code widths ", L.bits, "/", L.value_bits(),
             " bits (keys/values) are not a layer's: nuq 2..4 bits alike, uniform 1..4 each");
  XCTX_CHECK(L.n_head_kv > 0 && a.n_head > 0 && a.n_head % L.n_head_kv == 0 && L.head_dim > 0 &&
                 L.channels() % 8 == 0,
             "attention_kvq: bad heads n_head=", a.n_head, " n_head_kv=", L.n_head_kv, " head_dim=", L.head_dim);
  XCTX_CHECK(0 <= L.n_sink && L.n_sink <= L.q_end && L.q_end <= L.n, "attention_kvq: bad slot split n_sink=",
             L.n_sink, " q_end=", L.q_end, " n=", L.n);
  XCTX_CHECK(a.rope.head_dim == L.head_dim && a.rope.n_rot <= impl::kMaxRot && a.rope.n_rot % 2 == 0,
             "attention_kvq: rope head_dim ", a.rope.head_dim, " / n_rot ", a.rope.n_rot, " do not fit head_dim ",
             L.head_dim);
}

void merge_into(float* acc_o, float* acc_lse, const float* o, const float* lse, int R, int hd) {
  for (int r = 0; r < R; ++r) {
    if (lse[r] == kNegInf) continue;
    if (acc_lse[r] == kNegInf) {
      std::copy(o + (size_t)r * hd, o + (size_t)(r + 1) * hd, acc_o + (size_t)r * hd);
      acc_lse[r] = lse[r];
      continue;
    }
    const float m = std::max(acc_lse[r], lse[r]);
    const float wa = std::exp(acc_lse[r] - m), wb = std::exp(lse[r] - m);
    const float inv = 1.0f / (wa + wb);
    for (int d = 0; d < hd; ++d)
      acc_o[(size_t)r * hd + d] = (acc_o[(size_t)r * hd + d] * wa + o[(size_t)r * hd + d] * wb) * inv;
    acc_lse[r] = m + std::log(wa + wb);
  }
}

void attention_kvq_decode(isa v, const kvq_attn_args& a, const std::vector<int64_t>& q_end, int64_t kv_len,
                          const attention_switches& sw) {
  const kvq_layer_view& L = a.kv;
  const int hd = L.head_dim, C = L.channels(), g = a.n_head / L.n_head_kv;
  const int R = (int)(a.n_q * a.n_head);
  const impl::rope_table& tab = impl::rope_table_for(a.rope);
  // Rows ordered by kv head as decode_block wants them: r = (kvh * n_q + i) * g + u.
  std::vector<float> qs((size_t)R * hd);
  std::vector<int64_t> row_end((size_t)R), row_of((size_t)R);
  for (int kvh = 0; kvh < L.n_head_kv; ++kvh)
    for (int64_t i = 0; i < a.n_q; ++i)
      for (int u = 0; u < g; ++u) {
        const int64_t r = ((int64_t)kvh * a.n_q + i) * g + u;
        row_of[r] = i * a.n_head + (int64_t)kvh * g + u;
        for (int d = 0; d < hd; ++d) qs[r * hd + d] = a.q[row_of[r] * hd + d] * a.scale;
        row_end[r] = q_end[i];
      }
  const int64_t threads = omp_get_max_threads();
  int64_t n_chunk = std::clamp<int64_t>(threads == 1 ? 1 : 4 * threads, 1, std::max<int64_t>(1, kv_len / kDecodeMinChunk));
  int64_t chunk = (kv_len + n_chunk - 1) / n_chunk;
  chunk = (chunk + kTile - 1) / kTile * kTile;
  n_chunk = (kv_len + chunk - 1) / chunk;
  std::vector<float> o_parts((size_t)n_chunk * R * hd), lse_parts((size_t)n_chunk * R);  // rows in r order
#pragma omp parallel if (n_chunk > 1)
  {
    std::vector<float> kt((size_t)kTile * C), vt((size_t)kTile * C);  // [kTile, C]
    group_scales gs;
    std::vector<float> o_t((size_t)R * hd), lse_t((size_t)R), scratch((size_t)impl::decode_scratch_floats(R, hd));
    std::vector<int64_t> rel((size_t)R);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ch = 0; ch < n_chunk; ++ch) {
      float* acc_o = o_parts.data() + (size_t)ch * R * hd;
      float* acc_lse = lse_parts.data() + (size_t)ch * R;
      std::fill(acc_o, acc_o + (size_t)R * hd, 0.0f);
      std::fill(acc_lse, acc_lse + R, kNegInf);
      impl::rope_cursor cur;
      const int64_t end = std::min(kv_len, (ch + 1) * chunk);
      for (int64_t s0 = ch * chunk; s0 < end; s0 += kTile) {
        const int nt = (int)std::min<int64_t>(kTile, end - s0);
        decode_tile(v, L, tab, s0, nt, kt.data(), vt.data(), gs, cur, L.pos + s0);
        for (int r = 0; r < R; ++r) rel[r] = std::clamp<int64_t>(row_end[r] - s0, 0, nt);
        impl::decode_job jb;
        jb.q = qs.data(), jb.row_end = rel.data(), jb.R = R, jb.n_kvh = L.n_head_kv, jb.hd = hd;
        jb.k = kt.data(), jb.v = vt.data(), jb.type = kv_dtype::kv_f32, jb.ld = C;
        jb.j0 = 0, jb.j1 = nt;
        jb.o = o_t.data(), jb.lse = lse_t.data(), jb.scratch = scratch.data();
        jb.avx512_rows = sw.avx512_rows;
        impl::decode_block(v, jb);
        merge_into(acc_o, acc_lse, o_t.data(), lse_t.data(), R, hd);
      }
    }
  }
  // Chunk partials (r order) merged, then scattered to the caller's (query, head) order.
  std::vector<float> o_r((size_t)R * hd), lse_r((size_t)R);
  impl::merge_partials(v, o_parts.data(), lse_parts.data(), (int)n_chunk, R, hd, o_r.data(), lse_r.data());
  for (int r = 0; r < R; ++r) {
    std::copy(o_r.begin() + (size_t)r * hd, o_r.begin() + (size_t)(r + 1) * hd, a.o + row_of[r] * hd);
    a.lse[row_of[r]] = lse_r[r];
  }
}

void attention_kvq_prefill(isa v, const kvq_attn_args& a, int64_t kv_len) {
  const kvq_layer_view& L = a.kv;
  const int hd = L.head_dim, C = L.channels();
  const impl::rope_table& tab = impl::rope_table_for(a.rope);
  std::vector<float> kbuf((size_t)kPrefillTile * C), vbuf((size_t)kPrefillTile * C);  // [tile, C]
  attn_args qa;
  qa.q = a.q, qa.q_pos = a.q_pos, qa.n_q = a.n_q;
  qa.n_head = a.n_head, qa.n_head_kv = L.n_head_kv, qa.head_dim = hd, qa.scale = a.scale;
  impl::streamed_attention acc(v, qa);
  for (int64_t t0 = 0; t0 < kv_len; t0 += kPrefillTile) {
    const int64_t nt = std::min<int64_t>(kPrefillTile, kv_len - t0);
    const int64_t n_sub = (nt + kTile - 1) / kTile;
#pragma omp parallel if (n_sub > 1)
    {
      group_scales gs;
      impl::rope_cursor cur;
#pragma omp for schedule(static)
      for (int64_t b = 0; b < n_sub; ++b) {
        const int64_t s0 = t0 + b * kTile;
        const int n = (int)std::min<int64_t>(kTile, t0 + nt - s0);
        decode_tile(v, L, tab, s0, n, kbuf.data() + (s0 - t0) * C, vbuf.data() + (s0 - t0) * C, gs, cur, L.pos + s0);
      }
    }
    acc.add(kbuf.data(), vbuf.data(), L.pos + t0, nt);
  }
  acc.finish(a.o, a.lse);
}

// A unit decoded to f32 (outliers patched, keys rotated) in halves of one RoPE tile each.
class kvq_loader final : public unit_loader {
 public:
  kvq_loader(const kvq_attn_args& a, const impl::rope_table& tab) : a_(a), tab_(tab) {}
  unit_kv load(int64_t s0, int n, float* kbuf, float* vbuf) override {
    const int C = a_.kv.channels();
    for (int h = 0; h < n; h += kTile) {
      const int nt = std::min(kTile, n - h);
      decode_tile(impl::best_isa(), a_.kv, tab_, s0 + h, nt, kbuf + (size_t)h * C, vbuf + (size_t)h * C, gs_, cur_,
                  a_.kv.pos + s0 + h);
    }
    return unit_kv{kbuf, vbuf, kv_dtype::kv_f32, C};
  }
  unit_kv load_grouped(int64_t s0, int n, float* kbuf, float* vbuf) override {
    const int C = a_.kv.channels();
    int32_t gpos[kTile];
    for (int h = 0; h < n; h += kTile) {
      const int nt = std::min(kTile, n - h);
      for (int j = 0; j < nt; ++j) gpos[j] = (int32_t)self_extend_key_pos(a_.rope, a_.kv.pos[s0 + h + j]);
      decode_tile(impl::best_isa(), a_.kv, tab_, s0 + h, nt, kbuf + (size_t)h * C, vbuf + (size_t)h * C, gs_, cur_,
                  gpos);
    }
    return unit_kv{kbuf, vbuf, kv_dtype::kv_f32, C};
  }

 private:
  const kvq_attn_args& a_;
  const impl::rope_table& tab_;
  group_scales gs_;
  impl::rope_cursor cur_;
};

// One query's partial over a unit, decode fused into the attention (kvq_fused_avx2.cpp).
class kvq_fused_kernel final : public unit_kernel {
 public:
  // Scratch is per thread and kept between calls: a decode step calls this once per layer, and
  // zeroing ~120 KB each time cost more than the attention over a short cache.
  kvq_fused_kernel(const kvq_attn_args& a, const impl::rope_table& tab, bool keys_in_lanes)
      : a_(a), tab_(tab), keys_in_lanes_(keys_in_lanes), scratch_(thread_scratch()), angles_(thread_angles()) {
    const size_t need = impl::kvq_fused_scratch_floats(a.n_head, a.kv.head_dim, a.kv.channels());
    if (scratch_.size() < need) scratch_.resize(need);
    if (angles_.size() < (size_t)a.kv.head_dim) angles_.resize((size_t)a.kv.head_dim);
  }
  void attend(const float* q, int64_t s0, int n, bool grouped, float* o, float* lse) override {
    impl::kvq_fused_args f;
    f.kv = &a_.kv, f.q = q, f.n_head = a_.n_head, f.n_rot = a_.rope.n_rot;
    f.s0 = s0, f.n = n;
    f.pos_group = grouped ? a_.rope.se_group : 1;
    f.pos_period = grouped ? a_.rope.se_period : 0;
    f.off_cos2 = tab_.unit_cos2.data(), f.off_sin2 = tab_.unit_sin2.data();
    f.off_cos_t = tab_.unit_cos_t(), f.off_sin_t = tab_.unit_sin_t();
    f.angles = angles_of, f.angle_table = &tab_;
    f.scratch = scratch_.data(), f.angle_scratch = angles_.data();
    f.o = o, f.lse = lse;
    f.keys_in_lanes = keys_in_lanes_;
    if (has_avx512() && impl::kvq_fused_avx512_supported(a_.kv))
      impl::avx512::kvq_attend_fused(f);
    else
      impl::avx2::kvq_attend_fused(f);
  }

 private:
  static void angles_of(const void* table, int64_t pos, double* c, double* s) {
    impl::rope_angles(*static_cast<const impl::rope_table*>(table), pos, c, s);
  }
  static std::vector<float>& thread_scratch() {
    thread_local std::vector<float> v;
    return v;
  }
  static std::vector<double>& thread_angles() {
    thread_local std::vector<double> v;
    return v;
  }
  const kvq_attn_args& a_;
  const impl::rope_table& tab_;
  const bool keys_in_lanes_;
  std::vector<float>& scratch_;
  std::vector<double>& angles_;
};

}  // namespace

void attention_kvq(const kvq_attn_args& a) { attention_kvq(a, attention_switches{}); }

void attention_kvq(const kvq_attn_args& a, const attention_switches& sw) {
  check_args(a);
  const kvq_layer_view& L = a.kv;
  if (a.acc != nullptr) {
    unit_queries qs{a.q, a.q_pos, a.n_q, a.n_head, L.n_head_kv, L.head_dim, a.scale, &a.rope, a.select};
    qs.avx512_rows = sw.avx512_rows;
    const impl::rope_table& tab = impl::rope_table_for(a.rope);
    if (a.decode_step && a.n_q == 1 && impl::best_isa() == isa::isa_avx2 &&
        impl::kvq_fused_supported(L, a.n_head, a.rope.n_rot)) {
      attend_units_one_query(
          qs, L.pos, L.n, [&] { return std::make_unique<kvq_fused_kernel>(a, tab, sw.kvq_key_lanes); }, *a.acc);
      return;
    }
    attend_units(qs, L.pos, L.n, [&] { return std::make_unique<kvq_loader>(a, tab); }, *a.acc);
    return;
  }
  if (self_extend_on(a.rope) || a.select != nullptr)
    return attend_via_accumulator(a, a.n_q * a.n_head, L.head_dim,
                                  [&](const kvq_attn_args& b) { attention_kvq(b, sw); });
  if (a.n_q == 0) return;
  std::vector<int64_t> q_end;  // [n_q]
  const int64_t kv_len = impl::visible_prefixes(a.q_pos, a.n_q, L.pos, L.n, a.n_head, L.head_dim, a.o, a.lse, q_end);
  if (kv_len == 0) return;
  const isa v = impl::best_isa();
  if (a.n_q <= impl::kDecodeMaxQueries)
    attention_kvq_decode(v, a, q_end, kv_len, sw);
  else
    attention_kvq_prefill(v, a, kv_len);
}

}  // namespace xctx::cpu
