// cpu::matmul / cpu::get_rows / cpu::dequantize_row against the reference kernels.
//
// Error bounds, per output element y[t, r] (W dequantized exactly as the reference does):
//  * integer decode paths (legacy quants): activations are rounded to a grid of step
//    d_b = max|x_b| / L per 32-element block b (L = 127 for int8, act_q8; 32767 for int16,
//    act_q16), so |x - x̃| <= d_b / 2 (plus the rounding of x * (1/d_b), a relative 2^-23 of at
//    most L steps). Hence
//        |y_cpu - y_ref| <= Σ_b d_b (1/2 + L·2^-23) Σ_{i in b} |w_i|  +  float error.
//    The float error: each block contributes d_w·d_x·Σq·qx and c·d_x·Σqx (c = m, -8d or -16d),
//    integer sums are exact (converted to float: one more rounding per block in the scalar
//    int16 kernel), and at most (n_blocks + 10) roundings of relative 2^-24 hit terms of
//    magnitude (|w_i| + 2|c_b|)·|x̃_i| <= (|w_i| + 2|c_b|)(|x_i| + d_b).
//  * float paths (F32/F16/BF16 and K-quant decode, every sgemm prefill): only accumulation
//    error, <= (n_cols + 8)·2^-23·Σ|w_i||x_i|.
//  * float-activation decode path of the legacy quants (act_f32, the default): only accumulation
//    error too, with c = 1 in  |y - y_ref| <= c·(n_cols + 8)·2^-23·Σ a_i  (a chain of n terms
//    errs by at most (n - 1)·2^-24 of the sum of magnitudes; the 8 covers the lane and block
//    sums). a_i = |w_i x_i| where the kernel computes d·Σ(q - offset)·x with exact integer
//    codes (Q4_0, Q5_0, Q8_0, and every type in the scalar kernel, which dequantizes like the
//    reference); for Q4_1/Q5_1 the AVX2 kernel computes d·Σq·x + m·Σx, whose terms are
//    |d q_i x_i| and |m x_i| <= (|w_i| + 2|m|)|x_i|, so a_i = (|w_i| + 2|m|)|x_i| there.
//  * the reference itself rounds its double sum to float: 2^-24·|y| <= 2^-24·Σ|w_i||x_i|.
// The activation bound is a worst case (all roundings aligned), so a subtly wrong kernel could
// hide under it; the integer path is therefore also held to the float-error bound alone against
// Σ w_i·x̃_i, x̃ being the grid activations from quantize_act_scalar (tested bit-equal to the
// AVX2 quantizer and within half a step of x).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/ops.h"
#include "kernels/matmul_test_util.h"
#include "kernels/ref/ref_ops.h"
#include "registry/registry.h"
#include "test_util.h"

namespace xctx {
namespace {

using cpu::detail::prefill_mode;
using test::quantized_weights;
using test::random_activations;

constexpr double k_f32_eps = 1.0 / (1 << 23);  // FLT_EPSILON
constexpr double k_unit_round = k_f32_eps / 2;
// Half a step of the activation grid, widened by the rounding of x·(1/d) (<= L steps · 2^-23).
constexpr double act_half_step(int levels) { return 0.5 + levels * k_f32_eps; }

// The integer decode paths and their grids: index 0 act_q8 (int8), 1 act_q16 (int16).
constexpr decode_activations k_int_acts[] = {decode_activations::act_q8, decode_activations::act_q16};
constexpr int k_int_levels[] = {127, 32767};
int int_path_index(decode_activations act) { return act == decode_activations::act_q16 ? 1 : 0; }

// Row t of x on path p's grid (x̃ = d·q from quantize_act_scalar) and each block's step d.
void grid_activations(int p, const float* x, int64_t n_cols, double* x_grid, double* step) {
  const int64_t nb = n_cols / qk_small;
  std::vector<float> d((size_t)nb), s((size_t)nb);
  std::vector<int32_t> q((size_t)n_cols);
  if (p == 0) {
    std::vector<int8_t> q8((size_t)n_cols);
    cpu::detail::quantize_act_scalar(x, n_cols, q8.data(), d.data(), s.data());
    std::copy(q8.begin(), q8.end(), q.begin());
  } else {
    std::vector<int16_t> q16((size_t)n_cols);
    cpu::detail::quantize_act_scalar(x, n_cols, q16.data(), d.data(), s.data());
    std::copy(q16.begin(), q16.end(), q.begin());
  }
  for (int64_t i = 0; i < n_cols; ++i) x_grid[i] = (double)d[(size_t)(i / qk_small)] * q[(size_t)i];
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int j = 0; j < qk_small; ++j) amax = std::max(amax, std::fabs(x[b * qk_small + j]));
    step[b] = amax / (double)k_int_levels[p];
  }
}

struct shape {
  const char* name;
  int64_t n_rows, n_cols;
};

// The SmolLM2-135M matrices plus odd sizes (row counts not a multiple of the 16-row thread
// split, a single row, few blocks).
constexpr shape k_wq{"wq", 576, 576};
constexpr shape k_wk{"wk", 192, 576};
constexpr shape k_up{"ffn_up", 1536, 576};
constexpr shape k_down{"ffn_down", 576, 1536};
constexpr shape k_odd{"odd", 37, 96};
constexpr shape k_odd_k{"odd_k", 67, 512};
constexpr shape k_one{"one", 1, 256};

