// Elementwise and per-row kernels: rms_norm, rope, swiglu, add, sub, add_rows, convert_rows. Same contracts (and the same
// argument checks) as kernels/ref/elementwise_ref.cpp.
#include <climits>
#include <cmath>
#include <cstdint>

#include "common/error.h"
#include "common/half.h"
#include "common/cuda_check.h"
#include "kernels/cuda/kernels.cuh"

namespace xctx::cuda {

namespace {

constexpr int kBlock = 256;

// One block per row: sum of squares in fp32 (per-thread partials, then a tree), the scale
// itself in double so that only the reduction contributes error.
__global__ void __launch_bounds__(kBlock)
    rms_norm_kernel(const float* __restrict__ x /*[n_tok, dim]*/, const float* __restrict__ weight /*[dim]*/,
                    int64_t dim, float eps, float* y /*[n_tok, dim]; may alias x*/) {
  __shared__ float partial[kBlock / 32];
  __shared__ float inv;
  const float* xr = x + (int64_t)blockIdx.x * dim;
  float* yr = y + (int64_t)blockIdx.x * dim;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kBlock) ss = fmaf(xr[i], xr[i], ss);
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < kBlock / 32 ? partial[threadIdx.x] : 0.0f;
    v = warp_sum(v);
    if (threadIdx.x == 0) inv = (float)(1.0 / sqrt((double)v / (double)dim + (double)eps));
  }
  __syncthreads();  // every read of xr above precedes the (possibly in-place) writes below
  const float s = inv;
  for (int64_t i = threadIdx.x; i < dim; i += kBlock) yr[i] = xr[i] * s * weight[i];
}

// One thread per (token, rotary pair), all heads: theta and its sin/cos are computed once in
// double, as the reference does. Float theta would be off by ~pos·2⁻²⁴ rad, visible at the
// million-token positions this project targets.
__global__ void __launch_bounds__(kBlock)
    rope_kernel(float* x /*[n_tok, n_head, head_dim]*/, const int32_t* __restrict__ pos /*[n_tok]*/, int64_t n_tok,
                int n_head, int head_dim, int n_rot, double base_eff, double pos_div) {
  const int n_pairs = n_rot / 2;
  const int64_t n_items = n_tok * n_pairs;
  for (int64_t it = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; it < n_items;
       it += (int64_t)gridDim.x * blockDim.x) {
    const int64_t t = it / n_pairs;
    const int i = (int)(it % n_pairs);
    const double pos_eff = (double)pos[t] / pos_div;
    const double theta = pos_eff * pow(base_eff, -2.0 * (double)i / (double)n_rot);
    double s, c;
    sincos(theta, &s, &c);
    float* xt = x + t * n_head * (int64_t)head_dim + 2 * i;
    for (int h = 0; h < n_head; ++h) {
      float* xh = xt + (int64_t)h * head_dim;
      const double x0 = xh[0], x1 = xh[1];
      xh[0] = (float)(x0 * c - x1 * s);
      xh[1] = (float)(x0 * s + x1 * c);
    }
  }
}

__global__ void __launch_bounds__(kBlock)
    swiglu_kernel(const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];  // expf overflow for g < -88 gives g/inf = -0, the limit
  }
}

__global__ void __launch_bounds__(kBlock) add_kernel(float* y /*[n]*/, const float* x /*[n]*/, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += x[i];
}

__global__ void __launch_bounds__(kBlock) sub_kernel(float* y, const float* a, const float* b, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] = a[i] - b[i];
}

__global__ void __launch_bounds__(kBlock)
    add_rows_kernel(float* y /*[n_tok, dim]*/, const float* b /*[dim]*/, int64_t n_tok, int64_t dim) {
  const int64_t n = n_tok * dim;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    y[i] += b[i % dim];
}

// fp32_to_fp16 is the host's own function (common/half.h, host and device): the same bits.
__global__ void __launch_bounds__(kBlock) to_f16_kernel(uint16_t* dst /*[n]*/, const float* src /*[n]*/, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = fp32_to_fp16(src[i]);
}

void check_rope_config(const rope_config& cfg) {
  XCTX_CHECK(cfg.head_dim > 0, "cuda::rope: head_dim must be positive, got ", cfg.head_dim);
  XCTX_CHECK(cfg.n_rot >= 0 && cfg.n_rot <= cfg.head_dim && cfg.n_rot % 2 == 0,
             "cuda::rope: n_rot must be even and in [0, head_dim=", cfg.head_dim, "], got ", cfg.n_rot);
  XCTX_CHECK(cfg.freq_base > 0.0f, "cuda::rope: freq_base must be positive, got ", cfg.freq_base);
  switch (cfg.scaling) {
    case rope_scaling::rope_scaling_none: break;
    case rope_scaling::rope_scaling_linear:
      XCTX_CHECK(cfg.scaling_factor > 0.0f, "cuda::rope: linear scaling factor must be positive, got ",
                 cfg.scaling_factor);
      break;
    case rope_scaling::rope_scaling_ntk:
      XCTX_CHECK(cfg.scaling_factor > 0.0f, "cuda::rope: NTK scaling factor must be positive, got ",
                 cfg.scaling_factor);
      XCTX_CHECK(cfg.n_rot > 2, "cuda::rope: NTK scaling needs n_rot > 2, got ", cfg.n_rot);
      break;
  }
}

}  // namespace

