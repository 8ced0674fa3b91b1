#include "common/env_vars.h"

#include <iterator>

namespace xctx {

namespace {

constexpr env_var k_env_vars[] = {
    // Jobs and the coordinator.
    {"XCTX_MODEL", "model file when --model is not given",
     "models/SmolLM2-135M-Instruct.Q4_1.gguf, here or in the source tree"},
    {"XCTX_BACKEND", "backend when --backend is not given (cpu | cuda)", "cpu"},
    {"XCTX_CALIB_DIR", "where a model's default nuq calibration is stored and found",
     "beside the model, or $XDG_CACHE_HOME/xctx (else ~/.cache/xctx) when that folder is not writable"},
    {"XDG_CACHE_HOME", "the user cache folder (the nuq calibration store's fallback)", "~/.cache"},
    {"XCTX_MEMORY_LIMIT", "bytes the fit check assumes each node has (e.g. 8G), instead of MemAvailable",
     "/proc/meminfo MemAvailable"},
    {"OMP_NUM_THREADS", "threads per rank", "the node's cores / its node-local ranks"},
    // Communication.
    {"XCTX_COMM_TIMEOUT", "seconds a collective may wait for a peer before the job is aborted (MPI and NCCL)",
     "600"},
    {"XCTX_MPI_MAX_MESSAGE", "largest MPI message piece in bytes (tests use it to exercise splitting)",
     "1 GiB"},
    // CPU kernels.
    {"XCTX_DECODE_ACT", "decode matmul activations, when --decode-act is not given (q16 | f32 | q8)", "q16"},
    {"XCTX_PREFILL_ACT", "prefill matmul activations, when --prefill-act is not given (q16 | f32 | q8)",
     "q16 on AVX-512 VNNI CPUs, f32 elsewhere"},
    {"XCTX_NO_AVX2", "1: no AVX2 kernels (scalar fallbacks)", "0"},
    {"XCTX_NO_AVX512", "1: no AVX-512 kernels", "0"},
    {"XCTX_NO_AVXVNNI", "1: no AVX-VNNI (256-bit) kernels", "0"},
    {"XCTX_NO_AMX", "1: no AMX tiles in the integer prefill GEMMs", "0"},
    {"XCTX_ATTN_AVX512", "0: exact attention decode on the AVX2 kernel (a benchmark's baseline)", "1"},
    {"XCTX_KVQ_KEY_LANES", "0: the fused quantized-cache decode scores keys one at a time (a benchmark's baseline)",
     "1"},
    // CUDA backend.
    {"XCTX_CUDA_DEVICE", "the CUDA device every rank of this process binds", "node-local rank mod visible devices"},
    {"XCTX_CUDA_TF32", "0: prefill GEMMs in full fp32 instead of TF32", "1"},
    {"XCTX_CUDA_GRAPHS", "0: decode steps as eager launches instead of CUDA graph replays", "1"},
};

}  // namespace

const env_var* env_vars(size_t* count) {
  *count = std::size(k_env_vars);
  return k_env_vars;
}

}  // namespace xctx
