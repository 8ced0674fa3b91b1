// MPI_COMM_WORLD as a communicator, with a watchdog on every blocking call.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "common/error.h"

namespace xctx {
namespace {

std::string host_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

class mpi_communicator final : public communicator {
 public:
  explicit mpi_communicator(double timeout_s) {
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
      owns_mpi_ = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    host_ = host_name();
    timeout_s_ = timeout_s > 0 ? timeout_s : 600.0;
    // MPI counts are ints: larger point-to-point messages and broadcasts go in pieces.
    // XCTX_MPI_MAX_MESSAGE lowers the piece size (tests use it to exercise the splitting).
    if (const char* env = std::getenv("XCTX_MPI_MAX_MESSAGE")) {
      const long long m = std::atoll(env);
      XCTX_CHECK(m > 0 && (size_t)m <= max_piece_, "XCTX_MPI_MAX_MESSAGE must be in [1, ", max_piece_, "], got '", env, "'");
      max_piece_ = (size_t)m;
    }
    if (const char* env = std::getenv("XCTX_COMM_TIMEOUT")) {
      const double t = std::atof(env);
      XCTX_CHECK(t > 0, "XCTX_COMM_TIMEOUT must be a positive number of seconds, got '", env, "'");
      timeout_s_ = t;
    }
  }
  ~mpi_communicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_mpi_ && !finalized) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void all_gather(const void* send, void* recv, size_t bytes) override {
    // Used for per-layer partials (kilobytes); the ring's large blocks go through sendrecv.
    XCTX_CHECK(bytes <= (size_t)INT32_MAX, "all_gather of ", bytes, " bytes exceeds MPI's int count");
    MPI_Request req;
    check(MPI_Iallgather(send == recv ? MPI_IN_PLACE : send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE,
                         MPI_COMM_WORLD, &req),
          "all_gather");
    wait(req, "all_gather");
  }
  void all_reduce_sum(float* data, size_t n) override { all_reduce(data, n, MPI_SUM, "all_reduce_sum"); }
  void all_reduce_max(float* data, size_t n) override { all_reduce(data, n, MPI_MAX, "all_reduce_max"); }
  void broadcast(void* data, size_t bytes, int root) override {
    XCTX_CHECK(root >= 0 && root < size_, "broadcast root ", root, " outside [0, ", size_, ")");
    for_each_piece(bytes, [&](size_t off, int n) {
      MPI_Request req;
      check(MPI_Ibcast(static_cast<uint8_t*>(data) + off, n, MPI_BYTE, root, MPI_COMM_WORLD, &req), "broadcast");
      wait(req, "broadcast");
    });
  }
  void send(const void* data, size_t bytes, int dst, int tag) override {
    for_each_piece(bytes, [&](size_t off, int n) {
      MPI_Request req;
      check(MPI_Isend(static_cast<const uint8_t*>(data) + off, n, MPI_BYTE, dst, tag, MPI_COMM_WORLD, &req), "send");
      wait(req, "send");
    });
  }
  void recv(void* data, size_t bytes, int src, int tag) override {
    for_each_piece(bytes, [&](size_t off, int n) {
      MPI_Request req;
      check(MPI_Irecv(static_cast<uint8_t*>(data) + off, n, MPI_BYTE, src, tag, MPI_COMM_WORLD, &req), "recv");
      wait(req, "recv");
    });
  }
  // Pieces of one message keep their order (MPI orders messages of one source, tag and
  // communicator), so both sides split at the same offsets.
  void sendrecv(const void* send_buf, size_t send_bytes, int dst, void* recv_buf, size_t recv_bytes, int src,
                int tag) override {
    const size_t pieces = std::max(piece_count(send_bytes), piece_count(recv_bytes));
    for (size_t i = 0; i < pieces; ++i) {
      const size_t so = i * max_piece_, ro = i * max_piece_;
      MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
      if (ro < recv_bytes || (i == 0 && recv_bytes == 0))
        check(MPI_Irecv(static_cast<uint8_t*>(recv_buf) + std::min(ro, recv_bytes),
                        (int)std::min(max_piece_, recv_bytes - std::min(ro, recv_bytes)), MPI_BYTE, src, tag,
                        MPI_COMM_WORLD, &reqs[0]),
              "sendrecv");
      if (so < send_bytes || (i == 0 && send_bytes == 0))
        check(MPI_Isend(static_cast<const uint8_t*>(send_buf) + std::min(so, send_bytes),
                        (int)std::min(max_piece_, send_bytes - std::min(so, send_bytes)), MPI_BYTE, dst, tag,
                        MPI_COMM_WORLD, &reqs[1]),
              "sendrecv");
      if (reqs[0] != MPI_REQUEST_NULL) wait(reqs[0], "sendrecv");
      if (reqs[1] != MPI_REQUEST_NULL) wait(reqs[1], "sendrecv");
    }
  }
  void barrier() override {
    MPI_Request req;
    check(MPI_Ibarrier(MPI_COMM_WORLD, &req), "barrier");
    wait(req, "barrier");
  }
  [[noreturn]] void abort(const std::string& why) override {
    std::fprintf(stderr, "xctx: rank %d on %s: %s; aborting all %d ranks\n", rank_, host_.c_str(), why.c_str(), size_);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);  // MPI_Abort does not return; keep [[noreturn]] honest if it ever does
  }

