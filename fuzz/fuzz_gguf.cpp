// GGUF reader (model/gguf.cpp) and what reads a GGUF after it: every metadata value rendered,
// the typed getters, the hyper-parameters, the tokenizer vocabulary (and a tokenizer built from
// it, encoding and decoding a short text), and the weight table checks. Bad files must throw
// xctx::Error; anything else (a crash, a sanitizer report, another exception) is a finding.
#include <cstdint>
#include <memory>

#include "common/error.h"
#include "fuzz_util.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "model/weights.h"

using namespace xctx;

namespace {

void exercise_metadata(const gguf_file& f) {
  for (const auto& [key, value] : f.metadata()) {
    (void)gguf_value_to_string(value, 4);
    // Each typed getter either converts or throws xctx::Error naming the key.
    try { (void)f.get_int(key); } catch (const Error&) {}
    try { (void)f.get_float(key); } catch (const Error&) {}
    try { (void)f.get_bool(key, false); } catch (const Error&) {}
    try { (void)f.get_string(key); } catch (const Error&) {}
    try { (void)f.get_string_array(key); } catch (const Error&) {}
    try { (void)f.get_float_array(key); } catch (const Error&) {}
    try { (void)f.get_int_array(key); } catch (const Error&) {}
  }
  for (const gguf_tensor_info& t : f.tensors()) (void)t.n_elements();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = xctx_fuzz::write_file("in.gguf", data, size);
  std::shared_ptr<gguf_file> f;
  try {
    f = gguf_file::open(path);
  } catch (const Error&) {
    return 0;
  }
  exercise_metadata(*f);
  try {
    (void)read_gguf_hparams(*f);
  } catch (const Error&) {}
  try {
    const tokenizer_vocab v = read_gguf_vocab(*f);
    const std::unique_ptr<tokenizer> tok = make_tokenizer(v);
    const std::vector<int32_t> ids = tok->encode("Hello, world! 123 <|im_start|> \xc3\xa9\xe2\x96\x81 x", true, true);
    (void)tok->decode(ids, true);
  } catch (const Error&) {}
  try {
    (void)load_gguf_weights(f);
  } catch (const Error&) {}
  return 0;
}