struct mm_case {
  ggml_type type;
  shape s;
  int64_t n_tok;
  bool raw_blocks;  // random block bytes (all codes, e.g. Q8_0's -128) instead of quantize_row
  uint32_t seed;
};

std::string case_name(const testing::TestParamInfo<mm_case>& info) {
  const mm_case& c = info.param;
  return std::string(ggml_traits(c.type).name) + "_" + c.s.name + "_" + std::to_string(c.s.n_rows) + "x" +
         std::to_string(c.s.n_cols) + "_t" + std::to_string(c.n_tok) + (c.raw_blocks ? "_raw" : "");
}

bool is_k_quant(ggml_type t) {
  return t == ggml_type::ggml_q2_k || t == ggml_type::ggml_q3_k || t == ggml_type::ggml_q4_k ||
         t == ggml_type::ggml_q5_k || t == ggml_type::ggml_q6_k;
}

uint16_t random_scale(std::mt19937& rng, float lo, float hi) {
  return fp32_to_fp16(std::uniform_real_distribution<float>(lo, hi)(rng));
}

// Random bytes for every block, then finite fp16 scales written over the scale fields.
std::vector<uint8_t> random_blocks(ggml_type type, int64_t n_rows, int64_t n_cols, std::mt19937& rng) {
  const ggml_type_traits tr = ggml_traits(type);
  const int64_t n_blocks = n_rows * n_cols / tr.block_elems;
  std::vector<uint8_t> data((size_t)(n_blocks * tr.block_bytes));
  for (auto& b : data) b = (uint8_t)(rng() & 0xff);
  for (int64_t i = 0; i < n_blocks; ++i) {
    uint8_t* p = data.data() + i * tr.block_bytes;
    switch (type) {
      case ggml_type::ggml_q4_0: reinterpret_cast<block_q4_0*>(p)->d = random_scale(rng, -0.01f, 0.01f); break;
      case ggml_type::ggml_q5_0: reinterpret_cast<block_q5_0*>(p)->d = random_scale(rng, -0.01f, 0.01f); break;
      case ggml_type::ggml_q8_0: reinterpret_cast<block_q8_0*>(p)->d = random_scale(rng, -0.001f, 0.001f); break;
      case ggml_type::ggml_q4_1: {
        auto* b = reinterpret_cast<block_q4_1*>(p);
        b->d = random_scale(rng, 0.0f, 0.01f);
        b->m = random_scale(rng, -0.1f, 0.05f);
        break;
      }
      case ggml_type::ggml_q5_1: {
        auto* b = reinterpret_cast<block_q5_1*>(p);
        b->d = random_scale(rng, 0.0f, 0.005f);
        b->m = random_scale(rng, -0.1f, 0.05f);
        break;
      }
      case ggml_type::ggml_q2_k: {
        auto* b = reinterpret_cast<block_q2_k*>(p);
        b->d = random_scale(rng, 0.0f, 0.01f);
        b->dmin = random_scale(rng, 0.0f, 0.01f);
        break;
      }
      case ggml_type::ggml_q3_k: reinterpret_cast<block_q3_k*>(p)->d = random_scale(rng, -0.005f, 0.005f); break;
      case ggml_type::ggml_q4_k: {
        auto* b = reinterpret_cast<block_q4_k*>(p);
        b->d = random_scale(rng, 0.0f, 0.002f);
        b->dmin = random_scale(rng, 0.0f, 0.002f);
        break;
      }
      case ggml_type::ggml_q5_k: {
        auto* b = reinterpret_cast<block_q5_k*>(p);
        b->d = random_scale(rng, 0.0f, 0.001f);
        b->dmin = random_scale(rng, 0.0f, 0.002f);
        break;
      }
      case ggml_type::ggml_q6_k: reinterpret_cast<block_q6_k*>(p)->d = random_scale(rng, -0.001f, 0.001f); break;
      case ggml_type::ggml_f32:
      case ggml_type::ggml_f16:
      case ggml_type::ggml_bf16:
      case ggml_type::ggml_q8_1:
      case ggml_type::ggml_q8_k: ADD_FAILURE() << "random_blocks: no layout for " << tr.name; break;
    }
  }
  return data;
}

// |c| of a legacy block: the weight offset the integer path multiplies with the block sum.
double block_offset_abs(ggml_type type, const uint8_t* p) {
  if (type == ggml_type::ggml_q4_0) return 8.0 * std::fabs(fp16_to_fp32(reinterpret_cast<const block_q4_0*>(p)->d));
  if (type == ggml_type::ggml_q5_0) return 16.0 * std::fabs(fp16_to_fp32(reinterpret_cast<const block_q5_0*>(p)->d));
  if (type == ggml_type::ggml_q4_1) return std::fabs(fp16_to_fp32(reinterpret_cast<const block_q4_1*>(p)->m));
  if (type == ggml_type::ggml_q5_1) return std::fabs(fp16_to_fp32(reinterpret_cast<const block_q5_1*>(p)->m));
  return 0.0;  // Q8_0: no offset
}

class matmul_test : public testing::TestWithParam<mm_case> {
 protected:
  void SetUp() override {
    const mm_case& c = GetParam();
    std::printf("seed %u\n", c.seed);
    std::mt19937 rng(c.seed);
    w_data_ = (c.raw_blocks || is_k_quant(c.type)) ? random_blocks(c.type, c.s.n_rows, c.s.n_cols, rng)
                                                   : quantized_weights(c.type, c.s.n_rows, c.s.n_cols, rng);
    w_ = weight_view{c.type, c.s.n_rows, c.s.n_cols, w_data_.data()};
    x_ = random_activations(c.n_tok, c.s.n_cols, rng);
    y_ref_.resize((size_t)(c.n_tok * c.s.n_rows));
    ref::matmul(w_, x_.data(), c.n_tok, y_ref_.data());
    compute_bounds();
  }

