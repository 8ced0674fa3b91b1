// Quantized KV storage shared by host and device code (nvcc reads this header too): the layout
// of one layer of a quantized shard, the per-element encode/decode math, and the job structs
// of the encode and attention kernels. The ref, cpu and cuda kernels all call the inline
// functions below, so the CPU tests exercise the arithmetic the GPU runs.
//
// Two schemes (cache/format.h maps the user-facing names onto them):
//  kvq_uniform  KIVI*: asymmetric integer codes. Keys per channel over groups of `group` tokens
//               (scale/zero per group and channel), values per token over groups of `group`
//               channels. Scales and zero points are fp16.
//  kvq_lut      KVQuant nuqX: codes index a per-layer lookup table of 2^bits signposts in
//               normalized units. Keys: k = lut_k[code] * ch_scale[c] + ch_zero[c] (offline,
//               per channel); values: v = lut_v[code] * scale[t] + zero[t] (online, per token,
//               fp16). Dense-and-sparse outliers: a sparse entry stores the element's
//               correction to its dense decode (kvq_outlier_delta), which decoders add.
//
// A layer's token slots [0, n) are split as
//   [0, n_sink)        fp16 rows (the attention sink: the sequence's first token)
//   [n_sink, q_end)    quantized rows
//   [q_end, n)         fp16 rows (the residual window: tokens not yet in a full key group)
// Keys are always stored before RoPE; attention applies RoPE on the fly.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/ops.h"

