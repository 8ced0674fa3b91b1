#include "worker/llama_engine.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <functional>

#include "common/error.h"
#include "common/hash.h"
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
    // kFixedDistanceGroup: retrieval attention's positions (kernels/ops.h), set by apply_attention_mode.
    XCTX_CHECK((rp.se_group >= 2 && rp.se_group <= 4096) || rp.se_group == kFixedDistanceGroup,
               "SelfExtend --group must be in [2, 4096], got ", rp.se_group);
    XCTX_CHECK(rp.se_window >= 1 && rp.se_window < hp.n_ctx_train, "SelfExtend --window must be in [1, ",
               hp.n_ctx_train, ") (the trained context), got ", rp.se_window);
    r.se_group = rp.se_group;
    r.se_window = rp.se_window;
    XCTX_CHECK(rp.se_period == 0 || (rp.se_group == kFixedDistanceGroup && rp.se_period % kAttnUnit == 0),
               "rope period ", rp.se_period, " needs retrieval positions and whole attention units (internal)");
    r.se_period = rp.se_period;
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
  if (fixed_distance_on(r))
    return s + " + retrieval positions: exact within " + std::to_string(r.se_window) + ", farther keys " +
           (r.se_period > 0 ? "in blocks of " + std::to_string(r.se_period) + " at distances " +
                                  std::to_string(r.se_window + 1) + "-" + std::to_string(r.se_window + r.se_period)
                            : "at distance " + std::to_string(r.se_window)) +
           " (any length)";
  if (self_extend_on(r))
    s = (r.scaling == rope_scaling::rope_scaling_none ? "" : s + " + ") + "selfextend G " + std::to_string(r.se_group) +
        " W " + std::to_string(r.se_window);
  return s + " (reaches " + std::to_string(rope_reach(r, n_ctx_train)) + " tokens)";
}

int64_t rope_reach(const rope_config& r, int64_t n_ctx_train) {
  const double factor = r.scaling == rope_scaling::rope_scaling_none ? 1.0 : (double)r.scaling_factor;
  const int64_t trained = (int64_t)((double)n_ctx_train * factor);
  if (!self_extend_on(r)) return trained;
  if (fixed_distance_on(r))
    return r.se_window + r.se_period < trained ? std::numeric_limits<int64_t>::max() : 0;
  // The farthest pair is the query at L - 1 and the key at 0: floor((L - 1) / G) + W - floor(W / G)
  // must stay <= trained - 1.
  const int64_t room = trained - 1 - (r.se_window - r.se_window / r.se_group);
  return room < 0 ? 0 : (room + 1) * r.se_group;
}

