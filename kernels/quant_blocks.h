// Weight element types (GGML numbering, as stored in GGUF files) and their block layouts.
// Read by the host compiler and nvcc alike; sizes are pinned with static_assert so a layout
// change breaks the build instead of silently misreading files.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/half.h"

namespace xctx {

// Values are the on-disk GGML type ids; do not renumber.
enum class ggml_type : uint32_t {
  ggml_f32 = 0,
  ggml_f16 = 1,
  ggml_q4_0 = 2,
  ggml_q4_1 = 3,
  ggml_q5_0 = 6,
  ggml_q5_1 = 7,
  ggml_q8_0 = 8,
  ggml_q8_1 = 9,
  ggml_q2_k = 10,
  ggml_q3_k = 11,
  ggml_q4_k = 12,
  ggml_q5_k = 13,
  ggml_q6_k = 14,
  ggml_q8_k = 15,
  ggml_bf16 = 30,
};

constexpr int qk_small = 32;   // elements per block of the legacy quants
constexpr int qk_super = 256;  // elements per super-block of the K-quants
constexpr int k_scale_size = 12;

struct block_q4_0 {
  uint16_t d;                // fp16 scale
  uint8_t qs[qk_small / 2];  // nibbles: low = element j, high = element j+16
};
struct block_q4_1 {
  uint16_t d, m;  // fp16 scale and minimum: x = q*d + m
  uint8_t qs[qk_small / 2];
};
struct block_q5_0 {
  uint16_t d;
  uint8_t qh[4];  // 5th bit of each of the 32 elements
  uint8_t qs[qk_small / 2];
};
struct block_q5_1 {
  uint16_t d, m;
  uint8_t qh[4];
  uint8_t qs[qk_small / 2];
};
struct block_q8_0 {
  uint16_t d;
  int8_t qs[qk_small];
};
struct block_q8_1 {  // activation format for integer dot products with q4_1 / q5_1
  uint16_t d, s;     // s = d * sum(qs)
  int8_t qs[qk_small];
};
struct block_q2_k {
  uint8_t scales[qk_super / 16];  // 4-bit scale and 4-bit min per 16 elements
  uint8_t qs[qk_super / 4];
  uint16_t d, dmin;
};
struct block_q3_k {
  uint8_t hmask[qk_super / 8];
  uint8_t qs[qk_super / 4];
  uint8_t scales[12];
  uint16_t d;
};
struct block_q4_k {
  uint16_t d, dmin;
  uint8_t scales[k_scale_size];  // 6-bit scales and mins, packed
  uint8_t qs[qk_super / 2];
};
struct block_q5_k {
  uint16_t d, dmin;
  uint8_t scales[k_scale_size];
  uint8_t qh[qk_super / 8];
  uint8_t qs[qk_super / 2];
};
struct block_q6_k {
  uint8_t ql[qk_super / 2];
  uint8_t qh[qk_super / 4];
  int8_t scales[qk_super / 16];
  uint16_t d;
};
struct block_q8_k {
  float d;
  int8_t qs[qk_super];
  int16_t bsums[qk_super / 16];
};

static_assert(sizeof(block_q4_0) == 18);
static_assert(sizeof(block_q4_1) == 20);
static_assert(sizeof(block_q5_0) == 22);
static_assert(sizeof(block_q5_1) == 24);
static_assert(sizeof(block_q8_0) == 34);
static_assert(sizeof(block_q8_1) == 36);
static_assert(sizeof(block_q2_k) == 84);
static_assert(sizeof(block_q3_k) == 110);
static_assert(sizeof(block_q4_k) == 144);
static_assert(sizeof(block_q5_k) == 176);
static_assert(sizeof(block_q6_k) == 210);
static_assert(sizeof(block_q8_k) == 292);

struct ggml_type_traits {
  const char* name;
  int block_elems;  // elements per block (1 for plain float types)
  int block_bytes;  // bytes per block
};

// Traits of a type. Ids read from a file may be outside the enum: those (and types xctx cannot
// compute with) give name == nullptr, which callers turn into an error naming the file/tensor.
XCTX_HOST_DEVICE inline ggml_type_traits ggml_traits(ggml_type t) {
  switch (t) {  // no default: a new enumerator must be handled here
    case ggml_type::ggml_f32: return {"F32", 1, 4};
    case ggml_type::ggml_f16: return {"F16", 1, 2};
    case ggml_type::ggml_bf16: return {"BF16", 1, 2};
    case ggml_type::ggml_q4_0: return {"Q4_0", qk_small, sizeof(block_q4_0)};
    case ggml_type::ggml_q4_1: return {"Q4_1", qk_small, sizeof(block_q4_1)};
    case ggml_type::ggml_q5_0: return {"Q5_0", qk_small, sizeof(block_q5_0)};
    case ggml_type::ggml_q5_1: return {"Q5_1", qk_small, sizeof(block_q5_1)};
    case ggml_type::ggml_q8_0: return {"Q8_0", qk_small, sizeof(block_q8_0)};
    case ggml_type::ggml_q8_1: return {"Q8_1", qk_small, sizeof(block_q8_1)};
    case ggml_type::ggml_q2_k: return {"Q2_K", qk_super, sizeof(block_q2_k)};
    case ggml_type::ggml_q3_k: return {"Q3_K", qk_super, sizeof(block_q3_k)};
    case ggml_type::ggml_q4_k: return {"Q4_K", qk_super, sizeof(block_q4_k)};
    case ggml_type::ggml_q5_k: return {"Q5_K", qk_super, sizeof(block_q5_k)};
    case ggml_type::ggml_q6_k: return {"Q6_K", qk_super, sizeof(block_q6_k)};
    case ggml_type::ggml_q8_k: return {"Q8_K", qk_super, sizeof(block_q8_k)};
  }
  return {nullptr, 0, 0};
}

// Bytes of one row of n_cols elements (n_cols must be a multiple of the block size).
XCTX_HOST_DEVICE inline size_t ggml_row_bytes(ggml_type t, int64_t n_cols) {
  const ggml_type_traits tr = ggml_traits(t);
  return (size_t)(n_cols / tr.block_elems) * (size_t)tr.block_bytes;
}

}  // namespace xctx