namespace xctx {

enum class kvq_scheme : uint8_t { kvq_uniform, kvq_lut };

inline constexpr int kKvqMaxBits = 4;
inline constexpr int kKvqMaxLut = 1 << kKvqMaxBits;

// ---- packing ----------------------------------------------------------------------------
// A row of C codes of `bits` bits is a little-endian bit stream of C*bits/8 bytes (C is a
// multiple of 8, so every group of 8 codes fills exactly `bits` bytes and rows never share a
// byte). Code i of a row sits at bits [i*bits, (i+1)*bits).
XCTX_HOST_DEVICE inline size_t kvq_row_bytes(int channels, int bits) { return (size_t)channels * bits / 8; }

XCTX_HOST_DEVICE inline uint32_t kvq_get_code(const uint8_t* row, int bits, int i) {
  const int bit = i * bits;
  const int byte = bit >> 3, shift = bit & 7;
  // Codes are at most 4 bits and never straddle more than two bytes.
  const uint32_t w = (uint32_t)row[byte] | ((shift + bits > 8) ? (uint32_t)row[byte + 1] << 8 : 0u);
  return (w >> shift) & ((1u << bits) - 1u);
}

// Packs 8 codes into `bits` bytes (the unit every row is made of).
XCTX_HOST_DEVICE inline void kvq_pack8(const uint8_t* codes /*[8]*/, int bits, uint8_t* out /*[bits]*/) {
  uint32_t w = 0;
  for (int i = 0; i < 8; ++i) w |= (uint32_t)codes[i] << (i * bits);
  for (int b = 0; b < bits; ++b) out[b] = (uint8_t)(w >> (8 * b));
}

// Packs a row of C codes (C a multiple of 8).
XCTX_HOST_DEVICE inline void kvq_pack_row(const uint8_t* codes /*[C]*/, int C, int bits, uint8_t* out /*[C*bits/8]*/) {
  for (int i = 0; i < C; i += 8) kvq_pack8(codes + i, bits, out + (size_t)i / 8 * bits);
}

// ---- uniform (KIVI*) ----------------------------------------------------------------------
// Asymmetric min/max quantization. Scale and zero are rounded to fp16 *before* encoding so the
// stored parameters are exactly the ones the codes were computed against.
struct kvq_affine {
  uint16_t scale;  // fp16
  uint16_t zero;   // fp16 (the group minimum)
};
XCTX_HOST_DEVICE inline kvq_affine kvq_uniform_params(float lo, float hi, int bits) {
  const float levels = (float)((1 << bits) - 1);
  return {fp32_to_fp16((hi - lo) / levels), fp32_to_fp16(lo)};
}
XCTX_HOST_DEVICE inline uint8_t kvq_uniform_encode(float x, kvq_affine p, int bits) {
  const float scale = fp16_to_fp32(p.scale), zero = fp16_to_fp32(p.zero);
  if (!(scale > 0.0f)) return 0;  // constant group (or nan scale): every element decodes to zero
  float c = rintf((x - zero) / scale);
  const float top = (float)((1 << bits) - 1);
  c = c < 0.0f ? 0.0f : (c > top ? top : c);
  return (uint8_t)c;
}
XCTX_HOST_DEVICE inline float kvq_uniform_decode(uint32_t code, float scale, float zero) {
  return (float)code * scale + zero;
}

// ---- non-uniform (nuqX) -------------------------------------------------------------------
// Nearest signpost of an ascending table: the number of midpoints below y. Ties between two
// signposts go to the lower one; the same float comparisons run on every device.
XCTX_HOST_DEVICE inline uint8_t kvq_lut_encode(float y, const float* lut /*[n_lut] ascending*/, int n_lut) {
  uint8_t c = 0;
  for (int i = 0; i + 1 < n_lut; ++i) c += (y > 0.5f * (lut[i] + lut[i + 1])) ? 1 : 0;
  return c;
}
// A per-token vector normalization: zero is the midpoint and scale the half range of the
// non-outlier elements, both rounded to fp16 before the elements are normalized.
XCTX_HOST_DEVICE inline kvq_affine kvq_midrange_params(float lo, float hi) {
  return {fp32_to_fp16(0.5f * (hi - lo)), fp32_to_fp16(0.5f * (hi + lo))};
}
XCTX_HOST_DEVICE inline float kvq_normalize(float x, float scale, float zero) {
  return scale > 0.0f ? (x - zero) / scale : 0.0f;
}
// The sparse entry of an outlier x whose dense code decodes to lut[code]·scale + zero: the
// correction δ = x − dense in fp16. KVQuant writes the split as dense + sparse; storing δ (not x)
// keeps that sum exact up to δ's rounding -- smaller than x's, as the dense code is the clamped
// signpost nearest x -- and lets the fused kernels correct a score or an output with δ alone,
// without decoding the element's code again. The dense value is one fused multiply-add here, so
// the ref, cpu and cuda encoders store the same bits.
XCTX_HOST_DEVICE inline uint16_t kvq_outlier_delta(float x, const float* lut, uint32_t code, float scale, float zero) {
  return fp32_to_fp16(x - fmaf(lut[code], scale, zero));
}

// ---- one layer of a quantized shard, as the attention kernels read it ----------------------
// Shapes use C = n_head_kv * head_dim (a token's row), nq = q_end - n_sink (quantized rows).
struct kvq_layer_view {
  kvq_scheme scheme = kvq_scheme::kvq_uniform;
  int bits = 0;
  int v_bits = 0;                   // value code width when it differs from the keys' (clkv); 0 = bits
  int n_head_kv = 0;
  int head_dim = 0;
  int group = 0;                    // uniform: tokens per key group = channels per value group
  int64_t n = 0;                    // token slots held
  int64_t n_sink = 0;               // fp16 rows at the front
  int64_t q_end = 0;                // end of the quantized rows
  const int32_t* pos = nullptr;     // [n] ascending
  const uint16_t* k_sink = nullptr;  // [n_sink, C] fp16, pre-RoPE
  const uint16_t* v_sink = nullptr;  // [n_sink, C] fp16
  const uint16_t* k_tail = nullptr;  // [n - q_end, C] fp16, pre-RoPE
  const uint16_t* v_tail = nullptr;  // [n - q_end, C] fp16
  const uint8_t* k_codes = nullptr;  // [nq, C*bits/8]
  const uint8_t* v_codes = nullptr;  // [nq, C*value_bits()/8]
  // uniform
  const kvq_affine* k_group = nullptr;  // [nq / group, C]
  const kvq_affine* v_group = nullptr;  // [nq, ceil(C / group)]
  // lut
  const float* lut_k = nullptr;       // [2^bits]
  const float* lut_v = nullptr;       // [2^bits]
  const float* k_ch_scale = nullptr;  // [C]
  const float* k_ch_zero = nullptr;   // [C]
  const kvq_affine* v_tok = nullptr;  // [nq]
  // dense-and-sparse outliers (lut only; null when the format keeps none). Keys: a compressed
  // column per token (CSC of the [C, tokens] key matrix): entries [k_out_off[i], k_out_off[i+1])
  // belong to quantized row i. Values: exactly v_out_per_tok entries per row (the online top-k
  // fixes the count, so no offsets are stored). An entry's value is δ (kvq_outlier_delta): the
  // element decodes to its dense value + δ.
  const uint32_t* k_out_off = nullptr;  // [nq + 1]
  const uint16_t* k_out_idx = nullptr;  // [k_out_off[nq]] channel
  const uint16_t* k_out_val = nullptr;  // [k_out_off[nq]] fp16 δ
  int v_out_per_tok = 0;
  const uint16_t* v_out_idx = nullptr;  // [nq, v_out_per_tok] channel
  const uint16_t* v_out_val = nullptr;  // [nq, v_out_per_tok] fp16 δ

