// IEEE half and bfloat16 conversions usable on host and device (XCTX_HOST_DEVICE).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define XCTX_HOST_DEVICE __host__ __device__
#else
#define XCTX_HOST_DEVICE
#endif

namespace xctx {

// Storage type for IEEE binary16; arithmetic goes through float.
struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};
static_assert(sizeof(half_t) == 2 && sizeof(bf16_t) == 2);

XCTX_HOST_DEVICE inline float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
XCTX_HOST_DEVICE inline uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

// Exact half -> float (handles subnormals, inf, nan).
XCTX_HOST_DEVICE inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    // subnormal: value = mant * 2^-24
    float v = (float)mant * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// float -> half, round to nearest even, overflow to inf.
XCTX_HOST_DEVICE inline uint16_t fp32_to_fp16(float f) {
  uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
  if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (x < 0x38800000u) {                                     // below the smallest normal half
    // subnormal half: value / 2^-24 rounded to nearest even
    float v = bits_to_float(x) * 16777216.0f;
    uint32_t m = (uint32_t)v;
    float r = v - (float)m;
    if (r > 0.5f || (r == 0.5f && (m & 1u))) m++;
    return (uint16_t)(sign | m);
  }
  uint32_t mant = x & 0x7fffffu;
  uint32_t exp = (x >> 23) - 112u;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

XCTX_HOST_DEVICE inline float bf16_to_fp32(uint16_t b) { return bits_to_float((uint32_t)b << 16); }
XCTX_HOST_DEVICE inline uint16_t fp32_to_bf16(float f) {
  uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet nan
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

}  // namespace xctx
