#include "worker/shard_plan.h"

#include <algorithm>

#include "common/error.h"

namespace xctx {

int64_t shard_plan::tokens_of(int rank) const {
  int64_t n = 0;
  for (const auto& [b, e] : ranges.at(rank)) n += e - b;
  return n;
}

std::vector<int32_t> shard_plan::positions_of(int rank) const {
  std::vector<int32_t> pos;
  pos.reserve(tokens_of(rank));
  for (const auto& [b, e] : ranges.at(rank))
    for (int64_t p = b; p < e; ++p) pos.push_back((int32_t)p);
  return pos;
}

shard_plan make_shard_plan(int64_t n_tokens, int n_rank, shard_layout layout, int64_t align, int64_t min_tail) {
  XCTX_CHECK(n_rank >= 1, "shard plan: need at least one rank, got ", n_rank);
  XCTX_CHECK(align >= 1, "shard plan: alignment must be >= 1, got ", align);
  XCTX_CHECK(n_tokens >= 0 && n_tokens < (int64_t)INT32_MAX, "shard plan: ", n_tokens, " tokens is out of range");
  shard_plan p;
  p.layout = layout;
  p.n_rank = n_rank;
  p.n_tokens = n_tokens;
  p.ranges.resize(n_rank);
  // Boundary k of `parts` pieces, rounded down to the alignment (the end stays the end), and
  // never so close to the end that the last piece is a tiny batch.
  const auto cut = [&](int64_t k, int64_t parts) {
    if (k >= parts) return n_tokens;
    int64_t last = n_tokens * (parts - 1) / parts / align * align;
    while (last > 0 && n_tokens - last < min_tail) last = (last - 1) / align * align;
    return std::min(last, n_tokens * k / parts / align * align);
  };
  switch (layout) {
    case shard_layout::shard_contiguous:
      for (int r = 0; r < n_rank; ++r) {
        const int64_t b = cut(r, n_rank), e = cut(r + 1, n_rank);
        if (e > b) p.ranges[r].push_back({b, e});
      }
      break;
    case shard_layout::shard_zigzag: {
      const int pieces = 2 * n_rank;
      for (int r = 0; r < n_rank; ++r) {
        for (int piece : {r, pieces - 1 - r}) {
          const int64_t b = cut(piece, pieces), e = cut(piece + 1, pieces);
          if (e > b) p.ranges[r].push_back({b, e});
        }
      }
      break;
    }
  }
  p.tail_rank = 0;
  for (int r = 0; r < n_rank; ++r)
    if (!p.ranges[r].empty() && p.ranges[r].back().second == n_tokens) p.tail_rank = r;
  return p;
}

int64_t aligned_block(int64_t block, int64_t align) {
  XCTX_CHECK(block >= 1 && align >= 1, "block plan: block ", block, " / alignment ", align);
  return (block + align - 1) / align * align;
}

namespace {
// The block boundaries of the whole context: 0, B, 2B, ..., n (a short last block merged).
std::vector<int64_t> block_bounds(int64_t n_tokens, int64_t block, int64_t align, int64_t min_tail) {
  const int64_t b = aligned_block(block, align);
  std::vector<int64_t> out;
  for (int64_t s = 0; s < n_tokens; s += b) out.push_back(s);
  if (out.size() > 1 && n_tokens - out.back() < min_tail) out.pop_back();
  out.push_back(n_tokens);
  return out;
}
}  // namespace

shard_plan make_block_plan(int64_t n_tokens, int n_rank, int64_t block, int64_t align, int64_t min_tail) {
  XCTX_CHECK(n_rank >= 1, "block plan: need at least one rank, got ", n_rank);
  XCTX_CHECK(n_tokens >= 0 && n_tokens < (int64_t)INT32_MAX, "block plan: ", n_tokens, " tokens is out of range");
  shard_plan p;
  p.layout = shard_layout::shard_contiguous;
  p.n_rank = n_rank;
  p.n_tokens = n_tokens;
  p.ranges.resize(n_rank);
  const std::vector<int64_t> bounds = block_bounds(n_tokens, block, align, min_tail);
  const int64_t nb = (int64_t)bounds.size() - 1;
  for (int r = 0; r < n_rank; ++r) {
    const int64_t b0 = nb * r / n_rank, b1 = nb * (r + 1) / n_rank;
    if (b1 > b0 && n_tokens > 0) p.ranges[r].push_back({bounds[b0], bounds[b1]});
  }
  p.tail_rank = 0;
  for (int r = 0; r < n_rank; ++r)
    if (!p.ranges[r].empty() && p.ranges[r].back().second == n_tokens) p.tail_rank = r;
  return p;
}

std::vector<std::pair<int64_t, int64_t>> blocks_in(int64_t begin, int64_t end, int64_t n_tokens, int64_t block,
                                                   int64_t align, int64_t min_tail) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const std::vector<int64_t> bounds = block_bounds(n_tokens, block, align, min_tail);
  for (size_t i = 0; i + 1 < bounds.size(); ++i)
    if (bounds[i] >= begin && bounds[i + 1] <= end) out.push_back({bounds[i], bounds[i + 1]});
  return out;
}

shard_layout parse_shard_layout(const std::string& name) {
  if (name == "contiguous") return shard_layout::shard_contiguous;
  if (name == "zigzag") return shard_layout::shard_zigzag;
  fail("unknown shard layout '", name, "' (contiguous, zigzag)");
}

const char* shard_layout_name(shard_layout l) {
  switch (l) {
    case shard_layout::shard_contiguous: return "contiguous";
    case shard_layout::shard_zigzag: return "zigzag";
  }
  return "?";
}

}  // namespace xctx
