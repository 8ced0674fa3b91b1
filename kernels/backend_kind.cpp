// The backends' names as the command line and XCTX_BACKEND spell them.
#include <string>

#include "common/error.h"
#include "kernels/ops.h"

namespace xctx {

const char* backend_name(backend_kind kind) {
  switch (kind) {
    case backend_kind::backend_ref: return "ref";
    case backend_kind::backend_cpu: return "cpu";
    case backend_kind::backend_cuda: return "cuda";
  }
  return "?";
}

backend_kind parse_backend_kind(const std::string& name, const char* what) {
  if (name == "cpu") return backend_kind::backend_cpu;
  if (name == "cuda") return backend_kind::backend_cuda;
  if (name == "ref") return backend_kind::backend_ref;
  fail(what, ": unknown backend '", name, "' (cpu, cuda; ref is the scalar oracle)");
}

}  // namespace xctx
