// The tiny random Llama-family models the engine tests write and load (3 layers, GQA 4/2,
// head_dim 32, vocabulary 160), and a deterministic token sequence for them.
#pragma once

#include <cstdint>
#include <vector>

#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/weights.h"
#include "test_util.h"

namespace xctx::test {

// bias: a Qwen2-style file with q/k/v biases; tied: the output shares the token embedding.
inline model_hparams tiny_hparams(bool tied, bool bias) {
  model_hparams hp;
  hp.arch = bias ? "qwen2" : "llama";
  hp.name = "tiny";
  hp.n_layer = 3;
  hp.n_embd = 128;
  hp.n_ff = 256;
  hp.n_head = 4;
  hp.n_head_kv = 2;
  hp.head_dim = 32;
  hp.n_rot = 32;
  hp.n_vocab = 160;
  hp.n_ctx_train = 256;
  hp.rms_eps = 1e-5f;
  hp.rope_freq_base = 10000.0f;
  hp.tied_output = tied;
  hp.qkv_bias = bias;
  return hp;
}

inline model_weights write_and_load(const model_hparams& hp, ggml_type type, uint64_t seed) {
  const auto path = scratch_dir() / "tiny.gguf";
  make_tiny_model_writer(hp, type, seed).write(path.string());
  return load_model(path.string());
}

inline std::vector<int32_t> some_tokens(int64_t n, int32_t vocab) {
  std::vector<int32_t> t(n);
  for (int64_t i = 0; i < n; ++i) t[i] = (int32_t)((i * 37 + 11) % vocab);
  return t;
}

}  // namespace xctx::test
