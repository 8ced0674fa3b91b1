// The device-binding rule (which CUDA device a process uses) and what a CUDA probe reports. Host
// code in every build, so the rule is tested without GPUs; the CUDA backend (kernels/cuda) and
// the NCCL communicator (comm/nccl.cu) both bind through cuda_device_for_process.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace xctx {

// The CUDA device this process binds to among `count` > 0 visible ones: XCTX_CUDA_DEVICE when
// set (an error unless it is below count), else the node-local rank (node_local_rank,
// common/sys.h) mod count, else 0. `why`, when given, says which rule chose it.
int cuda_device_for_process(int count, std::string* why = nullptr);

// The CUDA side of this process as `xctx doctor` reports it (probe_cuda, registry/registry.h).
struct cuda_probe {
  struct device {
    std::string name;
    int cc_major = 0, cc_minor = 0, sm_count = 0;
    size_t total_bytes = 0;
  };
  bool compiled = false;     // built with XCTX_CUDA=ON
  std::string error;         // why no device can be used; empty when one can
  int runtime_version = 0;   // CUDA runtime, 1000 * major + 10 * minor
  int driver_version = 0;    // the newest CUDA version the driver supports, same encoding
  int nccl_version = 0;      // NCCL_VERSION_CODE of the linked library, 0 when unknown
  std::vector<device> devices;
  int bound = -1;            // cuda_device_for_process(devices.size()); -1 without devices
  std::string bound_why;     // its rule, or the error that rule raised
  size_t bound_free_bytes = 0;
};

}  // namespace xctx
