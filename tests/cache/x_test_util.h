// Shared by the X-cache tests: small GQA / MHA geometries, a synthetic model whose W_k/W_v are
// random f32 matrices, and layer inputs shaped like a residual stream (each layer's X a small
// refinement of the previous one, one large channel as real activations have).
#pragma once

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/x_cache.h"
#include "cache/x_factors.h"
#include "model/weights.h"

namespace xctx::test {

inline cache_geometry x_geometry(bool gqa, int64_t capacity, int n_layer = 4) {
  cache_geometry g;
  g.n_layer = n_layer;
  g.n_head = 4;
  g.n_head_kv = gqa ? 2 : 4;
  g.head_dim = 16;
  g.n_embd = gqa ? 96 : 64;  // GQA: kv_dim 32, latent rank 32, cross-layer rank 64 < 96
  g.rope.head_dim = 16;
  g.rope.n_rot = 16;
  g.rope.freq_base = 10000.0f;
  g.capacity = capacity;
  return g;
}

struct x_model {
  model_weights w;
  std::shared_ptr<std::vector<std::vector<float>>> mats;  // [n_layer * 2] W_k, W_v rows
};

inline x_model make_x_model(const cache_geometry& g, uint32_t seed, bool bias) {
  x_model m;
  model_hparams& hp = m.w.hp;
  hp.n_layer = g.n_layer, hp.n_embd = g.n_embd, hp.n_head = g.n_head, hp.n_head_kv = g.n_head_kv;
  hp.head_dim = g.head_dim, hp.qkv_bias = bias;
  const int C = g.n_head_kv * g.head_dim, d = g.n_embd;
  m.mats = std::make_shared<std::vector<std::vector<float>>>(2 * g.n_layer);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  m.w.layers.resize(g.n_layer);
  for (int l = 0; l < g.n_layer; ++l) {
    for (int k = 0; k < 2; ++k) {
      auto& a = (*m.mats)[2 * l + k];
      a.resize((size_t)C * d);
      for (float& x : a) x = nd(rng) / std::sqrt((float)d);
      weight_view& v = k == 0 ? m.w.layers[l].wk : m.w.layers[l].wv;
      v.type = ggml_type::ggml_f32, v.n_rows = C, v.n_cols = d, v.data = a.data();
    }
    if (bias) {
      m.w.layers[l].bk.resize(C), m.w.layers[l].bv.resize(C);
      for (int c = 0; c < C; ++c) m.w.layers[l].bk[c] = 0.5f * nd(rng), m.w.layers[l].bv[c] = 0.5f * nd(rng);
    }
  }
  m.w.storage = m.mats;
  return m;
}

// X of every layer: [n_layer][n, d]; layer l+1 = layer l + 0.15 N(0,1); channel 3 is 8x larger.
inline std::vector<std::vector<float>> make_layer_inputs(const cache_geometry& g, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int d = g.n_embd;
  std::vector<std::vector<float>> x(g.n_layer, std::vector<float>((size_t)n * d));
  for (int64_t t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) x[0][t * d + i] = nd(rng) * (i == 3 ? 8.0f : 1.0f);
  for (int l = 1; l < g.n_layer; ++l)
    for (size_t e = 0; e < x[l].size(); ++e) x[l][e] = x[l - 1][e] + 0.15f * nd(rng);
  return x;
}

// K, V of a layer from X (what the engine hands over besides x): [n, kv] each.
inline void project_kv(const x_model& m, int layer, const std::vector<float>& x, int64_t n, std::vector<float>& k,
                       std::vector<float>& v) {
  const layer_weights& L = m.w.layers[layer];
  const int C = (int)L.wk.n_rows, d = (int)L.wk.n_cols;
  k.assign((size_t)n * C, 0.0f), v.assign((size_t)n * C, 0.0f);
  const auto* wk = static_cast<const float*>(L.wk.data);
  const auto* wv = static_cast<const float*>(L.wv.data);
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) {
      double sk = L.bk.empty() ? 0.0 : L.bk[c], sv = L.bv.empty() ? 0.0 : L.bv[c];
      for (int i = 0; i < d; ++i) sk += (double)x[t * d + i] * wk[(size_t)c * d + i], sv += (double)x[t * d + i] * wv[(size_t)c * d + i];
      k[t * C + c] = (float)sk, v[t * C + c] = (float)sv;
    }
}

// The X-cache test cases: format, GQA or MHA, fp16 first latent channel; a cache of one filled
// chunk by chunk as the engine does (layers 0..L-1 per chunk).
inline constexpr int kTestWindow = 24;  // group_size: window (and xquant scale group) of 24 tokens

struct x_case {
  cache_format format;
  bool gqa;
  bool ch0;
};
inline std::string case_name(const x_case& c) {
  std::string s = format_traits(c.format).name;
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s + (c.gqa ? "_gqa" : "_mha") + (c.ch0 ? "_ch0" : "");
}

inline cache_spec spec_for(const x_case& c, const model_weights& w, cl_ring_mode ring = cl_ring_mode::cl_ring_deltas) {
  cache_options o;
  o.cl_ring = ring;
  o.group_size = kTestWindow;
  o.clkv_group = 8;
  o.x_fp16_first_channel = c.ch0;
  o.cl_hi_layers = 2;  // a 4-layer test model: layers 0-1 X at 4 bits, base 1, deltas 2-3
  o.clkv_value_share_from = 2;
  if (format_needs_x_factors(c.format)) o.factors = build_x_factors(w, x_factor_kind_for(c.format));
  return cache_spec(c.format, o);
}

struct filled {
  test::x_model model;
  cache_spec spec;
  std::unique_ptr<kv_cache> cache;
  std::vector<std::vector<float>> x, k, v;  // per layer [n, d], [n, kv], [n, kv]
  std::vector<int32_t> pos;
};

// Appends n tokens chunk by chunk, layers 0..L-1 per chunk (the engine's order).
inline filled fill(backend& be, const x_case& c, const cache_geometry& g, int64_t n, int32_t step,
            const std::vector<int64_t>& chunks, uint32_t seed, cl_ring_mode ring = cl_ring_mode::cl_ring_deltas) {
  filled f;
  f.model = make_x_model(g, seed, true);
  f.spec = spec_for(c, f.model.w, ring);
  f.cache = make_cache(f.spec, g, be);
  f.x = make_layer_inputs(g, n, seed + 1);
  f.k.resize(g.n_layer), f.v.resize(g.n_layer);
  for (int l = 0; l < g.n_layer; ++l) test::project_kv(f.model, l, f.x[l], n, f.k[l], f.v[l]);
  f.pos.resize(n);
  for (int64_t i = 0; i < n; ++i) f.pos[i] = (int32_t)(i * step);
  const int d = g.n_embd, C = g.n_head_kv * g.head_dim;
  int64_t at = 0;
  size_t ci = 0;
  while (at < n) {
    const int64_t m = std::min(n - at, chunks.empty() ? n : chunks[ci++ % chunks.size()]);
    for (int l = 0; l < g.n_layer; ++l)
      f.cache->append(l, layer_input{f.x[l].data() + at * d, f.k[l].data() + at * C, f.v[l].data() + at * C,
                                     f.pos.data() + at, m});
    at += m;
  }
  return f;
}

}  // namespace xctx::test
