// Row dequantization on the device: embedding lookups (get_rows) and the f32 weight panels the
// prefill GEMM multiplies. The per-block math is dequant.cuh, shared with the host tests.
#include <algorithm>
#include <cstdint>

#include "common/error.h"
#include "common/cuda_check.h"
#include "kernels/cuda/dequant.cuh"
#include "kernels/cuda/kernels.cuh"

namespace xctx::cuda {

namespace {

constexpr int kBlock = 256;

// Resolves output row i to a weight row; false (and the error recorded, the row NaN-filled by
// the caller) when an id is out of range.
__device__ inline bool source_row(const int32_t* ids, int64_t row0, int64_t i, int64_t n_rows_w, int64_t& row,
                                  int* err) {
  if (ids == nullptr) {
    row = row0 + i;
    return true;
  }
  const int32_t id = ids[i];
  if (id < 0 || (int64_t)id >= n_rows_w) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      report_device_error(err, device_error::device_error_row_id, id, (int)i, (int)n_rows_w);
    return false;
  }
  row = id;
  return true;
}

// One thread per (row, group of 32, quarter): 8 elements, written as two runs of 4 floats.
template <ggml_type T>
__global__ void __launch_bounds__(kBlock)
    dequant_blocks_kernel(const uint8_t* __restrict__ w,  // [n_rows_w, row_bytes]
                          size_t row_bytes, int64_t n_rows_w, int64_t n_cols,
                          const int32_t* __restrict__ ids,  // [n] or null
                          int64_t row0, int64_t n, float* __restrict__ out /*[n, n_cols]*/, bool out_vec,
                          int* err) {
  constexpr int gpb = block_elems<T>() / group_elems;
  const int64_t n_units = n_cols / group_elems * threads_per_group;
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    int64_t row = 0;
    const bool ok = source_row(ids, row0, i, n_rows_w, row, err);
    const uint8_t* wr = w + (size_t)row * row_bytes;
    float* orow = out + i * n_cols;
    for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < n_units;
         u += (int64_t)gridDim.x * blockDim.x) {
      const int64_t grp = u / threads_per_group;
      const int sub = (int)(u % threads_per_group);
      float lo[4], hi[4];
      if (ok) {
        dequant8<T>(wr + (grp / gpb) * block_bytes<T>(), (int)(grp % gpb), sub, lo, hi);
      } else {
        for (int k = 0; k < 4; ++k) lo[k] = hi[k] = __int_as_float(0x7fc00000);  // NaN: never stale data
      }
      float* o = orow + grp * group_elems + 4 * sub;
      if (out_vec) {
        *reinterpret_cast<float4*>(o) = make_float4(lo[0], lo[1], lo[2], lo[3]);
        *reinterpret_cast<float4*>(o + 16) = make_float4(hi[0], hi[1], hi[2], hi[3]);
      } else {
        for (int k = 0; k < 4; ++k) {
          o[k] = lo[k];
          o[16 + k] = hi[k];
        }
      }
    }
  }
}

template <ggml_type T>
__global__ void __launch_bounds__(kBlock)
    dequant_plain_kernel(const uint8_t* __restrict__ w, size_t row_bytes, int64_t n_rows_w, int64_t n_cols,
                         const int32_t* __restrict__ ids, int64_t row0, int64_t n,
                         float* __restrict__ out /*[n, n_cols]*/, int* err) {
  for (int64_t i = blockIdx.y; i < n; i += gridDim.y) {
    int64_t row = 0;
    const bool ok = source_row(ids, row0, i, n_rows_w, row, err);
    const uint8_t* wr = w + (size_t)row * row_bytes;
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < n_cols; c += (int64_t)gridDim.x * blockDim.x)
      out[i * n_cols + c] = ok ? load_plain<T>(wr, c) : __int_as_float(0x7fc00000);
  }
}

}  // namespace

void dequant_rows(context& ctx, const weight_view& w, const int32_t* ids, int64_t row0, int64_t n, float* out) {
  if (n == 0 || w.n_cols == 0) return;
  XCTX_CHECK(((uintptr_t)w.data & 1u) == 0, "cuda dequant: weight data at ", w.data,
             " is not 2-byte aligned (blocks are read with 16-bit loads)");
  const int64_t n_rows_w = w.n_rows;
  const size_t row_bytes = w.row_bytes();
  const auto* wp = static_cast<const uint8_t*>(w.data);
  const unsigned grid_y = (unsigned)std::min<int64_t>(n, 65535);
  const bool known = dispatch_weight_type(w.type, [&](auto tag) {
    constexpr ggml_type T = decltype(tag)::value;
    if constexpr (is_block_type<T>()) {
      const int64_t units = w.n_cols / group_elems * threads_per_group;
      const dim3 grid(grid_for(units, kBlock, ctx.n_sm), grid_y);
      const bool out_vec = ((uintptr_t)out & 15u) == 0;  // rows start at multiples of 32 floats
      dequant_blocks_kernel<T><<<grid, kBlock, 0, ctx.stream>>>(wp, row_bytes, n_rows_w, w.n_cols, ids, row0, n,
                                                                 out, out_vec, ctx.err);
    } else {
      const dim3 grid(grid_for(w.n_cols, kBlock, ctx.n_sm), grid_y);
      dequant_plain_kernel<T><<<grid, kBlock, 0, ctx.stream>>>(wp, row_bytes, n_rows_w, w.n_cols, ids, row0, n, out,
                                                               ctx.err);
    }
    CUDA_CHECK_LAUNCH();
  });
  XCTX_CHECK(known, "cuda dequant: unsupported weight type id ", (uint32_t)w.type);
}

}  // namespace xctx::cuda
