// Names of the backend settings' choices (kernels/backend_settings.h).
#include "kernels/backend_settings.h"

#include "common/error.h"

namespace xctx {

const char* decode_activations_name(decode_activations act) {
  switch (act) {
    case decode_activations::act_f32: return "f32";
    case decode_activations::act_q16: return "q16";
    case decode_activations::act_q8: return "q8";
  }
  return "?";
}

decode_activations parse_decode_activations(std::string_view name, const char* what) {
  for (decode_activations act : {decode_activations::act_f32, decode_activations::act_q16, decode_activations::act_q8})
    if (name == decode_activations_name(act)) return act;
  fail(what, " must be f32, q16 or q8, not '", name, "'");
}

const char* prefill_activations_name(prefill_activations act) {
  switch (act) {
    case prefill_activations::pre_f32: return "f32";
    case prefill_activations::pre_q16: return "q16";
    case prefill_activations::pre_q8: return "q8";
  }
  return "?";
}

prefill_activations parse_prefill_activations(std::string_view name, const char* what) {
  for (prefill_activations act :
       {prefill_activations::pre_f32, prefill_activations::pre_q16, prefill_activations::pre_q8})
    if (name == prefill_activations_name(act)) return act;
  fail(what, " must be f32, q16 or q8, not '", name, "'");
}

}  // namespace xctx
