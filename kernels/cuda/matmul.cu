// y = x · Wᵀ on the device.
//   Few tokens (decode): a fused dequantize-and-dot kernel, one warp per weight row. Lanes take
//     a quarter of a 32-element group each (dequant.cuh), so a warp streams 8 consecutive groups
//     (e.g. 160 contiguous bytes of Q4_1) per step and the weights are read exactly once per pass
//     of up to 8 tokens. Accumulation is fp32 FMA; no activation quantization.
//   Many tokens (prefill): weight row panels are dequantized to an f32 scratch and multiplied
//     with cublasGemmEx, on TF32 tensor cores unless XCTX_CUDA_TF32=0.
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "common/error.h"
#include "common/cuda_check.h"
#include "kernels/cuda/dequant.cuh"
#include "kernels/cuda/kernels.cuh"
#include "kernels/cuda/scratch.h"

namespace xctx::cuda {

namespace {

constexpr int kWarps = 4;                  // rows per thread block in the fused kernels
constexpr int kMaxTokPerPass = 8;          // register accumulators per lane
constexpr int64_t kFusedMaxTok = 32;       // up to 4 fused passes beat dequantize + GEMM on bytes moved

__device__ inline float4 load_x4(const float* p, bool vec) {
  if (vec) return *reinterpret_cast<const float4*>(p);
  return make_float4(p[0], p[1], p[2], p[3]);
}

__device__ inline float dot4(float acc, const float w[4], float4 x) {
  acc = fmaf(w[0], x.x, acc);
  acc = fmaf(w[1], x.y, acc);
  acc = fmaf(w[2], x.z, acc);
  return fmaf(w[3], x.w, acc);
}

template <ggml_type T, int NT>
__global__ void __launch_bounds__(kWarps * 32)
    matvec_blocks_kernel(const uint8_t* __restrict__ w,  // [n_rows, row_bytes]
                         size_t row_bytes, int64_t n_rows, int64_t n_cols,
                         const float* __restrict__ x,  // [n_tok, n_cols]
                         int n_tok, float* __restrict__ y /*[n_tok, n_rows]*/, bool x_vec) {
  constexpr int gpb = block_elems<T>() / group_elems;
  constexpr int groups_per_step = 32 / threads_per_group;
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  if (row >= n_rows) return;  // whole warps leave together; no block-level sync below
  const uint8_t* wr = w + (size_t)row * row_bytes;
  const int64_t n_groups = n_cols / group_elems;
  const int sub = lane % threads_per_group;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
#pragma unroll 2
  for (int64_t grp = lane / threads_per_group; grp < n_groups; grp += groups_per_step) {
    float lo[4], hi[4];
    dequant8<T>(wr + (grp / gpb) * block_bytes<T>(), (int)(grp % gpb), sub, lo, hi);
    const float* xe = x + grp * group_elems + 4 * sub;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t < n_tok) {
        acc[t] = dot4(acc[t], lo, load_x4(xe + t * n_cols, x_vec));
        acc[t] = dot4(acc[t], hi, load_x4(xe + t * n_cols + 16, x_vec));
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = warp_sum(acc[t]);
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < n_tok) y[t * n_rows + row] = acc[t];
  }
}

// Four consecutive plain weights at element c (vector path: c % 4 == 0, row suitably aligned).
template <ggml_type T>
__device__ inline void load_plain4(const uint8_t* row, int64_t c, float out[4]) {
  if constexpr (T == ggml_type::ggml_f32) {
    const float4 v = *reinterpret_cast<const float4*>(row + 4 * c);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(row + 2 * c);
    const uint32_t h[4] = {v.x & 0xffffu, v.x >> 16, v.y & 0xffffu, v.y >> 16};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (T == ggml_type::ggml_f16)
        out[k] = __half2float(__ushort_as_half((unsigned short)h[k]));  // exact, like fp16_to_fp32
      else
        out[k] = __uint_as_float(h[k] << 16);
    }
  }
}

