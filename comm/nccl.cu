// NCCL communicator: see comm/nccl.h.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/nccl.h"
#include "common/error.h"
#include "common/cuda_check.h"
#include "common/sys.h"
#include "kernels/device.h"  // cuda_device_for_process: the CUDA backend binds the same device

namespace xctx {
namespace {

class nccl_communicator final : public communicator {
 public:
  explicit nccl_communicator(communicator& bootstrap) : boot_(bootstrap) {
    rank_ = boot_.rank();
    size_ = boot_.size();
    int n_dev = 0;
    CUDA_CHECK(cudaGetDeviceCount(&n_dev));
    XCTX_CHECK(n_dev > 0, "NCCL communicator: no CUDA device visible to ", where_am_i());
    CUDA_CHECK(cudaSetDevice(cuda_device_for_process(n_dev)));  // the CUDA backend's device too
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclUniqueId id;
    if (rank_ == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    boot_.broadcast(&id, sizeof id, 0);
    NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  }
  ~nccl_communicator() override {
    if (comm_) ncclCommDestroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    // In place when send is this rank's slot of recv, as NCCL defines it.
    NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_));
    finish("all_gather");
  }
  void all_reduce_sum(float* data, size_t n) override {
    NCCL_CHECK(ncclAllReduce(data, data, n, ncclFloat32, ncclSum, comm_, stream_));
    finish("all_reduce_sum");
  }
  void all_reduce_max(float* data, size_t n) override {
    NCCL_CHECK(ncclAllReduce(data, data, n, ncclFloat32, ncclMax, comm_, stream_));
    finish("all_reduce_max");
  }
  void broadcast(void* data, size_t bytes, int root) override {
    XCTX_CHECK(root >= 0 && root < size_, "broadcast root ", root, " outside [0, ", size_, ")");
    NCCL_CHECK(ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_));
    finish("broadcast");
  }
  void send(const void* data, size_t bytes, int dst, int) override {
    NCCL_CHECK(ncclSend(data, bytes, ncclUint8, dst, comm_, stream_));
    finish("send");
  }
  void recv(void* data, size_t bytes, int src, int) override {
    NCCL_CHECK(ncclRecv(data, bytes, ncclUint8, src, comm_, stream_));
    finish("recv");
  }
  void sendrecv(const void* send_buf, size_t send_bytes, int dst, void* recv_buf, size_t recv_bytes, int src,
                int) override {
    // Grouped so neither side waits for the other to post first (a ring step).
    NCCL_CHECK(ncclGroupStart());
    NCCL_CHECK(ncclSend(send_buf, send_bytes, ncclUint8, dst, comm_, stream_));
    NCCL_CHECK(ncclRecv(recv_buf, recv_bytes, ncclUint8, src, comm_, stream_));
    NCCL_CHECK(ncclGroupEnd());
    finish("sendrecv");
  }
  void barrier() override { boot_.barrier(); }
  [[noreturn]] void abort(const std::string& why) override {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    boot_.abort(why);
    std::abort();  // unreachable: the bootstrap's abort does not return
  }

 private:
  // Waits for the stream with the same watchdog policy as the MPI communicator: a peer that
  // died leaves NCCL spinning, so poll, and abort the job after XCTX_COMM_TIMEOUT seconds.
  void finish(const char* what) {
    double timeout = 600.0;
    if (const char* env = std::getenv("XCTX_COMM_TIMEOUT")) timeout = std::atof(env);
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) CUDA_CHECK(q);
      ncclResult_t async = ncclSuccess;
      NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess) abort(std::string("NCCL ") + what + ": " + ncclGetErrorString(async));
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout)
        abort(std::string(what) + " waited more than " + std::to_string((int)timeout) +
              " s for the other ranks; a rank has died or hangs");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  communicator& boot_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<communicator> make_nccl_communicator(communicator& bootstrap) {
  return std::make_unique<nccl_communicator>(bootstrap);
}

int nccl_version() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

}  // namespace xctx
