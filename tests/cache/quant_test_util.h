// Shared by the quantized-cache tests: a small geometry, synthetic activations shaped like real
// ones (a few key channels with large magnitude, as KVQuant Fig. 2 shows), and a calibration
// fitted from a separate draw of the same distribution (no model needed).
#pragma once

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/calibration.h"

namespace xctx::test {

inline cache_geometry quant_geometry(int64_t capacity, int n_layer = 2) {
  cache_geometry g;
  g.n_layer = n_layer;
  g.n_head = 4;
  g.n_head_kv = 2;
  g.head_dim = 16;
  g.n_embd = 64;
  g.rope.head_dim = 16;
  g.rope.n_rot = 16;
  g.rope.freq_base = 10000.0f;
  g.capacity = capacity;
  return g;
}

// Keys: channel c has scale 1 + 6 * [c % 7 == 3] and offset 0.5 * sin(c); values Gaussian with
// per-token scale; a sprinkle of 1-in-300 spikes of 8 sigma in both.
struct synthetic_kv {
  std::vector<float> k, v;  // [n, C]
};
inline synthetic_kv make_synthetic_kv(int64_t n, int C, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.5f, 2.0f);
  std::bernoulli_distribution spike(1.0 / 300.0);
  synthetic_kv s;
  s.k.resize((size_t)n * C), s.v.resize((size_t)n * C);
  for (int64_t t = 0; t < n; ++t) {
    const float vs = ud(rng);
    for (int c = 0; c < C; ++c) {
      const float ks = 1.0f + 6.0f * (c % 7 == 3);
      s.k[t * C + c] = ks * nd(rng) + 0.5f * std::sin((float)c) + (spike(rng) ? 8.0f * ks : 0.0f);
      s.v[t * C + c] = vs * nd(rng) + (spike(rng) ? -8.0f * vs : 0.0f);
    }
  }
  return s;
}

// A calibration in the shape `xctx calibrate` writes, fitted (unweighted) on synthetic data.
inline std::shared_ptr<calibration> make_synthetic_calibration(const cache_geometry& g, uint32_t seed) {
  auto c = std::make_shared<calibration>();
  c->model_name = "synthetic", c->n_layer = g.n_layer, c->n_head_kv = g.n_head_kv, c->head_dim = g.head_dim;
  c->weighting = "none";
  const int C = g.n_head_kv * g.head_dim;
  const int64_t rows = 2000;
  for (int s = 0; s < kCalibSettings; ++s) c->layers[s].resize(g.n_layer);
  for (int l = 0; l < g.n_layer; ++l) {
    const synthetic_kv d = make_synthetic_kv(rows, C, seed + 31 * l);
    for (int s = 0; s < kCalibSettings; ++s) {
      calib_layer_setting& L = c->layers[s][l];
      L.k_lo.resize(C), L.k_hi.resize(C);
      const double f = kCalibOutlierFraction[s] / 2;
      std::vector<float> col(rows);
      for (int ch = 0; ch < C; ++ch) {
        for (int64_t t = 0; t < rows; ++t) col[t] = d.k[t * C + ch];
        std::sort(col.begin(), col.end());
        L.k_lo[ch] = col[(size_t)std::floor(f * (rows - 1))];
        L.k_hi[ch] = col[(size_t)std::ceil((1 - f) * (rows - 1))];
      }
      nuq_histogram hk, hv;
      for (int64_t t = 0; t < rows; ++t)
        for (int ch = 0; ch < C; ++ch) {
          const float x = d.k[t * C + ch], lo = L.k_lo[ch], hi = L.k_hi[ch];
          if (x >= lo && x <= hi) hk.add((x - 0.5f * (hi + lo)) / (0.5f * (hi - lo)), 1.0);
          hv.add(std::tanh(d.v[t * C + ch] / 2.0f), 1.0);  // a plausible value shape in [-1, 1]
        }
      for (int b = 0; b < 3; ++b) {
        L.k[b] = fit_nuq_datatype(hk, kCalibBits[b]);
        L.v[b] = fit_nuq_datatype(hv, kCalibBits[b]);
      }
    }
  }
  return c;
}

// The KV-quantizing formats (kivi, nuq); the X formats have their own tests (test_x_cache.cpp).
inline std::vector<cache_format> quantized_formats() {
  return formats_of({cache_family::family_kivi, cache_family::family_nuq});
}

// A format's name as a gtest parameter name ("nuq3-1%" -> "nuq3_1_").
inline std::string format_test_name(cache_format f) {
  std::string s = format_traits(f).name;
  for (char& ch : s)
    if (ch == '-' || ch == '%') ch = '_';
  return s;
}

}  // namespace xctx::test