template <ggml_type T, int NT>
__global__ void __launch_bounds__(kWarps * 32)
    matvec_plain_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows, int64_t n_cols,
                        const float* __restrict__ x /*[n_tok, n_cols]*/, int n_tok,
                        float* __restrict__ y /*[n_tok, n_rows]*/, bool vec) {
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  if (row >= n_rows) return;
  const uint8_t* wr = w + (size_t)row * row_bytes;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.0f;
  if (vec) {  // n_cols % 4 == 0, row and x 16-byte (f32) / 8-byte (16-bit types) aligned
    for (int64_t c = 4 * lane; c < n_cols; c += 4 * 32) {
      float wv[4];
      load_plain4<T>(wr, c, wv);
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (t < n_tok) acc[t] = dot4(acc[t], wv, *reinterpret_cast<const float4*>(x + t * n_cols + c));
    }
  } else {
    for (int64_t c = lane; c < n_cols; c += 32) {
      const float wv = load_plain<T>(wr, c);
#pragma unroll
      for (int t = 0; t < NT; ++t)
        if (t < n_tok) acc[t] = fmaf(wv, x[t * n_cols + c], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = warp_sum(acc[t]);
  if (lane == 0) {
#pragma unroll
    for (int t = 0; t < NT; ++t)
      if (t < n_tok) y[t * n_rows + row] = acc[t];
  }
}

template <ggml_type T, int NT>
void launch_matvec(context& ctx, const weight_view& w, const float* x, int nt, float* y) {
  const unsigned grid = (unsigned)((w.n_rows + kWarps - 1) / kWarps);
  const auto* wp = static_cast<const uint8_t*>(w.data);
  const size_t rb = w.row_bytes();
  if constexpr (is_block_type<T>()) {
    const bool x_vec = ((uintptr_t)x & 15u) == 0;  // n_cols is a multiple of 32: every row stays aligned
    matvec_blocks_kernel<T, NT><<<grid, kWarps * 32, 0, ctx.stream>>>(wp, rb, w.n_rows, w.n_cols, x, nt, y, x_vec);
  } else {
    const uintptr_t w_align = T == ggml_type::ggml_f32 ? 15u : 7u;
    const bool vec = w.n_cols % 4 == 0 && ((uintptr_t)wp & w_align) == 0 && ((uintptr_t)x & 15u) == 0;
    matvec_plain_kernel<T, NT><<<grid, kWarps * 32, 0, ctx.stream>>>(wp, rb, w.n_rows, w.n_cols, x, nt, y, vec);
  }
  CUDA_CHECK_LAUNCH();
}

template <ggml_type T>
void matmul_fused(context& ctx, const weight_view& w, const float* x, int64_t n_tok, float* y) {
  for (int64_t t0 = 0; t0 < n_tok; t0 += kMaxTokPerPass) {
    const int nt = (int)std::min<int64_t>(kMaxTokPerPass, n_tok - t0);
    const float* xt = x + t0 * w.n_cols;
    float* yt = y + t0 * w.n_rows;
    // Accumulator count rounded up to a power of two: 4 instantiations instead of 8.
    if (nt == 1) launch_matvec<T, 1>(ctx, w, xt, nt, yt);
    else if (nt == 2) launch_matvec<T, 2>(ctx, w, xt, nt, yt);
    else if (nt <= 4) launch_matvec<T, 4>(ctx, w, xt, nt, yt);
    else launch_matvec<T, 8>(ctx, w, xt, nt, yt);
  }
}

// C[n, ldc] (row-major, columns [0, m)) = B[n, k] · A[m, k]ᵀ, all row-major. In cuBLAS's
// column-major view A is k×m (lda k), B is k×n (ldb k), C is m×n (ldc): C = Aᵀ·B.
void gemm_rowmajor_abt(context& ctx, const float* a, int64_t m, int64_t k, const float* b, int64_t n, float* c,
                       int64_t ldc) {
  XCTX_CHECK(m <= INT_MAX && k <= INT_MAX && ldc <= INT_MAX, "cuda matmul: weight of ", m, "x", k,
             " exceeds cuBLAS's 32-bit dimensions");
  const float one = 1.0f, zero = 0.0f;
  const cublasComputeType_t compute = ctx.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  const int64_t max_n = INT_MAX;
  for (int64_t n0 = 0; n0 < n; n0 += max_n) {
    const int nn = (int)std::min(max_n, n - n0);
    CUBLAS_CHECK(cublasGemmEx(ctx.blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)m, nn, (int)k, &one, a, CUDA_R_32F, (int)k,
                              b + n0 * k, CUDA_R_32F, (int)k, &zero, c + n0 * ldc, CUDA_R_32F, (int)ldc, compute,
                              CUBLAS_GEMM_DEFAULT));
  }
}

void matmul_gemm(context& ctx, const weight_view& w, const float* x, int64_t n_tok, float* y) {
  if (w.type == ggml_type::ggml_f32) {
    gemm_rowmajor_abt(ctx, static_cast<const float*>(w.data), w.n_rows, w.n_cols, x, n_tok, y, w.n_rows);
    return;
  }
  const size_t row_f32 = (size_t)w.n_cols * sizeof(float);
  const size_t panel_bytes = matmul_panel_request(w.n_rows, w.n_cols);  // kernels/cuda/scratch.h
  const int64_t panel = (int64_t)(panel_bytes / row_f32);
  auto* scratch = static_cast<float*>(ctx.scratch(panel_bytes));  // [panel, n_cols]
  for (int64_t r0 = 0; r0 < w.n_rows; r0 += panel) {
    const int64_t rows = std::min(panel, w.n_rows - r0);
    dequant_rows(ctx, w, nullptr, r0, rows, scratch);
    gemm_rowmajor_abt(ctx, scratch, rows, w.n_cols, x, n_tok, y + r0, w.n_rows);
  }
}

}  // namespace

void matmul(context& ctx, const weight_view& w, const float* x, int64_t n_tok, float* y) {
  const ggml_type_traits tr = ggml_traits(w.type);
  XCTX_CHECK(tr.name != nullptr, "cuda::matmul: unsupported weight type id ", (uint32_t)w.type);
  XCTX_CHECK(w.n_rows >= 0 && w.n_cols > 0, "cuda::matmul: bad weight shape ", w.n_rows, "x", w.n_cols);
  XCTX_CHECK(w.n_cols % tr.block_elems == 0, "cuda::matmul: ", tr.name, " row length ", w.n_cols,
             " is not a multiple of the block size ", tr.block_elems);
  XCTX_CHECK(n_tok >= 0, "cuda::matmul: negative n_tok ", n_tok);
  if (n_tok == 0 || w.n_rows == 0) return;
  XCTX_CHECK(w.data != nullptr && x != nullptr && y != nullptr, "cuda::matmul: null pointer (w ", w.data, ", x ", x,
             ", y ", y, ")");
  XCTX_CHECK(((uintptr_t)w.data & 1u) == 0 && ((uintptr_t)x & 3u) == 0 && ((uintptr_t)y & 3u) == 0,
             "cuda::matmul: misaligned pointer (w ", w.data, ", x ", x, ", y ", y, ")");
  if (n_tok > kFusedMaxTok) {
    matmul_gemm(ctx, w, x, n_tok, y);
    return;
  }
  const bool known = dispatch_weight_type(w.type, [&](auto tag) {
    matmul_fused<decltype(tag)::value>(ctx, w, x, n_tok, y);
  });
  XCTX_CHECK(known, "cuda::matmul: unsupported weight type id ", (uint32_t)w.type);
}

}  // namespace xctx::cuda
