// Reference (de)quantizers for the GGML block formats. Decoding follows GGML's element order
// and arithmetic order exactly (scale products first, then the code), so results are bit-equal
// to llama.cpp's scalar dequantizers; encoding reproduces GGML's reference rounding (truncation
// after a +0.5 offset for the 4/5-bit formats, round-half-away for Q8_0/Q8_1, round-half-even
// for Q8_K) so the codes match files llama.cpp writes.
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"

// An oracle must not depend on compiler flags: contracting d*q + m into an FMA (GCC does so by
// default in gnu++ mode once FMA is enabled, e.g. -march=native) changes the last bit and
// breaks the bit-exact comparison with GGML's decoders.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace xctx::ref {
namespace {

float h2f(uint16_t h) { return fp16_to_fp32(h); }

// Blocks in a row of n elements; throws if n does not fill whole blocks.
int64_t block_count(ggml_type type, int64_t n, const char* what) {
  const ggml_type_traits tr = ggml_traits(type);
  XCTX_CHECK(tr.name != nullptr, what, ": unknown ggml type id ", (uint32_t)type);
  XCTX_CHECK(n >= 0 && n % tr.block_elems == 0, what, " ", tr.name, ": ", n,
             " elements is not a multiple of the block size ", tr.block_elems);
  return n / tr.block_elems;
}

// ---- decoders (one block each) -----------------------------------------------------------

void dequant_q4_0(const block_q4_0& b, float* y /*[32]*/) {
  const float d = h2f(b.d);
  for (int j = 0; j < qk_small / 2; ++j) {
    y[j] = (float)((b.qs[j] & 0x0f) - 8) * d;
    y[j + qk_small / 2] = (float)((b.qs[j] >> 4) - 8) * d;
  }
}

void dequant_q4_1(const block_q4_1& b, float* y /*[32]*/) {
  const float d = h2f(b.d), m = h2f(b.m);
  for (int j = 0; j < qk_small / 2; ++j) {
    y[j] = (float)(b.qs[j] & 0x0f) * d + m;
    y[j + qk_small / 2] = (float)(b.qs[j] >> 4) * d + m;
  }
}

// The 5th bits: bit j of the little-endian 32-bit qh belongs to element j.
int fifth_bit(const uint8_t qh[4], int j) { return (qh[j / 8] >> (j % 8)) & 1; }

void dequant_q5_0(const block_q5_0& b, float* y /*[32]*/) {
  const float d = h2f(b.d);
  for (int j = 0; j < qk_small / 2; ++j) {
    const int lo = (b.qs[j] & 0x0f) | (fifth_bit(b.qh, j) << 4);
    const int hi = (b.qs[j] >> 4) | (fifth_bit(b.qh, j + qk_small / 2) << 4);
    y[j] = (float)(lo - 16) * d;
    y[j + qk_small / 2] = (float)(hi - 16) * d;
  }
}

void dequant_q5_1(const block_q5_1& b, float* y /*[32]*/) {
  const float d = h2f(b.d), m = h2f(b.m);
  for (int j = 0; j < qk_small / 2; ++j) {
    const int lo = (b.qs[j] & 0x0f) | (fifth_bit(b.qh, j) << 4);
    const int hi = (b.qs[j] >> 4) | (fifth_bit(b.qh, j + qk_small / 2) << 4);
    y[j] = (float)lo * d + m;
    y[j + qk_small / 2] = (float)hi * d + m;
  }
}

template <typename Block>
void dequant_q8(const Block& b, float* y /*[32]*/) {
  const float d = h2f(b.d);
  for (int j = 0; j < qk_small; ++j) y[j] = (float)b.qs[j] * d;
}

// Q2_K: 16 groups of 16; each 32-byte half of qs holds 4 bit-planes (shift 0,2,4,6) of 128
// elements, and each plane covers two groups (bytes 0..15 and 16..31).
void dequant_q2_k(const block_q2_k& b, float* y /*[256]*/) {
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  int group = 0;
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = b.qs + 32 * half;
    for (int plane = 0; plane < 4; ++plane) {
      const int shift = 2 * plane;
      for (int part = 0; part < 2; ++part, ++group) {
        const uint8_t sc = b.scales[group];
        const float dl = d * (float)(sc & 0x0f);
        const float ml = dmin * (float)(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * (float)((q[16 * part + l] >> shift) & 3) - ml;
      }
    }
  }
}

// Q3_K's sixteen 6-bit signed scales (stored +32): low nibbles in bytes 0..7 (groups 0..7 low
// halves, 8..15 high halves), the 2 high bits in bytes 8..11.
int q3_k_scale(const uint8_t s[12], int g) {
  const int lo = g < 8 ? (s[g] & 0x0f) : (s[g - 8] >> 4);
  const int hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

void dequant_q3_k(const block_q3_k& b, float* y /*[256]*/) {
  const float d_all = h2f(b.d);
  int group = 0;
  int hbit = 0;  // element i's high bit is bit (i / 32) of hmask[i % 32]
  for (int half = 0; half < 2; ++half) {
    const uint8_t* q = b.qs + 32 * half;
    for (int plane = 0; plane < 4; ++plane, ++hbit) {
      const int shift = 2 * plane;
      for (int part = 0; part < 2; ++part, ++group) {
        const float dl = d_all * (float)q3_k_scale(b.scales, group);
        for (int l = 0; l < 16; ++l) {
          const int idx = 16 * part + l;
          const int low = (q[idx] >> shift) & 3;
          // A clear high bit means "subtract 4": codes span -4..3.
          const int code = low - (((b.hmask[idx] >> hbit) & 1) ? 0 : 4);
          *y++ = dl * (float)code;
        }
      }
    }
  }
}

// Q4_K/Q5_K: eight 6-bit (scale, min) pairs packed in 12 bytes. Pairs 0..3 sit in the low 6
// bits of bytes 0..3 / 4..7; pairs 4..7 take nibbles of bytes 8..11 plus the top 2 bits of
// bytes 0..3 (scales) / 4..7 (mins).
void k4_scale_min(const uint8_t s[12], int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void dequant_q4_k(const block_q4_k& b, float* y /*[256]*/) {
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int chunk = 0; chunk < 4; ++chunk) {  // 64 elements: low nibbles, then high nibbles
    const uint8_t* q = b.qs + 32 * chunk;
    int sc, mn;
    k4_scale_min(b.scales, 2 * chunk, sc, mn);
    const float d1 = d * (float)sc, m1 = dmin * (float)mn;
    k4_scale_min(b.scales, 2 * chunk + 1, sc, mn);
    const float d2 = d * (float)sc, m2 = dmin * (float)mn;
    for (int l = 0; l < 32; ++l) *y++ = d1 * (float)(q[l] & 0x0f) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * (float)(q[l] >> 4) - m2;
  }
}

void dequant_q5_k(const block_q5_k& b, float* y /*[256]*/) {
  const float d = h2f(b.d), dmin = h2f(b.dmin);
  for (int chunk = 0; chunk < 4; ++chunk) {
    const uint8_t* ql = b.qs + 32 * chunk;
    int sc, mn;
    k4_scale_min(b.scales, 2 * chunk, sc, mn);
    const float d1 = d * (float)sc, m1 = dmin * (float)mn;
    k4_scale_min(b.scales, 2 * chunk + 1, sc, mn);
    const float d2 = d * (float)sc, m2 = dmin * (float)mn;
    // qh bit 2*chunk gives the 5th bit of the low-nibble group, bit 2*chunk+1 the high one.
    for (int l = 0; l < 32; ++l)
      *y++ = d1 * (float)((ql[l] & 0x0f) | (((b.qh[l] >> (2 * chunk)) & 1) << 4)) - m1;
    for (int l = 0; l < 32; ++l)
      *y++ = d2 * (float)((ql[l] >> 4) | (((b.qh[l] >> (2 * chunk + 1)) & 1) << 4)) - m2;
  }
}

void dequant_q6_k(const block_q6_k& b, float* y /*[256]*/) {
  const float d = h2f(b.d);
  for (int half = 0; half < 2; ++half) {  // 128 elements each
    const uint8_t* ql = b.ql + 64 * half;
    const uint8_t* qh = b.qh + 32 * half;
    const int8_t* sc = b.scales + 8 * half;
    float* out = y + 128 * half;
    for (int l = 0; l < 32; ++l) {
      const int g = l / 16;
      const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      out[l] = d * (float)sc[g] * (float)q1;
      out[l + 32] = d * (float)sc[g + 2] * (float)q2;
      out[l + 64] = d * (float)sc[g + 4] * (float)q3;
      out[l + 96] = d * (float)sc[g + 6] * (float)q4;
    }
  }
}

void dequant_q8_k(const block_q8_k& b, float* y /*[256]*/) {
  for (int j = 0; j < qk_super; ++j) y[j] = b.d * (float)b.qs[j];
}

template <typename Block, typename Fn>
void dequant_blocks(const void* src, float* dst, int64_t nb, int block_elems, Fn fn) {
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t i = 0; i < nb; ++i) fn(blocks[i], dst + i * block_elems);
}

// ---- encoders ----------------------------------------------------------------------------

// Largest |x| and the signed value that attains it (first occurrence, as GGML scans).
void signed_absmax(const float* x, int n, float& amax, float& max) {
  amax = 0.0f;
  max = 0.0f;
  for (int j = 0; j < n; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
}

void min_max(const float* x, int n, float& mn, float& mx) {
  mn = INFINITY;
  mx = -INFINITY;
  for (int j = 0; j < n; ++j) {
    mn = x[j] < mn ? x[j] : mn;
    mx = x[j] > mx ? x[j] : mx;
  }
}

int clamp_code(int v, int hi) { return v < 0 ? 0 : (v > hi ? hi : v); }

// Symmetric 4/5-bit: d = max / -2^(bits-1), so the extreme value maps to code 0 and the codes
// are trunc(x/d + 2^(bits-1) + 0.5), i.e. round-half-up of x/d shifted to unsigned.
void quant_sym(const float* x, int bits, uint16_t& d_out, int* codes /*[32]*/) {
  float amax, max;
  signed_absmax(x, qk_small, amax, max);
  const float offset = (float)(1 << (bits - 1));
  const float d = max / -offset;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < qk_small; ++j) codes[j] = clamp_code((int)(x[j] * id + (offset + 0.5f)), (1 << bits) - 1);
  d_out = fp32_to_fp16(d);
}

// Asymmetric 4/5-bit: x ≈ code*d + min.
void quant_asym(const float* x, int bits, uint16_t& d_out, uint16_t& m_out, int* codes /*[32]*/) {
  float mn, mx;
  min_max(x, qk_small, mn, mx);
  const float d = (mx - mn) / (float)((1 << bits) - 1);
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < qk_small; ++j) codes[j] = clamp_code((int)((x[j] - mn) * id + 0.5f), (1 << bits) - 1);
  d_out = fp32_to_fp16(d);
  m_out = fp32_to_fp16(mn);
}

