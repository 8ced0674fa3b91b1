// Collectives between the ranks that share one sequence. Implementations: local (one process,
// size 1), mpi; nccl joins in the sequence-parallel work. Buffers are host memory for local/mpi.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace xctx {

class communicator {
 public:
  virtual ~communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  // recv[r * bytes ...] receives rank r's send buffer; recv holds size()*bytes.
  virtual void all_gather(const void* send, void* recv, size_t bytes) = 0;
  virtual void all_reduce_sum(float* data, size_t n) = 0;
  virtual void all_reduce_max(float* data, size_t n) = 0;
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void send(const void* data, size_t bytes, int dst, int tag) = 0;
  virtual void recv(void* data, size_t bytes, int src, int tag) = 0;
  // Sends to dst and receives from src at the same time (a ring step without deadlock).
  virtual void sendrecv(const void* send_buf, size_t send_bytes, int dst, void* recv_buf, size_t recv_bytes, int src,
                        int tag) = 0;
  virtual void barrier() = 0;
  // Ends every rank's participation with an error; never returns.
  [[noreturn]] virtual void abort(const std::string& why) = 0;
};

std::unique_ptr<communicator> make_local_communicator();

// MPI_COMM_WORLD. Initializes MPI (thread level FUNNELED) unless already initialized and
// finalizes it on destruction. Every blocking call polls a non-blocking MPI operation against
// a deadline of `timeout_s` seconds (env XCTX_COMM_TIMEOUT overrides; default 600): a rank that
// died or hangs makes the others print which operation stalled and MPI_Abort the whole job
// instead of waiting forever.
std::unique_ptr<communicator> make_mpi_communicator(double timeout_s = 0);

// True when this process was started by mpirun/srun with more than one rank.
bool launched_by_mpi();
// The linked MPI library's name and version (first line of MPI_Get_library_version).
std::string mpi_library_version();

// MPI when launched by mpirun with several ranks, else local.
std::unique_ptr<communicator> make_default_communicator();

// NCCL (CUDA builds): comm/nccl.h, made through registry/registry.h.

}  // namespace xctx
