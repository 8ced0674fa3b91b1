// The CPU backend: host memory, every op forwarded to the optimized kernels in xctx::cpu, the
// matmuls with the activation settings the backend was made with.
#include <algorithm>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/workspace.h"
#include "kernels/host_backend.h"
#include "kernels/x_quant.h"

namespace xctx {

std::unique_ptr<backend> make_cpu_backend(const backend_settings& settings) {
  const cpu::matmul_settings m{settings.decode.value_or(cpu::matmul_settings{}.decode),
                               settings.prefill.value_or(cpu::default_prefill_activations())};
  const cpu::attention_switches sw{settings.attn_avx512_rows.value_or(true), settings.kvq_key_lanes.value_or(true)};
  host_kernels k{"cpu",
                 [m](const weight_view& w, const float* x, int64_t n, float* y) { cpu::matmul(w, x, n, y, m); },
                 cpu::get_rows, cpu::rms_norm, cpu::rope, cpu::swiglu, cpu::add,
                 [sw](const attn_args& a) { cpu::attention_partial(a, sw); },
                 cpu::merge_partials, cpu::kvq_encode,
                 [sw](const kvq_attn_args& a) { cpu::attention_kvq(a, sw); },
                 cpu::xq_encode, cpu::xq_project,
                 [sw](const xq_attn_args& a) { cpu::attention_xq(a, sw); },
                 cpu::xq_decode_rows, cpu::xq_add_projected,
                 [m](const weight_view* w, int n_w, const float* x, int64_t n, float* const* y) {
                   cpu::matmul_n(w, n_w, x, n, y, m);
                 }};
  k.settings.decode = m.decode;
  k.settings.prefill = m.prefill;
  k.settings.attn_avx512_rows = sw.avx512_rows;
  k.settings.kvq_key_lanes = sw.kvq_key_lanes;
  return make_host_backend(k);
}

size_t cpu_workspace_bytes(const workspace_shape& s) {
  return cpu::kernel_workspace_bytes(std::max(1, s.n_threads), s.n_batch, s.kv_dim, s.q_dim);
}

}  // namespace xctx