  XCTX_HOST_DEVICE int channels() const { return n_head_kv * head_dim; }
  XCTX_HOST_DEVICE int64_t n_quant() const { return q_end - n_sink; }
  XCTX_HOST_DEVICE int value_bits() const { return v_bits != 0 ? v_bits : bits; }
};

// The code widths a layer may have: nuq 2..4 bits, keys and values alike (the KV formats);
// uniform 1..4 bits each, possibly different (clkv's K and V streams read through this view).
XCTX_HOST_DEVICE inline bool kvq_widths_ok(const kvq_layer_view& v) {
  const int kb = v.bits, vb = v.value_bits();
  if (v.scheme == kvq_scheme::kvq_lut) return kb >= 2 && kb <= kKvqMaxBits && vb == kb;
  return kb >= 1 && kb <= kKvqMaxBits && vb >= 1 && vb <= kKvqMaxBits;
}

// Dense part of quantized row i (0-based among the quantized rows), channel c.
XCTX_HOST_DEVICE inline float kvq_dense_key(const kvq_layer_view& v, int64_t i, int c) {
  const int C = v.channels();
  const uint32_t code = kvq_get_code(v.k_codes + (size_t)i * kvq_row_bytes(C, v.bits), v.bits, c);
  if (v.scheme == kvq_scheme::kvq_uniform) {
    const kvq_affine p = v.k_group[(size_t)(i / v.group) * C + c];
    return kvq_uniform_decode(code, fp16_to_fp32(p.scale), fp16_to_fp32(p.zero));
  }
  return v.lut_k[code] * v.k_ch_scale[c] + v.k_ch_zero[c];
}
XCTX_HOST_DEVICE inline float kvq_dense_value(const kvq_layer_view& v, int64_t i, int c) {
  const int C = v.channels();
  const int vb = v.value_bits();
  const uint32_t code = kvq_get_code(v.v_codes + (size_t)i * kvq_row_bytes(C, vb), vb, c);
  if (v.scheme == kvq_scheme::kvq_uniform) {
    const int n_vg = (C + v.group - 1) / v.group;
    const kvq_affine p = v.v_group[(size_t)i * n_vg + c / v.group];
    return kvq_uniform_decode(code, fp16_to_fp32(p.scale), fp16_to_fp32(p.zero));
  }
  const kvq_affine p = v.v_tok[i];
  return v.lut_v[code] * fp16_to_fp32(p.scale) + fp16_to_fp32(p.zero);
}

// ---- encode jobs ----------------------------------------------------------------------------
// One call encodes n rows of one tensor of one layer. Outputs are written at the given
// pointers; key outliers (variable count) go to per-row scratch that the cache compacts.
enum class kvq_tensor : uint8_t {
  kvq_uniform_keys,    // the n rows are one full key group (n == group): per-channel min/max
  kvq_uniform_values,  // per row, channel groups of `group`
  kvq_lut_keys,        // offline per-channel normalization; outliers outside [ch_lo, ch_hi]
  kvq_lut_values,      // online per-row normalization; top/bottom v_out_side outliers per row
};

struct kvq_encode_job {
  kvq_tensor tensor = kvq_tensor::kvq_uniform_keys;
  int bits = 0;
  int channels = 0;  // C
  int group = 0;     // uniform
  int64_t n = 0;
  const float* x = nullptr;       // [n, C]
  const uint16_t* x16 = nullptr;  // uniform tensors: [n, C] fp16 rows read instead of x (kivi's window)
  // lut parameters
  const float* lut = nullptr;       // [2^bits] ascending
  const float* ch_scale = nullptr;  // [C] keys
  const float* ch_zero = nullptr;   // [C] keys
  const float* ch_lo = nullptr;     // [C] keys: outlier thresholds, null = no outliers (clamp)
  const float* ch_hi = nullptr;     // [C]
  int v_out_side = 0;               // values: outliers taken from each end of the row
  // outputs
  uint8_t* codes = nullptr;        // [n, C*bits/8]
  kvq_affine* affine = nullptr;    // uniform keys [C]; uniform values [n, ceil(C/group)]; lut values [n]
  uint16_t* out_idx = nullptr;     // keys: [n, C] scratch; values: [n, 2*v_out_side]
  uint16_t* out_val = nullptr;     // same shape, fp16 δ (kvq_outlier_delta)
  uint32_t* out_count = nullptr;   // keys: [n] outliers found per row
};

// Appends the key outliers of n rows just encoded (kvq_encode's per-row scratch) to a layer's
// compressed columns, everything in the backend's memory, so a device cache never waits for a
// count: off[i + 1] = off[i] + count[i] for i < n, where off[0] already holds the layer's entries
// so far, and row i's count[i] entries go to idx/val from off[i]. Entries at or past `capacity`
// are not written (off still is): a caller that cannot bound the total reads off[n] afterwards
// and, when it exceeds the capacity, grows the lists and runs the same append again from the
// untouched scratch (the offsets come out the same).
struct kvq_outlier_append {
  int channels = 0;                   // C: the scratch's row stride
  int64_t n = 0;                      // rows
  const uint32_t* count = nullptr;    // [n] (kvq_encode_job::out_count)
  const uint16_t* row_idx = nullptr;  // [n, C] (out_idx)
  const uint16_t* row_val = nullptr;  // [n, C] (out_val)
  uint32_t* off = nullptr;            // [n + 1]; off[0] is read
  uint16_t* idx = nullptr;            // [capacity] the layer's channel list
  uint16_t* val = nullptr;            // [capacity] the layer's fp16 δ list
  uint64_t capacity = 0;
};

// Entry e of row i of an append (the row's offsets already written): the one copy every backend
// makes, dropped at or past the capacity.
XCTX_HOST_DEVICE inline void kvq_append_outlier_entry(const kvq_outlier_append& a, int64_t i, uint32_t e) {
  const uint64_t at = (uint64_t)a.off[i] + e;
  if (at >= a.capacity) return;
  a.idx[at] = a.row_idx[i * a.channels + e];
  a.val[at] = a.row_val[i * a.channels + e];
}

// The whole append on the host (the ref and cpu backends; the oracle of the CUDA kernels).
inline void kvq_append_outliers_host(const kvq_outlier_append& a) {
  for (int64_t i = 0; i < a.n; ++i) a.off[i + 1] = a.off[i] + a.count[i];
  for (int64_t i = 0; i < a.n; ++i)
    for (uint32_t e = 0; e < a.count[i]; ++e) kvq_append_outlier_entry(a, i, e);
}

// Element i of a job's input rows: x[i], or x16[i] widened when the job reads fp16 rows.
XCTX_HOST_DEVICE inline float kvq_input(const kvq_encode_job& j, int64_t i) {
  return j.x16 != nullptr ? fp16_to_fp32(j.x16[i]) : j.x[i];
}

// The job's input rows in f32 on the host: x itself, or x16 widened into buf (the encoders'
// scans then read one array whichever the job was given). x16 is for uniform tensors only.
inline const float* kvq_input_rows(const kvq_encode_job& j, std::vector<float>& buf) {
  XCTX_CHECK(j.x16 == nullptr || j.tensor == kvq_tensor::kvq_uniform_keys || j.tensor == kvq_tensor::kvq_uniform_values,
             "kvq_encode: fp16 input rows (x16) are for the uniform tensors only");
  if (j.x16 == nullptr) return j.x;
  buf.resize((size_t)j.n * j.channels);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = fp16_to_fp32(j.x16[i]);
  return buf.data();
}

// Attention of queries over one quantized layer (same contract as attn_args: o normalized by
// its own softmax sum, lse natural log; key j visible to query i iff pos[j] <= q_pos[i]).
struct kvq_attn_args {
  kvq_layer_view kv;
  const float* q = nullptr;        // [n_q, n_head, head_dim], RoPE applied
  const int32_t* q_pos = nullptr;  // [n_q]
  int64_t n_q = 0;
  int n_head = 0;
  float scale = 0.0f;
  rope_config rope;  // applied to the decoded pre-RoPE keys at their positions
  const attn_selection* select = nullptr;  // retrieval: the units each query sees (attn_args::select)
  float* o = nullptr;    // [n_q, n_head, head_dim]
  float* lse = nullptr;  // [n_q, n_head]
  softmax_acc* acc = nullptr;  // when set: exact per-unit deposits instead of o/lse (see attn_args)
  // The caller is a decode step (attend_path::attend_decode). With one query and an
  // accumulator the CPU backend then takes its fused one-query kernel, whose rounding differs
  // from the tiled kernel's: choosing by the phase, never by n_q, keeps a token's result
  // independent of how many queries share its call.
  bool decode_step = false;
};

}  // namespace xctx
