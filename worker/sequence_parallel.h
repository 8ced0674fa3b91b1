// One sequence split across the ranks of a communicator. Every rank holds the full weights and
// its shard of the cache; per layer the ranks combine partial attention (o, lse):
//   exact prefill: per layer, a ring pass of every rank's cache block (in the cache format's
//                  own bytes); each rank holds the layer's foreign blocks while its queries,
//                  in chunks of n_batch, attend to its shard and to them into exact
//                  accumulators: bitwise the logits of one rank.
//   star prefill:  (Star Attention, Acharya et al. 2024) the context is cut into blocks, each
//                  rank holds a contiguous run of whole blocks, and every block attends to
//                  [anchor = first anchor_tokens of the context ‖ itself] only: cost linear in
//                  the length. No communication; the anchor's keys/values live in a temporary
//                  cache per rank and are dropped afterwards (never stored twice).
//   suffix/decode: every rank runs the same tokens through each layer, attends over its own
//                  shard, one all-gather of the packed partials, then a max-shifted merge;
//                  the tail rank (holder of the last context position) stores the new tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "worker/llama_engine.h"
#include "worker/retrieval.h"
#include "worker/shard_plan.h"

namespace xctx {

// auto: exact below sequence_options::star_from_tokens prompt tokens, star (block-local) from there.
enum class prefill_mode : uint8_t { prefill_exact, prefill_star, prefill_auto };
prefill_mode parse_prefill_mode(const std::string& name);  // exact | star | auto
const char* prefill_mode_name(prefill_mode m);

struct sequence_options {
  prefill_mode mode = prefill_mode::prefill_exact;
  shard_layout layout = shard_layout::shard_zigzag;  // exact mode only; star is contiguous (blocks)
  // star: tokens per block; 0 = each rank's contiguous chunk is one block (rank-level star).
  int64_t block_tokens = 0;
  int64_t anchor_tokens = 0;  // star: 0 = one block (block_tokens, or rank 0's chunk when that is 0)
  // auto: the prompt length (context + suffix) from which star replaces exact. Measured on the 2-core test machine
  // (benchmarks/long_context.py, docs/sequence_parallel.md): below it the exact ring costs
  // little more than star, so exactness wins.
  int64_t star_from_tokens = 32768;
  // Tokens a sequence may generate at most. The tail rank reserves this many unless a prefill
  // names its own (smaller) number.
  int64_t max_new_tokens = 256;
  // Tokens each rank's cache holds, fixed for the runner's life: the cache is allocated at the
  // first prefill and cleared, not freed, for every later sequence (a service sizes its memory
  // once). A sequence that needs more on some rank is refused on every rank before any work.
  // 0: each sequence allocates a cache of exactly its own shard.
  int64_t capacity_per_rank = 0;
  // What each suffix/decode query attends to (worker/retrieval.h). retrieval needs the engine's
  // rope to place far keys at distance retrieval.local (apply_attention_mode does both); auto
  // must be resolved by the job before the engine is built. With retrieval on, auto prefill
  // runs star (blocks that see [anchor ‖ themselves]) once the prompt exceeds the local window.
  attention_mode attention = attention_mode::attention_full;
  retrieval_options retrieval;
};

// Resolves attention auto for a sequence of up to n_total tokens (prompt + generation) on a model
// trained on n_ctx_train: full while it fits the trained window, retrieval beyond. With retrieval,
// sets what it needs: the rope's fixed distance (rp), the caches' block summaries (spec), and
// checks the retrieval options (errors name the flags). Returns the mode that runs.
attention_mode apply_attention_mode(sequence_options& seq, run_params& rp, cache_spec& spec, int64_t n_total,
                                    int64_t n_ctx_train);
// "full" or "retrieval: sink 256, local 4096, ..." (+ " (auto: ...)" when auto chose).
std::string describe_attention(const sequence_options& seq);

// The mode a prefill of a prompt of n_prompt tokens (context + suffix) runs with, auto resolved;
// the same on every rank.
prefill_mode effective_prefill_mode(const sequence_options& opt, int64_t n_prompt);
// opt with its mode resolved for that prompt: the plan, the fit check and the prefill of one
// sequence all use this, so they cannot disagree at the threshold.
sequence_options with_mode_resolved(const sequence_options& opt, int64_t n_prompt);

// For run headers: "exact ring", "star: blocks of 4096 tokens, anchor 4096", with
// " (auto: prompt >= 32768)" when auto chose it.
std::string describe_prefill(const sequence_options& opt, int64_t n_prompt);

// Bytes this rank moved through the communicator, by purpose.
struct sequence_comm_stats {
  uint64_t ring_bytes_sent = 0;      // exact prefill: cache blocks passed on
  uint64_t ring_held_bytes_peak = 0; // exact prefill: most bytes of one layer's blocks held (own + foreign)
  uint64_t gather_bytes_sent = 0;    // decode/suffix: serialized exact partials contributed
  uint64_t gather_bytes_recv = 0;    // decode/suffix: partials received (all ranks')
  uint64_t decode_tokens = 0;        // tokens run through the merged path
  // Wall seconds inside the communicator's calls: the transfer plus any wait for a slower rank.
  double ring_seconds = 0;           // exact prefill's ring steps
  double gather_seconds = 0;         // decode/suffix all-gathers
  // Retrieval: the all-gather of each rank's best blocks per query and layer, and the summary
  // bytes scored.
  uint64_t retrieval_bytes_sent = 0;
  uint64_t retrieval_summary_bytes_read = 0;
  uint64_t retrieval_units_attended = 0;  // (query, layer, unit) triples of this rank's shard attended
};

// Bytes of the serialized exact partial (kernels/softmax_acc.h) one rank contributes per token
// per layer: n_head rows of one int32 top bin and kAccBins·(head_dim + 1) slice sums (doubles);
// every rank receives n_rank times that.
size_t partial_bytes_per_token_layer(const model_hparams& hp);

// The most tokens any one rank must hold for a prefill of n_context + n_suffix tokens followed
// by n_new decode steps; the same number on every rank (it depends on the plan only).
int64_t sequence_tokens_needed_per_rank(int64_t n_context, int64_t n_suffix, int64_t n_new, int n_rank,
                                        const cache_spec& spec, const sequence_options& opt);
// A capacity_per_rank that holds every sequence of at most n_total tokens (a prompt, then up to
// opt.max_new_tokens generated) on n_rank ranks.
int64_t sequence_capacity_per_rank(int64_t n_total, int n_rank, const cache_spec& spec, const sequence_options& opt);

// Which ranks would share one GPU, given each rank's device identity (cuda_device_identity,
// registry/registry.h; "" = none): "ranks 0 and 1 share host/0000:3b:00.0" for the first pair,
// "" when every device is a rank's own. NCCL refuses such ranks ("Duplicate GPU detected"), so
// the runner then passes ring blocks and decode partials through host memory instead.
std::string describe_shared_devices(const std::vector<std::string>& identities);

class sequence_parallel_runner {
 public:
  sequence_parallel_runner(llama_engine& engine, communicator& comm, backend& be, cache_spec spec,
                           const sequence_options& opt);
  ~sequence_parallel_runner();

