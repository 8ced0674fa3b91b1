// CUDA_CHECK / CUBLAS_CHECK: turn a failed runtime or cuBLAS call into an xctx::Error that names
// the call, the library's error string, file:line, and the host and rank it happened on (with
// many ranks on many nodes, "which GPU" is the first question). Host-side only.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <string>

#include "common/error.h"
#include "common/sys.h"  // where_am_i

namespace xctx::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  int dev = -1;
  // cudaGetDevice does not touch the (possibly broken) context; -1 if even that fails.
  if (cudaGetDevice(&dev) != cudaSuccess) dev = -1;
  fail("CUDA error in `", call, "`: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), " = ", (int)e,
       ") at ", file, ":", line, " on ", where_am_i(), " device ", dev);
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line) {
  fail("cuBLAS error in `", call, "`: ", cublasGetStatusString(s), " (", cublasGetStatusName(s), " = ", (int)s,
       ") at ", file, ":", line, " on ", where_am_i());
}

}  // namespace xctx::cuda

#define CUDA_CHECK(call)                                                                \
  do {                                                                                  \
    const cudaError_t xctx_cuda_err_ = (call);                                          \
    if (xctx_cuda_err_ != cudaSuccess) [[unlikely]]                                     \
      ::xctx::cuda::throw_cuda_error(xctx_cuda_err_, #call, __FILE__, __LINE__);        \
  } while (0)

#define CUBLAS_CHECK(call)                                                              \
  do {                                                                                  \
    const cublasStatus_t xctx_cublas_st_ = (call);                                      \
    if (xctx_cublas_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                          \
      ::xctx::cuda::throw_cublas_error(xctx_cublas_st_, #call, __FILE__, __LINE__);     \
  } while (0)

// After a kernel launch: reports bad launch configurations at the launch site (faults inside the
// kernel surface at the next synchronizing call).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
