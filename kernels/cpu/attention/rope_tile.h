// RoPE applied on the fly to tiles of pre-RoPE keys, shared by the quantized-cache attention
// kernels (kvq.cpp, xq.cpp). Calling sincos per token and rotary pair would cost more than
// reading the codes, so the angles of a tile's first position are built in double from tables
// of cos/sin(b·2^(8l)·θ) for each byte b of the position (four double complex products; a
// double sincos per pair and tile measured ~5 ms of a 30 ms decode step at 512K keys), and each
// token inside the tile derives from them and a table of cos/sin(j·θ), j < kRopeTile (one float
// complex multiply). A key's rotation is thus a function of its position and its
// tile's first position only -- never of where a run of tiles started -- which the
// rank-count-invariant attention relies on. Positions that span more than a tile fall back to
// exact per-token angles.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/ops.h"

namespace xctx::cpu::impl {

inline constexpr int kRopeTile = 64;   // tokens per tile the offset table covers
inline constexpr int kMaxRot = 1024;   // rotary dims supported

struct rope_table {
  rope_config cfg;
  int n_pair = 0;
  std::vector<double> theta;               // [n_pair] angle per unit of position
  std::vector<float> off_cos, off_sin;     // [kRopeTile, n_pair] cos/sin(j * theta_i)
  // Offsets inside an attention unit in the element order a rotation wants: [kAttnUnit, n_rot],
  // cos2[2i] = cos2[2i+1] = cos(j theta_i), sin2 = (-sin, +sin) (the fused decode kernel).
  std::vector<float> unit_cos2, unit_sin2;
  // The same angles pair-major, [n_pair, kUnitAngleStride] (kvq_impl.h): cos/sin(j theta_i) for
  // consecutive offsets j side by side (the AVX-512 fused kernel's keys-in-lanes scores load 16
  // keys' angles at once), from unit_cos_t() / unit_sin_t(): 64-byte aligned, so such a load
  // does not straddle two cache lines (measured: +30% on those scores when it does).
  std::vector<float> unit_cos_t_buf, unit_sin_t_buf;  // 16 floats to spare for the alignment
  size_t unit_cos_t_skip = 0, unit_sin_t_skip = 0;     // floats before each one's first 64-byte boundary
  const float* unit_cos_t() const { return unit_cos_t_buf.data() + unit_cos_t_skip; }
  const float* unit_sin_t() const { return unit_sin_t_buf.data() + unit_sin_t_skip; }
  // [kPosBytes, 256, n_pair] cos/sin(b << (8 l) * theta_i), exactly rounded doubles.
  std::vector<double> byte_cos, byte_sin;
};
inline constexpr int kPosBytes = 4;  // positions are int32

// cos/sin of pos * theta_i for every pair (double): the table product above for pos >= 0,
// sincos for negative positions. A function of pos alone.
void rope_angles(const rope_table& tab, int64_t pos, double* c /*[n_pair]*/, double* s /*[n_pair]*/);
// Built once per distinct config (a process sees one or two) and kept for its lifetime.
const rope_table& rope_table_for(const rope_config& cfg);

// The exact angles of the last tile start seen (recomputed for any other start).
struct rope_cursor {
  bool valid = false;
  int64_t next_pos = 0;
  std::vector<double> c, s;  // [n_pair]
};

// Rotates nt <= kRopeTile tokens of keys [nt, n_kvh, head_dim] to positions pos.
void rope_tile(isa v, float* k, const int32_t* pos /*[nt]*/, int nt, int n_kvh, const rope_table& tab,
               rope_cursor& cur);

// Rotates each row t of x [n, n_head, head_dim] further by the angle of position turn[t]
// (exact angles, any sign): rotations compose, so a row rotated to i and turned by d is at i + d.
void rotate_rows(isa v, float* x, const int64_t* turn /*[n]*/, int64_t n, int n_head, const rope_table& tab);

// SelfExtend's grouped-side queries: q [n_q, n_head, head_dim], rotated to q_pos, turned to
// self_extend_query_pos (kernels/ops.h). A function of each query and its position alone.
std::vector<float> self_extend_queries(const float* q, const int32_t* q_pos, int64_t n_q, int n_head,
                                       const rope_config& cfg);

}  // namespace xctx::cpu::impl
