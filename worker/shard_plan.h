// Which context positions each rank holds.
//   contiguous: rank r holds one run [r·N/P, (r+1)·N/P)
//   zigzag:     the context is cut into 2P pieces; rank r holds pieces r and 2P−1−r, so under a
//               causal mask every rank has about the same attention work in the ring prefill
// New tokens (decode, suffix) are appended by the tail rank: the holder of the last position.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace xctx {

enum class shard_layout : uint8_t { shard_contiguous, shard_zigzag };

struct shard_plan {
  shard_layout layout = shard_layout::shard_contiguous;
  int n_rank = 1;
  int64_t n_tokens = 0;
  // ranges[r]: the [begin, end) position runs rank r holds, ascending
  std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges;
  int tail_rank = 0;

  int64_t tokens_of(int rank) const;
  // The positions of `rank` in ascending order.
  std::vector<int32_t> positions_of(int rank) const;
};

// Smallest prefill batch the engine and shard plans hand the matmuls (unless the whole run is
// shorter): below ~40-64 rows the matmul kernels take their decode path, which rounds
// differently from the GEMM path, and a token's projections would depend on its batch.
inline constexpr int64_t kMinPrefillBatch = 64;

// align > 1 puts every boundary between pieces on a multiple of align (the last piece takes the
// remainder), so formats that compress groups of positions see the same groups on any rank count.
// A last piece shorter than min_tail (> 0) is merged into the piece before it (the runners pass
// kMinPrefillBatch).
shard_plan make_shard_plan(int64_t n_tokens, int n_rank, shard_layout layout, int64_t align = 1,
                           int64_t min_tail = 0);
// Block-local star attention: the context cut into blocks of `block` tokens (rounded up to a
// multiple of align) from position 0, a last block shorter than min_tail merged into the one
// before, and every rank given a contiguous run of whole blocks, ranks as even in block count as
// the division allows (rank r: blocks [r·nb/P, (r+1)·nb/P); with fewer blocks than ranks some
// ranks hold none). Blocks never straddle ranks, so each is prefilled where it lives.
shard_plan make_block_plan(int64_t n_tokens, int n_rank, int64_t block, int64_t align = 1, int64_t min_tail = 0);
// The block size make_block_plan uses.
int64_t aligned_block(int64_t block, int64_t align);
// Block starts in [begin, end) of a block plan: multiples of the aligned block, plus begin.
std::vector<std::pair<int64_t, int64_t>> blocks_in(int64_t begin, int64_t end, int64_t n_tokens, int64_t block,
                                                   int64_t align, int64_t min_tail);
shard_layout parse_shard_layout(const std::string& name);  // contiguous | zigzag
const char* shard_layout_name(shard_layout l);

}  // namespace xctx