  // abs_dot_[t, r] = Σ|w||x|; quant_term_[t, r] = the activation-rounding term and
  // int_float_err_[t, r] the integer path's float error term of the header comment.
  void compute_bounds() {
    const mm_case& c = GetParam();
    const int64_t n_rows = c.s.n_rows, n_cols = c.s.n_cols, n_tok = c.n_tok;
    const bool legacy = cpu::detail::is_legacy_quant(c.type);
    const int64_t nb = n_cols / qk_small;
    const size_t row_bytes = w_.row_bytes();
    abs_dot_.assign((size_t)(n_tok * n_rows), 0.0);
    abs_terms_f_.assign((size_t)(n_tok * n_rows), 0.0);
    const bool has_min = c.type == ggml_type::ggml_q4_1 || c.type == ggml_type::ggml_q5_1;
    std::vector<float> w((size_t)n_cols);  // [n_cols]
    std::vector<double> blk_abs((size_t)nb), blk_off((size_t)nb);  // [nb]
    std::vector<double> x_max((size_t)(n_tok * nb));  // [n_tok, nb]
    std::vector<double> x_step[2], x_grid[2];  // per integer path: [n_tok, nb], [n_tok, n_cols] (x as it sees them)
    for (int p = 0; p < 2; ++p) {
      quant_term_[p].assign((size_t)(n_tok * n_rows), 0.0);
      int_float_err_[p].assign((size_t)(n_tok * n_rows), 0.0);
      y_grid_[p].assign((size_t)(n_tok * n_rows), 0.0);
      if (!legacy) continue;
      x_step[p].resize((size_t)(n_tok * nb));
      x_grid[p].resize((size_t)(n_tok * n_cols));
      for (int64_t t = 0; t < n_tok; ++t) {
        grid_activations(p, x_.data() + t * n_cols, n_cols, x_grid[p].data() + t * n_cols, x_step[p].data() + t * nb);
      }
    }
    for (int64_t t = 0; legacy && t < n_tok; ++t) {
      for (int64_t b = 0; b < nb; ++b) {
        float amax = 0.0f;
        for (int j = 0; j < qk_small; ++j) amax = std::max(amax, std::fabs(x_[(size_t)(t * n_cols + b * qk_small + j)]));
        x_max[(size_t)(t * nb + b)] = amax;
      }
    }
    const double float_err_q = (double)(nb + 10) * k_f32_eps;
    for (int64_t r = 0; r < n_rows; ++r) {
      const uint8_t* row = w_data_.data() + (size_t)r * row_bytes;
      ref::dequantize_row(c.type, row, w.data(), n_cols);
      if (legacy) {
        const size_t block_bytes = (size_t)ggml_traits(c.type).block_bytes;
        for (int64_t b = 0; b < nb; ++b) {
          double s = 0.0;
          for (int j = 0; j < qk_small; ++j) s += std::fabs((double)w[(size_t)(b * qk_small + j)]);
          blk_abs[(size_t)b] = s;
          blk_off[(size_t)b] = block_offset_abs(c.type, row + b * block_bytes);
        }
      }
      for (int64_t t = 0; t < n_tok; ++t) {
        const float* xt = x_.data() + t * n_cols;
        double ad = 0.0;
        for (int64_t i = 0; i < n_cols; ++i) ad += std::fabs((double)w[(size_t)i] * (double)xt[i]);
        abs_dot_[(size_t)(t * n_rows + r)] = ad;
        double af = ad;
        if (has_min) {
          af = 0.0;
          for (int64_t i = 0; i < n_cols; ++i) {
            af += (std::fabs((double)w[(size_t)i]) + 2.0 * blk_off[(size_t)(i / qk_small)]) * std::fabs((double)xt[i]);
          }
        }
        abs_terms_f_[(size_t)(t * n_rows + r)] = af;
        for (int p = 0; legacy && p < 2; ++p) {
          double yg = 0.0;
          for (int64_t i = 0; i < n_cols; ++i) yg += (double)w[(size_t)i] * x_grid[p][(size_t)(t * n_cols + i)];
          y_grid_[p][(size_t)(t * n_rows + r)] = yg;
          double q = 0.0, f = 0.0;
          for (int64_t b = 0; b < nb; ++b) {
            const double step = x_step[p][(size_t)(t * nb + b)];
            q += step * act_half_step(k_int_levels[p]) * blk_abs[(size_t)b];
            f += (blk_abs[(size_t)b] + 2.0 * qk_small * blk_off[(size_t)b]) * (x_max[(size_t)(t * nb + b)] + step);
          }
          quant_term_[p][(size_t)(t * n_rows + r)] = q;
          int_float_err_[p][(size_t)(t * n_rows + r)] = float_err_q * f;
        }
      }
    }
  }

