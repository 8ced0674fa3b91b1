#include "worker/llama_engine.h"

#include <omp.h>

#include <algorithm>

#include "common/error.h"
#include "common/sys.h"
#include "worker/shard_plan.h"

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
  if (rp.se_group != 1) {
    XCTX_CHECK(rp.se_group >= 2 && rp.se_group <= 4096, "SelfExtend --group must be in [2, 4096], got ", rp.se_group);
    XCTX_CHECK(rp.se_window >= 1 && rp.se_window < hp.n_ctx_train, "SelfExtend --window must be in [1, ",
               hp.n_ctx_train, ") (the trained context), got ", rp.se_window);
    r.se_group = rp.se_group;
    r.se_window = rp.se_window;
  }
  return r;
}

std::string describe_rope(const rope_config& r, int64_t n_ctx_train) {
  std::string s;
  switch (r.scaling) {
    case rope_scaling::rope_scaling_none: s = "none"; break;
    case rope_scaling::rope_scaling_linear: s = "linear x" + std::to_string(r.scaling_factor); break;
    case rope_scaling::rope_scaling_ntk: s = "ntk x" + std::to_string(r.scaling_factor); break;
  }
  if (r.scaling != rope_scaling::rope_scaling_none) s.erase(s.find_last_not_of('0') + 1), s.erase(s.find_last_not_of('.') + 1);
  if (self_extend_on(r))
    s = (r.scaling == rope_scaling::rope_scaling_none ? "" : s + " + ") + "selfextend G " + std::to_string(r.se_group) +
        " W " + std::to_string(r.se_window);
  return s + " (reaches " + std::to_string(rope_reach(r, n_ctx_train)) + " tokens)";
}

int64_t rope_reach(const rope_config& r, int64_t n_ctx_train) {
  const double factor = r.scaling == rope_scaling::rope_scaling_none ? 1.0 : (double)r.scaling_factor;
  const int64_t trained = (int64_t)((double)n_ctx_train * factor);
  if (!self_extend_on(r)) return trained;
  // The farthest pair is the query at L - 1 and the key at 0: floor((L - 1) / G) + W - floor(W / G)
  // must stay <= trained - 1.
  const int64_t room = trained - 1 - (r.se_window - r.se_window / r.se_group);
  return room < 0 ? 0 : (room + 1) * r.se_group;
}

llama_engine::llama_engine(const model_weights& w, backend& be, const run_params& rp)
    : w_(w), be_(be), rp_(rp), rope_(make_rope_config(w.hp, rp)) {
  XCTX_CHECK(rp_.n_batch > 0, "n_batch must be positive, got ", rp_.n_batch);
  if (rp_.n_threads <= 0) rp_.n_threads = default_threads();
  omp_set_num_threads(rp_.n_threads);
}

cache_geometry make_cache_geometry(const model_hparams& hp, const rope_config& rope, int64_t capacity) {
  cache_geometry g;
  g.n_layer = hp.n_layer;
  g.n_head = hp.n_head;
  g.n_head_kv = hp.n_head_kv;
  g.head_dim = hp.head_dim;
  g.n_embd = hp.n_embd;
  g.rope = rope;
  g.capacity = capacity;
  return g;
}

cache_geometry llama_engine::cache_geometry_for(int64_t capacity) const {
  return make_cache_geometry(w_.hp, rope_, capacity);
}

void llama_engine::ensure_scratch(int64_t n_tokens, int64_t n_sub) {
  const model_hparams& hp = w_.hp;
  const auto grow = [](std::vector<float>& v, int64_t n) {
    if ((int64_t)v.size() < n) v.resize(n);
  };
  grow(x_, n_tokens * hp.n_embd);
  grow(q_, n_sub * hp.n_head * hp.head_dim);
  grow(o_, n_sub * hp.n_head * hp.head_dim);
  grow(h_, n_sub * hp.n_embd);
  grow(tmp_, n_sub * hp.n_embd);
  grow(k_, n_sub * hp.kv_dim());
  grow(v_, n_sub * hp.kv_dim());
  grow(gate_, n_sub * hp.n_ff);
  grow(up_, n_sub * hp.n_ff);
}

namespace {
void add_bias(float* y, const std::vector<float>& b, int64_t n) {
  if (b.empty()) return;
  const int64_t d = (int64_t)b.size();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; ++i) y[t * d + i] += b[i];
}
}  // namespace

