#include "kernels/softmax_acc.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/error.h"

namespace xctx {
namespace {

constexpr int32_t kEmpty = std::numeric_limits<int32_t>::min();
constexpr int W = kAccBinBits;
constexpr uint64_t kMask = (uint64_t{1} << W) - 1;
static_assert(W == 32, "bin_of() divides by an arithmetic shift of 5");

// floor(bit / W) for any sign (arithmetic shift).
inline int32_t bin_of(int32_t bit) { return bit >> 5; }

// A finite double as sign * m * 2^ex with m < 2^53 an integer (m = 0 for zero).
struct split_double {
  uint64_t m;
  int32_t ex;
  bool neg;
};
inline split_double split(double v) {
  const uint64_t bits = std::bit_cast<uint64_t>(v);
  const int biased = (int)((bits >> 52) & 0x7ff);
  const uint64_t frac = bits & ((uint64_t{1} << 52) - 1);
  split_double s;
  s.neg = (bits >> 63) != 0;
  if (biased == 0) {
    s.m = frac, s.ex = -1074;
  } else {
    s.m = frac | (uint64_t{1} << 52), s.ex = biased - 1075;
  }
  return s;
}
// Highest set bit of m·2^ex as an absolute bit position (m > 0).
inline int32_t msb(const split_double& s) { return s.ex + 63 - std::countl_zero(s.m); }

// Bits [W·b, W·b + W) of m·2^ex, as an integer < 2^W.
inline uint64_t slice(const split_double& s, int32_t b) {
  const int64_t shift = (int64_t)W * b - s.ex;  // bit of m that lands on the slice's bit 0
  if (shift >= 64 || shift <= -W) return 0;
  if (shift >= 0) return (s.m >> shift) & kMask;
  const int up = (int)-shift;
  return (s.m & (kMask >> up)) << up;
}

}  // namespace

struct softmax_acc::row_view {
  int32_t* top;
  int64_t* bins;  // [kAccBins, stride]
  int stride;
  // Re-indexes the kept bins for a new (higher) top bin, dropping what falls below.
  void raise(int32_t new_top) {
    if (*top == kEmpty) {
      std::fill(bins, bins + (size_t)kAccBins * stride, 0);
      *top = new_top;
      return;
    }
    const int32_t k = new_top - *top;
    if (k <= 0) return;
    for (int i = kAccBins - 1; i >= 0; --i) {
      int64_t* dst = bins + (size_t)i * stride;
      if (i - k >= 0) {
        const int64_t* src = bins + (size_t)(i - k) * stride;
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
  bins_.assign((size_t)n_row * kAccBins * (width + 1), 0);
}

void softmax_acc::add_partial(int64_t row, float lse, const float* o) {
  XCTX_ASSERT(row >= 0 && row < n_row_, "softmax_acc: row ", row, " outside ", n_row_);
  if (lse == -std::numeric_limits<float>::infinity()) return;
  XCTX_CHECK(std::isfinite(lse), "softmax_acc: log-sum-exp of a partial is ", lse);
  // exp(lse) = y·2^E with y in [1, 2): the deposit never overflows a double whatever lse is.
  const double t = (double)lse * 1.4426950408889634;
  const int32_t E = (int32_t)std::floor(t);
  const double y = std::exp2(t - E);
  const int stride = width_ + 1;
  split_double parts[1 + 1024];
  std::vector<split_double> big;
  split_double* v = parts;
  if (stride > 1 + 1024) {
    big.resize((size_t)stride);
    v = big.data();
  }
  int32_t hi = kEmpty;
  for (int j = 0; j < stride; ++j) {
    const double x = j == 0 ? y : y * (double)o[j - 1];
    XCTX_CHECK(std::isfinite(x), "softmax_acc: non-finite attention output at value ", j - 1);
    v[j] = split(x);
    v[j].ex += E;
    if (v[j].m != 0) hi = std::max(hi, bin_of(msb(v[j])));
  }
  row_view r{&top_[(size_t)row], bins_.data() + (size_t)row * kAccBins * stride, stride};
  if (*r.top == kEmpty || hi > *r.top) r.raise(hi);
  const int32_t top = *r.top;
  if (hi < top - (kAccBins - 1)) return;  // entirely below the kept bins
  for (int i = 0; i < kAccBins; ++i) {
    const int32_t b = top - i;
    int64_t* dst = r.bins + (size_t)i * stride;
    for (int j = 0; j < stride; ++j) {
      if (v[j].m == 0) continue;
      const int64_t s = (int64_t)slice(v[j], b);
      dst[j] += v[j].neg ? -s : s;
    }
  }
}

void softmax_acc::merge(const softmax_acc& other) {
  XCTX_CHECK(other.n_row_ == n_row_ && other.width_ == width_, "softmax_acc: merging ", other.n_row_, " x ",
             other.width_, " into ", n_row_, " x ", width_);
  const int stride = width_ + 1;
  const size_t row_elems = (size_t)kAccBins * stride;
  std::vector<int64_t> tmp(row_elems);
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
  return (size_t)n_row_ * sizeof(int32_t) + bins_.size() * sizeof(int64_t);
}

void softmax_acc::serialize(void* dst) const {
  char* p = (char*)dst;
  std::memcpy(p, top_.data(), top_.size() * sizeof(int32_t));
  std::memcpy(p + top_.size() * sizeof(int32_t), bins_.data(), bins_.size() * sizeof(int64_t));
}

void softmax_acc::merge_serialized(const void* src, size_t bytes) {
  XCTX_CHECK(bytes == serialized_bytes(), "softmax_acc: serialized image of ", bytes, " bytes, expected ",
             serialized_bytes());
  softmax_acc other(n_row_, width_);
  const char* p = (const char*)src;
  std::memcpy(other.top_.data(), p, other.top_.size() * sizeof(int32_t));
  std::memcpy(other.bins_.data(), p + other.top_.size() * sizeof(int32_t), other.bins_.size() * sizeof(int64_t));
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
    const int64_t* b = bins_.data() + (size_t)r * kAccBins * stride;
    std::fill(s.begin(), s.end(), 0.0);
    for (int i = kAccBins - 1; i >= 0; --i) {
      const double w = std::ldexp(1.0, -W * i);
      for (int j = 0; j < stride; ++j) s[j] += (double)b[(size_t)i * stride + j] * w;
    }
    XCTX_ASSERT(s[0] > 0.0, "softmax_acc: row ", r, " has values but no softmax sum");
    const double inv = 1.0 / s[0];
    for (int j = 0; j < width_; ++j) orow[j] = (float)(s[j + 1] * inv);
    if (lse != nullptr) lse[r] = (float)(std::log(s[0]) + (double)W * top_[(size_t)r] * 0.6931471805599453);
  }
}

void softmax_acc::finish(float* o) const { finish(o, nullptr); }

}  // namespace xctx
