// Block summaries for retrieval attention (worker/retrieval.h): per layer, per block of B
// absolute positions [b·B, (b+1)·B) and per KV head, the channel-wise minimum and maximum of
// the block's pre-RoPE keys (Quest's bound, Tang et al. 2024, §3) and their mean (the mean-key
// score, InfLLM's representative vector in its simplest form). Kept beside any
// format's codes by a cache wrapper that sees every append, so every format gets them without
// a kernel of its own; their bytes are part of the cache's (cache_bytes::summaries).
//
// An append's first `layer_input::summary_skip` rows are stored but left out of the summaries
// (a star-prefill block's restart: worker/retrieval.h, retrieval_options::restart_skip).
//
// Departure (docs/retrieval.md): the summaries are taken from the keys the layer hands the
// cache (before quantization), not from the keys each format decodes. Computed at append time
// from the same inputs on any rank count, they are rank-invariant either way; the attention
// itself reads the format's decoded keys.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "cache/cache.h"

namespace xctx {

// One layer's summaries, host memory, as bfloat16 (8 bits of mantissa: what ranking blocks
// needs, at half the bytes): the minimum rounded toward -inf and the maximum toward +inf, so
// Quest's bound still bounds the keys, and the mean rounded to nearest. Blocks are listed in
// ascending id; a block still being filled (the sequence's last) is listed with the keys it has
// so far (an f32 shadow of its running min, max and sum is kept beside it).
struct block_summary_view {
  int64_t block = 0;           // B, positions per block
  int n_head_kv = 0, head_dim = 0;
  int64_t n_blocks = 0;
  const int64_t* ids = nullptr;     // [n_blocks] absolute block ids (first position / B)
  const int32_t* count = nullptr;   // [n_blocks] keys summarized (0: the block cannot be scored)
  const uint16_t* kmin = nullptr;   // [n_blocks, n_head_kv, head_dim] bf16
  const uint16_t* kmax = nullptr;   // [n_blocks, n_head_kv, head_dim] bf16
  const uint16_t* kmean = nullptr;  // [n_blocks, n_head_kv, head_dim] bf16
};

// The roundings the summaries store (finite inputs).
uint16_t bf16_round_down(float x);
uint16_t bf16_round_up(float x);

// The most blocks one layer of a shard of `capacity` tokens can touch: a shard is at most two
// runs of positions (zigzag), each starting on a block boundary (cache_alignment), so
// capacity / B + 2 blocks.
int64_t summary_blocks_for(int64_t capacity, int64_t block);
// Bytes of one block's summary in one layer: id, count, and min, max, mean of every KV channel.
size_t summary_bytes_per_block(const cache_geometry& g);
// The bytes a summarized cache allocates for its summaries (all layers): the blocks, and per layer
// the f32 shadow (min, max, sum) of the block being filled.
size_t summary_bytes_for(const cache_geometry& g, int64_t capacity, int64_t block);

// Wraps `inner` so that every append also updates the summaries of blocks of `block` positions
// (a positive multiple of kAttnUnit). Snapshots carry the summaries; ring blocks do not (the
// receiver never scores a foreign block).
std::unique_ptr<kv_cache> make_summarized_cache(std::unique_ptr<kv_cache> inner, int64_t block, backend& be);
// The summaries of one layer of a summarized cache; throws for a cache without them.
block_summary_view summaries_of(const kv_cache& c, int layer);
bool has_summaries(const kv_cache& c);

}  // namespace xctx