  // Collective: every rank calls it with the same tokens. Prefills `context` with the chosen
  // mode, then runs `suffix` (at least one token; if empty, the last context token is moved
  // there) through the merged path. logits: [n_vocab] of the last token, on every rank.
  // max_new_tokens >= 0: this sequence generates at most that many (<= the options' number).
  void prefill(const std::vector<int32_t>& context, const std::vector<int32_t>& suffix, float* logits,
               const llama_engine::progress_fn& progress = {}, int64_t max_new_tokens = -1);
  // Collective teacher-forced scoring of one window (exact ring prefill, no suffix): every rank
  // scores the targets of its own positions p (token p+1, for first_scored <= p+1 < n) and the
  // sums meet on every rank. Returns (sum of natural-log NLL, number of targets scored).
  std::pair<double, int64_t> score(const std::vector<int32_t>& tokens, int64_t first_scored,
                                   const llama_engine::progress_fn& progress = {});
  // Collective teacher-forced scoring through the merged path, the way generation attends: the
  // first token prefilled, then the rest fed `chunk` tokens per step with every row's logits, so
  // each query attends as a decode step does (under retrieval: its own selection). The last
  // token is not fed (it has no target). Same return as score(); the sums are the same bits on
  // every rank.
  std::pair<double, int64_t> score_stepwise(const std::vector<int32_t>& tokens, int64_t first_scored, int64_t chunk,
                                            const llama_engine::progress_fn& progress = {});
  // Collective: runs tokens through the merged path; logits of the last one on every rank (of
  // every one, [n, n_vocab], with logits_all).
  void step(const int32_t* tokens, int64_t n, float* logits,
            llama_engine::logits_for which = llama_engine::logits_for::logits_last);
  // Ends the current sequence so the next prefill/score starts a new one. The cache is kept
  // (and cleared at the next prefill) when capacity_per_rank is set, else freed now.
  void reset();
  // With capacity_per_rank set: allocates the cache now rather than at the first prefill.
  void reserve();

