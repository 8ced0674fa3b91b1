#include "worker/llama_engine.h"

#include <omp.h>

#include <algorithm>

#include "common/error.h"

namespace xctx {

rope_config make_rope_config(const model_hparams& hp, const run_params& rp) {
  rope_config r;
  r.head_dim = hp.head_dim;
  r.n_rot = hp.n_rot;
  r.freq_base = hp.rope_freq_base;
  r.scaling = hp.rope_scale_type;
  r.scaling_factor = hp.rope_scale_factor;
  if (rp.rope_scale != rope_scaling::rope_scaling_none) {
    XCTX_CHECK(rp.rope_factor >= 1.0f, "rope scaling factor must be >= 1, got ", rp.rope_factor);
    r.scaling = rp.rope_scale;
    r.scaling_factor = rp.rope_factor;
  }
  return r;
}

llama_engine::llama_engine(const model_weights& w, backend& be, const run_params& rp)
    : w_(w), be_(be), rp_(rp), rope_(make_rope_config(w.hp, rp)) {
  XCTX_CHECK(rp_.n_batch > 0, "n_batch must be positive, got ", rp_.n_batch);
  if (rp_.n_threads > 0) omp_set_num_threads(rp_.n_threads);
}

cache_geometry llama_engine::cache_geometry_for(int64_t capacity) const {
  cache_geometry g;
  g.n_layer = w_.hp.n_layer;
  g.n_head = w_.hp.n_head;
  g.n_head_kv = w_.hp.n_head_kv;
  g.head_dim = w_.hp.head_dim;
  g.n_embd = w_.hp.n_embd;
  g.rope = rope_;
  g.capacity = capacity;
  return g;
}

void llama_engine::ensure_scratch(int64_t n) {
  if (n <= scratch_tokens_) return;
  const model_hparams& hp = w_.hp;
  x_.resize(n * hp.n_embd);
  h_.resize(n * hp.n_embd);
  tmp_.resize(n * hp.n_embd);
  q_.resize(n * hp.n_head * hp.head_dim);
  o_.resize(n * hp.n_head * hp.head_dim);
  k_.resize(n * hp.kv_dim());
  v_.resize(n * hp.kv_dim());
  lse_.resize(n * hp.n_head);
  gate_.resize(n * hp.n_ff);
  up_.resize(n * hp.n_ff);
  scratch_tokens_ = n;
}

namespace {
void add_bias(float* y, const std::vector<float>& b, int64_t n) {
  if (b.empty()) return;
  const int64_t d = (int64_t)b.size();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; ++i) y[t * d + i] += b[i];
}
}  // namespace

void llama_engine::forward_chunk(const int32_t* tokens, const int32_t* pos, int64_t n, kv_cache& cache) {
  const model_hparams& hp = w_.hp;
  const int64_t d = hp.n_embd;
  be_.get_rows(w_.tok_embd, tokens, n, x_.data());
  for (int l = 0; l < hp.n_layer; ++l) {
    const layer_weights& L = w_.layers[l];
    // attention block
    be_.rms_norm(x_.data(), L.attn_norm.data(), n, d, hp.rms_eps, h_.data());
    be_.matmul(L.wq, h_.data(), n, q_.data());
    be_.matmul(L.wk, h_.data(), n, k_.data());
    be_.matmul(L.wv, h_.data(), n, v_.data());
    add_bias(q_.data(), L.bq, n);
    add_bias(k_.data(), L.bk, n);
    add_bias(v_.data(), L.bv, n);
    be_.rope(q_.data(), pos, n, hp.n_head, rope_);
    layer_input in;
    in.x = h_.data();
    in.k = k_.data();
    in.v = v_.data();
    in.pos = pos;
    in.n = n;
    cache.append(l, in);
    cache.attend(l, q_.data(), pos, n, o_.data(), lse_.data());
    be_.matmul(L.wo, o_.data(), n, tmp_.data());
    be_.add(x_.data(), tmp_.data(), n * d);
    // MLP block
    be_.rms_norm(x_.data(), L.ffn_norm.data(), n, d, hp.rms_eps, h_.data());
    be_.matmul(L.w_gate, h_.data(), n, gate_.data());
    be_.matmul(L.w_up, h_.data(), n, up_.data());
    be_.swiglu(gate_.data(), up_.data(), n * hp.n_ff, gate_.data());
    be_.matmul(L.w_down, gate_.data(), n, tmp_.data());
    be_.add(x_.data(), tmp_.data(), n * d);
  }
}

void llama_engine::forward(const int32_t* tokens, const int32_t* pos, int64_t n, kv_cache& cache, logits_for which,
                           float* logits, const std::function<void(int64_t, int64_t)>& progress) {
  XCTX_CHECK(n > 0, "forward: no tokens");
  const model_hparams& hp = w_.hp;
  for (int64_t i = 0; i < n; ++i)
    XCTX_CHECK(tokens[i] >= 0 && tokens[i] < hp.n_vocab, "token id ", tokens[i], " at index ", i,
               " is outside the vocabulary [0, ", hp.n_vocab, ")");
  const int64_t chunk = std::min<int64_t>(n, rp_.n_batch);
  ensure_scratch(chunk);
  std::vector<float> normed;
  for (int64_t s = 0; s < n; s += chunk) {
    const int64_t m = std::min(chunk, n - s);
    forward_chunk(tokens + s, pos + s, m, cache);
    if (which == logits_for::logits_all || (which == logits_for::logits_last && s + m == n)) {
      const int64_t first = which == logits_for::logits_all ? 0 : m - 1;
      const int64_t rows = m - first;
      normed.resize(rows * hp.n_embd);
      be_.rms_norm(x_.data() + first * hp.n_embd, w_.out_norm.data(), rows, hp.n_embd, hp.rms_eps, normed.data());
      float* dst = which == logits_for::logits_all ? logits + s * (int64_t)hp.n_vocab : logits;
      be_.matmul(w_.output, normed.data(), rows, dst);
    }
    if (progress) progress(s + m, n);
  }
}

}  // namespace xctx
