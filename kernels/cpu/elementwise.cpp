// CPU elementwise kernels: OpenMP over rows/chunks, AVX2 bodies (elementwise_avx2.cpp) when the
// CPU has them, scalar loops otherwise.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"

namespace xctx::cpu {
namespace impl {

namespace {
// Below these element counts a parallel region costs more than it saves (decode-sized rows).
constexpr int64_t kParallelMinElems = 1 << 15;
constexpr int64_t kChunk = 1 << 14;  // elements per OpenMP chunk for flat ops
}  // namespace

isa best_isa() { return has_avx2() ? isa::isa_avx2 : isa::isa_scalar; }

const char* isa_name(isa v) {
  switch (v) {
    case isa::isa_scalar: return "scalar";
    case isa::isa_avx2: return "avx2";
  }
  return "?";
}

void rms_norm(isa v, const float* x /*[n_tok, dim]*/, const float* weight /*[dim]*/, int64_t n_tok, int64_t dim,
              float eps, float* y /*[n_tok, dim]*/) {
  XCTX_CHECK(dim > 0, "rms_norm: dim must be positive, got ", dim);
  XCTX_CHECK(n_tok >= 0, "rms_norm: negative n_tok ", n_tok);
#pragma omp parallel for schedule(static) if (n_tok * dim >= kParallelMinElems)
  for (int64_t t = 0; t < n_tok; ++t) {
    const float* xr = x + t * dim;
    float* yr = y + t * dim;
    switch (v) {
      case isa::isa_avx2: {
        const double ss = avx2::sum_squares(xr, dim);
        avx2::scale_mul(xr, weight, (float)(1.0 / std::sqrt(ss / (double)dim + (double)eps)), dim, yr);
        break;
      }
      case isa::isa_scalar: {
        double ss = 0.0;
        for (int64_t i = 0; i < dim; ++i) ss += (double)xr[i] * xr[i];
        const float s = (float)(1.0 / std::sqrt(ss / (double)dim + (double)eps));
        for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * s * weight[i];
        break;
      }
    }
  }
}

void rope(isa v, float* x /*[n_tok, n_head, head_dim]*/, const int32_t* pos /*[n_tok]*/, int64_t n_tok, int n_head,
          const rope_config& cfg) {
  XCTX_CHECK(cfg.head_dim > 0 && n_head > 0, "rope: bad shape head_dim=", cfg.head_dim, " n_head=", n_head);
  XCTX_CHECK(cfg.n_rot >= 0 && cfg.n_rot <= cfg.head_dim && cfg.n_rot % 2 == 0,
             "rope: n_rot must be even and in [0, head_dim=", cfg.head_dim, "], got ", cfg.n_rot);
  XCTX_CHECK(cfg.freq_base > 0.0f, "rope: freq_base must be positive, got ", cfg.freq_base);
  const int n_pair = cfg.n_rot / 2;
  if (n_pair == 0 || n_tok == 0) return;
  double pos_scale = 1.0, base = (double)cfg.freq_base;
  switch (cfg.scaling) {
    case rope_scaling::rope_scaling_none: break;
    case rope_scaling::rope_scaling_linear:
      XCTX_CHECK(cfg.scaling_factor > 0.0f, "rope: linear scaling factor must be positive, got ", cfg.scaling_factor);
      pos_scale = 1.0 / (double)cfg.scaling_factor;
      break;
    case rope_scaling::rope_scaling_ntk:
      XCTX_CHECK(cfg.scaling_factor > 0.0f, "rope: NTK scaling factor must be positive, got ", cfg.scaling_factor);
      XCTX_CHECK(cfg.n_rot > 2, "rope: NTK scaling needs n_rot > 2, got ", cfg.n_rot);
      // Same formula as ref::rope_theta (see there for its source).
      base *= std::pow((double)cfg.scaling_factor, (double)cfg.n_rot / (double)(cfg.n_rot - 2));
      break;
  }
  std::vector<double> inv_freq((size_t)n_pair);  // [n_pair]
  for (int i = 0; i < n_pair; ++i) inv_freq[i] = std::pow(base, -2.0 * i / (double)cfg.n_rot);
  const int64_t hd = cfg.head_dim;
  // One cos/sin table per token (in double: theta reaches ~1e5 rad at long positions, where a
  // float angle would already be off by ~4e-3 rad), shared by all heads of that token.
#pragma omp parallel if (n_tok * n_head * hd >= kParallelMinElems / 2)
  {
    std::vector<float> cos2((size_t)cfg.n_rot), sin2((size_t)cfg.n_rot);  // [n_rot]
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tok; ++t) {
      const double p = (double)pos[t] * pos_scale;
      for (int i = 0; i < n_pair; ++i) {
        const double theta = p * inv_freq[i];
        const float c = (float)std::cos(theta), s = (float)std::sin(theta);
        cos2[2 * i] = c, cos2[2 * i + 1] = c;
        sin2[2 * i] = -s, sin2[2 * i + 1] = s;
      }
      for (int h = 0; h < n_head; ++h) {
        float* xh = x + (t * n_head + h) * hd;
        switch (v) {
          case isa::isa_avx2: avx2::rope_rotate(xh, cos2.data(), sin2.data(), cfg.n_rot); break;
          case isa::isa_scalar:
            for (int i = 0; i < cfg.n_rot; i += 2) {
              const float x0 = xh[i], x1 = xh[i + 1];
              xh[i] = x0 * cos2[i] + x1 * sin2[i];
              xh[i + 1] = x1 * cos2[i + 1] + x0 * sin2[i + 1];
            }
            break;
        }
      }
    }
  }
}

void swiglu(isa v, const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/) {
  const int64_t n_chunk = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n >= kParallelMinElems)
  for (int64_t c = 0; c < n_chunk; ++c) {
    const int64_t i0 = c * kChunk, len = std::min(kChunk, n - i0);
    switch (v) {
      case isa::isa_avx2: avx2::swiglu(gate + i0, up + i0, len, out + i0); break;
      case isa::isa_scalar:
        for (int64_t i = i0; i < i0 + len; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
        break;
    }
  }
}

}  // namespace impl

void rms_norm(const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y) {
  impl::rms_norm(impl::best_isa(), x, weight, n_tok, dim, eps, y);
}
void rope(float* x, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg) {
  impl::rope(impl::best_isa(), x, pos, n_tok, n_head, cfg);
}
void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  impl::swiglu(impl::best_isa(), gate, up, n, out);
}

void add(float* y /*[n]*/, const float* x /*[n]*/, int64_t n) {
  // Memory-bound: the portable (SSE2) auto-vectorized loop already runs at bandwidth.
  const int64_t n_chunk = (n + impl::kChunk - 1) / impl::kChunk;
#pragma omp parallel for schedule(static) if (n >= 4 * impl::kParallelMinElems)
  for (int64_t c = 0; c < n_chunk; ++c) {
    const int64_t i0 = c * impl::kChunk, i1 = std::min(n, i0 + impl::kChunk);
    for (int64_t i = i0; i < i1; ++i) y[i] += x[i];
  }
}

}  // namespace xctx::cpu
