#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

#include "common/error.h"
#include "coordinator/jobs/sampler.h"

namespace xctx {
namespace {

TEST(sampler, greedy_is_argmax_first_on_ties) {
  sampler s({.temperature = 0.0f, .seed = 1});
  std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(s.sample(l.data(), 4), 1);
}

// Empirical frequencies of n draws against probabilities p (which sum to 1 over the kept ids):
// every kept token within a binomial 5-sigma bound, no other token ever drawn.
void expect_frequencies(sampler& s, const std::vector<float>& l, const std::map<int, double>& p, int n = 20000) {
  std::map<int, int> count;
  for (int i = 0; i < n; ++i) count[s.sample(l.data(), (int32_t)l.size())]++;
  for (const auto& [t, c] : count) EXPECT_TRUE(p.count(t)) << "token " << t << " drawn " << c << " times";
  for (const auto& [t, pt] : p) {
    const double sigma = std::sqrt(n * pt * (1 - pt));
    EXPECT_NEAR(count[t], n * pt, 5 * sigma + 1) << "token " << t;
  }
}

// With top_p below the top token's probability only that token can be drawn; with top_p = 1 the
// empirical frequencies follow softmax(l / T).
TEST(sampler, nucleus_and_temperature) {
  std::vector<float> l = {2.0f, 1.0f, 0.0f};
  sampler narrow({.temperature = 1.0f, .top_p = 0.5f, .seed = 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(narrow.sample(l.data(), 3), 0);
  sampler s({.temperature = 1.0f, .seed = 11});
  const double z = std::exp(2.0) + std::exp(1.0) + 1.0;
  expect_frequencies(s, l, {{0, std::exp(2.0) / z}, {1, std::exp(1.0) / z}, {2, 1.0 / z}});
}

// top-k keeps the k most likely and renormalizes; min-p drops tokens below min_p x the top
// probability; top-p is a fraction of the top-k mass (Hugging Face's order: temperature, top-k,
// top-p, min-p).
TEST(sampler, top_k_and_min_p_truncate_then_renormalize) {
  const std::vector<float> l = {0.0f, 3.0f, 1.0f, 2.0f, -1.0f};  // order by probability: 1, 3, 2, 0, 4
  const auto e = [](double x) { return std::exp(x); };
  sampler k2({.temperature = 1.0f, .top_k = 2, .seed = 5});
  expect_frequencies(k2, l, {{1, e(3) / (e(3) + e(2))}, {3, e(2) / (e(3) + e(2))}});
  // min-p 0.3: e(1)/e(3) = 0.135 goes, e(2)/e(3) = 0.37 stays.
  sampler mp({.temperature = 1.0f, .min_p = 0.3f, .seed = 6});
  expect_frequencies(mp, l, {{1, e(3) / (e(3) + e(2))}, {3, e(2) / (e(3) + e(2))}});
  // top-k 3 then top-p 0.8 of those three: 1 (0.665) and 3 (0.245) reach it.
  sampler kp({.temperature = 1.0f, .top_p = 0.8f, .top_k = 3, .seed = 7});
  expect_frequencies(kp, l, {{1, e(3) / (e(3) + e(2))}, {3, e(2) / (e(3) + e(2))}});
  // top-k larger than the vocabulary: everything stays.
  sampler all({.temperature = 1.0f, .top_k = 100, .seed = 8});
  const double z = e(0) + e(3) + e(1) + e(2) + e(-1);
  expect_frequencies(all, l, {{0, e(0) / z}, {1, e(3) / z}, {2, e(1) / z}, {3, e(2) / z}, {4, e(-1) / z}});
}

// CTRL's rule on the last repeat_last_n tokens of prompt and output: positive logits divided,
// negative multiplied; tokens outside the window untouched. Greedy shows the processed argmax.
TEST(sampler, repetition_penalty_over_the_window_of_prompt_and_output) {
  const std::vector<float> l = {2.0f, 1.9f, -1.0f, -1.2f};
  // Token 0 in the prompt: 2.0 / 1.5 = 1.33 < 1.9, so 1 wins.
  sampler s({.repetition_penalty = 1.5f, .repeat_last_n = 4}, {0});
  EXPECT_EQ(s.sample(l.data(), 4), 1);
  // Now 0 and 1 are both in the window: 1.33 vs 1.27, 0 wins.
  EXPECT_EQ(s.sample(l.data(), 4), 0);
  // A negative logit is multiplied: -1.0 * 3 = -3.0 < -1.2.
  const std::vector<float> neg = {-1.0f, -1.2f};
  sampler n({.repetition_penalty = 3.0f, .repeat_last_n = 8}, {0});
  EXPECT_EQ(n.sample(neg.data(), 2), 1);
  // Outside the window (the prompt's older tokens): no penalty.
  sampler w({.repetition_penalty = 1.5f, .repeat_last_n = 1}, {0, 3});
  EXPECT_EQ(w.sample(l.data(), 4), 0);
}

// OpenAI: logit -= count * frequency + (count > 0) * presence, count over generated tokens only.
TEST(sampler, frequency_and_presence_penalties_count_generated_tokens) {
  const std::vector<float> l = {1.0f, 0.75f, 0.0f};
  // The prompt does not count: the first draw is the plain argmax.
  sampler f({.frequency_penalty = 0.1f}, {0, 0, 0, 0});
  EXPECT_EQ(f.sample(l.data(), 3), 0);  // count(0) = 1 afterwards: 0.9
  EXPECT_EQ(f.sample(l.data(), 3), 0);  // 0.9 > 0.75; count 2: 0.8
  EXPECT_EQ(f.sample(l.data(), 3), 0);  // 0.8 > 0.75; count 3: 0.7
  EXPECT_EQ(f.sample(l.data(), 3), 1);  // 0.7 < 0.75
  // Presence: once is enough, and it does not grow.
  sampler p({.presence_penalty = 0.3f});
  EXPECT_EQ(p.sample(l.data(), 3), 0);
  EXPECT_EQ(p.sample(l.data(), 3), 1);  // 0.7 < 0.75
  EXPECT_EQ(p.sample(l.data(), 3), 0);  // both present once: 0.7 and 0.45; it does not grow with the count
}

// No n-gram of the output twice: greedy on logits that would loop "0 1 0 1 ..." leaves the loop
// the moment a 3-gram would repeat (after "0 1 0 1", a 0 would repeat "0 1 0"), and no 3-gram
// repeats over the run (16 tokens: never all of them banned).
TEST(sampler, no_repeat_ngram_never_repeats_an_output_ngram) {
  const int n_vocab = 16;
  sampler s({.no_repeat_ngram = 3});
  std::vector<int32_t> out;
  for (int step = 0; step < 40; ++step) {
    // A model that wants the loop 0 1 0 1 ...: the loop's next token scores highest, the others
    // fall off by id.
    std::vector<float> l(n_vocab);
    const int want = out.empty() ? 0 : 1 - std::min(out.back(), 1);
    for (int t = 0; t < n_vocab; ++t) l[t] = t == want ? 10.0f : -(float)t;
    out.push_back(s.sample(l.data(), n_vocab));
  }
  EXPECT_EQ(std::vector<int32_t>(out.begin(), out.begin() + 6), (std::vector<int32_t>{0, 1, 0, 1, 1, 0}));
  std::set<std::vector<int32_t>> seen;
  for (size_t i = 0; i + 3 <= out.size(); ++i)
    EXPECT_TRUE(seen.insert({out[i], out[i + 1], out[i + 2]}).second) << "the 3-gram at " << i << " repeats";
  // Off, the same logits loop.
  sampler plain({});
  std::vector<int32_t> loop;
  for (int step = 0; step < 6; ++step) {
    std::vector<float> l(n_vocab);
    const int want = loop.empty() ? 0 : 1 - std::min(loop.back(), 1);
    for (int t = 0; t < n_vocab; ++t) l[t] = t == want ? 10.0f : -(float)t;
    loop.push_back(plain.sample(l.data(), n_vocab));
  }
  EXPECT_EQ(loop, (std::vector<int32_t>{0, 1, 0, 1, 0, 1}));
}

TEST(sampler, same_seed_same_draws_and_bad_params_rejected) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[i] = std::sin(i * 0.7f);
  const sampler_params p{.temperature = 0.8f, .top_p = 0.9f, .top_k = 20, .min_p = 0.05f,
                         .repetition_penalty = 1.1f, .frequency_penalty = 0.2f, .no_repeat_ngram = 4, .seed = 5};
  sampler a(p), b(p);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.sample(l.data(), 50), b.sample(l.data(), 50));
  const auto message = [](const sampler_params& bad) {
    try {
      sampler s(bad);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message({.temperature = -1.0f}).find("--temperature"), std::string::npos);
  EXPECT_NE(message({.top_p = 0.0f}).find("--top-p"), std::string::npos);
  EXPECT_NE(message({.top_p = 1.5f}).find("--top-p"), std::string::npos);
  EXPECT_NE(message({.top_k = -1}).find("--sample-top-k"), std::string::npos);
  EXPECT_NE(message({.min_p = 1.5f}).find("--min-p"), std::string::npos);
  EXPECT_NE(message({.repetition_penalty = 0.0f}).find("--repeat-penalty"), std::string::npos);
  EXPECT_NE(message({.repeat_last_n = -1}).find("--repeat-last-n"), std::string::npos);
  EXPECT_NE(message({.frequency_penalty = 2.5f}).find("--frequency-penalty"), std::string::npos);
  EXPECT_NE(message({.presence_penalty = -3.0f}).find("--presence-penalty"), std::string::npos);
  EXPECT_NE(message({.no_repeat_ngram = 1}).find("--no-repeat-ngram"), std::string::npos);
  EXPECT_EQ(describe_sampler({}), "greedy");
  EXPECT_EQ(describe_sampler({.temperature = 0.7f, .top_p = 0.9f, .no_repeat_ngram = 3, .seed = 3}),
            "temperature 0.7, top-p 0.9, seed 3, no repeated 3-grams");
}

}  // namespace
}  // namespace xctx
