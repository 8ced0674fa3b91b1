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