namespace {
uint64_t next_instance() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace

llama_engine::llama_engine(const model_weights& w, backend& be, const run_params& rp)
    : w_(w), be_(be), rp_(rp), rope_(make_rope_config(w.hp, rp)), instance_(next_instance()), weights_(be), x_(be),
      pos_(be), ids_(be),
      q_(be), o_(be), h_(be), k_(be), v_(be), gate_(be), up_(be), tmp_(be), normed_(be), logits_(be) {
  XCTX_CHECK(rp_.n_batch > 0, "n_batch must be positive, got ", rp_.n_batch);
  if (rp_.n_threads <= 0) rp_.n_threads = default_threads();
  omp_set_num_threads(rp_.n_threads);
  make_resident_weights();
}

void llama_engine::make_resident_weights() {
  const auto vec = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  tok_embd_ = w_.tok_embd, output_ = w_.output, out_norm_ = vec(w_.out_norm);
  layers_.clear();
  for (const layer_weights& L : w_.layers)
    layers_.push_back({L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down, vec(L.attn_norm), vec(L.ffn_norm),
                       vec(L.bq), vec(L.bk), vec(L.bv)});
  if (be_.host_memory()) return;
  // One allocation for every matrix and vector, each piece 256-byte aligned; a tied output
  // shares the embedding's upload.
  const auto pad = [](size_t b) { return (b + 255) / 256 * 256; };
  std::vector<std::pair<const void**, size_t>> pieces;  // where the host pointer lives, its bytes
  const auto matrix = [&](weight_view& v) { pieces.push_back({&v.data, v.bytes()}); };
  const auto vector = [&](const float*& p, const std::vector<float>& v) {
    if (!v.empty()) pieces.push_back({reinterpret_cast<const void**>(&p), v.size() * sizeof(float)});
  };
  const bool tied = w_.output.data == w_.tok_embd.data;
  matrix(tok_embd_);
  if (!tied) matrix(output_);
  vector(out_norm_, w_.out_norm);
  for (size_t l = 0; l < layers_.size(); ++l) {
    resident_layer& R = layers_[l];
    const layer_weights& L = w_.layers[l];
    for (weight_view* v : {&R.wq, &R.wk, &R.wv, &R.wo, &R.w_gate, &R.w_up, &R.w_down}) matrix(*v);
    vector(R.attn_norm, L.attn_norm), vector(R.ffn_norm, L.ffn_norm);
    vector(R.bq, L.bq), vector(R.bk, L.bk), vector(R.bv, L.bv);
  }
  size_t total = 0;
  for (const auto& [where, bytes] : pieces) total += pad(bytes);
  auto* base = static_cast<uint8_t*>(weights_.reserve(total));
  size_t at = 0;
  for (const auto& [where, bytes] : pieces) {
    be_.upload(base + at, *where, bytes);
    *where = base + at;
    at += pad(bytes);
  }
  if (tied) output_.data = tok_embd_.data;
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
  x_.reserve_as<float>(n_tokens * hp.n_embd);
  q_.reserve_as<float>(n_sub * hp.n_head * hp.head_dim);
  o_.reserve_as<float>(n_sub * hp.n_head * hp.head_dim);
  h_.reserve_as<float>(n_sub * hp.n_embd);
  tmp_.reserve_as<float>(n_sub * hp.n_embd);
  k_.reserve_as<float>(n_sub * hp.kv_dim());
  v_.reserve_as<float>(n_sub * hp.kv_dim());
  gate_.reserve_as<float>(n_sub * hp.n_ff);
  up_.reserve_as<float>(n_sub * hp.n_ff);
}

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
  const int32_t* pos_be = host_array_on(be_, pos, n, pos_);  // rope reads positions in backend memory
  float* const xs = x_.as<float>();
  float *const q = q_.as<float>(), *const o = o_.as<float>(), *const h = h_.as<float>(), *const k = k_.as<float>(),
               *const v = v_.as<float>(), *const gate = gate_.as<float>(), *const up = up_.as<float>(),
               *const tmp = tmp_.as<float>();
  const auto bias = [&](float* y, const float* b, int64_t m, int64_t dim) {
    if (b != nullptr) be_.add_rows(y, b, m, dim);
  };
  // One sub-chunk (every decode step, short prompts): q is computed with k and v in pass 1 from
  // the same normed input (one matmul_n over the three: one parallel region and one activation
  // quantization instead of two, and no second rms_norm). The same bits as computing it in pass 2.
  const bool q_with_kv = sb.size() == 2;
  // A decode step (one token) runs its kernels between attention calls as segments a backend
  // may record once and replay (CUDA graphs): two per layer, named by everything they are called
  // with -- this engine (instance_), the layer, and every scratch pointer (a regrown buffer is a
  // new segment).
  const bool segments = n == 1;
  const auto segment = [&](int layer, int which, const std::function<void()>& f) {
    if (!segments) return f();
    const void* const named[] = {xs, q, o, h, k, v, gate, up, tmp, pos_be};
    hash64 key((uint64_t)layer * 2 + which);
    key.update(&instance_, sizeof instance_);
    key.update(named, sizeof named);
    be_.run_segment(key.digest(), f);
  };
  for (int l = 0; l < hp.n_layer; ++l) {
    const resident_layer& L = layers_[l];
    // Pass 1: every token's k, v stored before any query of the layer attends (the ring needs
    // the layer's complete shard).
    for (size_t bi = 0; bi + 1 < sb.size(); ++bi) {
      const int64_t s = sb[bi], m = sb[bi + 1] - s;
      segment(l, 0, [&] {
        be_.rms_norm(xs + s * d, L.attn_norm, m, d, hp.rms_eps, h);
        if (q_with_kv) {
          const weight_view w[3] = {L.wq, L.wk, L.wv};
          float* const y[3] = {q, k, v};
          be_.matmul_n(w, 3, h, m, y);
          bias(q, L.bq, m, L.wq.n_rows);
          be_.rope(q, pos_be + s, m, hp.n_head, rope_);  // q only: keys are cached before RoPE
        } else {
          be_.matmul2(L.wk, L.wv, h, m, k, v);
        }
        bias(k, L.bk, m, L.wk.n_rows);
        bias(v, L.bv, m, L.wv.n_rows);
      });
      layer_input in;
      in.x = h;
      in.k = k;
      in.v = v;
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
      float* x = xs + s * d;
      if (!q_with_kv) {
        be_.rms_norm(x, L.attn_norm, m, d, hp.rms_eps, h);
        be_.matmul(L.wq, h, m, q);
        bias(q, L.bq, m, L.wq.n_rows);
        be_.rope(q, pos_be + s, m, hp.n_head, rope_);
      }
      attn.attend(l, q, pos + s, m, o);
      segment(l, 1, [&] {
        be_.matmul(L.wo, o, m, tmp);
        be_.add(x, tmp, m * d);
        be_.rms_norm(x, L.ffn_norm, m, d, hp.rms_eps, h);
        be_.matmul2(L.w_gate, L.w_up, h, m, gate, up);
        be_.swiglu(gate, up, m * hp.n_ff, gate);
        be_.matmul(L.w_down, gate, m, tmp);
        be_.add(x, tmp, m * d);
      });
    }
    if (layer_progress) layer_progress(l + 1, hp.n_layer);
  }
}

