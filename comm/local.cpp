// The one-process communicator: size 1, every collective is a copy or a no-op. Lets the worker
// logic run (and be tested) without MPI.
#include <cstring>

#include "comm/communicator.h"
#include "common/error.h"

namespace xctx {
namespace {

class local_communicator final : public communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "local"; }
  void all_gather(const void* send, void* recv, size_t bytes) override {
    if (send != recv) std::memmove(recv, send, bytes);
  }
  void all_reduce_sum(float*, size_t) override {}
  void all_reduce_max(float*, size_t) override {}
  void broadcast(void*, size_t, int root) override { XCTX_CHECK(root == 0, "broadcast: root ", root, " of 1 rank"); }
  void send(const void*, size_t, int dst, int) override { fail("send to rank ", dst, ": the local communicator has one rank"); }
  void recv(void*, size_t, int src, int) override { fail("recv from rank ", src, ": the local communicator has one rank"); }
  void sendrecv(const void* send_buf, size_t send_bytes, int dst, void* recv_buf, size_t recv_bytes, int src,
                int) override {
    XCTX_CHECK(dst == 0 && src == 0, "sendrecv with ranks ", dst, "/", src, ": the local communicator has one rank");
    XCTX_CHECK(send_bytes == recv_bytes, "sendrecv to self: ", send_bytes, " bytes sent, ", recv_bytes, " expected");
    if (send_buf != recv_buf) std::memmove(recv_buf, send_buf, send_bytes);
  }
  void barrier() override {}
  [[noreturn]] void abort(const std::string& why) override { throw Error("aborted: " + why); }
};

}  // namespace

std::unique_ptr<communicator> make_local_communicator() { return std::make_unique<local_communicator>(); }

}  // namespace xctx