void pack_nibbles(const int* codes /*[32]*/, uint8_t* qs /*[16]*/) {
  for (int j = 0; j < qk_small / 2; ++j) qs[j] = (uint8_t)((codes[j] & 0x0f) | ((codes[j + qk_small / 2] & 0x0f) << 4));
}

void pack_fifth_bits(const int* codes /*[32]*/, uint8_t* qh /*[4]*/) {
  std::memset(qh, 0, 4);
  for (int j = 0; j < qk_small; ++j) qh[j / 8] |= (uint8_t)(((codes[j] >> 4) & 1) << (j % 8));
}

// Q8_0/Q8_1: d = amax/127, codes = roundf(x/d) (half away from zero). Returns the float d.
float quant_q8(const float* x, int8_t* qs /*[32]*/) {
  float amax = 0.0f;
  for (int j = 0; j < qk_small; ++j) amax = std::fmax(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < qk_small; ++j) qs[j] = (int8_t)std::roundf(x[j] * id);
  return d;
}

// Round half to even via the 1.5*2^23 trick GGML uses (valid for |v| < 2^22).
int nearest_even(float v) {
  const float t = v + 12582912.0f;
  int32_t i;
  std::memcpy(&i, &t, 4);
  return (i & 0x007fffff) - 0x00400000;
}