  double float_bound(int64_t i) const {
    const double n = (double)GetParam().s.n_cols;
    return ((n + 8.0) * k_f32_eps + k_unit_round) * abs_dot_[(size_t)i] + std::numeric_limits<float>::denorm_min();
  }
  // The float-activation decode path of the legacy quants (header comment).
  double decode_f32_bound(int64_t i) const {
    const double n = (double)GetParam().s.n_cols;
    return (n + 8.0) * k_f32_eps * abs_terms_f_[(size_t)i] + k_unit_round * abs_dot_[(size_t)i] +
           std::numeric_limits<float>::denorm_min();
  }
  // The decode path's bound with activations `act`: integer path for legacy quants under
  // act_q8 / act_q16, float dot otherwise.
  double decode_bound(int64_t i, decode_activations act) const {
    if (!cpu::detail::is_legacy_quant(GetParam().type)) return float_bound(i);
    if (act == decode_activations::act_f32) return decode_f32_bound(i);
    const int p = int_path_index(act);
    return quant_term_[p][(size_t)i] + int_float_err_[p][(size_t)i] + k_unit_round * abs_dot_[(size_t)i] +
           std::numeric_limits<float>::denorm_min();
  }

  // The integer prefill GEMM with activations `pre` (q8 or q16; test_matmul_prefill_int.cpp
  // derives its float error): the same activation grid as the decode path's, and a chain of
  // (3 nb + 4) roundings of 2^-24 over terms bounded by the M that int_float_err_ sums (the
  // decode path's (nb + 10)·2^-23 of M, rescaled).
  double prefill_int_bound(int64_t i, prefill_activations pre) const {
    const int p = pre == prefill_activations::pre_q16 ? 1 : 0;
    const double nb = (double)(GetParam().s.n_cols / qk_small);
    const double rescale = ((3.0 * nb + 4.0) * k_unit_round) / ((nb + 10.0) * k_f32_eps);
    return quant_term_[p][(size_t)i] + int_float_err_[p][(size_t)i] * std::max(1.0, rescale) +
           k_unit_round * abs_dot_[(size_t)i] + std::numeric_limits<float>::denorm_min();
  }

  // Integer paths only: against the exact product with the grid activations, where nothing but
  // float rounding separates them.
  void expect_near_grid(const std::vector<float>& y, decode_activations act, const char* what) const {
    if (!cpu::detail::is_legacy_quant(GetParam().type)) return;
    const int p = int_path_index(act);
    const std::vector<float> want(y_grid_[p].begin(), y_grid_[p].end());
    expect_close(y, want,
                 [&](int64_t i) {
                   return int_float_err_[p][(size_t)i] + k_unit_round * std::fabs(y_grid_[p][(size_t)i]) +
                          std::numeric_limits<float>::denorm_min();
                 },
                 what);
  }

  template <typename Bound>
  void expect_close(const std::vector<float>& y, const std::vector<float>& y_want, Bound bound,
                    const char* what) const {
    const mm_case& c = GetParam();
    int64_t n_bad = 0;
    for (int64_t i = 0; i < (int64_t)y.size(); ++i) {
      const double err = std::fabs((double)y[(size_t)i] - (double)y_want[(size_t)i]);
      if (!(err <= bound(i))) {  // NaN (an unwritten output) fails too
        if (++n_bad <= 5) {
          ADD_FAILURE() << what << ": y[t=" << i / c.s.n_rows << ", r=" << i % c.s.n_rows << "] = " << y[(size_t)i]
                        << ", want " << y_want[(size_t)i] << ", |err| " << err << " > bound " << bound(i);
        }
      }
    }
    EXPECT_EQ(n_bad, 0) << what << ": " << n_bad << " of " << y.size() << " outputs out of bounds";
  }

  std::vector<float> nan_output() const {
    return std::vector<float>(y_ref_.size(), std::numeric_limits<float>::quiet_NaN());
  }

  std::vector<uint8_t> w_data_;  // [n_rows, row_bytes]
  weight_view w_;
  std::vector<float> x_;           // [n_tok, n_cols]
  std::vector<float> y_ref_;       // [n_tok, n_rows]
  std::vector<double> abs_dot_;    // [n_tok, n_rows]
  std::vector<double> abs_terms_f_;  // [n_tok, n_rows] Σ a_i of the act_f32 bound
  // Per integer path (int_path_index), each [n_tok, n_rows]:
  std::vector<double> quant_term_[2];
  std::vector<double> int_float_err_[2];
  std::vector<double> y_grid_[2];  // Σ w·x̃ in double, x̃ = the path's grid activations
};

