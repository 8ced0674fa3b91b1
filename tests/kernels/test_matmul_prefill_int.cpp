// The integer prefill GEMM (prefill_activations::pre_q8, matmul_prefill_int*.cpp).
//
// 1. The AVX-512 VNNI and AMX kernels do the scalar reference's float operations in the same
//    order, so each must agree with it bit for bit (every legacy type, raw block bytes included:
//    Q8_0's -128 becomes the unsigned code 0; row counts off the 16-row strip; token counts off
//    the kernels' 12- and 16-token groups; odd block counts for AMX's block pairs).
// 2. Against the exact product with the grid activations x̃ = d_x q (quantize_act_scalar), in
//    double: the kernel computes, per block b, fl(Σ u q) · fl(d_w d_x) and c_w · fl(d_x Σ q),
//    then a chain of 2 nb fused multiply-adds. Each rounding is at most 2^-24 of a term or of the
//    running sum, and every term and partial sum is bounded by M = Σ_j (|w_j| + 2|c_b|)·|x̃_j|
//    (w = d u + c, so |d u| <= |w| + |c|), hence
//        |y - Σ w_j x̃_j| <= (2 nb + 4)·2^-24·M + 2^-24·Σ|w_j x̃_j|,
//    the last term for the reference dequantizer's own rounding of w (d q + m in float).
//    The activation rounding itself (|x - x̃| <= d_x / 2) is act_q8's and tested with it.
//    For 16-bit codes (q16) the integer sum's conversion to float may round as well: 3 nb + 4.
// 3. Through cpu::matmul with q8 and q16 prefill activations: the same bits as
//    matmul_prefill_int (or the f32 GEMM where this CPU has no integer kernel for the type), and
//    a parse error naming the flag for a bad setting. Row and rank-count invariance of the
//    integer paths is in test_matmul_rows.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/ops.h"
#include "kernels/matmul_test_util.h"
#include "kernels/ref/ref_ops.h"
#include "test_util.h"

