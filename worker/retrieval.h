// Retrieval attention (docs/retrieval.md): a training-free way for a short-window model to use a
// context far beyond it, after InfLLM (Xiao et al. 2024) with Quest's block bound (Tang et al.
// 2024). Each query attends to
//   - the sink: the first S positions,
//   - the local window: the last W positions, at their exact relative positions,
//   - the top-k blocks of B positions of everything else, chosen per query by a score from the
//     blocks' summaries (cache/block_summary.h),
// and every attended key farther than W sits at the one distance W (with_fixed_distance in
// kernels/ops.h), so no relative position leaves the trained window.
//
// Sharded: every rank scores its own blocks, one all-gather of each rank's best k (score, block
// id) per query gives every rank the same global top-k (ties to the lower block id), and each
// rank attends its share of the selected units; the exact merge combines them as for full
// attention. Blocks never straddle ranks (cache_alignment), so a block's score is computed by
// one rank from the same keys on any rank count: the selection, and so the logits, are the same
// bits on any number of ranks (CPU backend).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "comm/communicator.h"

namespace xctx {

class representative_tokens;

// full: every query sees every earlier key. retrieval: as above. auto: full while the prompt and
// the generation fit the trained window, retrieval beyond it (resolve_attention_mode below).
enum class attention_mode : uint8_t { attention_full, attention_retrieval, attention_auto };
attention_mode parse_attention_mode(const std::string& name);  // full | retrieval | auto
// The one rule for auto (the jobs through apply_attention_mode, and `xctx plan`): full while a
// sequence of n_total tokens fits the trained window or the user chose positions of their own
// (--rope-scaling, SelfExtend), retrieval beyond. Other modes are returned as given.
attention_mode resolve_attention_mode(attention_mode requested, int64_t n_total, int64_t n_ctx_train,
                                      bool own_positions);
const char* attention_mode_name(attention_mode m);

// How a block is scored against a query head (summed over the heads a selection serves:
// selection_scope).
//   minmax: Quest's upper bound of q·k over the block, Σ_c max(q_c·min_c, q_c·max_c);
//   mean:   q · (mean key of the block), the representative vector of one.
enum class block_score_rule : uint8_t { score_minmax, score_mean };
block_score_rule parse_block_score_rule(const std::string& name);  // minmax | mean
const char* block_score_rule_name(block_score_rule r);

// Whose selection: one top-k per query and layer, the heads' scores summed (InfLLM), or one per
// query and KV head, each from its own query heads' scores (Quest selects per head; per KV head
// here, the granularity at which GQA's heads share keys). per KV head reads the union of the
// lists' units and deposits each only for the heads that chose it.
enum class selection_scope : uint8_t { select_per_layer, select_per_kv_head };
selection_scope parse_selection_scope(const std::string& name);  // layer | kv-head
const char* selection_scope_name(selection_scope s);

// Where retrieval places the keys farther than W (the sink and the retrieved blocks).
//   fixed:   every one at the distance W (InfLLM): a retrieved block's keys lose their order.
//   ordered: each keeps its offset in its block: distances W + 1 .. W + B, so a block reads in
//            order (a departure from InfLLM, measured in docs/retrieval.md).
enum class far_positions : uint8_t { far_fixed, far_ordered };
far_positions parse_far_positions(const std::string& name);  // fixed | ordered
const char* far_positions_name(far_positions f);

struct retrieval_options {
  int64_t sink = 256;    // S: the first positions every query sees (rounded up to kAttnUnit)
  int64_t local = 4096;  // W: the window at exact positions; also the distance of everything else
  int64_t block = 256;   // B: positions per retrievable block, a multiple of kAttnUnit
  // k: blocks retrieved per query and layer. 32, not InfLLM's 16: at 128K the key's block ranked
  // 31st in 14 of 30 layers (benchmarks/results/needle_rank_notes.md), and top-32 answered.
  int top_k = 32;
  block_score_rule rule = block_score_rule::score_minmax;
  selection_scope scope = selection_scope::select_per_layer;
  // After a star prefill: the first positions of every star block but the context's first are
  // left out of their block's summary (still attended when the block is selected). Computed
  // seeing only the anchor, a block's first tokens restart the sequence and their keys won
  // Quest's bound over the blocks that matter (docs/retrieval.md, measured at 128K). At most
  // star block - 1, so every block keeps a summarized key; below B. 64: at 32K (2 trials) the
  // key's block ranked 1-2 in every layer against 1-6 with 0 or 16; 192 hid a key that sat at a
  // star block's start (benchmarks/results/restart_skip_notes.md).
  int64_t restart_skip = 64;
  far_positions far = far_positions::far_fixed;
  // The rope period that places far keys as `far` says (rope_config::se_period): 0 or B.
  int period() const { return far == far_positions::far_ordered ? (int)block : 0; }
};

// Throws xctx::Error naming the flag (--sink, --local, --block-size, --top-k) for values the
// mechanism cannot run with: W must leave room inside the trained window for the distance W
// plus the local window (2·W <= n_ctx_train), B a positive multiple of kAttnUnit, k >= 1; with
// ordered far positions the farthest distance W + B inside the window.
void check_retrieval_options(const retrieval_options& o, int64_t n_ctx_train);
// "retrieval: sink 256, local 4096, top-32 blocks of 256 (minmax)" for run headers.
std::string describe_retrieval(const retrieval_options& o);

// Per-query selection for one layer. Collective when the communicator has more than one rank.
class retrieval_selector {
 public:
  // rope: the keys' rope (the fixed-distance rope of the run); be: host-memory backends only.
  retrieval_selector(const retrieval_options& o, const rope_config& rope, int n_head, backend& be, communicator& comm);
  ~retrieval_selector();

