// Ranks that would share one GPU (worker/sequence_parallel.h, describe_shared_devices): the
// runner asks before NCCL's initialisation, which refuses two ranks on one device, and passes
// ring blocks and decode partials through host memory instead. Host code: runs without GPUs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "registry/registry.h"
#include "worker/sequence_parallel.h"

namespace xctx {
namespace {

TEST(device_sharing, names_the_first_two_ranks_on_one_gpu) {
  EXPECT_EQ(describe_shared_devices({"node1/0000:3b:00.0", "node1/0000:5e:00.0", "node1/0000:3b:00.0"}),
            "ranks 0 and 2 share node1/0000:3b:00.0");
  // The same bus id on two hosts is two GPUs; ranks without a device share nothing.
  EXPECT_EQ(describe_shared_devices({"node1/0000:3b:00.0", "node2/0000:3b:00.0"}), "");
  EXPECT_EQ(describe_shared_devices({"", "", ""}), "");
  EXPECT_EQ(describe_shared_devices({"node1/0000:3b:00.0"}), "");
}

// Without a usable CUDA device (every CI machine) this process has no device identity; with one
// it names the host and the bound device's PCI bus id.
TEST(device_sharing, identity_names_host_and_bus_or_nothing) {
  const std::string id = cuda_device_identity();
  if (!backend_available(backend_kind::backend_cuda)) {
    EXPECT_EQ(id, "");
  } else {
    EXPECT_NE(id.find('/'), std::string::npos) << id;
    EXPECT_NE(id.find(':'), std::string::npos) << id;
  }
}

}  // namespace
}  // namespace xctx
