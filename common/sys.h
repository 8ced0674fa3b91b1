// Small system helpers: timing, peak memory, thread count, logging set-up.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace xctx {

class stopwatch {
 public:
  stopwatch() : t0_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  void reset() { t0_ = std::chrono::steady_clock::now(); }

 private:
  std::chrono::steady_clock::time_point t0_;
};

size_t peak_rss_bytes();     // VmHWM of this process
size_t current_rss_bytes();  // VmRSS
// VmRSS by kind of page: anonymous (heap, stacks), file-backed (code, mapped model files) and
// shared memory (an MPI transport's segments count here once a process has touched them).
// malloc_free: bytes the allocator holds free (mallinfo2's fordblks; 0 off glibc): resident
// pages that no allocation uses, which a peak can include.
struct rss_parts {
  size_t anon = 0, file = 0, shmem = 0, malloc_free = 0;
};
rss_parts current_rss_parts();
std::string format_bytes(double bytes);  // "12.3 MiB"
// "host gpu7 rank 3" (the world rank from the launcher's environment; omitted outside one):
// where an error happened, which with many ranks on many nodes is the first question.
std::string where_am_i();
// Ranks of this MPI job on this node, from the launcher's environment (1 outside a launcher).
int node_local_ranks();
// This process's rank among them (OpenMPI, MPICH/Hydra, Slurm, torchrun variables, first set
// wins), or -1 outside a launcher; `source`, when given, receives the variable's name. A value
// that is not a non-negative integer is an error naming the variable.
int node_local_rank(std::string* source = nullptr);
// OMP_NUM_THREADS if set, else the cores this process may use, shared evenly among the node's
// ranks (at least 1).
int default_threads();
void init_logging(const char* argv0);  // glog to stderr, idempotent
// Parses "32K", "1M", "10M", "2048" (K = 1024). Throws naming `what` on bad input.
long long parse_count(const std::string& text, const std::string& what);
// A whole file's bytes; throws "cannot read [what ]path" (what: e.g. "prompt file").
std::string read_file_bytes(const std::string& path, const std::string& what = "");
// Writes every byte to fd (retrying short writes and EINTR); throws "cannot write PATH: reason".
void write_all_bytes(int fd, const char* data, size_t n, const std::string& path);

}  // namespace xctx