// One test per case runs every path, so the double-precision oracle and the bounds are built
// once; each failure message names its path.
TEST_P(matmul_test, all_paths_match_ref) {
  const mm_case& c = GetParam();
  const bool legacy = cpu::detail::is_legacy_quant(c.type);

  // Float activations: both kernels within the accumulation bound of ref, and of each other.
  {
    const decode_activations act = decode_activations::act_f32;
    std::vector<float> y_simd = nan_output();
    cpu::detail::matmul_decode(w_, x_.data(), c.n_tok, y_simd.data(), act);
    expect_close(y_simd, y_ref_, [&](int64_t i) { return decode_bound(i, act); },
                 cpu::has_avx2() ? "decode f32 avx2" : "decode f32");
    std::vector<float> y_scalar = nan_output();
    cpu::set_force_scalar(true);
    cpu::detail::matmul_decode(w_, x_.data(), c.n_tok, y_scalar.data(), act);
    cpu::set_force_scalar(false);
    expect_close(y_scalar, y_ref_, [&](int64_t i) { return decode_bound(i, act); }, "decode f32 scalar");
    expect_close(y_scalar, y_simd, [&](int64_t i) { return 2.0 * decode_bound(i, act); },
                 "decode f32 scalar vs simd");
  }

  // 8- and 16-bit activations (legacy quants only; other types ignore the setting).
  for (int p = 0; legacy && p < 2; ++p) {
    const decode_activations act = k_int_acts[p];
    const std::string name = p == 0 ? "q8" : "q16";
    std::vector<float> y_scalar = nan_output();
    cpu::set_force_scalar(true);
    cpu::detail::matmul_decode(w_, x_.data(), c.n_tok, y_scalar.data(), act);
    cpu::set_force_scalar(false);
    expect_close(y_scalar, y_ref_, [&](int64_t i) { return decode_bound(i, act); },
                 ("decode " + name + " scalar").c_str());
    expect_near_grid(y_scalar, act, ("decode " + name + " scalar vs grid activations").c_str());

    // Every SIMD kernel this CPU can run: AVX-512 VNNI, AVX-VNNI (when present) and AVX2 (forced).
    std::vector<float> y_vnni256;
    for (const int isa : {2, 1, 0}) {  // 2: AVX-512, 1: AVX-VNNI, 0: AVX2; AVX2 last
      if (isa == 2 ? !cpu::has_avx512() : isa == 1 ? !cpu::has_avx_vnni() : !cpu::has_avx2()) continue;
      const std::string kernel = "decode " + name + (isa == 2 ? " avx512" : isa == 1 ? " avx-vnni" : " avx2");
      std::vector<float> y_simd = nan_output();
      cpu::set_force_avx_vnni(isa == 1);
      cpu::set_force_avx2(isa == 0);
      cpu::detail::matmul_decode(w_, x_.data(), c.n_tok, y_simd.data(), act);
      cpu::set_force_avx2(false);
      cpu::set_force_avx_vnni(false);
      if (isa == 1) y_vnni256 = y_simd;  // compared with AVX2 below: the same integer sums, the same bits
      if (isa == 0 && !y_vnni256.empty()) {
        EXPECT_EQ(0, std::memcmp(y_vnni256.data(), y_simd.data(), y_simd.size() * sizeof(float)))
            << "decode " << name << " avx-vnni vs avx2: not bitwise the same";
      }
      expect_close(y_simd, y_ref_, [&](int64_t i) { return decode_bound(i, act); }, kernel.c_str());
      expect_near_grid(y_simd, act, (kernel + " vs grid activations").c_str());
      // Both quantize the activations to identical bits, so they differ by float rounding only:
      // at most each side's own accumulation error.
      expect_close(
          y_scalar, y_simd,
          [&](int64_t i) { return 2.0 * int_float_err_[p][(size_t)i] + std::numeric_limits<float>::denorm_min(); },
          (kernel + " vs scalar").c_str());
    }
  }

  for (prefill_mode mode : {prefill_mode::prefill_split_rows, prefill_mode::prefill_whole_matrix}) {
    std::vector<float> y = nan_output();
    cpu::detail::matmul_prefill(w_, x_.data(), c.n_tok, y.data(), mode);
    expect_close(y, y_ref_, [&](int64_t i) { return float_bound(i); },
                 mode == prefill_mode::prefill_split_rows ? "prefill split rows" : "prefill whole matrix");
  }

  // cpu::matmul under each prefill setting: the decode path below the crossover, above it the
  // integer prefill GEMM where it applies to this type on this CPU, else the f32 one.
  const decode_activations act = cpu::matmul_settings{}.decode;
  const bool prefill = c.n_tok >= cpu::detail::prefill_min_tokens(c.type, act);
  for (const prefill_activations pre :
       {prefill_activations::pre_f32, prefill_activations::pre_q16, prefill_activations::pre_q8}) {
    const bool prefill_int = prefill && cpu::detail::prefill_int_applies(c.type, pre);
    std::vector<float> y = nan_output();
    cpu::matmul(w_, x_.data(), c.n_tok, y.data(), test::with_prefill(pre));
    expect_close(y, y_ref_,
                 [&](int64_t i) {
                   return !prefill ? decode_bound(i, act) : prefill_int ? prefill_int_bound(i, pre) : float_bound(i);
                 },
                 (std::string("cpu::matmul, prefill ") + prefill_activations_name(pre)).c_str());
  }
}

