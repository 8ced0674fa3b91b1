// The Llama-family transformer forward over one cache shard: RMSNorm, RoPE, grouped-query
// attention through an attention_exchange (local cache or sequence-parallel), SwiGLU MLP, tied
// or separate output.
#pragma once

#include <cstdint>
#include <string>
#include <functional>
#include <vector>

#include "cache/cache.h"
#include "model/weights.h"
#include "worker/attention_exchange.h"
#include "worker/run_params.h"

namespace xctx {

// A layer's weights where the backend reads them (see llama_engine::resident_).
struct resident_layer {
  weight_view wq, wk, wv, wo, w_gate, w_up, w_down;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* bq = nullptr;  // biases: null unless hparams.qkv_bias
  const float* bk = nullptr;
  const float* bv = nullptr;
};

// Pointer spaces: the engine's activations, scratch and weights live in the backend's memory
// (device memory on CUDA); what callers pass in and get back (token ids, positions, logits,
// NLLs) is host memory. Exchanges and caches see activations (q, k, v, x, o) in backend memory
// and positions on the host (worker/attention_exchange.h).
class llama_engine {
 public:
  // `w` and `be` must outlive the engine. On a backend whose memory is not the host's, every
  // weight is uploaded here, once.
  llama_engine(const model_weights& w, backend& be, const run_params& rp);

  const model_hparams& hparams() const { return w_.hp; }
  const model_weights& weights() const { return w_; }
  const rope_config& rope() const { return rope_; }
  const run_params& params() const { return rp_; }
  // Geometry of a cache holding `capacity` tokens of this model.
  cache_geometry cache_geometry_for(int64_t capacity) const;

  enum class logits_for : uint8_t { logits_none, logits_last, logits_all };
  using progress_fn = std::function<void(int64_t done, int64_t total)>;

  // Runs n tokens at positions pos through the model. Token-chunk-major: chunks of
  // run_params.n_batch tokens go through all layers one after the other, so memory stays
  // bounded for any n (each chunk attends to what earlier chunks stored). Chunks start on
  // multiples of chunk_align (a cache's alignment: a chunk then ends on the same quantization
  // group boundaries a rank of a shard plan would), and see batch_bounds for the tail. logits: [1, n_vocab]
  // for logits_last, [n, n_vocab] for logits_all.
  void forward(const int32_t* tokens,  // [n]
               const int32_t* pos,     // [n]
               int64_t n, attention_exchange& attn, logits_for which, float* logits,
               const progress_fn& progress = {}, int64_t chunk_align = 1);
  // The same over one local cache.
  void forward(const int32_t* tokens, const int32_t* pos, int64_t n, kv_cache& cache, logits_for which,
               float* logits, const progress_fn& progress = {});

  // Layer-major over all n tokens at once: every layer stores all n tokens before any query
  // of that layer attends. Needed when the exchange must see a layer's complete shard (the
  // exact ring prefill); everything else runs in sub-chunks of n_batch. Keeps the residual
  // stream [n, n_embd] floats live plus O(n_batch) scratch. No logits (the ring prefill has none
  // to give).
  void forward_layer_major(const int32_t* tokens, const int32_t* pos, int64_t n, attention_exchange& attn,
                           const progress_fn& progress = {});
  // The same, then teacher-forced scoring: for every token i with targets[i] >= 0,
  // nll[i] = logsumexp(logits_i) - logits_i[targets[i]] (natural log; others get 0). Logits are
  // computed n_batch rows at a time and never kept whole.
  void forward_layer_major_scored(const int32_t* tokens, const int32_t* pos, int64_t n, attention_exchange& attn,
                                  const int32_t* targets,  // [n]
                                  float* nll,              // [n]
                                  const progress_fn& progress = {});

 private:
  // x [n, n_embd] holds the residual stream of the n tokens; runs every layer over them.
  void run_layers(const int32_t* pos, int64_t n, attention_exchange& attn, const progress_fn& layer_progress);
  // logits (host) of the rows of x (backend memory).
  void compute_logits(const float* x, int64_t rows, float* logits);
  void ensure_scratch(int64_t n_tokens, int64_t n_sub);
  void make_resident_weights();

  const model_weights& w_;
  backend& be_;
  run_params rp_;
  rope_config rope_;
  // Never reused by another engine of the process (an address can be): names this engine's decode
  // segments, whose recorded calls hold its weights, shapes and rope (run_layers).
  const uint64_t instance_;
  // The weights as the backend reads them: the model's own views on host-memory backends, views
  // into one upload (weights_) otherwise.
  backend_buffer weights_;
  std::vector<resident_layer> layers_;
  weight_view tok_embd_, output_;
  const float* out_norm_ = nullptr;
  // Backend memory. Over all tokens of a run_layers call:
  backend_buffer x_;    // [n, n_embd] residual stream
  backend_buffer pos_;  // [n] positions (non-host backends: rope reads them there)
  backend_buffer ids_;  // [n] token ids (non-host backends)
  // Over one sub-chunk of at most n_batch tokens:
  backend_buffer q_;     // [n_sub, n_head, head_dim]
  backend_buffer o_;     // [n_sub, n_head, head_dim]
  backend_buffer h_;     // [n_sub, n_embd] normed input of the current block
  backend_buffer k_;     // [n_sub, n_head_kv, head_dim]
  backend_buffer v_;     // [n_sub, n_head_kv, head_dim]
  backend_buffer gate_;  // [n_sub, n_ff]
  backend_buffer up_;    // [n_sub, n_ff]
  backend_buffer tmp_;   // [n_sub, n_embd]
  backend_buffer normed_;  // [rows, n_embd] final norm before the output projection
  backend_buffer logits_;  // [rows, n_vocab] non-host backends: logits before their download
};

// The rope the engine uses: the file's base and dims, with run_params scaling applied.
rope_config make_rope_config(const model_hparams& hp, const run_params& rp);
// The longest context whose relative positions stay within what the model was trained on
// (n_ctx_train, stretched by linear/NTK scaling, or reached through SelfExtend's groups).
int64_t rope_reach(const rope_config& r, int64_t n_ctx_train);
// For run headers: "none (reaches 8192 tokens)", "selfextend G 8 W 1024 (reaches 58368 tokens)".
std::string describe_rope(const rope_config& r, int64_t n_ctx_train);
// Geometry of a cache of `capacity` tokens for this model.
cache_geometry make_cache_geometry(const model_hparams& hp, const rope_config& rope, int64_t capacity);

// Batch boundaries for n tokens: batches of batch tokens (rounded down to a multiple of align,
// at least align) starting at 0; a tail shorter than kMinPrefillBatch joins the batch before
// it. Returns the starts plus n. Every token of a long run thus goes through the matmuls in a
// batch of >= kMinPrefillBatch rows -- the GEMM path, whose rows do not depend on the batch --
// wherever the run is cut.
std::vector<int64_t> batch_bounds(int64_t n, int64_t batch, int64_t align);

}  // namespace xctx