  // Cache snapshots (worker/cache_snapshot.h). Collective: every rank writes its shard of the
  // current sequence to dir, then rank 0 the manifest; `tokens` are the sequence's ids so far
  // (rank 0's are stored). Call after a prefill (or between steps). Returns the bytes of all
  // ranks' files. Any rank's failure is every rank's error.
  uint64_t save_cache(const std::string& dir, const std::vector<int32_t>& tokens);
  // Collective: starts a sequence from a snapshot instead of a prefill -- the cache restored
  // (room for max_new more tokens on the tail rank), next_position() the saved length -- to go
  // on with step(). Needs the saving run's rank count, model, cache format and options. Returns
  // the saved token ids on rank 0 (empty elsewhere). Any rank's failure is every rank's error.
  std::vector<int32_t> load_cache(const std::string& dir, int64_t max_new);

  // sequence_tokens_needed_per_rank for this runner's ranks, format and options.
  int64_t tokens_needed_per_rank(int64_t n_context, int64_t n_suffix, int64_t n_new) const;
  const sequence_options& options() const { return opt_; }
  // Collectives on backend memory for the decode merge and the exact prefill's ring blocks (the
  // runner makes an NCCL one itself on a backend with device collectives and more than one
  // rank); null: through the host communicator. `c` must outlive the runner.
  void set_device_communicator(communicator* c) { device_comm_ = c; }
  const communicator* device_communicator() const { return device_comm_; }

  int64_t next_position() const { return next_pos_; }
  const shard_plan& plan() const { return plan_; }
  prefill_mode mode() const { return mode_; }  // the current sequence's (auto resolved)
  const kv_cache& cache() const { return *cache_; }
  const sequence_comm_stats& stats() const { return stats_; }
  // Retrieval attention's selector (null with full attention): for the needle-rank probe.
  retrieval_selector* selector() { return selector_.get(); }
  const retrieval_selector* selector() const { return selector_.get(); }
  // The memory plan's estimate for the sequence the cache was last sized for (worker/memory_plan.h):
  // the most any rank needs, the figure the fit check compares against the node's memory.
  size_t planned_bytes() const { return planned_bytes_; }

 private:
  llama_engine& engine_;
  communicator& comm_;
  backend& be_;
  cache_spec spec_;
  sequence_options opt_;
  shard_plan plan_;
  void prefill_star(const std::vector<int32_t>& context, const std::vector<int32_t>& pos,
                    const llama_engine::progress_fn& progress);
  // Makes cache_ ready for a sequence whose largest shard (over all ranks) is max_tokens and of
  // which this rank holds own_tokens: reuses and clears it under capacity_per_rank.
  // Checks the memory first (every rank, collectively) when it allocates.
  // seq: the sequence's options, mode resolved.
  void prepare_cache(const sequence_options& seq, int64_t own_tokens, int64_t max_tokens, int64_t n_context,
                     int64_t extra_on_tail);

