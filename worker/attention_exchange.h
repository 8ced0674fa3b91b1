// How one layer's attention is formed for the tokens being run. The engine computes q, k, v
// and hands them over; the exchange decides where k/v are stored (own cache, tail rank, a
// temporary anchor cache) and which blocks the queries see (own shard, ring of other ranks'
// blocks, all ranks' partials merged). Implementations: local_attention (one process) here;
// the sequence-parallel ones in worker/sequence_parallel.h.
#pragma once

#include <vector>

#include "cache/cache.h"

namespace xctx {

class attention_exchange {
 public:
  virtual ~attention_exchange() = default;
  // Stores the keys/values of a batch for `layer`. A layer may be stored in several calls
  // (sub-chunks) before attend() is called for it.
  virtual void store(int layer, const layer_input& in) = 0;
  // Every token of this call has been stored for `layer`; attend() calls for it follow (the
  // exact ring exchanges the layer's blocks here, once, however many query chunks follow).
  virtual void layer_stored(int /*layer*/) {}
  // Attention output for queries (RoPE applied) after their layer's layer_stored: o is the
  // softmax-normalized result over every token the queries may see, merged across blocks. A
  // layer's queries may come in several calls (chunks of n_batch).
  virtual void attend(int layer,
                      const float* q,        // [n_q, n_head, head_dim]
                      const int32_t* q_pos,  // [n_q]
                      int64_t n_q,
                      float* o)              // [n_q, n_head, head_dim]
      = 0;
};

// One process, one cache: store = append, attend = the cache's own attention.
class local_attention final : public attention_exchange {
 public:
  explicit local_attention(kv_cache& cache, attend_path path = attend_path::attend_prefill)
      : cache_(cache), path_(path) {}
  void store(int layer, const layer_input& in) override { cache_.append(layer, in); }
  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) override {
    acc_.reset(n_q * cache_.geometry().n_head, cache_.geometry().head_dim);
    cache_.attend(layer, q, q_pos, n_q, path_, acc_);
    acc_.finish(o);
  }

 private:
  kv_cache& cache_;
  attend_path path_;
  softmax_acc acc_;  // rows n_q * n_head
};

}  // namespace xctx
