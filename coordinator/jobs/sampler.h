// Token sampling: a chain of logit processors, then greedy (temperature 0) or a seeded draw.
//
// The chain, in order (Hugging Face's generate applies the same steps in the same order):
//  1. repetition penalty (Keskar et al. 2019, CTRL): every token among the last repeat_last_n
//     tokens of prompt and output has its logit divided by the penalty when positive and
//     multiplied by it when negative;
//  2. frequency and presence penalties with OpenAI's semantics: logit -= count * frequency +
//     (count > 0) * presence, where count is how often the token was generated so far (the
//     prompt does not count);
//  3. no-repeat n-grams: a token that would complete an n-gram the output already holds is
//     banned. Departure from Hugging Face, which also counts the prompt's n-grams: a summary
//     quotes its document, and banning every n-gram of a 100K-token prompt bans most phrases;
//  4. temperature 0: the argmax of what is left. Otherwise softmax at the temperature, then
//     top-k, top-p (nucleus) and min-p (tokens below min_p x the most likely token's
//     probability go), and a draw from what remains.
// With every processor at its neutral value the chain is plain greedy / temperature + top-p.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

namespace xctx {

struct sampler_params {
  float temperature = 0.0f;  // 0: greedy (argmax)
  float top_p = 1.0f;        // keep the smallest set of tokens whose probability reaches top_p
  int top_k = 0;             // keep the k most likely tokens (0: all)
  float min_p = 0.0f;        // keep tokens with probability >= min_p x the largest (0: all)
  float repetition_penalty = 1.0f;  // 1: off; > 1 discourages recent tokens
  int repeat_last_n = 64;           // the repetition penalty's window over prompt and output
  float frequency_penalty = 0.0f;   // OpenAI range [-2, 2]
  float presence_penalty = 0.0f;    // OpenAI range [-2, 2]
  int no_repeat_ngram = 0;          // n >= 2: never repeat an n-gram of the output (0: off)
  uint64_t seed = 0;
};

// Throws naming the option (as the CLI spells it) when a value is out of range.
void check_sampler_params(const sampler_params& p);
// The processors that are on, for run headers ("greedy", "temperature 0.7, top-p 0.9, ...").
std::string describe_sampler(const sampler_params& p);

class sampler {
 public:
  // prompt: the sequence's prompt tokens (the repetition penalty's window reaches into them).
  explicit sampler(const sampler_params& p, const std::vector<int32_t>& prompt = {});
  // The next token; it is recorded as generated (the penalties and n-gram ban see it).
  int32_t sample(const float* logits /*[n_vocab]*/, int32_t n_vocab);

 private:
  bool processes() const;  // any processor that changes logits is on
  void apply_processors(std::vector<float>& logits) const;
  int32_t draw(const std::vector<float>& logits);

  sampler_params p_;
  std::mt19937_64 rng_;
  std::vector<int32_t> recent_;   // prompt tail + output, the last repeat_last_n tokens
  std::vector<int32_t> output_;   // every generated token
  std::unordered_map<int32_t, int> counts_;  // generated tokens' counts
};

int32_t argmax(const float* x /*[n]*/, int32_t n);

}  // namespace xctx
