// How one layer's attention is formed for the tokens being run. The engine computes q, k, v
// and hands them over; the exchange decides where k/v are stored (own cache, tail rank, a
// temporary anchor cache) and which blocks the queries see (own shard, ring of other ranks'
// blocks, all ranks' partials merged). Implementations: local_attention (one process) here;
// the sequence-parallel ones in worker/sequence_parallel.h.
#pragma once

#include <vector>

#include "cache/cache.h"
#include "worker/attention_sum.h"

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
  // layer's queries may come in several calls (chunks of n_batch). q and o are in the backend's
  // memory, q_pos on the host (as layer_input: cache/cache.h).
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
  local_attention(kv_cache& cache, backend& be, attend_path path = attend_path::attend_prefill)
      : cache_(cache), path_(path), sum_(be) {}
  void store(int layer, const layer_input& in) override { cache_.append(layer, in); }
  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) override {
    sum_.begin(n_q, cache_.geometry().n_head, cache_.geometry().head_dim);
    sum_.add(cache_, layer, q, q_pos, n_q, path_);
    sum_.finish(o);
  }

 private:
  kv_cache& cache_;
  attend_path path_;
  attention_sum sum_;  // rows n_q * n_head
};

}  // namespace xctx
