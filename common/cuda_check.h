// CUDA_CHECK / CUBLAS_CHECK / NCCL_CHECK: turn a failed runtime, cuBLAS or NCCL call into an
// xctx::Error that names the call, the library's error string, file:line, and the host and rank
// it happened on (with many ranks on many nodes, "which GPU" is the first question). The one set
// of check macros of the CUDA backend (kernels/cuda) and the NCCL communicator (comm/nccl.cu);
// host-side only, included from .cu files alone.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <nccl.h>
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

[[noreturn]] inline void throw_nccl_error(ncclResult_t r, const char* call, const char* file, int line) {
  fail("NCCL error in `", call, "`: ", ncclGetErrorString(r), " (", (int)r, ") at ", file, ":", line, " on ",
       where_am_i());
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

// ncclInProgress is not a failure: a non-blocking communicator's call is still running.
#define NCCL_CHECK(call)                                                                \
  do {                                                                                  \
    const ncclResult_t xctx_nccl_rc_ = (call);                                          \
    if (xctx_nccl_rc_ != ncclSuccess && xctx_nccl_rc_ != ncclInProgress) [[unlikely]]   \
      ::xctx::cuda::throw_nccl_error(xctx_nccl_rc_, #call, __FILE__, __LINE__);         \
  } while (0)

// After a kernel launch: reports bad launch configurations at the launch site (faults inside the
// kernel surface at the next synchronizing call).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