  // The units each query sees: sink, local window and its top-k blocks over all ranks.
  // q: [n_q, n_head, head_dim] with RoPE at q_pos (backend memory, host here).
  const attn_selection& select(const kv_cache& own, int layer, const float* q, const int32_t* q_pos, int64_t n_q);

  // One rank's block scores for the queries, highest first (ties: lower block id), at most k
  // per list: [n_q * lists][<= k] of (score, block id), lists = 1 per query, or one per KV head
  // (selection_scope). Exposed for tests and the needle-rank tool.
  struct scored_block {
    double score;
    int64_t id;
  };
  std::vector<std::vector<scored_block>> score_blocks(const kv_cache& own, int layer, const float* q,
                                                      const int32_t* q_pos, int64_t n_q, int64_t keep);
  int lists_per_query(const kv_cache& own, int layer) const;
  // Whether block `id` is a candidate for the query at position p (started, and not wholly
  // inside the sink and the local window, which every query sees anyway).
  bool candidate(int64_t id, int64_t p) const;
  // The units every query at p sees without retrieval: the sink's and the local window's.
  void fixed_units(int64_t p, std::vector<int64_t>& out) const;

  // The needle-rank measurement (issue 53's tool; `passkey --needle-rank`): with a probe position
  // set, the first selection of each layer (the suffix's) also ranks the block holding that
  // position among all candidate blocks, for the last query, under each rule, for the whole
  // layer (heads summed) and for each KV head's query heads alone. Rank 1 = the best block; 0 =
  // the block is in the sink or the local window (always seen). One rank only. The rules: the
  // two the selector runs (minmax, mean) and InfLLM's representative tokens (repr,
  // worker/representative_tokens.h), which the probe computes itself during a star prefill
  // (rank -1: not measured, the prefill was not star).
  struct probe_layer {
    int layer = 0;
    int64_t candidates = 0;
    int64_t rank_minmax = 0, rank_mean = 0, rank_repr = -1;             // heads summed
    std::vector<int64_t> rank_minmax_kv, rank_mean_kv, rank_repr_kv;   // [n_head_kv]
    // The best kProbeTop candidate blocks (heads summed), best first: which blocks outrank it.
    std::vector<int64_t> top_minmax, top_mean, top_repr;
  };
  static constexpr int kProbeTop = 8;
  void set_probe(int64_t pos);  // -1: off (and clears the results)
  bool probing() const { return probe_pos_ >= 0; }
  const std::vector<probe_layer>& probe_results() const { return probe_; }
  // Fed by the star prefill while probing (star_attention): each star block's start, its keys
  // (pre-RoPE, as the cache gets them) and its queries, from which the representative tokens
  // are chosen.
  void probe_star_block();
  void probe_keys(int layer, const cache_geometry& g, const layer_input& in);
  void probe_queries(int layer, const float* q, const int32_t* q_pos, int64_t n_q);

  uint64_t gather_bytes_sent() const { return gather_bytes_sent_; }
  uint64_t summary_bytes_read() const { return summary_bytes_read_; }
  // (query, unit) pairs selected that this rank holds, summed over calls: what its attention reads.
  uint64_t own_units_selected() const { return own_units_; }

 private:
  retrieval_options opt_;
  rope_config rope_;
  int n_head_;
  backend& be_;
  communicator& comm_;
  attn_selection sel_;
  std::vector<float> qf_;  // [n_q, n_head, head_dim] queries turned to the fixed distance
  std::vector<int32_t> turn_;
  // The queries of the last score_blocks call turned to the fixed distance, and the probe.
  void turn_queries(const float* q, const int32_t* q_pos, int64_t n_q, int H, int hd);
  void run_probe(const kv_cache& own, int layer, const int32_t* q_pos, int64_t n_q);
  int64_t probe_pos_ = -1;
  std::vector<probe_layer> probe_;
  std::vector<bool> probed_;  // [n_layer] the layer's first selection was probed
  std::unique_ptr<representative_tokens> repr_;  // while probing a star prefill
  uint64_t gather_bytes_sent_ = 0, summary_bytes_read_ = 0, own_units_ = 0;
};

}  // namespace xctx
