// Reference elementwise kernels: plain loops in double, the oracles for kernels/cpu and cuda.
#include <cmath>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"

namespace xctx::ref {

void rms_norm(const float* x /*[n_tok, dim]*/, const float* weight /*[dim]*/, int64_t n_tok, int64_t dim,
              float eps, float* y /*[n_tok, dim]*/) {
  XCTX_CHECK(dim > 0, "rms_norm: dim must be positive, got ", dim);
  XCTX_CHECK(n_tok >= 0, "rms_norm: negative n_tok ", n_tok);
  for (int64_t t = 0; t < n_tok; ++t) {
    const float* xr = x + t * dim;
    double ss = 0.0;
    for (int64_t i = 0; i < dim; ++i) ss += (double)xr[i] * xr[i];
    const double inv = 1.0 / std::sqrt(ss / (double)dim + (double)eps);
    for (int64_t i = 0; i < dim; ++i) y[t * dim + i] = (float)((double)xr[i] * inv * weight[i]);
  }
}

static void check_rope_config(const rope_config& cfg) {
  XCTX_CHECK(cfg.head_dim > 0, "rope: head_dim must be positive, got ", cfg.head_dim);
  XCTX_CHECK(cfg.n_rot >= 0 && cfg.n_rot <= cfg.head_dim && cfg.n_rot % 2 == 0,
             "rope: n_rot must be even and in [0, head_dim=", cfg.head_dim, "], got ", cfg.n_rot);
  XCTX_CHECK(cfg.freq_base > 0.0f, "rope: freq_base must be positive, got ", cfg.freq_base);
  switch (cfg.scaling) {
    case rope_scaling::rope_scaling_none: break;
    case rope_scaling::rope_scaling_linear:
      XCTX_CHECK(cfg.scaling_factor > 0.0f, "rope: linear scaling factor must be positive, got ",
                 cfg.scaling_factor);
      break;
    case rope_scaling::rope_scaling_ntk:
      XCTX_CHECK(cfg.scaling_factor > 0.0f, "rope: NTK scaling factor must be positive, got ", cfg.scaling_factor);
      XCTX_CHECK(cfg.n_rot > 2, "rope: NTK scaling needs n_rot > 2 (exponent n_rot/(n_rot-2)), got ", cfg.n_rot);
      break;
  }
}

// theta_i(pos) = pos_eff * base_eff^(-2i / n_rot).
//  linear ("position interpolation", Chen et al. 2023): pos_eff = pos / factor, base unchanged.
//  NTK-aware (bloc97's "NTK-aware scaled RoPE" proposal, 2023; the same base change HF applies in
//  its dynamic-NTK rope with the factor held fixed): base_eff = base * factor^(n_rot / (n_rot - 2)).
//  The exponent is chosen so the lowest frequency (i = n_rot/2 - 1) is stretched by exactly
//  `factor` — like linear interpolation there — while the highest (i = 0) is untouched.
double rope_theta(const rope_config& cfg, int32_t pos, int pair) {
  double pos_eff = (double)pos;
  double base_eff = (double)cfg.freq_base;
  switch (cfg.scaling) {
    case rope_scaling::rope_scaling_none: break;
    case rope_scaling::rope_scaling_linear: pos_eff /= (double)cfg.scaling_factor; break;
    case rope_scaling::rope_scaling_ntk:
      base_eff *= std::pow((double)cfg.scaling_factor, (double)cfg.n_rot / (double)(cfg.n_rot - 2));
      break;
  }
  return pos_eff * std::pow(base_eff, -2.0 * (double)pair / (double)cfg.n_rot);
}

void rope(float* x /*[n_tok, n_head, head_dim]*/, const int32_t* pos /*[n_tok]*/, int64_t n_tok, int n_head,
          const rope_config& cfg) {
  check_rope_config(cfg);
  XCTX_CHECK(n_head > 0, "rope: n_head must be positive, got ", n_head);
  for (int64_t t = 0; t < n_tok; ++t) {
    for (int i = 0; i < cfg.n_rot / 2; ++i) {
      const double theta = rope_theta(cfg, pos[t], i);
      const double c = std::cos(theta), s = std::sin(theta);
      for (int h = 0; h < n_head; ++h) {
        float* xh = x + (t * n_head + h) * (int64_t)cfg.head_dim;
        const double x0 = xh[2 * i], x1 = xh[2 * i + 1];
        xh[2 * i] = (float)(x0 * c - x1 * s);
        xh[2 * i + 1] = (float)(x0 * s + x1 * c);
      }
    }
  }
}

void swiglu(const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/) {
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    out[i] = (float)(g / (1.0 + std::exp(-g)) * (double)up[i]);
  }
}

void add(float* y /*[n]*/, const float* x /*[n]*/, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace xctx::ref