std::vector<mm_case> matmul_cases() {
  std::vector<mm_case> out;
  uint32_t seed = 1000;
  const ggml_type plain[] = {ggml_type::ggml_f32,  ggml_type::ggml_f16,  ggml_type::ggml_bf16,
                             ggml_type::ggml_q4_0, ggml_type::ggml_q4_1, ggml_type::ggml_q5_0,
                             ggml_type::ggml_q5_1, ggml_type::ggml_q8_0};
  const ggml_type kq[] = {ggml_type::ggml_q2_k, ggml_type::ggml_q3_k, ggml_type::ggml_q4_k, ggml_type::ggml_q5_k,
                          ggml_type::ggml_q6_k};
  // The model's shapes at decode-sized n_tok; 200 tokens (prefill path) on the smaller ones to
  // keep the double-precision oracle fast.
  for (ggml_type t : plain) {
    for (const shape& s : {k_wq, k_wk, k_up, k_down, k_odd, k_odd_k, k_one}) {
      for (int64_t n_tok : {1, 3, 17, 200}) {
        if (n_tok == 200 && s.n_rows * s.n_cols > k_wk.n_rows * k_wk.n_cols) continue;
        out.push_back({t, s, n_tok, false, seed++});
      }
    }
    if (cpu::detail::is_legacy_quant(t)) {
      for (int64_t n_tok : {1, 3, 17}) out.push_back({t, k_odd, n_tok, true, seed++});
    }
  }
  for (ggml_type t : kq) {
    for (const shape& s : {k_odd_k, k_one, k_down}) {
      for (int64_t n_tok : {1, 3, 17, 200}) {
        if (n_tok == 200 && s.n_rows * s.n_cols > k_wk.n_rows * k_wk.n_cols) continue;
        out.push_back({t, s, n_tok, true, seed++});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(types_shapes, matmul_test, testing::ValuesIn(matmul_cases()), case_name);

// ---- pieces of the decode path -------------------------------------------------------------

template <typename Code>
void expect_quantizers_agree(int levels) {
  const uint32_t seed = 77;
  std::printf("seed %u, %d levels\n", seed, levels);
  std::mt19937 rng(seed);
  const int64_t n = 64 * qk_small;
  std::vector<float> x = random_activations(1, n, rng);
  // Near-ties of the grid (k + 1/2 steps) and all-zero / single-value blocks.
  const float l = (float)levels;
  for (int j = 0; j < qk_small; ++j) x[(size_t)j] = (j % 2 ? 1.0f : -1.0f) * (float)j * (l / 31.0f) / 2.0f;
  for (int j = 0; j < qk_small; ++j) x[(size_t)(qk_small + j)] = 0.0f;
  for (int j = 0; j < qk_small; ++j) x[(size_t)(2 * qk_small + j)] = j == 5 ? -3.0f : 0.0f;
  std::vector<Code> qa((size_t)n), qb((size_t)n);
  std::vector<float> da(n / qk_small), sa(n / qk_small), db(n / qk_small), sb(n / qk_small);
  cpu::detail::quantize_act_avx2(x.data(), n, qa.data(), da.data(), sa.data());
  cpu::detail::quantize_act_scalar(x.data(), n, qb.data(), db.data(), sb.data());
  EXPECT_EQ(qa, qb);
  EXPECT_EQ(0, std::memcmp(da.data(), db.data(), da.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(float)));
  // The grid error promised to the matmul bound, and the code range.
  for (int64_t i = 0; i < n; ++i) {
    const float d = db[(size_t)(i / qk_small)];
    EXPECT_LE(std::fabs(x[(size_t)i] - d * (float)qb[(size_t)i]), d * act_half_step(levels) + 1e-30) << "element " << i;
    EXPECT_LE(std::abs((int)qb[(size_t)i]), levels) << "element " << i;
  }
}

TEST(matmul_act_quant, avx2_and_scalar_agree_bitwise) {
  if (!cpu::has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  expect_quantizers_agree<int8_t>(127);
  expect_quantizers_agree<int16_t>(32767);
}

TEST(matmul_threads, row_split_never_shares_a_cache_line) {
  for (int64_t n_rows : {1, 15, 16, 17, 192, 576, 1537, 49152}) {
    for (int nth : {1, 2, 3, 4}) {
      int64_t covered = 0;
      for (int ith = 0; ith < nth; ++ith) {
        int64_t r0, r1;
        cpu::detail::thread_rows(n_rows, ith, nth, &r0, &r1);
        EXPECT_EQ(r0, std::min(n_rows, covered)) << n_rows << " rows, thread " << ith << " of " << nth;
        if (r0 < n_rows) {
          EXPECT_EQ(r0 % 16, 0) << n_rows << " rows, thread " << ith << " of " << nth;
        }
        covered = std::max(covered, r1);
      }
      EXPECT_EQ(covered, n_rows) << n_rows << " rows, " << nth << " threads";
    }
  }
}

TEST(matmul_threads, one_and_two_threads_give_identical_bits) {
  const uint32_t seed = 91;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const int64_t n_rows = 1000, n_cols = 576, n_tok = 5;
  std::vector<uint8_t> w_data = quantized_weights(ggml_type::ggml_q4_1, n_rows, n_cols, rng);
  const weight_view w{ggml_type::ggml_q4_1, n_rows, n_cols, w_data.data()};
  std::vector<float> x = random_activations(n_tok, n_cols, rng);
  for (decode_activations act :
       {decode_activations::act_f32, decode_activations::act_q16, decode_activations::act_q8}) {
    std::vector<float> y1((size_t)(n_tok * n_rows)), y2((size_t)(n_tok * n_rows));
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    cpu::detail::matmul_decode(w, x.data(), n_tok, y1.data(), act);
    omp_set_num_threads(2);
    cpu::detail::matmul_decode(w, x.data(), n_tok, y2.data(), act);
    omp_set_num_threads(saved);
    EXPECT_EQ(0, std::memcmp(y1.data(), y2.data(), y1.size() * sizeof(float))) << "activations " << (int)act;
  }
}

// ---- continuity: what the integer grids give up -------------------------------------------
//
// (act_f32 was the default while multi-rank attention differed from one rank's by float
// summation order; attention is now bitwise rank-count invariant, so every decode matmul sees the
// same inputs on any number of ranks and the grids' discontinuity no longer shows between rank
// counts. It still shows against exact arithmetic: tests/worker/test_engine_golden.cpp.)
//
// A relative 1e-6 change of the activations (what a different float summation order upstream
// produces, e.g. the same sequence split over another number of ranks) may move y by about as
// much: |Δy| <= 1e-6·Σ|w x| plus the difference of the two runs' rounding errors, which follow
// the same order on operands equal to 1e-6 and stay far below 1e-5·Σ|w x| (random walk of
// n_cols roundings of 2^-24: ~2e-6 at n_cols = 576 even with partial sums as large as Σ|w x|).
// Hence k_continuity_tol = 1e-5 relative to Σ|w x|. Rounding x to an integer grid breaks this:
// an element sitting on a rounding tie moves a whole grid step (d_x·|w_i|) under any
// perturbation.
constexpr double k_continuity_rel = 1e-6;
constexpr double k_continuity_tol = 1e-5;

class matmul_continuity_test : public testing::TestWithParam<ggml_type> {};

TEST_P(matmul_continuity_test, f32_activations_are_continuous_integer_grids_are_not) {
  const ggml_type type = GetParam();
  const uint32_t seed = 700 + (uint32_t)type;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const int64_t n_rows = 64, n_cols = 576;
  std::vector<uint8_t> w_data = quantized_weights(type, n_rows, n_cols, rng);
  const weight_view w{type, n_rows, n_cols, w_data.data()};
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  std::vector<float> x0((size_t)n_cols), u((size_t)n_cols);  // [n_cols]
  for (auto& v : x0) v = ud(rng);
  for (auto& v : u) v = ud(rng);
  // Block 0: max |x| = L (the grid's levels) makes the grid step exactly 1, and 40.5 sits on a
  // tie (rounds half-even to 40). The perturbation keeps x[0] (so the step stays 1) and pushes
  // x[1] up by the full relative 1e-6, to 41 on the grid; every other element moves by a random
  // relative amount within ±1e-6.
  u[0] = 0.0f;
  u[1] = 1.0f;
  std::vector<float> x, xp((size_t)n_cols);
  auto set_levels = [&](int levels) {
    x = x0;
    x[0] = (float)levels;
    x[1] = 40.5f;
    for (int64_t i = 0; i < n_cols; ++i) xp[(size_t)i] = x[(size_t)i] * (1.0f + (float)k_continuity_rel * u[(size_t)i]);
    ASSERT_NE(x[1], xp[1]);
  };

  // Largest |y(x') - y(x)| / Σ|w x| over the rows, per path.
  std::vector<float> wrow((size_t)n_cols);  // [n_cols]
  auto max_rel_move = [&](decode_activations act) {
    std::vector<double> scale((size_t)n_rows);  // [n_rows] Σ|w x|
    for (int64_t r = 0; r < n_rows; ++r) {
      ref::dequantize_row(type, w_data.data() + (size_t)r * w.row_bytes(), wrow.data(), n_cols);
      double s = 0.0;
      for (int64_t i = 0; i < n_cols; ++i) s += std::fabs((double)wrow[(size_t)i] * x[(size_t)i]);
      scale[(size_t)r] = s;
    }
    std::vector<float> y((size_t)n_rows), yp((size_t)n_rows);
    cpu::detail::matmul_decode(w, x.data(), 1, y.data(), act);
    cpu::detail::matmul_decode(w, xp.data(), 1, yp.data(), act);
    double m = 0.0;
    for (int64_t r = 0; r < n_rows; ++r) {
      m = std::max(m, std::fabs((double)yp[(size_t)r] - (double)y[(size_t)r]) / scale[(size_t)r]);
    }
    return m;
  };
  for (bool scalar : {false, true}) {
    cpu::set_force_scalar(scalar);
    const char* kind = scalar ? "scalar" : "simd";
    set_levels(127);
    const double f32 = max_rel_move(decode_activations::act_f32);
    const double q8 = max_rel_move(decode_activations::act_q8);
    set_levels(32767);
    const double f32_wide = max_rel_move(decode_activations::act_f32);
    const double q16 = max_rel_move(decode_activations::act_q16);
    cpu::set_force_scalar(false);
    EXPECT_LE(std::max(f32, f32_wide), k_continuity_tol) << kind << ": f32 activations moved y discontinuously";
    // The grid step shows up in y (a step is 1 for both grids here: x[0] = L).
    EXPECT_GT(q8, k_continuity_tol) << kind << ": q8 activations did not flip the tie at x[1] = 40.5";
    EXPECT_GT(q16, k_continuity_tol) << kind << ": q16 activations did not flip the tie at x[1] = 40.5";
    std::printf("%s: max |dy| / sum|w x|: f32 %.3g / %.3g, q8 %.3g, q16 %.3g\n", kind, f32, f32_wide, q8, q16);
  }
}

INSTANTIATE_TEST_SUITE_P(types, matmul_continuity_test,
                         testing::Values(ggml_type::ggml_q4_0, ggml_type::ggml_q4_1, ggml_type::ggml_q5_0,
                                         ggml_type::ggml_q5_1, ggml_type::ggml_q8_0),
                         [](const testing::TestParamInfo<ggml_type>& info) { return ggml_traits(info.param).name; });

TEST(matmul_errors, bad_input_throws) {
  std::vector<uint8_t> data(ggml_row_bytes(ggml_type::ggml_q4_1, 64) * 4);
  const weight_view bad_cols{ggml_type::ggml_q4_1, 4, 48, data.data()};  // 48 % 32 != 0
  std::vector<float> x(64), y(8);
  EXPECT_THROW(cpu::matmul(bad_cols, x.data(), 1, y.data()), Error);
  EXPECT_THROW(ref::matmul(bad_cols, x.data(), 1, y.data()), Error);
  const weight_view bad_type{(ggml_type)99, 4, 64, data.data()};
  EXPECT_THROW(cpu::matmul(bad_type, x.data(), 1, y.data()), Error);
  const weight_view ok{ggml_type::ggml_q4_1, 4, 64, data.data()};
  const int32_t ids[] = {0, 4};
  std::vector<float> out(2 * 64);
  EXPECT_THROW(cpu::get_rows(ok, ids, 2, out.data()), Error);
  EXPECT_THROW(ref::get_rows(ok, ids, 2, out.data()), Error);
  const int32_t neg[] = {-1};
  EXPECT_THROW(cpu::get_rows(ok, neg, 1, out.data()), Error);
  // No tokens: nothing is read or written.
  y.assign(8, 7.0f);
  cpu::matmul(ok, nullptr, 0, y.data());
  EXPECT_EQ(y, std::vector<float>(8, 7.0f));
}

// ---- get_rows / dequantize_row: bit-exact ---------------------------------------------------

class get_rows_test : public testing::TestWithParam<ggml_type> {};

TEST_P(get_rows_test, matches_ref_bitwise) {
  const ggml_type type = GetParam();
  const uint32_t seed = 500 + (uint32_t)type;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const int64_t n_rows = 300, n_cols = 512;
  std::vector<uint8_t> data = (is_k_quant(type) || cpu::detail::is_legacy_quant(type))
                                  ? random_blocks(type, n_rows, n_cols, rng)
                                  : quantized_weights(type, n_rows, n_cols, rng);
  const weight_view w{type, n_rows, n_cols, data.data()};
  // More ids than the parallel threshold; repeats and both ends included.
  std::vector<int32_t> ids = {0, (int32_t)n_rows - 1, 7, 7};
  while (ids.size() < 100) ids.push_back((int32_t)(rng() % n_rows));
  const int64_t n = (int64_t)ids.size();
  std::vector<float> want((size_t)(n * n_cols)), got((size_t)(n * n_cols), -1.0f);
  ref::get_rows(w, ids.data(), n, want.data());
  for (bool scalar : {false, true}) {
    cpu::set_force_scalar(scalar);
    std::fill(got.begin(), got.end(), -1.0f);
    cpu::get_rows(w, ids.data(), n, got.data());
    cpu::set_force_scalar(false);
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float)))
        << (scalar ? "scalar" : "simd") << " get_rows differs from ref::get_rows";
  }
}

INSTANTIATE_TEST_SUITE_P(types, get_rows_test,
                         testing::Values(ggml_type::ggml_f32, ggml_type::ggml_f16, ggml_type::ggml_bf16,
                                         ggml_type::ggml_q4_0, ggml_type::ggml_q4_1, ggml_type::ggml_q5_0,
                                         ggml_type::ggml_q5_1, ggml_type::ggml_q8_0, ggml_type::ggml_q2_k,
                                         ggml_type::ggml_q3_k, ggml_type::ggml_q4_k, ggml_type::ggml_q5_k,
                                         ggml_type::ggml_q6_k),
                         [](const testing::TestParamInfo<ggml_type>& info) { return ggml_traits(info.param).name; });

// ---- through the backend interface ----------------------------------------------------------

// The backends only forward, so their results are the kernels' bits exactly.
TEST(matmul_backend, backends_forward_to_their_kernels) {
  const uint32_t seed = 123;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const int64_t n_rows = 100, n_cols = 576, n_tok = 2;
  std::vector<uint8_t> w_data = quantized_weights(ggml_type::ggml_q8_0, n_rows, n_cols, rng);
  const weight_view w_host{ggml_type::ggml_q8_0, n_rows, n_cols, w_data.data()};
  std::vector<float> x = random_activations(n_tok, n_cols, rng);
  const int32_t ids[] = {3, 99, 0};
  for (backend_kind kind : {backend_kind::backend_ref, backend_kind::backend_cpu}) {
    std::unique_ptr<backend> be = make_backend(kind);
    EXPECT_EQ(be->name(), backend_name(kind));
    std::vector<float> y_want((size_t)(n_tok * n_rows)), rows_want(3 * (size_t)n_cols);
    if (kind == backend_kind::backend_ref) {
      ref::matmul(w_host, x.data(), n_tok, y_want.data());
      ref::get_rows(w_host, ids, 3, rows_want.data());
    } else {
      cpu::matmul(w_host, x.data(), n_tok, y_want.data());
      cpu::get_rows(w_host, ids, 3, rows_want.data());
    }
    void* wd = be->alloc(w_data.size());
    auto* xd = (float*)be->alloc(x.size() * sizeof(float));
    auto* yd = (float*)be->alloc(y_want.size() * sizeof(float));
    auto* rd = (float*)be->alloc(rows_want.size() * sizeof(float));
    be->upload(wd, w_data.data(), w_data.size());
    be->upload(xd, x.data(), x.size() * sizeof(float));
    const weight_view w{ggml_type::ggml_q8_0, n_rows, n_cols, wd};
    be->matmul(w, xd, n_tok, yd);
    be->get_rows(w, ids, 3, rd);
    be->synchronize();
    std::vector<float> y(y_want.size()), rows(rows_want.size());
    be->download(y.data(), yd, y.size() * sizeof(float));
    be->download(rows.data(), rd, rows.size() * sizeof(float));
    for (void* p : {wd, (void*)xd, (void*)yd, (void*)rd}) be->free(p);
    EXPECT_EQ(0, std::memcmp(y.data(), y_want.data(), y.size() * sizeof(float))) << be->name();
    EXPECT_EQ(0, std::memcmp(rows.data(), rows_want.data(), rows.size() * sizeof(float))) << be->name();
  }
}

}  // namespace
}  // namespace xctx
