// The reference backend: host memory, every op forwarded to the scalar oracles in xctx::ref.
#include "kernels/host_backend.h"
#include "kernels/ref/ref_ops.h"

namespace xctx {

std::unique_ptr<backend> make_ref_backend() {
  return make_host_backend({"ref", ref::matmul, ref::get_rows, ref::rms_norm, ref::rope, ref::swiglu, ref::add,
                            ref::attention_partial, ref::merge_partials, ref::kvq_encode, ref::attention_kvq,
                            nullptr});
}

}  // namespace xctx
