// Row invariance of the prefill matmul and of cpu::gemm_rows: a token row's f32 result must be
// bitwise the same whatever the call it is part of (how many rows, at which offset, what the
// other rows hold) and whatever the OpenMP thread count. Sequence parallelism depends on it: the
// same token is projected in a chunk of one rank's prompt or in a shard on another rank, and
// the logits must not change with the number of ranks.
//
// The references are the rows of one big call (n_tok = 700, 2 threads); every sub-call must
// reproduce them with memcmp. gemm_rows is also held to a float accumulation bound against a
// double-precision product: |c - c_ref| <= (k + 2)·2^-24·(Σ|a b| + |c0|), which covers a chain
// of k fused multiply-adds plus the final beta·C addition, each rounding at most half an ulp of
// the running magnitude.
//
// cpu::matmul2 (two products of one input in one pass) is held to the same rule: bitwise the
// two separate products.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ostream>
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

constexpr int64_t k_all_rows = 700;

// Restores the OpenMP thread count a test changed.
class omp_threads_guard {
 public:
  omp_threads_guard() : saved_(omp_get_max_threads()) {}
  ~omp_threads_guard() { omp_set_num_threads(saved_); }
  omp_threads_guard(const omp_threads_guard&) = delete;
  omp_threads_guard& operator=(const omp_threads_guard&) = delete;

 private:
  int saved_;
};

std::vector<float> random_floats(int64_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v((size_t)n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Weights of `type` from normal floats (quantized by the reference quantizer, or stored as
// F16/F32 directly).
std::vector<uint8_t> make_weights(ggml_type type, int64_t n_rows, int64_t n_cols, std::mt19937& rng) {
  const size_t row_bytes = ggml_row_bytes(type, n_cols);
  std::vector<uint8_t> data(row_bytes * (size_t)n_rows);
  for (int64_t r = 0; r < n_rows; ++r) {
    const std::vector<float> row = random_floats(n_cols, 0.05f, rng);
    uint8_t* dst = data.data() + (size_t)r * row_bytes;
    if (type == ggml_type::ggml_f32) {
      std::memcpy(dst, row.data(), row_bytes);
    } else if (type == ggml_type::ggml_f16) {
      for (int64_t c = 0; c < n_cols; ++c) reinterpret_cast<uint16_t*>(dst)[c] = fp32_to_fp16(row[(size_t)c]);
    } else {
      ref::quantize_row(type, row.data(), dst, n_cols);
    }
  }
  return data;
}

struct sub_call {
  int64_t offset, n;
};

// Sub-calls of the 700-row block: small and large, aligned and odd offsets, sizes around the
// 64-row blocks, each at least `min_n` rows (the prefill threshold).
std::vector<sub_call> sub_calls(int64_t min_n) {
  std::vector<sub_call> out;
  const sub_call raw[] = {{0, min_n},   {1, min_n}, {7, min_n + 1}, {3, 64},   {63, 65},
                          {100, 129}, {13, 137},  {189, 511},     {5, 600},  {700 - 97, 97}};
  for (sub_call s : raw) {
    s.n = std::max(s.n, min_n);
    if (s.offset + s.n > k_all_rows) s.offset = k_all_rows - s.n;
    out.push_back(s);
  }
  return out;
}

// Index of the first row of `got` ([n, width]) that differs bitwise from want[offset + i], or -1.
int64_t first_bad_row(const float* got, const float* want, int64_t offset, int64_t n, int64_t width) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(got + i * width, want + (offset + i) * width, (size_t)width * sizeof(float)) != 0) return i;
  }
  return -1;
}

// ---- cpu::matmul, prefill path --------------------------------------------------------------

struct rows_case {
  ggml_type type;
  int64_t n_rows, n_cols;
  uint32_t seed;
};

std::string rows_case_name(const testing::TestParamInfo<rows_case>& info) {
  const rows_case& c = info.param;
  return std::string(ggml_traits(c.type).name) + "_" + std::to_string(c.n_rows) + "x" + std::to_string(c.n_cols);
}