  std::unique_ptr<kv_cache> cache_;
  std::unique_ptr<retrieval_selector> selector_;  // retrieval attention on
  std::unique_ptr<communicator> own_device_comm_;  // the NCCL communicator made for be_
  communicator* device_comm_ = nullptr;
  size_t planned_bytes_ = 0;
  bool active_ = false;  // a sequence was prefilled and not reset
  prefill_mode mode_ = prefill_mode::prefill_exact;  // of the current sequence (auto resolved)
  int64_t next_pos_ = 0;
  sequence_comm_stats stats_;
};

// The exchanges, exposed for tests.
class ring_attention final : public attention_exchange {
 public:
  // device_comm (partials mode only): ring blocks sent and received in backend memory (NCCL on
  // the CUDA backend); null: through comm and the host.
  ring_attention(kv_cache& own, communicator& comm, backend& be, sequence_comm_stats& stats,
                 communicator* device_comm = nullptr);
  void store(int layer, const layer_input& in) override;
  // The ring pass of the layer's blocks; the P-1 foreign blocks are held for the attend calls.
  void layer_stored(int layer) override;
  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) override;
  void release();  // drops the held blocks

 private:
  kv_cache& own_;
  communicator& comm_;
  backend& be_;
  sequence_comm_stats& stats_;
  std::vector<std::vector<uint8_t>> held_;  // this layer's foreign blocks, in arrival order
  // partials mode (a backend without the exact accumulator): the held blocks in backend memory,
  // uploaded once per layer for all of its query chunks.
  // With a device communicator one more slot, the last, holds the own block to send.
  std::vector<backend_buffer> held_on_backend_;
  communicator* device_comm_;
  uint64_t held_bytes_ = 0;
  attention_sum sum_;  // rows n_q·n_head of one query chunk: the own shard and every held block
};

class merged_attention final : public attention_exchange {
 public:
  // device_comm: collectives on backend memory (NCCL) for the partials, when the runner has one.
  // selector: retrieval attention's per-query selection (null: every key).
  merged_attention(kv_cache& own, bool is_tail, communicator& comm, backend& be, sequence_comm_stats& stats,
                   communicator* device_comm = nullptr, retrieval_selector* selector = nullptr);
  void store(int layer, const layer_input& in) override;
  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) override;

 private:
  kv_cache& own_;
  bool is_tail_;
  communicator& comm_;
  backend& be_;
  sequence_comm_stats& stats_;
  communicator* device_comm_;
  retrieval_selector* selector_;
  attention_sum sum_;  // rows n_q·n_head: this rank's, then every rank's
};

// One star block: its tokens are stored in the own cache, and its queries see [anchor ‖ the
// block]. anchor == nullptr: the block starts the context (it is the anchor). block == nullptr:
// the own cache holds nothing before this block, so it is the block's view; otherwise `block`
// (a temporary cache, cleared per block) holds a second copy of the block's keys/values for the
// queries to see without the rank's earlier blocks.
class star_attention final : public attention_exchange {
 public:
  // Rows stored below position summary_skip_below are left out of the own cache's retrieval
  // summaries (retrieval_options::restart_skip); 0: none. probe: the needle-rank probe, fed the
  // block's keys and queries (retrieval_selector::probe_keys); null: none.
  star_attention(kv_cache& own, kv_cache* anchor, kv_cache* block, backend& be, int64_t summary_skip_below = 0,
                 retrieval_selector* probe = nullptr);
  void store(int layer, const layer_input& in) override;
  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) override;

 private:
  kv_cache& own_;
  kv_cache* anchor_;
  kv_cache* block_;
  int64_t summary_skip_below_;
  retrieval_selector* probe_;
  attention_sum sum_;  // rows n_q·n_head
};

}  // namespace xctx
