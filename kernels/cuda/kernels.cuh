// Internal to kernels/cuda: the device state one backend instance owns, and the host-side
// launchers of each .cu file. Pointers are device pointers unless named *_host.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cuda/attention.cuh"  // attn_sel_view
#include "kernels/ops.h"

namespace xctx::cuda {

// Bad input that only the device can see (ids, positions live in device memory) is recorded in
// a small mapped host buffer and turned into an xctx::Error at the next synchronizing call.
enum class device_error : int {
  device_error_none = 0,
  device_error_row_id = 1,    // get_rows: {id, position, n_rows}
  device_error_kv_order = 2,  // attention: kv_pos decreases: {index j, kv_pos[j], kv_pos[j+1]}
};
constexpr int device_error_words = 4;  // {code, a, b, c}

struct context {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int n_sm = 1;
  size_t smem_optin = 48 << 10;  // largest dynamic shared memory a block may opt into
  bool tf32 = true;              // prefill GEMMs on TF32 tensor cores (XCTX_CUDA_TF32=0: exact fp32)
  int* err = nullptr;            // [device_error_words], mapped pinned host memory

  // One growable scratch buffer (dequantized weight panels, attention split partials). Every
  // op runs in order on `stream`, so consecutive ops can reuse it; growing waits for the stream.
  void* scratch(size_t bytes);
  void* scratch_ptr = nullptr;
  size_t scratch_bytes = 0;
  // Static shared memory of each kernel launched with dynamic shared memory (cudaFuncGetAttributes
  // once per kernel; prepare_shared_memory).
  std::vector<std::pair<const void*, size_t>> static_smem;
};

// Before a launch with `dynamic` bytes of dynamic shared memory: checks static + dynamic against
// the device's per-block opt-in limit (an Error naming `who` otherwise) and, when the sum passes
// the 48 KiB every block gets unasked, opts the kernel into the dynamic size. The 48 KiB line is
// for static + dynamic together: comparing the dynamic part alone lets a launch fail at runtime.
void prepare_shared_memory(context& ctx, const void* kernel, size_t dynamic, const char* who);

// ---- dequant.cu ---------------------------------------------------------------------------
// out[i, :] = dequant(W[row_i, :]) with row_i = ids ? ids[i] : row0 + i.
void dequant_rows(context& ctx, const weight_view& w, const int32_t* ids /*[n] or null*/, int64_t row0, int64_t n,
                  float* out /*[n, w.n_cols]*/);

// ---- matmul.cu ----------------------------------------------------------------------------
void matmul(context& ctx, const weight_view& w, const float* x /*[n_tok, n_cols]*/, int64_t n_tok,
            float* y /*[n_tok, n_rows]*/);

// ---- elementwise.cu -----------------------------------------------------------------------
void rms_norm(context& ctx, const float* x /*[n_tok, dim]*/, const float* weight /*[dim]*/, int64_t n_tok,
              int64_t dim, float eps, float* y /*[n_tok, dim]*/);
void rope(context& ctx, float* x /*[n_tok, n_head, head_dim]*/, const int32_t* pos /*[n_tok]*/, int64_t n_tok,
          int n_head, const rope_config& cfg);
void swiglu(context& ctx, const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/);
void add(context& ctx, float* y /*[n]*/, const float* x /*[n]*/, int64_t n);
void sub(context& ctx, float* y /*[n]*/, const float* a /*[n]*/, const float* b /*[n]*/, int64_t n);
void add_rows(context& ctx, float* y /*[n_tok, dim]*/, const float* b /*[dim]*/, int64_t n_tok, int64_t dim);
void convert_rows(context& ctx, void* dst /*[n] of type*/, kv_dtype type, const float* src /*[n]*/, int64_t n);

// ---- attention.cu -------------------------------------------------------------------------
void attention_partial(context& ctx, const attn_args& a);
// One call's scratch for the three attention launchers (attention.cu, kvq.cu, xq.cu): the split
// partials (part_bytes, may be 0) and, with a retrieval selection, its lists copied behind them
// (checked against the call's n_q and n_head_kv first; the copy is queued on ctx.stream from the
// host vectors, which may go once this returns). The view is empty without a selection.
struct attn_scratch {
  float* parts = nullptr;
  attn_sel_view sel;
};
attn_scratch attention_scratch(context& ctx, size_t part_bytes, const attn_selection* select, int64_t n_q,
                               int n_head_kv, const char* who);
void merge_partials(context& ctx, const float* o_parts /*[n_part, n_row, head_dim]*/,
                    const float* lse_parts /*[n_part, n_row]*/, int n_part, int64_t n_row, int head_dim,
                    float* o /*[n_row, head_dim]*/, float* lse /*[n_row]*/);

#if defined(__CUDACC__)
// Device side of the error channel: the first error wins, later ones are dropped.
__device__ inline void report_device_error(int* err, device_error code, int a, int b, int c) {
  if (atomicCAS(err, 0, (int)code) == 0) {
    err[1] = a;
    err[2] = b;
    err[3] = c;
    __threadfence_system();
  }
}

// Grid sizes: enough blocks to fill the device, capped so grid-stride loops do the rest.
inline unsigned grid_for(int64_t n_items, int block, int n_sm) {
  const int64_t want = (n_items + block - 1) / block;
  const int64_t cap = (int64_t)n_sm * 32;
  return (unsigned)(want < 1 ? 1 : (want < cap ? want : cap));
}

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
#endif

}  // namespace xctx::cuda
