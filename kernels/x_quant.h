// Kernels of the X caches (xquant, xquant-cl, clkv; cache/x_cache.cpp, docs/x_formats.md):
// uniform quantization of latent streams at 1-4 bits (with the ACL paper's data-free
// calibration eta) and attention that rebuilds K and V from the stored latents on the fly.
//
// A stream is n rows of C channels of one layer: rows [0, nq) quantized, rows [nq, n) fp16
// (the residual window). Two axes, as KIVI keys and values:
//   xq_per_channel  scale/zero per channel over groups of `group` rows (keys, X·U_k)
//   xq_per_token    scale/zero per row over groups of `group` channels (values, X, deltas)
// Codes are packed with kv_quant.h's little-endian bit streams (1-bit works the same way: 8 codes
// per byte) and computed with kvq_uniform_params/encode (same rounding as kivi). With eta > 0 the
// stored scale and zero are the calibrated ones (ACL Eq. 12): ẑ = z + η s (2^B - 1), ŝ = (1-2η) s,
// from the fp16 s and z the codes were computed against, rounded to fp16 again.
//
// Attention rebuilds, per tile of rows: K = Z_k·M_k + b_k (then RoPE), scores, online softmax.
// V is not rebuilt on the decode path: each query row accumulates u = Σ_t p_t z_v,t in the latent
// space and o = u·M_v[:, head] / Σp + b_v at the end (V-absorption; Σp/Σp = 1 so b_v is added once).
// M = null means the identity (the stream is K or V itself: clkv; the CPU then runs a decode
// step through the quantized-KV fused kernel, whose layer view the two streams fit).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/kv_quant.h"
#include "kernels/ops.h"

