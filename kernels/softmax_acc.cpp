#include "kernels/softmax_acc.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <limits>

#include "common/error.h"

namespace xctx {
namespace {

constexpr int32_t kEmpty = std::numeric_limits<int32_t>::min();
constexpr int W = kAccBinBits;
static_assert(W == 32, "bin_of() divides by an arithmetic shift of 5");
constexpr double kTwoW = 4294967296.0;  // 2^W

// floor(bit / W) for any sign (arithmetic shift).
inline int32_t bin_of(int32_t bit) { return bit >> 5; }

// Exponent of a finite nonzero double (ilogb), from its bits. Deposits are y·o with y in
// [1, 2) and o a float, never subnormal in double, so the biased field is enough.
inline int32_t exponent_of(double v) { return (int32_t)((std::bit_cast<uint64_t>(v) >> 52) & 0x7ff) - 1023; }

}  // namespace

struct softmax_acc::row_view {
  int32_t* top;
  double* bins;  // [kAccBins, stride]
  int stride;
  // Re-indexes the kept bins for a new (higher) top bin, dropping what falls below.
  void raise(int32_t new_top) {
    if (*top == kEmpty) {
      std::fill(bins, bins + (size_t)kAccBins * stride, 0.0);
      *top = new_top;
      return;
    }
    const int32_t k = new_top - *top;
    if (k <= 0) return;
    for (int i = kAccBins - 1; i >= 0; --i) {
      double* dst = bins + (size_t)i * stride;
      if (i - k >= 0) {
        const double* src = bins + (size_t)(i - k) * stride;
        std::copy(src, src + stride, dst);
      } else {
        std::fill(dst, dst + stride, 0);
      }
    }
    *top = new_top;
  }
};

void softmax_acc::reset(int64_t n_row, int width) {
  XCTX_CHECK(n_row >= 0 && width >= 0, "softmax_acc: bad shape ", n_row, " x ", width);
  n_row_ = n_row, width_ = width;
  top_.assign((size_t)n_row, kEmpty);
  bins_.assign((size_t)n_row * kAccBins * (width + 1), 0.0);
}

namespace {

// The slices of r = y·o_j·scale (j < n) added to bins [kAccBins, stride] at columns 1 + j. The
// same IEEE operations in the same order on every path (exact ones apart from y·o_j), so the
// AVX2 and scalar versions give the same bins.
void slice_values_scalar(const float* o, int n, double y, double scale, double* bins, int stride) {
  for (int j = 0; j < n; ++j) {
    double r = y * (double)o[j] * scale;
    for (int i = 0; i < kAccBins; ++i) {
      const double q = std::trunc(r);
      bins[(size_t)i * stride + 1 + j] += q;
      r = (r - q) * kTwoW;
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void slice_values_avx2(const float* o, int n, double y, double scale, double* bins,
                                                        int stride) {
  const __m256d Y = _mm256_set1_pd(y), S = _mm256_set1_pd(scale), T = _mm256_set1_pd(kTwoW);
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256d r = _mm256_mul_pd(_mm256_mul_pd(_mm256_cvtps_pd(_mm_loadu_ps(o + j)), Y), S);
    for (int i = 0; i < kAccBins; ++i) {
      double* b = bins + (size_t)i * stride + 1 + j;
      const __m256d q = _mm256_round_pd(r, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
      _mm256_storeu_pd(b, _mm256_add_pd(_mm256_loadu_pd(b), q));
      r = _mm256_mul_pd(_mm256_sub_pd(r, q), T);
    }
  }
  slice_values_scalar(o + j, n - j, y, scale, bins + j, stride);
}
const bool kHasAvx2 = __builtin_cpu_supports("avx2");
#endif

// max |o_j| over j < n, and whether every o_j is finite. Both loops are dependency chains in
// scalar code (a float max or sum cannot be reordered), ~400 cycles for a 64-wide row: as much
// as the slicing, on every deposit of every decode step.
bool max_abs_finite_scalar(const float* o, int n, float* o_max) {
  float m = 0.0f, zero = 0.0f;
  for (int j = 0; j < n; ++j) m = std::max(m, std::fabs(o[j])), zero += 0.0f * o[j];
  *o_max = m;
  return zero == 0.0f;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) bool max_abs_finite_avx2(const float* o, int n, float* o_max) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
  __m256 m = _mm256_setzero_ps();
  __m256i bad = _mm256_setzero_si256();  // lanes whose exponent field is all ones: inf or NaN
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_and_ps(_mm256_loadu_ps(o + j), abs_mask);
    m = _mm256_max_ps(m, v);
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(v), exp_mask);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, exp_mask));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float tail_max = 0.0f;
  const bool tail_ok = max_abs_finite_scalar(o + j, n - j, &tail_max);
  float mx = tail_max;
  for (float x : lanes) mx = std::max(mx, x);
  *o_max = mx;
  return tail_ok && _mm256_testz_si256(bad, bad);
}
#endif

bool max_abs_finite(const float* o, int n, float* o_max) {
#if defined(__x86_64__)
  if (kHasAvx2) return max_abs_finite_avx2(o, n, o_max);
#endif
  return max_abs_finite_scalar(o, n, o_max);
}

void slice_values(const float* o, int n, double y, double scale, double* bins, int stride) {
#if defined(__x86_64__)
  if (kHasAvx2) return slice_values_avx2(o, n, y, scale, bins, stride);
#endif
  slice_values_scalar(o, n, y, scale, bins, stride);
}

}  // namespace