 private:
  void all_reduce(float* data, size_t n, MPI_Op op, const char* what) {
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, data, (int)n, MPI_FLOAT, op, MPI_COMM_WORLD, &req), what);
    wait(req, what);
  }
  void check(int rc, const char* what) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    abort(std::string("MPI ") + what + " failed: " + std::string(msg, len));
  }
  // Polls until the request completes; spins briefly, then sleeps in short steps so a waiting
  // rank does not steal the core its peers compute on.
  void wait(MPI_Request& req, const char* what) {
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      int done = 0;
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), what);
      if (done) return;
      if (spins < 1000) continue;
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 20000 ? 20 : 500));
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s_) {
        abort(std::string(what) + " waited " + std::to_string((int)waited) +
              " s for the other ranks (XCTX_COMM_TIMEOUT=" + std::to_string((int)timeout_s_) +
              "); a rank has died or hangs");
      }
    }
  }

  // Calls f(offset, count) for each piece of a message (one empty piece for an empty message).
  template <typename F>
  void for_each_piece(size_t bytes, F&& f) {
    for (size_t off = 0;; off += max_piece_) {
      const size_t n = std::min(max_piece_, bytes - off);
      f(off, (int)n);
      if (off + n >= bytes) break;
    }
  }
  size_t piece_count(size_t bytes) const { return bytes == 0 ? 1 : (bytes + max_piece_ - 1) / max_piece_; }

  int rank_ = 0, size_ = 1;
  bool owns_mpi_ = false;
  size_t max_piece_ = size_t(1) << 30;
  std::string host_;
  double timeout_s_ = 600.0;
};

}  // namespace

std::unique_ptr<communicator> make_mpi_communicator(double timeout_s) {
  return std::make_unique<mpi_communicator>(timeout_s);
}

std::string mpi_library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {0};
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return "";  // callable before MPI_Init
  std::string v(text, (size_t)std::max(0, len));
  // Open MPI appends build details after a comma and a newline; the first line names it.
  if (const size_t nl = v.find_first_of("\r\n"); nl != std::string::npos) v.resize(nl);
  while (!v.empty() && (v.back() == ',' || v.back() == ' ')) v.pop_back();
  return v;
}

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS"}) {
    if (const char* v = std::getenv(var)) {
      if (std::strcmp(var, "PMIX_RANK") == 0 || std::atoi(v) > 1) return true;
    }
  }
  return false;
}

std::unique_ptr<communicator> make_default_communicator() {
  if (launched_by_mpi()) return make_mpi_communicator();
  return make_local_communicator();
}

}  // namespace xctx
