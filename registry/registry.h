// The top of the build: the only part that knows which backends and communicators were compiled
// in (CUDA and NCCL or not). Everything that makes a backend or a device communicator asks here;
// kernels/ and comm/ below it define the pieces and never decide between them.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "kernels/device.h"
#include "kernels/ops.h"

namespace xctx {

// A backend of `kind` made with `settings`, each unset one taken from the environment
// (XCTX_DECODE_ACT, XCTX_PREFILL_ACT; an error naming the variable when it is not a choice)
// or else the backend's default. Only the CPU backend has these choices (kernels/backend_settings.h).
std::unique_ptr<backend> make_backend(backend_kind kind, const backend_settings& settings = {});
// `settings` with every unset field the environment sets filled in.
backend_settings settings_with_environment(backend_settings settings);
bool backend_available(backend_kind kind);  // cuda: compiled in AND a device is present
// The backend a job runs on: `flag` (the --backend value) when given, else XCTX_BACKEND, else
// cpu. Checked here, before any model is loaded: cuda on a build without it, or on a machine
// where no device can be used, is an error saying which and why.
backend_kind choose_backend(const std::string& flag);

// The bytes `kind`'s kernels hold for `s` (workspace_shape, kernels/ops.h), for the fit check and
// the planner, which may run before (or without) the backend itself.
size_t kernel_workspace_bytes(backend_kind kind, const workspace_shape& s);

// NCCL over device buffers, bootstrapped through `bootstrap` (CUDA builds with a device only;
// otherwise a clear error).
bool nccl_available();
std::unique_ptr<communicator> make_nccl_communicator_or_fail(communicator& bootstrap);
// "host/PCI bus id" of the CUDA device this process binds to, to tell whether two ranks share
// one (NCCL refuses that); "" where no CUDA device can be used.
std::string cuda_device_identity();

// The CUDA side of this process as `xctx doctor` reports it; nccl_version included.
cuda_probe probe_cuda();

}  // namespace xctx