std::vector<int64_t> batch_bounds(int64_t n, int64_t batch, int64_t align) {
  XCTX_CHECK(batch > 0 && align > 0, "batch_bounds: batch ", batch, " / align ", align);
  const int64_t b = std::max(align, batch / align * align);
  std::vector<int64_t> out;
  for (int64_t s = 0; s < n; s += b) out.push_back(s);
  // A short tail joins the batch before it: no batch of a long run is short enough for the
  // matmul kernels to take their decode path, which rounds differently.
  if (out.size() > 1 && n - out.back() < kMinPrefillBatch) out.pop_back();
  out.push_back(n);
  return out;
}

namespace {

int64_t max_batch(int64_t n, int64_t batch, int64_t align) {
  const std::vector<int64_t> b = batch_bounds(n, batch, align);
  int64_t m = 0;
  for (size_t i = 1; i < b.size(); ++i) m = std::max(m, b[i] - b[i - 1]);
  return m;
}

}  // namespace

void llama_engine::run_layers(const int32_t* pos, int64_t n, attention_exchange& attn,
                              const progress_fn& layer_progress) {
  const model_hparams& hp = w_.hp;
  const int64_t d = hp.n_embd;
  const std::vector<int64_t> sb = batch_bounds(n, rp_.n_batch, 1);
  // One sub-chunk (every decode step, short prompts): q is computed with k and v in pass 1 from
  // the same normed input (one matmul_n over the three: one parallel region and one activation
  // quantization instead of two, and no second rms_norm). The same bits as computing it in pass 2.
  const bool q_with_kv = sb.size() == 2;
  for (int l = 0; l < hp.n_layer; ++l) {
    const layer_weights& L = w_.layers[l];
    // Pass 1: every token's k, v stored before any query of the layer attends (the ring needs
    // the layer's complete shard).
    for (size_t bi = 0; bi + 1 < sb.size(); ++bi) {
      const int64_t s = sb[bi], m = sb[bi + 1] - s;
      be_.rms_norm(x_.data() + s * d, L.attn_norm.data(), m, d, hp.rms_eps, h_.data());
      if (q_with_kv) {
        const weight_view w[3] = {L.wq, L.wk, L.wv};
        float* const y[3] = {q_.data(), k_.data(), v_.data()};
        be_.matmul_n(w, 3, h_.data(), m, y);
        add_bias(q_.data(), L.bq, m);
      } else {
        be_.matmul2(L.wk, L.wv, h_.data(), m, k_.data(), v_.data());
      }
      add_bias(k_.data(), L.bk, m);
      add_bias(v_.data(), L.bv, m);
      layer_input in;
      in.x = h_.data();
      in.k = k_.data();
      in.v = v_.data();
      in.pos = pos + s;
      in.n = m;
      attn.store(l, in);
    }
    attn.layer_stored(l);
    // Pass 2, sub-chunk by sub-chunk: queries, attention, output projection, MLP. The normed
    // input is recomputed (the same bits: rms_norm is per row) so q and o stay O(n_batch), not
    // O(n): what bounds a long shard's prefill memory (docs/sequence_parallel.md).
    for (size_t bi = 0; bi + 1 < sb.size(); ++bi) {
      const int64_t s = sb[bi], m = sb[bi + 1] - s;
      float* x = x_.data() + s * d;
      if (!q_with_kv) {
        be_.rms_norm(x, L.attn_norm.data(), m, d, hp.rms_eps, h_.data());
        be_.matmul(L.wq, h_.data(), m, q_.data());
        add_bias(q_.data(), L.bq, m);
      }
      be_.rope(q_.data(), pos + s, m, hp.n_head, rope_);
      attn.attend(l, q_.data(), pos + s, m, o_.data());
      be_.matmul(L.wo, o_.data(), m, tmp_.data());
      be_.add(x, tmp_.data(), m * d);
      be_.rms_norm(x, L.ffn_norm.data(), m, d, hp.rms_eps, h_.data());
      be_.matmul2(L.w_gate, L.w_up, h_.data(), m, gate_.data(), up_.data());
      be_.swiglu(gate_.data(), up_.data(), m * hp.n_ff, gate_.data());
      be_.matmul(L.w_down, gate_.data(), m, tmp_.data());
      be_.add(x, tmp_.data(), m * d);
    }
    if (layer_progress) layer_progress(l + 1, hp.n_layer);
  }
}

