// The reference backend: host memory, every op forwarded to the scalar oracles in xctx::ref.
#include "kernels/host_backend.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/x_quant.h"

namespace xctx {

std::unique_ptr<backend> make_ref_backend() {
  return make_host_backend({"ref", ref::matmul, ref::get_rows, ref::rms_norm, ref::rope, ref::swiglu, ref::add,
                            ref::attention_partial, ref::merge_partials, ref::kvq_encode, ref::attention_kvq,
                            ref::xq_encode, ref::xq_project, [](const xq_attn_args& a) { ref::attention_xq(a); },
                            ref::xq_decode_rows, ref::xq_add_projected, nullptr});
}

}  // namespace xctx
