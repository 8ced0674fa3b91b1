// NCCL communicator (CUDA builds): collectives on device buffers, one CUDA stream per rank,
// bootstrapped by broadcasting the NCCL unique id over an existing (MPI) communicator, which
// also serves the host-side operations (barrier, abort). Implemented in comm/nccl.cu; created
// through registry/registry.h.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace xctx {

// `bootstrap` must outlive the returned communicator. Selects the device the CUDA backend
// uses (cuda_device_for_process, kernels/device.h). Buffers passed to the
// returned communicator are device pointers; every call is stream-ordered and synchronizes
// before it returns (the worker's step loop is host-driven).
std::unique_ptr<communicator> make_nccl_communicator(communicator& bootstrap);
// The linked NCCL's version code (e.g. 22105 for 2.21.5), 0 if it cannot say.
int nccl_version();

}  // namespace xctx