void softmax_acc::add_partial(int64_t row, float lse, const float* o) {
  XCTX_ASSERT(row >= 0 && row < n_row_, "softmax_acc: row ", row, " outside ", n_row_);
  if (lse == -std::numeric_limits<float>::infinity()) return;
  XCTX_CHECK(std::isfinite(lse), "softmax_acc: log-sum-exp of a partial is ", lse);
  // exp(lse) = y·2^E with y in [1, 2): the deposit never overflows a double whatever lse is.
  const double t = (double)lse * 1.4426950408889634;
  const int32_t E = (int32_t)std::floor(t);
  const double y = std::exp2(t - E);
  const int stride = width_ + 1;
  // The largest |value| decides the top bin: y·max|o| has the largest exponent of the y·|o_j|
  // (rounding is monotonic), so no per-value exponent is needed.
  float o_max = 0.0f;
  XCTX_CHECK(max_abs_finite(o, width_, &o_max), "softmax_acc: non-finite attention output in a partial");
  int32_t e_max = exponent_of(y);
  if (o_max > 0.0f) e_max = std::max(e_max, exponent_of(y * (double)o_max));
  const int32_t hi = bin_of(e_max + E);
  row_view rv{&top_[(size_t)row], bins_.data() + (size_t)row * kAccBins * stride, stride};
  if (*rv.top == kEmpty || hi > *rv.top) rv.raise(hi);
  const int32_t top = *rv.top;
  if (hi < top - (kAccBins - 1)) return;  // entirely below the kept bins
  // Scaled so the top bin's unit is 1: every value is then < 2^W in magnitude, and each bin's
  // slice is the truncated integer part, the rest scaled up by 2^W for the next bin. Powers of
  // two and integer parts are exact, so the slices are the value's binary digits in base 2^W.
  const double scale = std::ldexp(1.0, E - W * top);
  double r = y * scale;  // the softmax sum, value 0
  for (int i = 0; i < kAccBins; ++i) {
    const double q = std::trunc(r);
    rv.bins[(size_t)i * stride] += q;
    r = (r - q) * kTwoW;
  }
  slice_values(o, width_, y, scale, rv.bins, stride);
}

void softmax_acc::merge(const softmax_acc& other) {
  XCTX_CHECK(other.n_row_ == n_row_ && other.width_ == width_, "softmax_acc: merging ", other.n_row_, " x ",
             other.width_, " into ", n_row_, " x ", width_);
  const int stride = width_ + 1;
  const size_t row_elems = (size_t)kAccBins * stride;
  std::vector<double> tmp(row_elems);
  for (int64_t r = 0; r < n_row_; ++r) {
    const int32_t t_other = other.top_[(size_t)r];
    if (t_other == kEmpty) continue;
    row_view me{&top_[(size_t)r], bins_.data() + (size_t)r * row_elems, stride};
    if (*me.top == kEmpty || t_other > *me.top) me.raise(t_other);
    // The other row re-indexed to this top (a copy: `other` is const).
    int32_t t = t_other;
    std::copy(other.bins_.begin() + (size_t)r * row_elems, other.bins_.begin() + (size_t)(r + 1) * row_elems,
              tmp.begin());
    row_view o{&t, tmp.data(), stride};
    o.raise(*me.top);
    for (size_t e = 0; e < row_elems; ++e) me.bins[e] += tmp[e];
  }
}

size_t softmax_acc::serialized_bytes() const {
  return (size_t)n_row_ * sizeof(int32_t) + bins_.size() * sizeof(double);
}

void softmax_acc::serialize(void* dst) const {
  char* p = (char*)dst;
  std::memcpy(p, top_.data(), top_.size() * sizeof(int32_t));
  std::memcpy(p + top_.size() * sizeof(int32_t), bins_.data(), bins_.size() * sizeof(double));
}

void softmax_acc::merge_serialized(const void* src, size_t bytes) {
  XCTX_CHECK(bytes == serialized_bytes(), "softmax_acc: serialized image of ", bytes, " bytes, expected ",
             serialized_bytes());
  softmax_acc other(n_row_, width_);
  const char* p = (const char*)src;
  std::memcpy(other.top_.data(), p, other.top_.size() * sizeof(int32_t));
  std::memcpy(other.bins_.data(), p + other.top_.size() * sizeof(int32_t), other.bins_.size() * sizeof(double));
  merge(other);
}

void softmax_acc::finish(float* o, float* lse) const {
  const int stride = width_ + 1;
  std::vector<double> s((size_t)stride);
  for (int64_t r = 0; r < n_row_; ++r) {
    float* orow = o + r * width_;
    if (top_[(size_t)r] == kEmpty) {
      std::fill(orow, orow + width_, 0.0f);
      if (lse != nullptr) lse[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    // Values relative to 2^(W·top), lowest bin first: a fixed order, so a fixed rounding.
    const double* b = bins_.data() + (size_t)r * kAccBins * stride;
    std::fill(s.begin(), s.end(), 0.0);
    for (int i = kAccBins - 1; i >= 0; --i) {
      const double w = std::ldexp(1.0, -W * i);
      for (int j = 0; j < stride; ++j) s[j] += b[(size_t)i * stride + j] * w;
    }
    // Values 2^(W·(kAccBins-1)) times the softmax sum or more push the sum below the kept bins:
    // no model's keys and values come near (a damaged cache or snapshot does), so say so.
    XCTX_CHECK(s[0] > 0.0, "softmax_acc: row ", r, ": attention values too large for the exact accumulator (",
               "over 2^", W * (kAccBins - 1), " times the softmax sum): the cache holds keys or values out of range");
    const double inv = 1.0 / s[0];
    for (int j = 0; j < width_; ++j) orow[j] = (float)(s[j + 1] * inv);
    if (lse != nullptr) lse[r] = (float)(std::log(s[0]) + (double)W * top_[(size_t)r] * 0.6931471805599453);
  }
}

void softmax_acc::finish(float* o) const { finish(o, nullptr); }

}  // namespace xctx
