// InfLLM's representative tokens (Xiao et al. 2024, "InfLLM", §3.2 "block-level memory"), kept
// for the needle-rank probe (issue 53, part 2: measure a scoring rule before building its
// kernels). InfLLM gives the m-th token of a memory block the representative score
//     r_m = (1 / l_L) Σ_{j=1..l_L} q_{m+j} · k_m,
// the mean attention logit it receives from the l_L queries after it (its local window), keeps
// the r_k tokens of highest score as the block's representative keys, and scores a block for the
// current queries by Σ_i Σ_j q_i · k_{b_j} (here: one query, the heads summed or one KV head's).
//
// Where this follows the star prefill rather than InfLLM's stream (say so wherever the numbers
// are quoted): a token's later queries are those of its own star block only (a block's last
// tokens see fewer than l_L = W queries; the mean is over those it has, and the block's very last
// token, which no query follows, is never a representative); the score is the sum over the KV
// head's query heads (GQA: keys are per KV head); the positions a star prefill leaves out of the
// block summaries (retrieval_options::restart_skip) are left out here too, as they are a
// restart's attention sinks. r_k = 4 (InfLLM's setting for its memory units).
//
// Host memory, one rank; O(star block · W) work per layer: a diagnostic, not the selector's path.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "cache/cache.h"
#include "kernels/ops.h"

namespace xctx {

class representative_tokens {
 public:
  static constexpr int kPerBlock = 4;  // r_k

  // block: the summaries' block (B positions); window: l_L (the local window W); rope: the keys'
  // plain rope (the queries handed in carry RoPE at their positions).
  representative_tokens(int n_head, int n_head_kv, int head_dim, int64_t block, int64_t window, const rope_config& rope,
                        backend& be);

  // A new star block starts: the previous one's representatives are chosen.
  void begin_star_block();
  // One store of the star block at `layer`: pre-RoPE keys at their positions; its first
  // in.summary_skip rows are stored for the scores' queries but never chosen.
  void keys(int layer, const layer_input& in);
  // The block's queries at `layer` (RoPE at q_pos), after the keys they see were stored.
  void queries(int layer, const float* q, const int32_t* q_pos, int64_t n_q);

  // One block's representative keys at `layer`, pre-RoPE, [n_head_kv][kPerBlock][head_dim]
  // with count[g] of them valid per KV head; null when the block has none (not star-prefilled).
  struct block_keys {
    std::vector<float> k;
    std::vector<int> count;  // [n_head_kv]
  };
  const block_keys* of(int layer, int64_t block_id);
  bool empty() const { return chosen_.empty() && open_.empty(); }
  void clear();

 private:
  struct open_block {  // one layer's rows of the star block being prefilled
    std::vector<int32_t> pos;
    std::vector<float> k, k_rot;  // [n, n_head_kv * head_dim] pre-RoPE and rotated at pos
    std::vector<double> score;    // [n, n_head_kv] Σ of q·k over the later queries in the window
    std::vector<int32_t> seen;    // [n] queries that added to the row's score
    std::vector<uint8_t> eligible;
  };
  void choose(int layer, open_block& b);

  int n_head_, n_head_kv_, head_dim_;
  int64_t block_, window_;
  rope_config rope_;
  backend& be_;
  std::map<int, open_block> open_;
  std::map<int, std::map<int64_t, block_keys>> chosen_;  // layer -> block id -> keys
  std::vector<float> tile_;                               // query tile x keys logits
};

}  // namespace xctx