void quant_q8_k(const float* x, block_q8_k& b) {
  float amax, max;
  signed_absmax(x, qk_super, amax, max);
  if (amax == 0.0f) {
    std::memset(&b, 0, sizeof b);
    return;
  }
  // -127 (not -128) keeps codes symmetric, which the integer dot products rely on.
  const float iscale = -127.0f / max;
  for (int j = 0; j < qk_super; ++j) {
    const int v = nearest_even(iscale * x[j]);
    b.qs[j] = (int8_t)(v > 127 ? 127 : v);
  }
  for (int g = 0; g < qk_super / 16; ++g) {
    int sum = 0;
    for (int l = 0; l < 16; ++l) sum += b.qs[16 * g + l];
    b.bsums[g] = (int16_t)sum;
  }
  b.d = 1.0f / iscale;
}

}  // namespace

void dequantize_row(ggml_type type, const void* src, float* dst /*[n]*/, int64_t n) {
  const int64_t nb = block_count(type, n, "dequantize_row");
  switch (type) {
    case ggml_type::ggml_f32: std::memcpy(dst, src, (size_t)n * sizeof(float)); return;
    case ggml_type::ggml_f16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_fp32(h[i]);
      return;
    }
    case ggml_type::ggml_bf16: {
      const auto* h = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
      return;
    }
    case ggml_type::ggml_q4_0: dequant_blocks<block_q4_0>(src, dst, nb, qk_small, dequant_q4_0); return;
    case ggml_type::ggml_q4_1: dequant_blocks<block_q4_1>(src, dst, nb, qk_small, dequant_q4_1); return;
    case ggml_type::ggml_q5_0: dequant_blocks<block_q5_0>(src, dst, nb, qk_small, dequant_q5_0); return;
    case ggml_type::ggml_q5_1: dequant_blocks<block_q5_1>(src, dst, nb, qk_small, dequant_q5_1); return;
    case ggml_type::ggml_q8_0: dequant_blocks<block_q8_0>(src, dst, nb, qk_small, dequant_q8<block_q8_0>); return;
    case ggml_type::ggml_q8_1: dequant_blocks<block_q8_1>(src, dst, nb, qk_small, dequant_q8<block_q8_1>); return;
    case ggml_type::ggml_q2_k: dequant_blocks<block_q2_k>(src, dst, nb, qk_super, dequant_q2_k); return;
    case ggml_type::ggml_q3_k: dequant_blocks<block_q3_k>(src, dst, nb, qk_super, dequant_q3_k); return;
    case ggml_type::ggml_q4_k: dequant_blocks<block_q4_k>(src, dst, nb, qk_super, dequant_q4_k); return;
    case ggml_type::ggml_q5_k: dequant_blocks<block_q5_k>(src, dst, nb, qk_super, dequant_q5_k); return;
    case ggml_type::ggml_q6_k: dequant_blocks<block_q6_k>(src, dst, nb, qk_super, dequant_q6_k); return;
    case ggml_type::ggml_q8_k: dequant_blocks<block_q8_k>(src, dst, nb, qk_super, dequant_q8_k); return;
  }
  XCTX_ASSERT(false, "block_count accepted type id ", (uint32_t)type);
}

