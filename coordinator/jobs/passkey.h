// `xctx passkey`: the passkey-retrieval test (Mohtashami & Jaggi 2023, used by LongLoRA and
// KVQuant): a 5-digit key hidden at a chosen depth inside irrelevant filler text, then the
// question; greedy decoding must reproduce the key.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "model/tokenizer.h"
#include "worker/run_params.h"
#include "worker/sequence_parallel.h"

namespace xctx {

struct passkey_options {
  std::string model;       // empty: default_model_path()
  std::string tokenizer;   // empty: the model file
  int64_t context = 4096;  // total prompt tokens (template included with chat)
  int trials = 3;
  std::vector<double> depths = {0.0, 0.25, 0.5, 0.75, 1.0};  // each in [0, 1]
  uint64_t seed = 1;
  std::string filler = "classic";  // classic | austen
  bool chat = false;
  // The model often repeats the lead-in (" the pass key. The pass key is") before the number:
  // 24 tokens leave room for that; decoding stops early once a 5-digit number is complete.
  int max_answer_tokens = 24;
  std::string json_path;  // non-empty: results written there as JSON
  // Retrieval only, one rank: each trial also reports, per layer and KV head, the rank of the
  // key's block among all candidate blocks under each scoring rule (docs/retrieval.md).
  bool needle_rank = false;
  run_params run;
  sequence_options seq;
};

// Collective under mpirun: rank 0 builds prompts, decides tokens and prints; every rank holds a
// shard of each trial's cache.
int run_passkey(const passkey_options& opt, communicator& comm);

// Throws, naming the flag, when the options cannot run on this model and context.
void check_passkey_options(const passkey_options& opt, const model_hparams& hp);
// Tokens one trial may need: the prompt within its tolerance plus the answer.
int64_t passkey_tokens_needed(const passkey_options& opt);

class sequence_driver;
struct passkey_hooks {  // rank 0
  std::function<void(size_t depth_index, int trial, int64_t done, int64_t total)> prefill_progress;
  std::function<void(const nlohmann::json& trial)> on_trial;  // each trial's result as it ends
  std::function<bool()> should_stop;  // polled between trials and decode steps
  std::function<void(int64_t key_pos)> before_trial;     // the key's first token position
  std::function<void(nlohmann::json& trial)> annotate_trial;  // adds fields before on_trial
  std::function<void(bool decoding)> on_phase;  // each trial's prefill and answer (sequence_hooks)
};
// Rank 0: every (depth, trial) of opt as one sequence of the driver; returns the trials' JSON
// objects (fewer than all when should_stop ended it early).
nlohmann::json passkey_trials(const passkey_options& opt, const tokenizer& tok, const std::string& chat_template,
                              sequence_driver& driver, const passkey_hooks& hooks);
// Accuracy per depth and overall of the trials passkey_trials returned.
nlohmann::json passkey_summary(const passkey_options& opt, const nlohmann::json& trials);

// The prompt of one trial. The context tokens are prefilled with the chosen mode; the suffix
// (the question, plus the chat template's tail with --chat) runs through the merged decode path.
struct passkey_prompt {
  std::string text;                 // everything the model sees, template included
  std::vector<int32_t> ids;         // [n_tokens] = context_ids ‖ suffix_ids
  std::vector<int32_t> context_ids;
  std::vector<int32_t> suffix_ids;
  int64_t key_token = 0;            // index in ids of the key's first token (first mention)
  int64_t filler_tokens = 0;        // tokens of filler measured piece by piece
  int key = 0;
};

// The token count make_passkey_prompt guarantees: |ids.size() - context_tokens| <= this.
int64_t passkey_token_tolerance(int64_t context_tokens);

// Builds the prompt to `context_tokens` total tokens with the key after `depth` (in [0, 1]) of
// the filler. filler_kind: "classic" (the repeated grass/sky/sun lines) or "austen" (consecutive
// sentences of the novels from a seeded start). chat: wrap in the model's chat template
// (`chat_template` is the GGUF's tokenizer.chat_template). Pure apart from reading the corpus.
passkey_prompt make_passkey_prompt(const tokenizer& tok, int64_t context_tokens, double depth, int key,
                                   const std::string& filler_kind, uint64_t seed, bool chat = false,
                                   const std::string& chat_template = "");

// The key of trial seed: a uniform 5-digit number.
int passkey_for_seed(uint64_t seed);

// The first run of exactly five digits in `answer` (runs of other lengths are skipped), or -1.
int extract_passkey(const std::string& answer);
// True once `answer` holds a run of exactly five digits followed by a non-digit: more tokens
// cannot change what extract_passkey returns.
bool passkey_answer_complete(const std::string& answer);

// The Wilson score interval (95%: z = 1.96) of a proportion `correct` / `n` -- honest at the
// small n and the 0%/100% cells a passkey sweep has (the normal approximation collapses there).
std::pair<double, double> wilson_interval(int correct, int n, double z = 1.96);

// "0,0.25,1" -> {0, 0.25, 1}; throws naming --depths on a bad or out-of-range value.
std::vector<double> parse_depths(const std::string& text);

}  // namespace xctx
