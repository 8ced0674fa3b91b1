// Tokenizers (model/tokenizer*.cpp) on arbitrary bytes: the byte-level BPE of the real model
// (SmolLM2's vocabulary, read once from models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched by
// launch/fetch-model) and a SentencePiece vocabulary (the golden one of the tokenizer tests).
//
// Checked: encode and decode never crash; every id encode returns is in the vocabulary; the BPE
// round trip decode(encode(s)) == s holds for every valid UTF-8 string whose bytes the
// vocabulary can spell (tokenizer.h: "exact inverse on normal text"; SmolLM2 lacks a few byte
// tokens, which are dropped as in llama.cpp), with and without special-token parsing; the
// streamed pieces concatenate to the decoded text; ids taken from the input decode or throw
// xctx::Error.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error.h"
#include "tests/model/spm_vocab_json.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

using namespace xctx;

namespace {

std::unique_ptr<tokenizer> g_bpe, g_spm;
bool g_byte_ok[256];  // the BPE vocabulary can spell this byte on its own

// Strict UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF.
bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = (uint8_t)s[i];
    size_t n = 0;
    uint32_t cp = 0;
    if (c < 0x80) { ++i; continue; }
    if (c >= 0xC2 && c <= 0xDF) n = 1, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) n = 2, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) n = 3, cp = c & 0x07;
    else return false;
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return false;
      const auto d = (uint8_t)s[i + k];
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    if ((n == 2 && cp < 0x800) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += n + 1;
  }
  return true;
}

void check_ids(const tokenizer& tok, const std::vector<int32_t>& ids, const char* what) {
  for (int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) {
      std::fprintf(stderr, "%s: id %d outside the %d-token vocabulary\n", what, id, tok.n_vocab());
      std::abort();
    }
}

void expect_eq(const std::string& got, const std::string& want, const char* what) {
  if (got == want) return;
  std::fprintf(stderr, "round trip failed (%s): %zu bytes in, %zu bytes back\n", what, want.size(), got.size());
  std::abort();
}

std::unique_ptr<tokenizer> load_spm(const std::string& golden_path) {
  std::ifstream in(golden_path);
  if (!in) return nullptr;
  return make_tokenizer(test::spm_vocab_from_json(nlohmann::json::parse(in).at("spm")));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* model = std::getenv("XCTX_FUZZ_MODEL");
  const std::string path = model ? model : XCTX_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  try {
    const auto f = gguf_file::open(path);
    g_bpe = make_tokenizer(read_gguf_vocab(*f));
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz_tokenizer: cannot load the BPE vocabulary (%s); run launch/fetch-model\n", e.what());
    std::exit(1);
  }
  for (int b = 0; b < 256; ++b) {
    const std::string s(1, (char)b);
    g_byte_ok[b] = g_bpe->decode(g_bpe->encode(s, false, false)) == s;
  }
  g_spm = load_spm(XCTX_SOURCE_DIR "/tests/data/tokenizer_golden.json");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  bool spellable = valid_utf8(text);
  for (size_t i = 0; i < size && spellable; ++i) spellable = g_byte_ok[data[i]];

  const tokenizer& bpe = *g_bpe;
  const std::vector<int32_t> plain = bpe.encode(text, false, false);
  check_ids(bpe, plain, "bpe encode");
  const std::string back = bpe.decode(plain);
  if (spellable) expect_eq(back, text, "bpe, plain");
  const std::vector<int32_t> special = bpe.encode(text, true, true);
  check_ids(bpe, special, "bpe encode special");
  std::string streamed;
  for (size_t i = 1; i < special.size(); ++i) streamed += bpe.token_piece(special[i], true);
  if (spellable) expect_eq(streamed, text, "bpe, special tokens parsed and rendered");

  if (g_spm) {
    const std::vector<int32_t> ids = g_spm->encode(text, true, false);
    check_ids(*g_spm, ids, "spm encode");
    (void)g_spm->decode(ids);
    (void)g_spm->decode(g_spm->encode(text, false, true), true);
  }

  // Arbitrary ids: in range they decode, out of range they throw xctx::Error.
  std::vector<int32_t> ids(size / 4);
  if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
  for (const tokenizer* t : {g_bpe.get(), g_spm.get()}) {
    if (t == nullptr) continue;
    try {
      (void)t->decode(ids, (size & 1) != 0);
    } catch (const Error&) {
    }
  }
  return 0;
}