void rms_norm(context& ctx, const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y) {
  XCTX_CHECK(dim > 0, "cuda::rms_norm: dim must be positive, got ", dim);
  XCTX_CHECK(n_tok >= 0 && n_tok <= INT_MAX, "cuda::rms_norm: n_tok out of range: ", n_tok);
  if (n_tok == 0) return;
  rms_norm_kernel<<<(unsigned)n_tok, kBlock, 0, ctx.stream>>>(x, weight, dim, eps, y);
  CUDA_CHECK_LAUNCH();
}

void rope(context& ctx, float* x, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg) {
  check_rope_config(cfg);
  XCTX_CHECK(n_head > 0, "cuda::rope: n_head must be positive, got ", n_head);
  XCTX_CHECK(n_tok >= 0, "cuda::rope: negative n_tok ", n_tok);
  if (n_tok == 0 || cfg.n_rot == 0) return;
  // base_eff and the position divisor on the host, with the reference's exact expressions.
  double base_eff = (double)cfg.freq_base;
  double pos_div = 1.0;
  switch (cfg.scaling) {
    case rope_scaling::rope_scaling_none: break;
    case rope_scaling::rope_scaling_linear: pos_div = (double)cfg.scaling_factor; break;
    case rope_scaling::rope_scaling_ntk:
      base_eff *= std::pow((double)cfg.scaling_factor, (double)cfg.n_rot / (double)(cfg.n_rot - 2));
      break;
  }
  const int64_t items = n_tok * (cfg.n_rot / 2);
  rope_kernel<<<grid_for(items, kBlock, ctx.n_sm), kBlock, 0, ctx.stream>>>(x, pos, n_tok, n_head, cfg.head_dim,
                                                                            cfg.n_rot, base_eff, pos_div);
  CUDA_CHECK_LAUNCH();
}

void swiglu(context& ctx, const float* gate, const float* up, int64_t n, float* out) {
  XCTX_CHECK(n >= 0, "cuda::swiglu: negative n ", n);
  if (n == 0) return;
  swiglu_kernel<<<grid_for(n, kBlock, ctx.n_sm), kBlock, 0, ctx.stream>>>(gate, up, n, out);
  CUDA_CHECK_LAUNCH();
}

void add(context& ctx, float* y, const float* x, int64_t n) {
  XCTX_CHECK(n >= 0, "cuda::add: negative n ", n);
  if (n == 0) return;
  add_kernel<<<grid_for(n, kBlock, ctx.n_sm), kBlock, 0, ctx.stream>>>(y, x, n);
  CUDA_CHECK_LAUNCH();
}

void sub(context& ctx, float* y, const float* a, const float* b, int64_t n) {
  XCTX_CHECK(n >= 0, "cuda::sub: negative n ", n);
  if (n == 0) return;
  sub_kernel<<<grid_for(n, kBlock, ctx.n_sm), kBlock, 0, ctx.stream>>>(y, a, b, n);
  CUDA_CHECK_LAUNCH();
}

void add_rows(context& ctx, float* y, const float* b, int64_t n_tok, int64_t dim) {
  XCTX_CHECK(n_tok >= 0 && dim >= 0, "cuda::add_rows: bad shape ", n_tok, "x", dim);
  if (n_tok == 0 || dim == 0) return;
  add_rows_kernel<<<grid_for(n_tok * dim, kBlock, ctx.n_sm), kBlock, 0, ctx.stream>>>(y, b, n_tok, dim);
  CUDA_CHECK_LAUNCH();
}

void convert_rows(context& ctx, void* dst, kv_dtype type, const float* src, int64_t n) {
  XCTX_CHECK(n >= 0, "cuda::convert_rows: negative n ", n);
  if (n == 0) return;
  if (type == kv_dtype::kv_f32) {
    if (dst != src)
      CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * sizeof(float), cudaMemcpyDeviceToDevice, ctx.stream));
    return;
  }
  to_f16_kernel<<<grid_for(n, kBlock, ctx.n_sm), kBlock, 0, ctx.stream>>>(static_cast<uint16_t*>(dst), src, n);
  CUDA_CHECK_LAUNCH();
}

}  // namespace xctx::cuda
