// Block decoders shared by the CUDA kernels and the host tests (XCTX_HOST_DEVICE, no CUDA
// headers): the test binary runs exactly this math against ref::dequantize_row on machines
// without a GPU. Arithmetic follows the reference decoders' order, so results are bit-equal.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/half.h"
#include "kernels/quant_blocks.h"

namespace xctx::cuda {

// Every block format is decoded in groups of 32 consecutive elements; a group is split among
// four threads, thread `sub` (0..3) taking elements {4sub..4sub+3} and {16+4sub..16+4sub+3}.
// That split matches the nibble packing (byte j holds elements j and j+16), so each thread
// reads 4 contiguous code bytes and writes/reads 2 runs of 4 contiguous floats.
constexpr int group_elems = 32;
constexpr int threads_per_group = 4;

template <ggml_type T>
constexpr bool is_block_type() {
  return T != ggml_type::ggml_f32 && T != ggml_type::ggml_f16 && T != ggml_type::ggml_bf16;
}

// Compile-time block geometry (ggml_traits() is the run-time table; both must agree).
template <ggml_type T>
constexpr int block_elems() {
  if constexpr (T == ggml_type::ggml_q2_k || T == ggml_type::ggml_q3_k || T == ggml_type::ggml_q4_k ||
                T == ggml_type::ggml_q5_k || T == ggml_type::ggml_q6_k || T == ggml_type::ggml_q8_k)
    return qk_super;
  else if constexpr (is_block_type<T>())
    return qk_small;
  else
    return 1;
}

template <ggml_type T>
constexpr int block_bytes() {
  if constexpr (T == ggml_type::ggml_q4_0) return sizeof(block_q4_0);
  else if constexpr (T == ggml_type::ggml_q4_1) return sizeof(block_q4_1);
  else if constexpr (T == ggml_type::ggml_q5_0) return sizeof(block_q5_0);
  else if constexpr (T == ggml_type::ggml_q5_1) return sizeof(block_q5_1);
  else if constexpr (T == ggml_type::ggml_q8_0) return sizeof(block_q8_0);
  else if constexpr (T == ggml_type::ggml_q8_1) return sizeof(block_q8_1);
  else if constexpr (T == ggml_type::ggml_q2_k) return sizeof(block_q2_k);
  else if constexpr (T == ggml_type::ggml_q3_k) return sizeof(block_q3_k);
  else if constexpr (T == ggml_type::ggml_q4_k) return sizeof(block_q4_k);
  else if constexpr (T == ggml_type::ggml_q5_k) return sizeof(block_q5_k);
  else if constexpr (T == ggml_type::ggml_q6_k) return sizeof(block_q6_k);
  else if constexpr (T == ggml_type::ggml_q8_k) return sizeof(block_q8_k);
  else if constexpr (T == ggml_type::ggml_f32) return 4;
  else return 2;  // f16, bf16
}

// Block sizes are all even and every multi-byte field sits at an even offset, so any block in
// a 2-byte-aligned row can be read with 16-bit loads (the backend checks that alignment).
XCTX_HOST_DEVICE inline uint32_t ld_u16(const uint8_t* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint16_t*>(p);
#else
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
#endif
}
// Four bytes at a 2-byte-aligned address as a little-endian word (byte k in bits 8k..8k+7).
XCTX_HOST_DEVICE inline uint32_t ld_u32_a2(const uint8_t* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }
XCTX_HOST_DEVICE inline uint32_t byte_of(uint32_t w, int k) { return (w >> (8 * k)) & 0xffu; }
XCTX_HOST_DEVICE inline float h16(const uint8_t* p) { return fp16_to_fp32((uint16_t)ld_u16(p)); }

// Q4_K/Q5_K 6-bit (scale, min) pair j of the 12 packed scale bytes.
XCTX_HOST_DEVICE inline void kquant_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K signed 6-bit scale of 16-element group gi (stored with a +32 offset).
XCTX_HOST_DEVICE inline int q3k_scale(const uint8_t* s, int gi) {
  const int lo = gi < 8 ? (s[gi] & 0x0f) : (s[gi - 8] >> 4);
  const int hi = (s[8 + gi % 4] >> (2 * (gi / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

// Decodes the 8 elements of thread `sub` in 32-element group `g` of the block at `blk`:
// lo[k] = element 32g + 4sub + k, hi[k] = element 32g + 16 + 4sub + k.
template <ggml_type T>
XCTX_HOST_DEVICE inline void dequant8(const uint8_t* blk, int g, int sub, float lo[4], float hi[4]) {
  static_assert(is_block_type<T>(), "dequant8 is for block formats; plain floats are read directly");
  const int l0 = 4 * sub;  // first element of the lo run inside the group
  if constexpr (T == ggml_type::ggml_q4_0) {
    const float d = h16(blk);
    const uint32_t q = ld_u32_a2(blk + 2 + l0);
    for (int k = 0; k < 4; ++k) {
      lo[k] = (float)((int)(byte_of(q, k) & 0x0f) - 8) * d;
      hi[k] = (float)((int)(byte_of(q, k) >> 4) - 8) * d;
    }
  } else if constexpr (T == ggml_type::ggml_q4_1) {
    const float d = h16(blk), m = h16(blk + 2);
    const uint32_t q = ld_u32_a2(blk + 4 + l0);
    for (int k = 0; k < 4; ++k) {
      lo[k] = (float)(byte_of(q, k) & 0x0f) * d + m;  // q*d is exact, so fma or not gives one rounding
      hi[k] = (float)(byte_of(q, k) >> 4) * d + m;
    }
  } else if constexpr (T == ggml_type::ggml_q5_0 || T == ggml_type::ggml_q5_1) {
    constexpr bool has_min = T == ggml_type::ggml_q5_1;
    const float d = h16(blk);
    const float m = has_min ? h16(blk + 2) : 0.0f;
    const uint8_t* p = blk + (has_min ? 4 : 2);
    const uint32_t qh = ld_u32_a2(p);  // bit e = 5th bit of element e
    const uint32_t q = ld_u32_a2(p + 4 + l0);
    for (int k = 0; k < 4; ++k) {
      const int e = l0 + k;
      const int qlo = (int)((byte_of(q, k) & 0x0f) | (((qh >> e) & 1u) << 4));
      const int qhi = (int)((byte_of(q, k) >> 4) | (((qh >> (e + 16)) & 1u) << 4));
      if constexpr (has_min) {
        lo[k] = (float)qlo * d + m;
        hi[k] = (float)qhi * d + m;
      } else {
        lo[k] = (float)(qlo - 16) * d;
        hi[k] = (float)(qhi - 16) * d;
      }
    }
  } else if constexpr (T == ggml_type::ggml_q8_0 || T == ggml_type::ggml_q8_1) {
    const float d = h16(blk);
    const uint8_t* qs = blk + (T == ggml_type::ggml_q8_0 ? 2 : 4);
    const uint32_t a = ld_u32_a2(qs + l0), b = ld_u32_a2(qs + 16 + l0);
    for (int k = 0; k < 4; ++k) {
      lo[k] = (float)(int8_t)byte_of(a, k) * d;
      hi[k] = (float)(int8_t)byte_of(b, k) * d;
    }
  } else if constexpr (T == ggml_type::ggml_q2_k) {
    // Element e = 32g + l: plane g%4 (2-bit shift) of byte l in the 32-byte half g/4 of qs;
    // 16-element scale group e/16.
    const float d = h16(blk + 80), dmin = h16(blk + 82);
    const uint8_t* qs = blk + 16 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
    const uint32_t a = ld_u32_a2(qs + l0), b = ld_u32_a2(qs + 16 + l0);
    const uint8_t sa = blk[2 * g], sb = blk[2 * g + 1];
    const float dla = d * (float)(sa & 0x0f), mla = dmin * (float)(sa >> 4);
    const float dlb = d * (float)(sb & 0x0f), mlb = dmin * (float)(sb >> 4);
    for (int k = 0; k < 4; ++k) {
      lo[k] = dla * (float)((byte_of(a, k) >> shift) & 3u) - mla;  // dl*q exact: fma-safe
      hi[k] = dlb * (float)((byte_of(b, k) >> shift) & 3u) - mlb;
    }
  } else if constexpr (T == ggml_type::ggml_q3_k) {
    // Like Q2_K, plus a high bit: bit g of hmask[l]; a clear bit means "subtract 4".
    const float d_all = h16(blk + 108);
    const uint8_t* qs = blk + 32 + 32 * (g / 4);
    const int shift = 2 * (g % 4);
    const uint32_t a = ld_u32_a2(qs + l0), b = ld_u32_a2(qs + 16 + l0);
    const uint32_t ha = ld_u32_a2(blk + l0), hb = ld_u32_a2(blk + 16 + l0);
    const float dla = d_all * (float)q3k_scale(blk + 96, 2 * g);
    const float dlb = d_all * (float)q3k_scale(blk + 96, 2 * g + 1);
    for (int k = 0; k < 4; ++k) {
      const int ca = (int)((byte_of(a, k) >> shift) & 3u) - (((byte_of(ha, k) >> g) & 1u) ? 0 : 4);
      const int cb = (int)((byte_of(b, k) >> shift) & 3u) - (((byte_of(hb, k) >> g) & 1u) ? 0 : 4);
      lo[k] = dla * (float)ca;
      hi[k] = dlb * (float)cb;
    }
  } else if constexpr (T == ggml_type::ggml_q4_k || T == ggml_type::ggml_q5_k) {
    // Element e = 32g + l: nibble g%2 of byte l in the 32-byte chunk g/2; (scale, min) pair g.
    constexpr bool five = T == ggml_type::ggml_q5_k;
    const float d = h16(blk), dmin = h16(blk + 2);
    int sc, mn;
    kquant_scale_min(blk + 4, g, sc, mn);
    const float dl = d * (float)sc, ml = dmin * (float)mn;
    const uint8_t* qs = blk + (five ? 48 : 16) + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    const uint32_t a = ld_u32_a2(qs + l0), b = ld_u32_a2(qs + 16 + l0);
    uint32_t ha = 0, hb = 0;
    if constexpr (five) {
      ha = ld_u32_a2(blk + 16 + l0);  // qh[l]: bit g is element 32g+l's 5th bit
      hb = ld_u32_a2(blk + 16 + 16 + l0);
    }
    for (int k = 0; k < 4; ++k) {
      uint32_t qa = (byte_of(a, k) >> shift) & 0x0fu, qb = (byte_of(b, k) >> shift) & 0x0fu;
      if constexpr (five) {
        qa |= ((byte_of(ha, k) >> g) & 1u) << 4;
        qb |= ((byte_of(hb, k) >> g) & 1u) << 4;
      }
      lo[k] = dl * (float)qa - ml;  // dl*q exact: fma-safe
      hi[k] = dl * (float)qb - ml;
    }
  } else if constexpr (T == ggml_type::ggml_q6_k) {
    // Element e = 32g + l, half h = g/4, quarter u = g%4: low 4 bits are nibble u/2 of
    // ql[64h + 32(u%2) + l], high 2 bits are bits 2u..2u+1 of qh[32h + l]; scale 8h + l/16 + 2u.
    const float d = h16(blk + 208);
    const int h = g / 4, u = g % 4;
    const uint8_t* ql = blk + 64 * h + 32 * (u % 2);
    const uint8_t* qh = blk + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192) + 8 * h + 2 * u;
    const int ls = 4 * (u / 2), hs = 2 * u;
    const uint32_t a = ld_u32_a2(ql + l0), b = ld_u32_a2(ql + 16 + l0);
    const uint32_t ha = ld_u32_a2(qh + l0), hb = ld_u32_a2(qh + 16 + l0);
    const float dsa = d * (float)sc[0], dsb = d * (float)sc[1];  // (d*scale) first, as the reference
    for (int k = 0; k < 4; ++k) {
      const int qa = (int)(((byte_of(a, k) >> ls) & 0x0fu) | (((byte_of(ha, k) >> hs) & 3u) << 4)) - 32;
      const int qb = (int)(((byte_of(b, k) >> ls) & 0x0fu) | (((byte_of(hb, k) >> hs) & 3u) << 4)) - 32;
      lo[k] = dsa * (float)qa;
      hi[k] = dsb * (float)qb;
    }
  } else if constexpr (T == ggml_type::ggml_q8_k) {
    const float d = bits_to_float(ld_u32_a2(blk));
    const uint8_t* qs = blk + 4 + 32 * g;
    const uint32_t a = ld_u32_a2(qs + l0), b = ld_u32_a2(qs + 16 + l0);
    for (int k = 0; k < 4; ++k) {
      lo[k] = d * (float)(int8_t)byte_of(a, k);
      hi[k] = d * (float)(int8_t)byte_of(b, k);
    }
  }
}

// Element c of a row of plain floats.
template <ggml_type T>
XCTX_HOST_DEVICE inline float load_plain(const uint8_t* row, int64_t c) {
  static_assert(!is_block_type<T>());
  if constexpr (T == ggml_type::ggml_f32) {
    return bits_to_float(ld_u32_a2(row + 4 * c));
  } else if constexpr (T == ggml_type::ggml_f16) {
    return fp16_to_fp32((uint16_t)ld_u16(row + 2 * c));
  } else {
    return bf16_to_fp32((uint16_t)ld_u16(row + 2 * c));
  }
}

template <ggml_type T>
using type_tag = std::integral_constant<ggml_type, T>;

// Calls fn(type_tag<T>{}) with the run-time type as a template argument. Every GGML weight
// type the reference decodes is handled; returns false for ids outside the enum.
template <typename Fn>
bool dispatch_weight_type(ggml_type t, Fn&& fn) {
  switch (t) {  // no default: a new enumerator must be handled here
    case ggml_type::ggml_f32: fn(type_tag<ggml_type::ggml_f32>{}); return true;
    case ggml_type::ggml_f16: fn(type_tag<ggml_type::ggml_f16>{}); return true;
    case ggml_type::ggml_bf16: fn(type_tag<ggml_type::ggml_bf16>{}); return true;
    case ggml_type::ggml_q4_0: fn(type_tag<ggml_type::ggml_q4_0>{}); return true;
    case ggml_type::ggml_q4_1: fn(type_tag<ggml_type::ggml_q4_1>{}); return true;
    case ggml_type::ggml_q5_0: fn(type_tag<ggml_type::ggml_q5_0>{}); return true;
    case ggml_type::ggml_q5_1: fn(type_tag<ggml_type::ggml_q5_1>{}); return true;
    case ggml_type::ggml_q8_0: fn(type_tag<ggml_type::ggml_q8_0>{}); return true;
    case ggml_type::ggml_q8_1: fn(type_tag<ggml_type::ggml_q8_1>{}); return true;
    case ggml_type::ggml_q2_k: fn(type_tag<ggml_type::ggml_q2_k>{}); return true;
    case ggml_type::ggml_q3_k: fn(type_tag<ggml_type::ggml_q3_k>{}); return true;
    case ggml_type::ggml_q4_k: fn(type_tag<ggml_type::ggml_q4_k>{}); return true;
    case ggml_type::ggml_q5_k: fn(type_tag<ggml_type::ggml_q5_k>{}); return true;
    case ggml_type::ggml_q6_k: fn(type_tag<ggml_type::ggml_q6_k>{}); return true;
    case ggml_type::ggml_q8_k: fn(type_tag<ggml_type::ggml_q8_k>{}); return true;
  }
  return false;
}

// Host reference use: decodes a whole row (n multiple of the block size) through dequant8 /
// load_plain, i.e. through the device code path.
template <ggml_type T>
void dequantize_row_via_device_math(const uint8_t* row, float* out /*[n]*/, int64_t n) {
  if constexpr (is_block_type<T>()) {
    constexpr int groups_per_block = block_elems<T>() / group_elems;
    for (int64_t e = 0; e < n; e += group_elems) {
      const int64_t grp = e / group_elems;
      const uint8_t* blk = row + (grp / groups_per_block) * block_bytes<T>();
      for (int sub = 0; sub < threads_per_group; ++sub) {
        float lo[4], hi[4];
        dequant8<T>(blk, (int)(grp % groups_per_block), sub, lo, hi);
        for (int k = 0; k < 4; ++k) {
          out[e + 4 * sub + k] = lo[k];
          out[e + 16 + 4 * sub + k] = hi[k];
        }
      }
    }
  } else {
    for (int64_t c = 0; c < n; ++c) out[c] = load_plain<T>(row, c);
  }
}

}  // namespace xctx::cuda
