#include "coordinator/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "common/error.h"

namespace xctx {

int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;  // first maximum wins ties, as llama.cpp's greedy sampler
  return best;
}

sampler::sampler(const sampler_params& p) : p_(p), rng_(p.seed) {
  XCTX_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature), "temperature must be >= 0, got ", p.temperature);
  XCTX_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top-p must be in (0, 1], got ", p.top_p);
}

int32_t sampler::sample(const float* logits, int32_t n_vocab) {
  if (p_.temperature == 0.0f) return argmax(logits, n_vocab);
  const float max_logit = logits[argmax(logits, n_vocab)];
  std::vector<int32_t> ids(n_vocab);
  std::vector<double> prob(n_vocab);
  double sum = 0;
  for (int32_t i = 0; i < n_vocab; ++i) {
    prob[i] = std::exp(((double)logits[i] - max_logit) / p_.temperature);
    sum += prob[i];
  }
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return prob[a] > prob[b] || (prob[a] == prob[b] && a < b); });
  // Nucleus: the shortest prefix of the sorted distribution with mass >= top_p.
  size_t keep = 0;
  double mass = 0;
  while (keep < ids.size() && (keep == 0 || mass < p_.top_p * sum)) mass += prob[ids[keep++]];
  std::uniform_real_distribution<double> u(0.0, mass);
  double r = u(rng_);
  for (size_t i = 0; i < keep; ++i) {
    r -= prob[ids[i]];
    if (r <= 0) return ids[i];
  }
  return ids[keep - 1];
}

}  // namespace xctx