namespace xctx {

enum class xq_axis : uint8_t { xq_per_channel, xq_per_token };
inline constexpr int kXqMaxBits = 4;

struct xq_stream {
  xq_axis axis = xq_axis::xq_per_token;
  int channels = 0;  // C (multiple of 8)
  int bits = 0;      // 1..4
  int group = 0;     // per_channel: rows per scale group; per_token: channels per scale group
  int64_t nq = 0;    // quantized rows; per_channel: a multiple of group
  const uint8_t* codes = nullptr;      // [nq, C*bits/8]
  const kvq_affine* params = nullptr;  // per_channel [nq/group, C]; per_token [nq, ceil(C/group)]
  const uint16_t* tail = nullptr;      // [n - nq, C] fp16
  const uint16_t* ch0 = nullptr;       // [nq] fp16 first channel of the quantized rows, or null
  const float* dense = nullptr;        // [n, C] f32 rows; when set, everything above is ignored
  XCTX_HOST_DEVICE int n_groups_per_row() const { return (channels + group - 1) / group; }
};

// Element c of row t (t < n) of a stream.
XCTX_HOST_DEVICE inline float xq_element(const xq_stream& s, int64_t t, int c) {
  if (s.dense != nullptr) return s.dense[t * s.channels + c];
  if (t >= s.nq) return fp16_to_fp32(s.tail[(t - s.nq) * s.channels + c]);
  if (c == 0 && s.ch0 != nullptr) return fp16_to_fp32(s.ch0[t]);
  const uint32_t code = kvq_get_code(s.codes + (size_t)t * kvq_row_bytes(s.channels, s.bits), s.bits, c);
  const kvq_affine p = s.axis == xq_axis::xq_per_channel ? s.params[(size_t)(t / s.group) * s.channels + c]
                                                         : s.params[(size_t)t * s.n_groups_per_row() + c / s.group];
  return kvq_uniform_decode(code, fp16_to_fp32(p.scale), fp16_to_fp32(p.zero));
}

// The stored (calibrated) parameters for a group whose codes were computed against p.
XCTX_HOST_DEVICE inline kvq_affine xq_calibrate(kvq_affine p, int bits, float eta) {
  if (eta == 0.0f) return p;
  const float s = fp16_to_fp32(p.scale), z = fp16_to_fp32(p.zero);
  return {fp32_to_fp16((1.0f - 2.0f * eta) * s), fp32_to_fp16(z + eta * s * (float)((1 << bits) - 1))};
}

// Encodes n rows of one stream. per_channel: n is a multiple of group (whole groups).
// codes == nullptr computes the parameters only (clkv: a layer that reuses its partner's codes).
struct xq_encode_job {
  xq_axis axis = xq_axis::xq_per_token;
  int bits = 0;
  int channels = 0;
  int group = 0;
  float eta = 0.0f;
  int64_t n = 0;
  const float* x = nullptr;       // [n, C]
  const uint16_t* x16 = nullptr;  // [n, C] fp16 rows instead of x (a cache's residual window)
  uint8_t* codes = nullptr;       // [n, C*bits/8] or null
  kvq_affine* params = nullptr;   // per_channel [n/group, C]; per_token [n, ceil(C/group)]
  // When set: channel 0 of every row is stored here as fp16 and encoded as the constant 0
  // (XQuant App. B, the outlier channel of the key-side latent kept in fp16).
  uint16_t* ch0 = nullptr;        // [n]
};

// Element c of input row t as the encoder sees it (x16 widened, channel 0 zero under ch0), and
// what it stores for row t under ch0: the same on every backend.
XCTX_HOST_DEVICE inline float xq_encode_input(const xq_encode_job& j, int64_t t, int c) {
  if (c == 0 && j.ch0 != nullptr) return 0.0f;
  const int64_t e = t * j.channels + c;
  return j.x16 != nullptr ? fp16_to_fp32(j.x16[e]) : j.x[e];
}
XCTX_HOST_DEVICE inline uint16_t xq_encode_ch0(const xq_encode_job& j, int64_t t) {
  const int64_t e = t * j.channels;
  return j.x16 != nullptr ? j.x16[e] : fp32_to_fp16(j.x[e]);
}

struct xq_attn_args {
  int64_t n = 0;                 // rows of the streams
  const int32_t* pos = nullptr;  // [n] ascending
  xq_stream zk, zv;
  bool same_stream = false;      // zv is zk (X or the accumulator feeds both K and V)
  const float* m_k = nullptr;    // [zk.channels, ld_mk]: K = Z_k·M_k[:, :kv]; null = identity
  int64_t ld_mk = 0;
  const float* m_v = nullptr;    // [zv.channels, ld_mv]; null = identity
  int64_t ld_mv = 0;
  const float* b_k = nullptr;    // [kv] or null
  const float* b_v = nullptr;    // [kv] or null
  const float* q = nullptr;      // [n_q, n_head, head_dim], RoPE applied
  const int32_t* q_pos = nullptr;  // [n_q]
  int64_t n_q = 0;
  int n_head = 0, n_head_kv = 0, head_dim = 0;
  float scale = 0.0f;
  rope_config rope;              // applied to the rebuilt keys at their positions
  const attn_selection* select = nullptr;  // retrieval: the units each query sees (attn_args::select)
  float* o = nullptr;            // [n_q, n_head, head_dim]
  float* lse = nullptr;          // [n_q, n_head]
  // When set: exact per-unit deposits instead of o/lse (see attn_args). absorb_v then picks the
  // unit kernel: V absorbed in the latent space (few queries: decode steps) or K and V rebuilt
  // per unit (many queries share them: prefill). The caller decides, never n_q, so a token's
  // result does not depend on how many other queries share its call.
  softmax_acc* acc = nullptr;
  bool absorb_v = false;
};

namespace ref {
void xq_encode(const xq_encode_job& j);
// Rows [t0, t0 + nt) of a stream in f32.
void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out /*[nt, C]*/);
// Oracle: decode everything, rebuild K and V explicitly (double sums), RoPE, attention_partial.
// absorb = true instead forms Σ p_t z_v,t and projects once (double), for the absorption test.
void attention_xq(const xq_attn_args& a, bool absorb = false);
}  // namespace ref

namespace cpu {
struct attention_switches;  // kernels/cpu/cpu_ops.h
void xq_encode(const xq_encode_job& j);  // OpenMP over rows / channels; codes equal to ref's
// Decode (n_q <= 8): tiles of rows, K rebuilt with a small GEMM and rotated in the tile, V absorbed.
// Prefill: blocks of rows with K and V rebuilt explicitly (cheaper when many queries share them)
// and the BLAS-tiled attention core. Never holds more than one block of rebuilt rows per thread.
void attention_xq(const xq_attn_args& a);
void attention_xq(const xq_attn_args& a, const attention_switches& s);
// acc[t, :] += z[t, :]·uᵀ for t < n (xquant-cl's accumulator update), BLAS.
void xq_add_projected(const float* z /*[n, r]*/, const float* u /*[d, r]*/, int64_t n, int r, int d,
                      float* acc /*[n, d]*/);
// Rows [t0, t0 + nt) of a stream in f32 (OpenMP over rows).
void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out /*[nt, C]*/);
// out = x·u: the latent of n rows (x [n, d], u [d, r] row-major), BLAS.
void xq_project(const float* x /*[n, d]*/, const float* u /*[d, r]*/, int64_t n, int d, int r, float* out /*[n, r]*/);
}  // namespace cpu
namespace ref {
void xq_add_projected(const float* z, const float* u, int64_t n, int r, int d, float* acc);
void xq_project(const float* x, const float* u, int64_t n, int d, int r, float* out);
}  // namespace ref

}  // namespace xctx
