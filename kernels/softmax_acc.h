// Exact, order-independent accumulation of attention partials.
//
// Attention over keys split into blocks is a sum: o = Σ_blocks exp(lse_b)·o_b / Σ_blocks exp(lse_b).
// Merging partials with floats (max-shifted log-sum-exp) rounds differently for every grouping,
// so one process and four ranks -- or two thread splits -- disagree in the last bits, and a
// 2-bit cache turns that into different codes and tokens. This accumulator makes the sum exact:
// every deposit is cut into fixed-point slices of absolute binary weight (bins of kAccBinBits
// bits, positions fixed independently of the data) and the slices are added as integers (held
// in doubles, exact below 2^53), which is associative. Only the kAccBins highest bins a row has seen are kept; a slice below them is
// dropped, and since the highest bin only rises, what is kept at the end is the same truncation
// of every deposit whatever the order or grouping (the idea of binned reproducible summation,
// Demmel & Nguyen 2013, specialised to this use). Precision: 2·kAccBinBits bits below the
// leading bin of the row's largest value, far below float resolution.
//
// The result is bitwise a function of the multiset of deposits. Callers that want identical
// results for any partition of the keys therefore deposit one partial per *unit* of positions
// fixed in absolute terms (kernels/cpu/attention/attention_units.h), computed by the same code wherever
// the unit lives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace xctx {

// Positions per deposited attention partial: units are [u·kAttnUnit, (u+1)·kAttnUnit) in absolute
// positions, so shard boundaries must fall on multiples of it (cache_alignment). 256 measured
// best on the 2-core dev machine: 128 spent ~15% of an 8K prefill on per-unit calls and
// deposits; 512 gained nothing and spilled the quantized formats' decoded tiles from L2.
inline constexpr int kAttnUnit = 256;
// The unit of an absolute position (floor division: positions may be negative in tests).
inline int64_t attn_unit_of(int64_t pos) { return pos >= 0 ? pos / kAttnUnit : -((-pos + kAttnUnit - 1) / kAttnUnit); }

inline constexpr int kAccBinBits = 32;  // bits per bin; a slice is < 2^32, sums of < 2^21 slices stay exact
inline constexpr int kAccBins = 3;      // bins kept per value

class softmax_acc {
 public:
  softmax_acc() = default;
  softmax_acc(int64_t n_row, int width) { reset(n_row, width); }
  // Empties the accumulator and gives it n_row rows of width values (plus the softmax sum).
  void reset(int64_t n_row, int width);
  int64_t rows() const { return n_row_; }
  int width() const { return width_; }

  // Adds the partial (o normalised by its own softmax sum, lse its natural log-sum-exp) to row
  // `row`: the row gains exp(lse) to its sum and exp(lse)·o to its values. lse = -inf adds nothing.
  void add_partial(int64_t row, float lse, const float* o /*[width]*/);
  // Adds every row of `other` (same shape). Exact, so the order of merges does not matter.
  void merge(const softmax_acc& other);

  // A fixed-size byte image for collectives: serialized_bytes() depends only on the shape.
  size_t serialized_bytes() const;
  void serialize(void* dst) const;
  void merge_serialized(const void* src, size_t bytes);

  // o = values / sum, lse = ln(sum); empty rows give o = 0, lse = -inf.
  void finish(float* o /*[rows, width]*/, float* lse /*[rows]*/) const;
  // Only the normalised values (lse not needed).
  void finish(float* o /*[rows, width]*/) const;

 private:
  struct row_view;
  int64_t n_row_ = 0;
  int width_ = 0;
  std::vector<int32_t> top_;   // [n_row] absolute index of the highest kept bin; kEmpty when unused
  std::vector<double> bins_;  // [n_row, kAccBins, width + 1] integer-valued slice sums; value 0 is the softmax sum
};

}  // namespace xctx
