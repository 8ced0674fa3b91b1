// The CPU backend: host memory, every op forwarded to the optimized kernels in xctx::cpu.
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/workspace.h"
#include "kernels/host_backend.h"
#include "kernels/x_quant.h"

namespace xctx {

std::unique_ptr<backend> make_cpu_backend() {
  return make_host_backend({"cpu", cpu::matmul, cpu::get_rows, cpu::rms_norm, cpu::rope, cpu::swiglu, cpu::add,
                            cpu::attention_partial, cpu::merge_partials, cpu::kvq_encode, cpu::attention_kvq,
                            cpu::xq_encode, cpu::xq_project, cpu::attention_xq, cpu::xq_decode_rows,
                            cpu::xq_add_projected, cpu::matmul_n});
}

size_t cpu_workspace_bytes(const workspace_shape& s) {
  return cpu::kernel_workspace_bytes(std::max(1, s.n_threads), s.n_batch, s.kv_dim, s.q_dim);
}

}  // namespace xctx