void PrintTo(const rows_case& c, std::ostream* os) {
  *os << ggml_traits(c.type).name << " " << c.n_rows << "x" << c.n_cols << " seed " << c.seed;
}

class matmul_rows_test : public testing::TestWithParam<rows_case> {};

void expect_rows_independent_of_the_call(const rows_case& c, const cpu::matmul_settings& settings = {}) {
  std::printf("seed %u\n", c.seed);
  std::mt19937 rng(c.seed);
  const std::vector<uint8_t> w_data = make_weights(c.type, c.n_rows, c.n_cols, rng);
  const weight_view w{c.type, c.n_rows, c.n_cols, w_data.data()};
  const std::vector<float> x = random_floats(k_all_rows * c.n_cols, 1.0f, rng);  // [700, n_cols]
  const int64_t min_n = cpu::detail::prefill_min_tokens(c.type, settings.decode);

  omp_threads_guard guard;
  omp_set_num_threads(2);
  std::vector<float> y_all((size_t)(k_all_rows * c.n_rows));  // [700, n_rows]
  cpu::matmul(w, x.data(), k_all_rows, y_all.data(), settings);

  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const sub_call& s : sub_calls(min_n)) {
      std::vector<float> y((size_t)(s.n * c.n_rows));
      cpu::matmul(w, x.data() + s.offset * c.n_cols, s.n, y.data(), settings);
      EXPECT_EQ(-1, first_bad_row(y.data(), y_all.data(), s.offset, s.n, c.n_rows))
          << "rows [" << s.offset << ", " << s.offset + s.n << "), " << threads << " thread(s)";
    }
  }

  // Other rows replaced by new data (and the kept rows moved to other offsets): rows 0, 1 and
  // 64 of the 700 land at positions 5, 70 and 130 of a 200-row call.
  const int64_t n = 200;
  std::vector<float> x2 = random_floats(n * c.n_cols, 1.0f, rng);  // [n, n_cols]
  const int64_t moved[][2] = {{0, 5}, {1, 70}, {64, 130}};
  for (const auto& m : moved) {
    std::memcpy(x2.data() + m[1] * c.n_cols, x.data() + m[0] * c.n_cols, (size_t)c.n_cols * sizeof(float));
  }
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    std::vector<float> y((size_t)(n * c.n_rows));
    cpu::matmul(w, x2.data(), n, y.data(), settings);
    for (const auto& m : moved) {
      EXPECT_EQ(0, std::memcmp(y.data() + m[1] * c.n_rows, y_all.data() + m[0] * c.n_rows,
                               (size_t)c.n_rows * sizeof(float)))
          << "row " << m[0] << " placed at " << m[1] << " of " << n << ", " << threads << " thread(s)";
    }
  }
}

TEST_P(matmul_rows_test, row_results_do_not_depend_on_the_call) { expect_rows_independent_of_the_call(GetParam()); }

// The same with 8- and 16-bit prefill activations (the integer GEMMs where the CPU has AVX-512
// VNNI, AMX where granted; the f32 path, already covered above, elsewhere and for the float types).
TEST_P(matmul_rows_test, integer_prefill_rows_do_not_depend_on_the_call) {
  if (!cpu::prefill_q8_supported()) GTEST_SKIP() << "no AVX-512 VNNI: integer prefill is the f32 path here";
  for (prefill_activations act : {prefill_activations::pre_q8, prefill_activations::pre_q16}) {
    SCOPED_TRACE(prefill_activations_name(act));
    expect_rows_independent_of_the_call(GetParam(), test::with_prefill(act));
  }
}

