// Host-side entry points of the CUDA backend (the .cu files implement them). Included only
// from registry/registry.cpp and the CUDA tests.
#pragma once

#include <memory>
#include <string>

#include "kernels/device.h"
#include "kernels/ops.h"

namespace xctx::cuda {

bool device_present();  // a CUDA device is visible and the runtime initializes
// The PCI bus id ("0000:3b:00.0") of the device this process binds to (cuda_device_for_process).
std::string bound_device_pci_bus_id();
std::unique_ptr<backend> make_cuda_backend(const backend_settings& settings);  // cuda_graphs, cuda_tf32
// Runtime and driver versions, the visible devices and the one this process binds to
// (no context is created on the others); nccl_version is filled by the caller.
cuda_probe probe_runtime();

}  // namespace xctx::cuda
