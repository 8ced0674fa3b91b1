// Collectives under mpirun (-np 2 and -np 4): each rank builds its input from (seed, rank), so
// every rank can compute the expected result alone and check it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/sys.h"
#include "mpi_test.h"

namespace xctx {
namespace {

constexpr uint32_t kSeed = 20261121;

uint8_t byte_of(int rank, size_t i) { return (uint8_t)((kSeed ^ (uint32_t)(rank * 2654435761u)) + i * 31u); }
// Small integers: float sums are exact, so equality is the right check.
float value_of(int rank, size_t i) { return (float)((int)((rank + 1) * 7 + i * 13 % 101) - 50); }

TEST(collectives, all_gather_bytes) {
  communicator& c = mpi_test::world();
  for (size_t bytes : {size_t(0), size_t(1), size_t(37), size_t(1 << 20)}) {
    std::vector<uint8_t> send(bytes), recv(bytes * c.size());
    for (size_t i = 0; i < bytes; ++i) send[i] = byte_of(c.rank(), i);
    c.all_gather(send.data(), recv.data(), bytes);
    for (int r = 0; r < c.size(); ++r)
      for (size_t i = 0; i < bytes; ++i)
        ASSERT_EQ(recv[r * bytes + i], byte_of(r, i)) << "bytes " << bytes << " from rank " << r << " i " << i;
  }
}

// A plain `mpirun -np P` (no launcher script, no OMP_NUM_THREADS) must not start P x cores
// threads: each rank takes its share of the node's cores.
TEST(collectives, default_threads_share_the_node) {
  communicator& c = mpi_test::world();
  const char* saved = std::getenv("OMP_NUM_THREADS");
  const std::string keep = saved ? saved : "";
  unsetenv("OMP_NUM_THREADS");
  const int threads = default_threads();
  if (saved) setenv("OMP_NUM_THREADS", keep.c_str(), 1);
  EXPECT_EQ(node_local_ranks(), c.size()) << "all test ranks run on this node";
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  EXPECT_GE(threads, 1);
  EXPECT_LE((long)threads * c.size(), std::max<long>(online, c.size())) << threads << " threads x " << c.size()
                                                                        << " ranks on " << online << " cores";
}

TEST(collectives, all_gather_in_place) {
  communicator& c = mpi_test::world();
  const size_t bytes = 64;
  std::vector<uint8_t> buf(bytes * c.size(), 0);
  for (size_t i = 0; i < bytes; ++i) buf[c.rank() * bytes + i] = byte_of(c.rank(), i);
  c.all_gather(buf.data() + c.rank() * bytes, buf.data(), bytes);
  for (int r = 0; r < c.size(); ++r)
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(buf[r * bytes + i], byte_of(r, i));
}

TEST(collectives, all_reduce_sum_and_max) {
  communicator& c = mpi_test::world();
  const size_t n = 1000;
  std::vector<float> sum(n), mx(n);
  for (size_t i = 0; i < n; ++i) sum[i] = mx[i] = value_of(c.rank(), i);
  c.all_reduce_sum(sum.data(), n);
  c.all_reduce_max(mx.data(), n);
  for (size_t i = 0; i < n; ++i) {
    float es = 0, em = -1e30f;
    for (int r = 0; r < c.size(); ++r) {
      es += value_of(r, i);
      em = std::max(em, value_of(r, i));
    }
    ASSERT_EQ(sum[i], es) << i;
    ASSERT_EQ(mx[i], em) << i;
  }
}

TEST(collectives, broadcast_from_every_root) {
  communicator& c = mpi_test::world();
  for (int root = 0; root < c.size(); ++root) {
    std::vector<uint8_t> buf(333, 0);
    if (c.rank() == root)
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = byte_of(root, i);
    c.broadcast(buf.data(), buf.size(), root);
    for (size_t i = 0; i < buf.size(); ++i) ASSERT_EQ(buf[i], byte_of(root, i)) << "root " << root;
  }
}

TEST(collectives, ring_send_recv) {
  communicator& c = mpi_test::world();
  if (c.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  std::vector<uint8_t> out(4096), in(4096);
  for (size_t i = 0; i < out.size(); ++i) out[i] = byte_of(c.rank(), i);
  // Even ranks send first, odd ranks receive first: no deadlock with blocking calls.
  if (c.rank() % 2 == 0) {
    c.send(out.data(), out.size(), next, 7);
    c.recv(in.data(), in.size(), prev, 7);
  } else {
    c.recv(in.data(), in.size(), prev, 7);
    c.send(out.data(), out.size(), next, 7);
  }
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(in[i], byte_of(prev, i));
  c.barrier();
}

// A ring step where every rank sends a different amount (as the ring prefill does with uneven
// shards); with XCTX_MPI_MAX_MESSAGE small, each message travels in many pieces.
TEST(collectives, sendrecv_ring_uneven_sizes) {
  communicator& c = mpi_test::world();
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  const auto size_of = [](int r) { return size_t(5000 + 1237 * r) * (r % 3 == 2 ? 0 : 1); };
  std::vector<uint8_t> out(size_of(c.rank())), in(size_of(prev));
  for (size_t i = 0; i < out.size(); ++i) out[i] = byte_of(c.rank(), i);
  c.sendrecv(out.data(), out.size(), next, in.data(), in.size(), prev, 11);
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(in[i], byte_of(prev, i)) << "from " << prev << " byte " << i;
  std::vector<uint8_t> big(10007);
  if (c.rank() == 0)
    for (size_t i = 0; i < big.size(); ++i) big[i] = byte_of(0, i);
  c.broadcast(big.data(), big.size(), 0);
  for (size_t i = 0; i < big.size(); ++i) ASSERT_EQ(big[i], byte_of(0, i));
}

TEST(collectives, bad_arguments_are_errors) {
  communicator& c = mpi_test::world();
  std::vector<uint8_t> buf(8);
  EXPECT_THROW(c.broadcast(buf.data(), buf.size(), c.size()), std::exception);
}

}  // namespace
}  // namespace xctx

// NCCL on device buffers (CUDA builds with a GPU per rank); skipped elsewhere. Same checks as
// the MPI collectives, data moved through the CUDA backend's alloc/upload/download.
#include "kernels/ops.h"
#include "registry/registry.h"

namespace xctx {
namespace {

TEST(nccl_collectives, all_gather_all_reduce_broadcast_sendrecv) {
  if (!nccl_available()) GTEST_SKIP() << "no CUDA device (NCCL is compiled in CUDA builds and runs only with GPUs)";
  communicator& world = mpi_test::world();
  auto nccl = make_nccl_communicator_or_fail(world);
  auto be = make_backend(backend_kind::backend_cuda);
  const int p = nccl->size(), r = nccl->rank();
  const size_t bytes = 4096;
  std::vector<uint8_t> send(bytes), got(bytes * p);
  for (size_t i = 0; i < bytes; ++i) send[i] = byte_of(r, i);
  void* d_send = be->alloc(bytes);
  void* d_recv = be->alloc(bytes * p);
  be->upload(d_send, send.data(), bytes);
  nccl->all_gather(d_send, d_recv, bytes);
  be->download(got.data(), d_recv, bytes * p);
  for (int s = 0; s < p; ++s)
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(got[s * bytes + i], byte_of(s, i));

  std::vector<float> v(256), expect(256, 0.0f);
  for (size_t i = 0; i < v.size(); ++i) v[i] = value_of(r, i);
  for (int s = 0; s < p; ++s)
    for (size_t i = 0; i < v.size(); ++i) expect[i] += value_of(s, i);
  auto* d_v = static_cast<float*>(be->alloc(v.size() * sizeof(float)));
  be->upload(d_v, v.data(), v.size() * sizeof(float));
  nccl->all_reduce_sum(d_v, v.size());
  be->download(v.data(), d_v, v.size() * sizeof(float));
  EXPECT_EQ(v, expect);

  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  nccl->sendrecv(d_send, bytes, next, d_recv, bytes, prev, 0);
  be->download(got.data(), d_recv, bytes);
  for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(got[i], byte_of(prev, i));
  be->free(d_send);
  be->free(d_recv);
  be->free(d_v);
}

}  // namespace
}  // namespace xctx