// Both prefill modes and the public entry point give the same rows.
TEST_P(matmul_rows_test, prefill_modes_agree_bitwise) {
  const rows_case& c = GetParam();
  std::printf("seed %u\n", c.seed + 1);
  std::mt19937 rng(c.seed + 1);
  const std::vector<uint8_t> w_data = make_weights(c.type, c.n_rows, c.n_cols, rng);
  const weight_view w{c.type, c.n_rows, c.n_cols, w_data.data()};
  const int64_t n_tok = 150;
  const std::vector<float> x = random_floats(n_tok * c.n_cols, 1.0f, rng);  // [n_tok, n_cols]
  std::vector<float> y_split((size_t)(n_tok * c.n_rows)), y_whole(y_split.size());
  cpu::detail::matmul_prefill(w, x.data(), n_tok, y_split.data(), cpu::detail::prefill_mode::prefill_split_rows);
  cpu::detail::matmul_prefill(w, x.data(), n_tok, y_whole.data(), cpu::detail::prefill_mode::prefill_whole_matrix);
  EXPECT_EQ(-1, first_bad_row(y_whole.data(), y_split.data(), 0, n_tok, c.n_rows));
}

// SmolLM2-135M's K sizes (576, 1536), row counts that are and are not multiples of 16.
INSTANTIATE_TEST_SUITE_P(types, matmul_rows_test,
                         testing::Values(rows_case{ggml_type::ggml_q4_1, 200, 576, 3101},
                                         rows_case{ggml_type::ggml_q4_1, 72, 1536, 3102},
                                         rows_case{ggml_type::ggml_q8_0, 200, 576, 3103},
                                         rows_case{ggml_type::ggml_f16, 136, 576, 3104},
                                         rows_case{ggml_type::ggml_f32, 83, 576, 3105}),
                         rows_case_name);

// ---- cpu::gemm_rows ------------------------------------------------------------------------

struct gemm_case {
  int k, n_out;
  bool b_transposed;
  float beta;
  uint32_t seed;
};

std::string gemm_case_name(const testing::TestParamInfo<gemm_case>& info) {
  const gemm_case& c = info.param;
  return std::string("k") + std::to_string(c.k) + "_n" + std::to_string(c.n_out) + (c.b_transposed ? "_bt" : "_b") +
         (c.beta != 0.0f ? "_beta1" : "_beta0");
}

void PrintTo(const gemm_case& c, std::ostream* os) {
  *os << "k " << c.k << " n_out " << c.n_out << (c.b_transposed ? " B transposed" : " B plain") << " beta " << c.beta
      << " seed " << c.seed;
}

class gemm_rows_test : public testing::TestWithParam<gemm_case> {};