namespace xctx {
namespace {

constexpr double k_unit_round = 1.0 / (1 << 24);

struct q8_case {
  ggml_type type;
  int64_t n_rows, n_cols, n_tok;
  bool raw_blocks;  // random block bytes (every code, Q8_0's -128 too) instead of quantize_row
  uint32_t seed;
};

std::string q8_case_name(const testing::TestParamInfo<q8_case>& info) {
  const q8_case& c = info.param;
  return std::string(ggml_traits(c.type).name) + "_" + std::to_string(c.n_rows) + "x" + std::to_string(c.n_cols) +
         "_t" + std::to_string(c.n_tok) + (c.raw_blocks ? "_raw" : "");
}

// Legacy quant weights: normal floats quantized by the reference, or random bytes with finite
// fp16 scales over the d (and m) fields at the start of each block.
std::vector<uint8_t> legacy_weights(const q8_case& c, std::mt19937& rng) {
  const ggml_type_traits tr = ggml_traits(c.type);
  const size_t row_bytes = ggml_row_bytes(c.type, c.n_cols);
  std::vector<uint8_t> data(row_bytes * (size_t)c.n_rows);
  if (c.raw_blocks) {
    for (auto& b : data) b = (uint8_t)(rng() & 0xff);
    std::uniform_real_distribution<float> ud(-0.01f, 0.01f);
    const bool has_m = c.type == ggml_type::ggml_q4_1 || c.type == ggml_type::ggml_q5_1;
    for (size_t off = 0; off < data.size(); off += tr.block_bytes) {
      const uint16_t d = fp32_to_fp16(ud(rng)), m = fp32_to_fp16(10.0f * ud(rng));
      std::memcpy(data.data() + off, &d, 2);
      if (has_m) std::memcpy(data.data() + off + 2, &m, 2);
    }
    return data;
  }
  return test::quantized_weights(c.type, c.n_rows, c.n_cols, rng);  // kernels/matmul_test_util.h
}

// One call's activations with Code (int8_t: q8, int16_t: q16) as quantize_act_scalar makes them.
template <typename Code>
struct int_acts {
  std::vector<Code> qs;
  std::vector<float> d, s;
  cpu::detail::int_act<Code> view(int64_t nb) const { return {qs.data(), d.data(), s.data(), nb}; }
};

template <typename Code>
int_acts<Code> quantize(const std::vector<float>& x, int64_t n_tok, int64_t n_cols) {
  const int64_t nb = n_cols / qk_small;
  int_acts<Code> a{std::vector<Code>((size_t)(n_tok * n_cols)), std::vector<float>((size_t)(n_tok * nb)),
                   std::vector<float>((size_t)(n_tok * nb))};
  for (int64_t t = 0; t < n_tok; ++t) {
    cpu::detail::quantize_act_scalar(x.data() + t * n_cols, n_cols, a.qs.data() + t * n_cols, a.d.data() + t * nb,
                                     a.s.data() + t * nb);
  }
  return a;
}

std::vector<uint8_t> packed(const weight_view& w, cpu::detail::q8_layout layout) {
  std::vector<uint8_t> p((size_t)((w.n_rows + 15) / 16 * (w.n_cols / qk_small)) * cpu::detail::k_q8_block_bytes);
  cpu::detail::pack_q8_strips(w, 0, w.n_rows, p.data(), layout);
  return p;
}

// Rows of y [n_tok, ldy] equal bit for bit; ldy = n_rows + 1 leaves a sentinel column that a
// store outside the strip's real rows would overwrite.
void expect_same_bits(const std::vector<float>& want, const std::vector<float>& got, int64_t n_tok, int64_t ldy,
                      const char* what) {
  for (int64_t t = 0; t < n_tok; ++t) {
    ASSERT_EQ(0, std::memcmp(want.data() + t * ldy, got.data() + t * ldy, (size_t)ldy * sizeof(float)))
        << what << ": token " << t << " of " << n_tok;
  }
}

class prefill_int_test : public testing::TestWithParam<q8_case> {};

// Each SIMD kernel of both code widths against the scalar reference (Q8_0 has no VNNI q16 kernel).
template <typename Code>
void expect_kernels_give_the_scalar_bits(const q8_case& c, bool amx) {
  std::mt19937 rng(c.seed + (amx ? 3 : 0) + (sizeof(Code) == 2 ? 7 : 0));
  const std::vector<uint8_t> w_data = legacy_weights(c, rng);
  const weight_view w{c.type, c.n_rows, c.n_cols, w_data.data()};
  const int64_t nb = c.n_cols / qk_small, ldy = c.n_rows + 1;
  const int_acts<Code> a = quantize<Code>(test::random_activations(c.n_tok, c.n_cols, rng), c.n_tok, c.n_cols);
  const std::vector<uint8_t> p_vnni = packed(w, cpu::detail::q8_layout::vnni);
  std::vector<float> y_ref((size_t)(c.n_tok * ldy), -7.0f), y(y_ref.size(), -7.0f);
  cpu::detail::gemm_q8_strips_scalar(p_vnni.data(), c.n_rows, nb, a.view(nb), c.n_tok, y_ref.data(), ldy);
  constexpr bool q16 = sizeof(Code) == 2;
  std::vector<int8_t> plane_storage;
  if (amx) {
    const std::vector<uint8_t> p_amx = packed(w, cpu::detail::q8_layout::amx);
    cpu::detail::q8_tiles_storage st, st_lo;
    if constexpr (q16) {
      const cpu::detail::q16_planes planes = cpu::detail::split_q16_planes(a.view(nb), c.n_tok, plane_storage);
      const auto hi = cpu::detail::make_byte_tiles(planes.hi, planes.d, planes.s, nb, c.n_tok, st);
      const auto lo = cpu::detail::make_byte_tiles(planes.lo, planes.d, planes.s, nb, c.n_tok, st_lo);
      cpu::detail::gemm_q16_strips_amx(p_amx.data(), c.n_rows, nb, hi, lo, c.n_tok, y.data(), ldy);
    } else {
      const cpu::detail::q8_tiles tiles = cpu::detail::make_q8_tiles(a.view(nb), c.n_tok, st);
      cpu::detail::gemm_q8_strips_amx(p_amx.data(), c.n_rows, nb, tiles, c.n_tok, y.data(), ldy);
    }
    expect_same_bits(y_ref, y, c.n_tok, ldy, q16 ? "amx q16" : "amx q8");
    return;
  }
  if constexpr (q16) {
    if (c.type == ggml_type::ggml_q8_0) return;
    const cpu::detail::q16_planes planes = cpu::detail::split_q16_planes(a.view(nb), c.n_tok, plane_storage);
    cpu::detail::gemm_q16_strips_avx512(p_vnni.data(), c.n_rows, nb, planes, c.n_tok, y.data(), ldy);
  } else {
    cpu::detail::gemm_q8_strips_avx512(p_vnni.data(), c.n_rows, nb, a.view(nb), c.n_tok, y.data(), ldy);
  }
  expect_same_bits(y_ref, y, c.n_tok, ldy, q16 ? "vnni q16" : "vnni q8");
}

TEST_P(prefill_int_test, vnni_kernels_give_the_scalar_bits) {
  if (!cpu::has_avx512()) GTEST_SKIP() << "no AVX-512 VNNI on this CPU";
  expect_kernels_give_the_scalar_bits<int8_t>(GetParam(), false);
  expect_kernels_give_the_scalar_bits<int16_t>(GetParam(), false);
}

TEST_P(prefill_int_test, amx_kernels_give_the_scalar_bits) {
  if (!cpu::has_amx()) GTEST_SKIP() << "no AMX-INT8 on this CPU (or the kernel does not grant the tile state)";
  expect_kernels_give_the_scalar_bits<int8_t>(GetParam(), true);
  expect_kernels_give_the_scalar_bits<int16_t>(GetParam(), true);
}

// The scalar kernel against the exact grid product; for 16-bit codes the integer sum's
// conversion to float may round too (|Σ| up to 2^28), one more rounding per block.
template <typename Code>
void expect_grid_product_within_float_error(const q8_case& c) {
  constexpr bool q16 = sizeof(Code) == 2;
  std::mt19937 rng(c.seed + 1);
  const std::vector<uint8_t> w_data = legacy_weights(c, rng);
  const weight_view w{c.type, c.n_rows, c.n_cols, w_data.data()};
  const int64_t nb = c.n_cols / qk_small;
  const int_acts<Code> a = quantize<Code>(test::random_activations(c.n_tok, c.n_cols, rng), c.n_tok, c.n_cols);
  std::vector<float> y((size_t)(c.n_tok * c.n_rows));
  const std::vector<uint8_t> p = packed(w, cpu::detail::q8_layout::vnni);
  cpu::detail::gemm_q8_strips_scalar(p.data(), c.n_rows, nb, a.view(nb), c.n_tok, y.data(), c.n_rows);

  const size_t row_bytes = ggml_row_bytes(c.type, c.n_cols), block_bytes = row_bytes / (size_t)nb;
  std::vector<float> wr((size_t)c.n_cols);
  int32_t q[qk_small];
  double worst = 0.0;
  const double roundings = (q16 ? 3.0 : 2.0) * (double)nb + 4.0;
  for (int64_t r = 0; r < c.n_rows; ++r) {
    const uint8_t* row = w_data.data() + (size_t)r * row_bytes;
    ref::dequantize_row(c.type, row, wr.data(), c.n_cols);
    for (int64_t t = 0; t < c.n_tok; ++t) {
      double exact = 0.0, mag = 0.0, abs_sum = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        float d_w, c_w;
        cpu::detail::block_codes(c.type, row + (size_t)b * block_bytes, q, &d_w, &c_w);
        const double c_abs = c.type == ggml_type::ggml_q8_0 ? 128.0 * std::fabs(d_w) : std::fabs(c_w);
        for (int j = 0; j < qk_small; ++j) {
          const int64_t i = b * qk_small + j;
          const double xg = (double)a.d[(size_t)(t * nb + b)] * a.qs[(size_t)(t * c.n_cols + i)];
          exact += (double)wr[(size_t)i] * xg;
          mag += (std::fabs(wr[(size_t)i]) + 2.0 * c_abs) * std::fabs(xg);
          abs_sum += std::fabs((double)wr[(size_t)i] * xg);
        }
      }
      const double bound = roundings * k_unit_round * mag + k_unit_round * abs_sum;
      const double err = std::fabs((double)y[(size_t)(t * c.n_rows + r)] - exact);
      ASSERT_LE(err, bound) << (q16 ? "q16" : "q8") << " row " << r << " token " << t << " exact " << exact;
      if (bound > 0) worst = std::max(worst, err / bound);
    }
  }
  std::printf("%s: worst error / bound %.3g\n", q16 ? "q16" : "q8", worst);
}

TEST_P(prefill_int_test, scalar_kernel_is_the_grid_product_within_float_error) {
  expect_grid_product_within_float_error<int8_t>(GetParam());
  expect_grid_product_within_float_error<int16_t>(GetParam());
}

TEST_P(prefill_int_test, matmul_with_integer_prefill_is_the_integer_gemm) {
  const q8_case& c = GetParam();
  if (c.n_tok < cpu::detail::prefill_min_tokens(c.type, cpu::matmul_settings{}.decode))
    GTEST_SKIP() << "a decode-path size";
  std::mt19937 rng(c.seed + 2);
  const std::vector<uint8_t> w_data = legacy_weights(c, rng);
  const weight_view w{c.type, c.n_rows, c.n_cols, w_data.data()};
  const std::vector<float> x = test::random_activations(c.n_tok, c.n_cols, rng);
  for (prefill_activations act : {prefill_activations::pre_q8, prefill_activations::pre_q16}) {
    std::vector<float> y_mm((size_t)(c.n_tok * c.n_rows)), y_ref(y_mm.size());
    cpu::matmul(w, x.data(), c.n_tok, y_mm.data(), test::with_prefill(act));
    if (cpu::detail::prefill_int_applies(c.type, act)) {
      cpu::detail::matmul_prefill_int(w, x.data(), c.n_tok, y_ref.data(), act, false);
    } else {  // this CPU runs the f32 GEMM for it whatever the setting
      cpu::detail::matmul_prefill(w, x.data(), c.n_tok, y_ref.data());
    }
    EXPECT_EQ(0, std::memcmp(y_mm.data(), y_ref.data(), y_mm.size() * sizeof(float)))
        << prefill_activations_name(act);
  }
}

INSTANTIATE_TEST_SUITE_P(
    types, prefill_int_test,
    testing::Values(q8_case{ggml_type::ggml_q4_1, 576, 576, 72, false, 5101},
                    q8_case{ggml_type::ggml_q4_1, 37, 1536, 9, true, 5102},
                    q8_case{ggml_type::ggml_q4_0, 67, 512, 13, true, 5103},
                    q8_case{ggml_type::ggml_q5_0, 33, 256, 6, true, 5104},
                    q8_case{ggml_type::ggml_q5_1, 48, 96, 71, false, 5105},
                    q8_case{ggml_type::ggml_q8_0, 200, 576, 68, false, 5106},
                    q8_case{ggml_type::ggml_q8_0, 17, 64, 7, true, 5107},
                    q8_case{ggml_type::ggml_q4_1, 1, 32, 1, true, 5108}),
    q8_case_name);

TEST(prefill_activations, parse_names_the_flag_and_the_choices) {
  EXPECT_EQ(prefill_activations::pre_q8, cpu::parse_prefill_activations("q8", "--prefill-act"));
  EXPECT_EQ(prefill_activations::pre_f32, cpu::parse_prefill_activations("f32", "--prefill-act"));
  EXPECT_EQ(prefill_activations::pre_q16, cpu::parse_prefill_activations("q16", "--prefill-act"));
  EXPECT_EQ("--prefill-act must be f32, q16 or q8, not 'q4'",
            test::error_of([] { cpu::parse_prefill_activations("q4", "--prefill-act"); }));
}

}  // namespace
}  // namespace xctx
