// What a rank needs in memory for a sequence, by part, and the check that refuses a sequence
// that cannot fit before anything is allocated (docs/sequence_parallel.md, "Memory").
//
// Per rank (the weights are already resident and not counted; n = context tokens, s = the
// rank's tokens, b = min(n_batch, s), d = n_embd, q = n_head·head_dim, kv = n_head_kv·head_dim,
// f = n_ff, R = 4 + kAccBins·(head_dim + 1)·8 bytes per exact accumulator row):
//   cache         the format's bytes at the rank's capacity (cache_bytes_for)
//   residual      exact ring on P > 1 ranks (layer-major): s·d·4; otherwise b·d·4
//   scratch       b·(2d + 2q + 2kv + 2f)·4
//   accumulators  b·n_head·R (one query chunk)
//   ring_blocks   exact ring: n·(the largest layer's block bytes per token) + P·(a block's fixed
//                 bytes: header, nuq tables, fp16 residual window) -- every rank ends a layer's
//                 ring holding all of the layer's blocks (own export + P−1 received)
//   foreign_acc   xquant-cl deltas ring: (n − s)·(d + 1)·4
//   star_caches   star: an anchor cache and a block view (cache_bytes_for of each)
//   x_accumulator xquant-cl: (capacity + star's anchor and block rows)·(d·4 + 2), the f32 X̂
//                 rows and a layer tag each, allocated whole on first use
//   workspace     the backend's kernel buffers (kernel_workspace_bytes, registry/registry.h) + nuq -1%'s per-row
//                 outlier lists, one chunk per cache appended to
//   factors       X formats on a device backend: the rebuild factors' upload (x_factor_bytes),
//                 unless already there; on the host they are resident model data, not counted
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/hparams.h"
#include "worker/sequence_parallel.h"

namespace xctx {

struct rank_memory {
  size_t cache = 0, residual = 0, scratch = 0, accumulators = 0, ring_blocks = 0, foreign_acc = 0,
         star_caches = 0, x_accumulator = 0, workspace = 0, factors = 0;
  size_t total() const {
    return cache + residual + scratch + accumulators + ring_blocks + foreign_acc + star_caches + x_accumulator +
           workspace + factors;
  }
  std::string describe() const;  // "cache 1.2 GiB + residual ... = 2.0 GiB"
};

// The most any rank of n_rank needs for a prefill of n_context tokens whose tail rank then
// holds `extra_on_tail` more (suffix + new tokens); capacity_per_rank > 0 fixes the cache size.
rank_memory estimate_rank_memory(const model_hparams& hp, const cache_spec& spec, const sequence_options& opt,
                                 int n_batch, int n_threads, int64_t n_context, int64_t extra_on_tail, int n_rank,
                                 backend_kind kind);

// The bytes the cache of this spec allocates for `capacity` tokens (nominal outliers).
size_t cache_allocation_bytes(const cache_spec& spec, const model_hparams& hp, int64_t capacity);

// Memory this process may still take: MemAvailable, lowered to the cgroup's limit minus its usage
// where one is set; XCTX_MEMORY_LIMIT (bytes, K/M/G suffixes) overrides it (tests, shared nodes).
size_t available_memory_bytes();

// xquant-cl with cl_ring auto: deltas while its foreign accumulators stay within
// kClDeltasBudget bytes per rank, latent beyond (O(block) memory). Other formats unchanged.
inline constexpr size_t kClDeltasBudget = size_t{1} << 30;
cache_spec resolve_ring_mode(const cache_spec& spec, const model_hparams& hp, const sequence_options& opt,
                             int64_t n_context, int n_rank);

// The rebuild factors of spec's format that a device backend (memory_share_bytes() > 0) would
// still have to upload for a cache; 0 on host backends, for other formats, or when be holds them.
size_t factor_upload_bytes(const model_hparams& hp, const cache_spec& spec, const backend* be);

// Collective: every rank passes its estimate and its share of the memory it allocates in -- the
// node's, or on a device backend (be.memory_share_bytes() > 0) its device's free memory shared
// among the ranks bound to it, against which the whole estimate is counted (conservative: ring
// blocks are held on the host) -- and when any rank lacks room, every rank throws the same
// message, naming the rank, what it needs by part, and the formats and rank counts that would fit.
void check_sequence_fits(communicator& comm, const model_hparams& hp, const cache_spec& spec,
                         const sequence_options& opt, int n_batch, int n_threads, int64_t n_context,
                         int64_t extra_on_tail, backend_kind kind, const backend* be = nullptr);

}  // namespace xctx