void llama_engine::compute_logits(const float* x, int64_t rows, float* logits) {
  const model_hparams& hp = w_.hp;
  float* normed = normed_.reserve_as<float>(rows * hp.n_embd);
  be_.rms_norm(x, out_norm_, rows, hp.n_embd, hp.rms_eps, normed);
  if (be_.host_memory()) {
    be_.matmul(output_, normed, rows, logits);
    return;
  }
  float* dev = logits_.reserve_as<float>(rows * (int64_t)hp.n_vocab);
  be_.matmul(output_, normed, rows, dev);
  be_.download(logits, dev, (size_t)rows * hp.n_vocab * sizeof(float));
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
    be_.get_rows(tok_embd_, host_array_on(be_, tokens + s, m, ids_), m, x_.as<float>());
    run_layers(pos + s, m, attn, {});
    if (which == logits_for::logits_all) {
      compute_logits(x_.as<float>(), m, logits + s * (int64_t)hp.n_vocab);
    } else if (which == logits_for::logits_last && s + m == n) {
      compute_logits(x_.as<float>() + (m - 1) * hp.n_embd, 1, logits);
    }
    if (progress) progress(s + m, n);
  }
}

void llama_engine::forward(const int32_t* tokens, const int32_t* pos, int64_t n, kv_cache& cache, logits_for which,
                           float* logits, const progress_fn& progress) {
  local_attention attn(cache, be_);
  forward(tokens, pos, n, attn, which, logits, progress);
}

void llama_engine::forward_layer_major(const int32_t* tokens, const int32_t* pos, int64_t n,
                                       attention_exchange& attn, const progress_fn& progress) {
  check_tokens(tokens, n, w_.hp.n_vocab);
  ensure_scratch(n, max_batch(n, rp_.n_batch, 1));
  be_.get_rows(tok_embd_, host_array_on(be_, tokens, n, ids_), n, x_.as<float>());
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
    compute_logits(x_.as<float>() + s * w_.hp.n_embd, m, logits.data());
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
