// The Llama-family weights of one model, as views into a mapped file (GGUF) or owned buffers
// (safetensors converted to f32/f16). Shapes use weight_view's [n_rows = out, n_cols = in].
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/types.h"
#include "model/hparams.h"

namespace xctx {

struct layer_weights {
  std::vector<float> attn_norm;  // [n_embd]
  weight_view wq;                // [n_head*head_dim, n_embd]
  weight_view wk;                // [n_head_kv*head_dim, n_embd]
  weight_view wv;                // [n_head_kv*head_dim, n_embd]
  weight_view wo;                // [n_embd, n_head*head_dim]
  std::vector<float> bq, bk, bv; // empty unless hparams.qkv_bias
  std::vector<float> ffn_norm;   // [n_embd]
  weight_view w_gate;            // [n_ff, n_embd]
  weight_view w_up;              // [n_ff, n_embd]
  weight_view w_down;            // [n_embd, n_ff]
};

struct model_weights {
  model_hparams hp;
  weight_view tok_embd;          // [n_vocab, n_embd]
  std::vector<float> out_norm;   // [n_embd]
  weight_view output;            // [n_vocab, n_embd]; == tok_embd when tied
  std::vector<layer_weights> layers;

  // Keeps the mapping / buffers the views point into alive.
  std::shared_ptr<void> storage;
  std::string source;  // file or directory it came from
  size_t weight_bytes() const;  // bytes of all matrices and vectors as stored
};

// Reads one byte of every page of the matrices, so a mapped file's weights are resident before
// the first forward: the first step is not timed with page faults, and RSS measured after
// loading includes the weights (what memory plans compare against leaves them out).
void make_resident(const model_weights& w);

class gguf_file;
// From a GGUF (llama.* / mistral.* / qwen2.* keys). Checks every tensor's presence, type and
// shape against the hparams; errors name the file and tensor.
model_weights load_gguf_weights(std::shared_ptr<gguf_file> file);
model_hparams read_gguf_hparams(const gguf_file& file);

// From a Hugging Face checkpoint directory: config.json + model.safetensors or sharded
// model-0000x-of-0000y.safetensors with model.safetensors.index.json (bf16/f16/f32).
// Q/K rows are permuted from HF's rotate-half layout into the adjacent-pair layout the rope
// kernels use (what llama.cpp's converter does), so both paths share one forward.
model_weights load_hf_weights(const std::string& dir);
// Only the hyper-parameters of such a directory (its config.json), checked.
model_hparams read_hf_config(const std::string& dir);

// Dispatches on what `path` is: a .gguf file or a checkpoint directory.
model_weights load_model(const std::string& path);

}  // namespace xctx
