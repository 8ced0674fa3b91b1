// Host-side entry points of the CUDA backend (the .cu files implement them). Included only
// from registry/registry.cpp and the CUDA tests.
#pragma once

#include <memory>

#include "kernels/device.h"
#include "kernels/ops.h"

namespace xctx::cuda {

bool device_present();  // a CUDA device is visible and the runtime initializes
std::unique_ptr<backend> make_cuda_backend();
// Runtime and driver versions, the visible devices and the one this process binds to
// (no context is created on the others); nccl_version is filled by the caller.
cuda_probe probe_runtime();

}  // namespace xctx::cuda