bool can_quantize(ggml_type type) {
  switch (type) {
    case ggml_type::ggml_f32:
    case ggml_type::ggml_f16:
    case ggml_type::ggml_bf16:
    case ggml_type::ggml_q4_0:
    case ggml_type::ggml_q4_1:
    case ggml_type::ggml_q5_0:
    case ggml_type::ggml_q5_1:
    case ggml_type::ggml_q8_0:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q8_k: return true;
    // K-quant weight encoders need GGML's iterative scale search; xctx only reads them.
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k: return false;
  }
  return false;
}

void quantize_row(ggml_type type, const float* src /*[n]*/, void* dst, int64_t n) {
  const int64_t nb = block_count(type, n, "quantize_row");
  XCTX_CHECK(can_quantize(type), "quantize_row: no encoder for type ", ggml_traits(type).name,
             " (supported: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1 Q8_K)");
  int codes[qk_small];
  switch (type) {
    case ggml_type::ggml_f32: std::memcpy(dst, src, (size_t)n * sizeof(float)); return;
    case ggml_type::ggml_f16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(src[i]);
      return;
    }
    case ggml_type::ggml_bf16: {
      auto* h = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(src[i]);
      return;
    }
    case ggml_type::ggml_q4_0:
      for (int64_t i = 0; i < nb; ++i) {
        auto& b = static_cast<block_q4_0*>(dst)[i];
        quant_sym(src + i * qk_small, 4, b.d, codes);
        pack_nibbles(codes, b.qs);
      }
      return;
    case ggml_type::ggml_q4_1:
      for (int64_t i = 0; i < nb; ++i) {
        auto& b = static_cast<block_q4_1*>(dst)[i];
        quant_asym(src + i * qk_small, 4, b.d, b.m, codes);
        pack_nibbles(codes, b.qs);
      }
      return;
    case ggml_type::ggml_q5_0:
      for (int64_t i = 0; i < nb; ++i) {
        auto& b = static_cast<block_q5_0*>(dst)[i];
        quant_sym(src + i * qk_small, 5, b.d, codes);
        pack_nibbles(codes, b.qs);
        pack_fifth_bits(codes, b.qh);
      }
      return;
    case ggml_type::ggml_q5_1:
      for (int64_t i = 0; i < nb; ++i) {
        auto& b = static_cast<block_q5_1*>(dst)[i];
        quant_asym(src + i * qk_small, 5, b.d, b.m, codes);
        pack_nibbles(codes, b.qs);
        pack_fifth_bits(codes, b.qh);
      }
      return;
    case ggml_type::ggml_q8_0:
      for (int64_t i = 0; i < nb; ++i) {
        auto& b = static_cast<block_q8_0*>(dst)[i];
        b.d = fp32_to_fp16(quant_q8(src + i * qk_small, b.qs));
      }
      return;
    case ggml_type::ggml_q8_1:
      for (int64_t i = 0; i < nb; ++i) {
        auto& b = static_cast<block_q8_1*>(dst)[i];
        const float d = quant_q8(src + i * qk_small, b.qs);
        int sum = 0;
        for (int j = 0; j < qk_small; ++j) sum += b.qs[j];
        // s uses the unrounded d, as GGML does, so s != fp16(d)*sum in the last bit at times.
        b.d = fp32_to_fp16(d);
        b.s = fp32_to_fp16((float)sum * d);
      }
      return;
    case ggml_type::ggml_q8_k:
      for (int64_t i = 0; i < nb; ++i) quant_q8_k(src + i * qk_super, static_cast<block_q8_k*>(dst)[i]);
      return;
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k: break;  // rejected by can_quantize above
  }
  XCTX_ASSERT(false, "quantize_row: unhandled type ", ggml_traits(type).name);
}

}  // namespace xctx::ref