void llama_engine::compute_logits(const float* x, int64_t rows, float* logits) {
  const model_hparams& hp = w_.hp;
  if ((int64_t)normed_.size() < rows * hp.n_embd) normed_.resize(rows * hp.n_embd);
  be_.rms_norm(x, w_.out_norm.data(), rows, hp.n_embd, hp.rms_eps, normed_.data());
  be_.matmul(w_.output, normed_.data(), rows, logits);
}

namespace {
void check_tokens(const int32_t* tokens, int64_t n, int32_t n_vocab) {
  XCTX_CHECK(n > 0, "forward: no tokens");
  for (int64_t i = 0; i < n; ++i)
    XCTX_CHECK(tokens[i] >= 0 && tokens[i] < n_vocab, "token id ", tokens[i], " at index ", i,
               " is outside the vocabulary [0, ", n_vocab, ")");
}
}  // namespace

void llama_engine::forward(const int32_t* tokens, const int32_t* pos, int64_t n, attention_exchange& attn,
                           logits_for which, float* logits, const progress_fn& progress, int64_t chunk_align) {
  const model_hparams& hp = w_.hp;
  check_tokens(tokens, n, hp.n_vocab);
  const std::vector<int64_t> cb = batch_bounds(n, rp_.n_batch, chunk_align);
  const int64_t chunk = max_batch(n, rp_.n_batch, chunk_align);
  ensure_scratch(chunk, max_batch(chunk, rp_.n_batch, 1));
  for (size_t ci = 0; ci + 1 < cb.size(); ++ci) {
    const int64_t s = cb[ci], m = cb[ci + 1] - s;
    be_.get_rows(w_.tok_embd, tokens + s, m, x_.data());
    run_layers(pos + s, m, attn, {});
    if (which == logits_for::logits_all) {
      compute_logits(x_.data(), m, logits + s * (int64_t)hp.n_vocab);
    } else if (which == logits_for::logits_last && s + m == n) {
      compute_logits(x_.data() + (m - 1) * hp.n_embd, 1, logits);
    }
    if (progress) progress(s + m, n);
  }
}

void llama_engine::forward(const int32_t* tokens, const int32_t* pos, int64_t n, kv_cache& cache, logits_for which,
                           float* logits, const progress_fn& progress) {
  local_attention attn(cache);
  forward(tokens, pos, n, attn, which, logits, progress);
}

void llama_engine::forward_layer_major(const int32_t* tokens, const int32_t* pos, int64_t n,
                                       attention_exchange& attn, const progress_fn& progress) {
  check_tokens(tokens, n, w_.hp.n_vocab);
  ensure_scratch(n, max_batch(n, rp_.n_batch, 1));
  be_.get_rows(w_.tok_embd, tokens, n, x_.data());
  run_layers(pos, n, attn, progress);
}

void llama_engine::forward_layer_major_scored(const int32_t* tokens, const int32_t* pos, int64_t n,
                                              attention_exchange& attn, const int32_t* targets, float* nll,
                                              const progress_fn& progress) {
  forward_layer_major(tokens, pos, n, attn, progress);
  const int64_t V = w_.hp.n_vocab;
  const std::vector<int64_t> lb = batch_bounds(n, rp_.n_batch, 1);
  std::vector<float> logits((size_t)(max_batch(n, rp_.n_batch, 1) * V));  // [batch, n_vocab]
  for (size_t bi = 0; bi + 1 < lb.size(); ++bi) {
    const int64_t s = lb[bi], m = lb[bi + 1] - s;
    compute_logits(x_.data() + s * w_.hp.n_embd, m, logits.data());
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; ++i) {
      const int32_t t = targets[s + i];
      if (t < 0) {
        nll[s + i] = 0.0f;
        continue;
      }
      XCTX_CHECK(t < V, "scoring target ", t, " is outside the vocabulary");
      const float* l = logits.data() + i * V;
      const float mx = *std::max_element(l, l + V);
      double sum = 0.0;
      for (int64_t j = 0; j < V; ++j) sum += std::exp((double)l[j] - mx);
      nll[s + i] = (float)((double)mx + std::log(sum) - (double)l[t]);
    }
  }
}

}  // namespace xctx
