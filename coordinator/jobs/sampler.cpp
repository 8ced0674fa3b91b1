#include "coordinator/jobs/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>
#include <unordered_set>

#include "common/error.h"

namespace xctx {

int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;  // first maximum wins ties, as llama.cpp's greedy sampler
  return best;
}

void check_sampler_params(const sampler_params& p) {
  XCTX_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature), "--temperature must be >= 0, got ", p.temperature);
  XCTX_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "--top-p must be in (0, 1], got ", p.top_p);
  XCTX_CHECK(p.top_k >= 0, "--sample-top-k must be >= 0 (0: off), got ", p.top_k);
  XCTX_CHECK(p.min_p >= 0.0f && p.min_p <= 1.0f, "--min-p must be in [0, 1], got ", p.min_p);
  XCTX_CHECK(p.repetition_penalty > 0.0f && std::isfinite(p.repetition_penalty),
             "--repeat-penalty must be > 0 (1: off), got ", p.repetition_penalty);
  XCTX_CHECK(p.repeat_last_n >= 0, "--repeat-last-n must be >= 0, got ", p.repeat_last_n);
  XCTX_CHECK(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f,
             "--frequency-penalty must be in [-2, 2], got ", p.frequency_penalty);
  XCTX_CHECK(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f,
             "--presence-penalty must be in [-2, 2], got ", p.presence_penalty);
  XCTX_CHECK(p.no_repeat_ngram == 0 || p.no_repeat_ngram >= 2,
             "--no-repeat-ngram must be 0 (off) or >= 2, got ", p.no_repeat_ngram);
}

std::string describe_sampler(const sampler_params& p) {
  std::ostringstream s;
  if (p.temperature == 0.0f) {
    s << "greedy";
  } else {
    s << "temperature " << p.temperature;
    if (p.top_k > 0) s << ", sample top-k " << p.top_k;
    if (p.top_p < 1.0f) s << ", top-p " << p.top_p;
    if (p.min_p > 0.0f) s << ", min-p " << p.min_p;
    s << ", seed " << p.seed;
  }
  if (p.repetition_penalty != 1.0f && p.repeat_last_n > 0)
    s << ", repeat penalty " << p.repetition_penalty << " over the last " << p.repeat_last_n;
  if (p.frequency_penalty != 0.0f) s << ", frequency penalty " << p.frequency_penalty;
  if (p.presence_penalty != 0.0f) s << ", presence penalty " << p.presence_penalty;
  if (p.no_repeat_ngram > 0) s << ", no repeated " << p.no_repeat_ngram << "-grams";
  return s.str();
}

sampler::sampler(const sampler_params& p, const std::vector<int32_t>& prompt) : p_(p), rng_(p.seed) {
  check_sampler_params(p);
  const size_t n = std::min(prompt.size(), (size_t)p.repeat_last_n);
  recent_.assign(prompt.end() - (std::ptrdiff_t)n, prompt.end());
}

bool sampler::processes() const {
  return (p_.repetition_penalty != 1.0f && p_.repeat_last_n > 0) || p_.frequency_penalty != 0.0f ||
         p_.presence_penalty != 0.0f || p_.no_repeat_ngram > 0;
}

void sampler::apply_processors(std::vector<float>& logits) const {
  const int32_t n_vocab = (int32_t)logits.size();
  const auto in_vocab = [&](int32_t id) { return id >= 0 && id < n_vocab; };
  if (p_.repetition_penalty != 1.0f) {
    // Once per distinct token, however often it occurs in the window.
    const std::unordered_set<int32_t> seen(recent_.begin(), recent_.end());
    for (int32_t id : seen) {
      if (!in_vocab(id)) continue;
      float& l = logits[id];
      l = l > 0.0f ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    }
  }
  if (p_.frequency_penalty != 0.0f || p_.presence_penalty != 0.0f)
    for (const auto& [id, count] : counts_)
      if (in_vocab(id)) logits[id] -= (float)count * p_.frequency_penalty + p_.presence_penalty;
  const size_t n = (size_t)p_.no_repeat_ngram;
  if (n >= 2 && output_.size() >= n) {
    // The last n-1 tokens, and every earlier place they occur: the token after each is banned.
    const size_t prefix = output_.size() - (n - 1);
    for (size_t i = 0; i + n <= output_.size(); ++i)
      if (std::equal(output_.begin() + (std::ptrdiff_t)i, output_.begin() + (std::ptrdiff_t)(i + n - 1),
                     output_.begin() + (std::ptrdiff_t)prefix) &&
          in_vocab(output_[i + n - 1]))
        logits[output_[i + n - 1]] = -INFINITY;
  }
}

int32_t sampler::draw(const std::vector<float>& logits) {
  const int32_t n_vocab = (int32_t)logits.size();
  if (p_.temperature == 0.0f) return argmax(logits.data(), n_vocab);
  const float max_logit = logits[argmax(logits.data(), n_vocab)];
  std::vector<int32_t> ids(n_vocab);
  std::vector<double> prob(n_vocab);
  double kept = 0;  // the mass top-p is a fraction of: all tokens', summed in id order, or the top k's
  for (int32_t i = 0; i < n_vocab; ++i) {
    prob[i] = std::exp(((double)logits[i] - max_logit) / p_.temperature);
    kept += prob[i];
  }
  std::iota(ids.begin(), ids.end(), 0);
  const auto more_likely = [&](int32_t a, int32_t b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); };
  size_t keep = ids.size();
  if (p_.top_k > 0 && (size_t)p_.top_k < keep) {
    keep = (size_t)p_.top_k;
    std::partial_sort(ids.begin(), ids.begin() + (std::ptrdiff_t)keep, ids.end(), more_likely);
  } else {
    std::sort(ids.begin(), ids.end(), more_likely);
  }
  if (keep < ids.size()) {
    kept = 0;
    for (size_t i = 0; i < keep; ++i) kept += prob[ids[i]];
  }
  // Nucleus: the shortest prefix of the (top-k) distribution with mass >= top_p.
  size_t nucleus = 0;
  double mass = 0;
  while (nucleus < keep && (nucleus == 0 || mass < p_.top_p * kept)) mass += prob[ids[nucleus++]];
  keep = nucleus;
  // min-p: relative to the most likely token; the first token always stays.
  if (p_.min_p > 0.0f) {
    const double floor = p_.min_p * prob[ids[0]];
    while (keep > 1 && prob[ids[keep - 1]] < floor) mass -= prob[ids[--keep]];
  }
  std::uniform_real_distribution<double> u(0.0, mass);
  double r = u(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= prob[ids[i]];
    if (r <= 0) return ids[i];
  }
  return ids[keep - 1];
}

int32_t sampler::sample(const float* logits, int32_t n_vocab) {
  int32_t id;
  if (!processes() && p_.temperature == 0.0f) {
    id = argmax(logits, n_vocab);  // plain greedy: no copy of the logits
  } else {
    std::vector<float> l(logits, logits + n_vocab);
    if (processes()) apply_processors(l);
    id = draw(l);
  }
  output_.push_back(id);
  ++counts_[id];
  if (p_.repeat_last_n > 0) {
    recent_.push_back(id);
    if (recent_.size() > (size_t)p_.repeat_last_n) recent_.erase(recent_.begin());
  }
  return id;
}

}  // namespace xctx