TEST_P(gemm_rows_test, row_invariant_and_accurate) {
  const gemm_case& c = GetParam();
  std::printf("seed %u\n", c.seed);
  std::mt19937 rng(c.seed);
  const int64_t ldc = c.n_out + 3;  // a padded output stride: the gap must stay untouched
  const std::vector<float> a = random_floats(k_all_rows * c.k, 1.0f, rng);         // [700, k]
  const std::vector<float> b = random_floats((int64_t)c.k * c.n_out, 0.1f, rng);   // [k, n_out] or [n_out, k]
  const std::vector<float> c0 = random_floats(k_all_rows * ldc, 1.0f, rng);        // [700, ldc]
  auto b_at = [&](int kk, int j) {
    return c.b_transposed ? b[(size_t)j * c.k + kk] : b[(size_t)kk * c.n_out + j];
  };

  omp_threads_guard guard;
  std::vector<float> c_all = c0;
  cpu::gemm_rows(a.data(), k_all_rows, c.k, b.data(), c.b_transposed, c.n_out, c.beta, c_all.data(), ldc);

  // Accuracy against a double product, and the stride gap left alone.
  constexpr double k_half_ulp = 1.0 / (1 << 24);
  for (int64_t t = 0; t < k_all_rows; t += 7) {
    for (int j = 0; j < c.n_out; ++j) {
      double exact = c.beta != 0.0f ? (double)c0[(size_t)(t * ldc + j)] : 0.0;
      double mag = c.beta != 0.0f ? std::fabs((double)c0[(size_t)(t * ldc + j)]) : 0.0;
      for (int kk = 0; kk < c.k; ++kk) {
        const double p = (double)a[(size_t)(t * c.k + kk)] * (double)b_at(kk, j);
        exact += p;
        mag += std::fabs(p);
      }
      const double bound = (c.k + 2) * k_half_ulp * mag;
      ASSERT_LE(std::fabs((double)c_all[(size_t)(t * ldc + j)] - exact), bound) << "row " << t << " col " << j;
    }
    for (int64_t j = c.n_out; j < ldc; ++j) {
      ASSERT_EQ(c_all[(size_t)(t * ldc + j)], c0[(size_t)(t * ldc + j)]) << "stride gap, row " << t;
    }
  }

  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    for (const sub_call& s : sub_calls(1)) {
      std::vector<float> cs(c0.begin() + s.offset * ldc, c0.begin() + (s.offset + s.n) * ldc);
      cpu::gemm_rows(a.data() + s.offset * c.k, s.n, c.k, b.data(), c.b_transposed, c.n_out, c.beta, cs.data(),
                     ldc);
      EXPECT_EQ(-1, first_bad_row(cs.data(), c_all.data(), s.offset, s.n, ldc))
          << "rows [" << s.offset << ", " << s.offset + s.n << "), " << threads << " thread(s)";
    }
  }
  // The scalar fallback runs the same fma chains (std::fma), so it gives the AVX2 bits.
  {
    const int64_t n = 40;
    std::vector<float> cs(c0.begin(), c0.begin() + n * ldc);
    cpu::set_force_scalar(true);
    cpu::gemm_rows(a.data(), n, c.k, b.data(), c.b_transposed, c.n_out, c.beta, cs.data(), ldc);
    cpu::set_force_scalar(false);
    EXPECT_EQ(-1, first_bad_row(cs.data(), c_all.data(), 0, n, ldc)) << "scalar fallback";
  }
  // Single rows, from inside an OpenMP region (callers may be parallel already).
  omp_set_num_threads(2);
  bool all_equal = true;
#pragma omp parallel for schedule(static) reduction(&& : all_equal)
  for (int64_t t = 0; t < k_all_rows; t += 11) {
    std::vector<float> row(c0.begin() + t * ldc, c0.begin() + (t + 1) * ldc);
    cpu::gemm_rows(a.data() + t * c.k, 1, c.k, b.data(), c.b_transposed, c.n_out, c.beta, row.data(), ldc);
    all_equal = all_equal && std::memcmp(row.data(), c_all.data() + t * ldc, (size_t)ldc * sizeof(float)) == 0;
  }
  EXPECT_TRUE(all_equal) << "single-row calls inside a parallel region";
}

INSTANTIATE_TEST_SUITE_P(shapes, gemm_rows_test,
                         testing::Values(gemm_case{64, 200, true, 0.0f, 3201}, gemm_case{64, 200, false, 0.0f, 3202},
                                         gemm_case{576, 83, true, 1.0f, 3203}, gemm_case{576, 83, false, 1.0f, 3204},
                                         gemm_case{192, 64, false, 0.0f, 3205}, gemm_case{37, 16, true, 1.0f, 3206}),
                         gemm_case_name);

