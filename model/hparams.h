// Read-only model hyper-parameters (from the model file) and the runtime parameters.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/types.h"

namespace xctx {

struct model_hparams {
  std::string arch = "llama";  // llama | mistral | qwen2 (same forward; qwen2 has q/k/v biases)
  std::string name;
  int n_layer = 0;
  int n_embd = 0;
  int n_ff = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;      // n_embd / n_head unless the file says otherwise
  int n_vocab = 0;
  int n_ctx_train = 0;
  float rms_eps = 1e-5f;
  float rope_freq_base = 10000.0f;
  int n_rot = 0;         // rotated dims per head
  rope_scaling rope_scale_type = rope_scaling::rope_scaling_none;  // as stored in the file
  float rope_scale_factor = 1.0f;
  bool tied_output = false;  // output projection shares token_embd
  bool qkv_bias = false;

  int n_gqa() const { return n_head / n_head_kv; }
  int kv_dim() const { return n_head_kv * head_dim; }
  // Throws xctx::Error naming `source` and the field if anything is out of range.
  void validate(const std::string& source) const;
};

}  // namespace xctx
