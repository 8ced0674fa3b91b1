// The Llama-family transformer forward over one cache shard: RMSNorm, RoPE, grouped-query
// attention through the cache interface (partials (o, lse)), SwiGLU MLP, tied or separate output.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "cache/cache.h"
#include "model/weights.h"
#include "worker/run_params.h"

namespace xctx {

class llama_engine {
 public:
  // `w` and `be` must outlive the engine.
  llama_engine(const model_weights& w, backend& be, const run_params& rp);

  const model_hparams& hparams() const { return w_.hp; }
  const rope_config& rope() const { return rope_; }
  // Geometry of a cache holding `capacity` tokens of this model.
  cache_geometry cache_geometry_for(int64_t capacity) const;

  enum class logits_for : uint8_t { logits_none, logits_last, logits_all };

  // Runs n tokens at positions pos through the model, appending them to `cache`. Long inputs
  // are processed in chunks of run_params.n_batch. logits: [1, n_vocab] for logits_last,
  // [n, n_vocab] for logits_all. `progress(done, n)` is called after each chunk.
  void forward(const int32_t* tokens,  // [n]
               const int32_t* pos,     // [n]
               int64_t n, kv_cache& cache, logits_for which, float* logits,
               const std::function<void(int64_t, int64_t)>& progress = {});

 private:
  void forward_chunk(const int32_t* tokens, const int32_t* pos, int64_t n, kv_cache& cache);
  void ensure_scratch(int64_t n);

  const model_weights& w_;
  backend& be_;
  run_params rp_;
  rope_config rope_;
  // Scratch, sized for one chunk.
  int64_t scratch_tokens_ = 0;
  std::vector<float> x_;     // [n, n_embd] residual stream
  std::vector<float> h_;     // [n, n_embd] normed input of the current block
  std::vector<float> q_;     // [n, n_head, head_dim]
  std::vector<float> k_;     // [n, n_head_kv, head_dim]
  std::vector<float> v_;     // [n, n_head_kv, head_dim]
  std::vector<float> o_;     // [n, n_head, head_dim]
  std::vector<float> lse_;   // [n, n_head]
  std::vector<float> gate_;  // [n, n_ff]
  std::vector<float> up_;    // [n, n_ff]
  std::vector<float> tmp_;   // [n, n_embd]
};

// The rope the engine uses: the file's base and dims, with run_params scaling applied.
rope_config make_rope_config(const model_hparams& hp, const run_params& rp);

}  // namespace xctx