// cpu::matmul2 / matmul_n (q, k and v, gate and up in one pass) give the bits of separate
// cpu::matmul calls under every activation setting, on the shared path (legacy quants,
// decode-sized n_tok, every SIMD level) and on the fallbacks (prefill-sized n_tok, mixed types,
// different row lengths).
TEST(matmul_pair, equals_two_products_bitwise) {
  const uint32_t seed = 93;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  struct pair_case {
    ggml_type ta, tb;
    int64_t rows_a, rows_b, cols_a, cols_b, n_tok;
  };
  const pair_case cases[] = {
      {ggml_type::ggml_q4_1, ggml_type::ggml_q4_1, 192, 192, 576, 576, 1},
      {ggml_type::ggml_q4_1, ggml_type::ggml_q4_1, 1536, 1536, 576, 576, 3},
      {ggml_type::ggml_q4_0, ggml_type::ggml_q8_0, 37, 100, 96, 96, 5},    // odd rows, mixed legacy types
      {ggml_type::ggml_q5_1, ggml_type::ggml_q5_0, 64, 48, 160, 160, 1},   // odd block count per row
      {ggml_type::ggml_q4_1, ggml_type::ggml_f16, 64, 64, 576, 576, 2},    // float weight: two calls
      {ggml_type::ggml_q4_1, ggml_type::ggml_q4_1, 64, 64, 576, 576, 200},  // prefill: two calls
  };
  for (const pair_case& c : cases) {
    const int64_t n_cols = c.cols_a;
    std::vector<uint8_t> wa_data = make_weights(c.ta, c.rows_a, c.cols_a, rng);
    std::vector<uint8_t> wb_data = make_weights(c.tb, c.rows_b, c.cols_b, rng);
    const weight_view wa{c.ta, c.rows_a, c.cols_a, wa_data.data()};
    const weight_view wb{c.tb, c.rows_b, c.cols_b, wb_data.data()};
    std::vector<float> x = random_floats(c.n_tok * n_cols, 1.0f, rng);
    for (decode_activations act :
         {decode_activations::act_q16, decode_activations::act_q8, decode_activations::act_f32}) {
      const cpu::matmul_settings s = test::with_decode(act);
      for (int level = 0; level < 4; ++level) {  // best kernels, AVX2 forced, scalar, AVX-VNNI preferred
        cpu::set_force_avx2(level == 1);
        cpu::set_force_scalar(level == 2);
        cpu::set_force_avx_vnni(level == 3);
        std::vector<float> ya((size_t)(c.n_tok * c.rows_a)), yb((size_t)(c.n_tok * c.rows_b));
        std::vector<float> want_a(ya.size()), want_b(yb.size());
        cpu::matmul(wa, x.data(), c.n_tok, want_a.data(), s);
        cpu::matmul(wb, x.data(), c.n_tok, want_b.data(), s);
        cpu::matmul2(wa, wb, x.data(), c.n_tok, ya.data(), yb.data(), s);
        // Three products (q, k and v): b between two a's, so a's rows come first and last.
        std::vector<float> ya1(ya.size()), yb1(yb.size()), ya2(ya.size());
        const weight_view w3[3] = {wa, wb, wa};
        float* const y3[3] = {ya1.data(), yb1.data(), ya2.data()};
        cpu::matmul_n(w3, 3, x.data(), c.n_tok, y3, s);
        const std::string what = std::string(ggml_traits(c.ta).name) + "+" + ggml_traits(c.tb).name + " n_tok " +
                                 std::to_string(c.n_tok) + " act " + decode_activations_name(act) + " level " +
                                 std::to_string(level);
        EXPECT_EQ(0, std::memcmp(want_a.data(), ya.data(), ya.size() * sizeof(float))) << what;
        EXPECT_EQ(0, std::memcmp(want_b.data(), yb.data(), yb.size() * sizeof(float))) << what;
        EXPECT_EQ(0, std::memcmp(want_a.data(), ya1.data(), ya.size() * sizeof(float))) << what << " (3 products)";
        EXPECT_EQ(0, std::memcmp(want_b.data(), yb1.data(), yb.size() * sizeof(float))) << what << " (3 products)";
        EXPECT_EQ(0, std::memcmp(want_a.data(), ya2.data(), ya.size() * sizeof(float))) << what << " (3 products)";
      }
      cpu::set_force_avx2(false);
      cpu::set_force_scalar(false);
      cpu::set_force_avx_vnni(false);
    }
  }
}

}  // namespace
}  // namespace xctx
