// Token sampling: greedy at temperature 0, else temperature + nucleus (top-p), seeded.
#pragma once

#include <cstdint>
#include <random>

namespace xctx {

struct sampler_params {
  float temperature = 0.0f;  // 0: greedy (argmax)
  float top_p = 1.0f;        // keep the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;
};

class sampler {
 public:
  explicit sampler(const sampler_params& p);
  int32_t sample(const float* logits /*[n_vocab]*/, int32_t n_vocab);

 private:
  sampler_params p_;
  std::mt19937_64 rng_;
};

int32_t argmax(const float* x /*[n]*/, int32_t n);

}  // namespace xctx
