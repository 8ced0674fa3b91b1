// Vocabulary loading from GGUF, the tokenizer factory, and what both tokenizer kinds share.
#include <algorithm>
#include <array>

#include "common/error.h"
#include "model/gguf.h"
#include "model/tokenizer_impl.h"

namespace xctx {

namespace {

bool is_llama3_pre(const std::string& pre) {
  return pre == "llama3" || pre == "llama-v3" || pre == "llama-bpe" || pre == "falcon3";
}

}  // namespace

tokenizer_vocab read_gguf_vocab(const gguf_file& file) {
  const std::string& path = file.path();
  tokenizer_vocab v;
  v.model = file.get_string("tokenizer.ggml.model");
  const bool spm = v.model == "llama";
  v.tokens = file.get_string_array("tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  XCTX_CHECK(n > 0, path, ": tokenizer.ggml.tokens is empty");

  if (file.has("tokenizer.ggml.scores")) {
    v.scores = file.get_float_array("tokenizer.ggml.scores");
    XCTX_CHECK(v.scores.size() == n, path, ": tokenizer.ggml.scores has ", v.scores.size(), " entries for ", n,
               " tokens");
  }
  if (file.has("tokenizer.ggml.token_type")) {
    const std::vector<int32_t> types = file.get_int_array("tokenizer.ggml.token_type");
    XCTX_CHECK(types.size() == n, path, ": tokenizer.ggml.token_type has ", types.size(), " entries for ", n,
               " tokens");
    v.kinds.resize(n);
    for (size_t i = 0; i < n; ++i) {
      XCTX_CHECK(types[i] >= (int32_t)token_kind::token_normal && types[i] <= (int32_t)token_kind::token_byte, path,
                 ": tokenizer.ggml.token_type[", i, "] (token '", v.tokens[i], "') is ", types[i],
                 ", expected 1..6");
      v.kinds[i] = (token_kind)types[i];
    }
  } else {
    v.kinds.assign(n, token_kind::token_normal);
  }
  if (file.has("tokenizer.ggml.merges")) v.merges = file.get_string_array("tokenizer.ggml.merges");
  if (v.model == "gpt2") {
    XCTX_CHECK(file.has("tokenizer.ggml.merges"), path, ": BPE (gpt2) vocabulary without tokenizer.ggml.merges");
    // llama.cpp's fallback for files written before the key existed.
    v.pre = file.get_string("tokenizer.ggml.pre", "default");
  }

  // Defaults follow llama.cpp for files that omit the keys: SentencePiece models number
  // <unk>, <s>, </s> as 0, 1, 2 and want BOS and a space prefix; Llama-3 BPE wants BOS.
  v.bos_id = (int32_t)file.get_int("tokenizer.ggml.bos_token_id", spm ? 1 : -1);
  v.eos_id = (int32_t)file.get_int("tokenizer.ggml.eos_token_id", spm ? 2 : -1);
  v.unk_id = (int32_t)file.get_int("tokenizer.ggml.unknown_token_id", spm ? 0 : -1);
  v.pad_id = (int32_t)file.get_int("tokenizer.ggml.padding_token_id", -1);
  v.add_bos = file.get_bool("tokenizer.ggml.add_bos_token", spm || is_llama3_pre(v.pre));
  v.add_eos = file.get_bool("tokenizer.ggml.add_eos_token", false);
  v.add_space_prefix = file.get_bool("tokenizer.ggml.add_space_prefix", spm);
  const std::array<std::pair<const char*, int32_t>, 4> ids = {
      {{"bos_token_id", v.bos_id}, {"eos_token_id", v.eos_id}, {"unknown_token_id", v.unk_id},
       {"padding_token_id", v.pad_id}}};
  for (const auto& [key, id] : ids)
    XCTX_CHECK(id >= -1 && id < (int64_t)n, path, ": tokenizer.ggml.", key, " = ", id, " is outside the ", n,
               "-token vocabulary");
  return v;
}

std::unique_ptr<tokenizer> make_tokenizer(const tokenizer_vocab& vocab) {
  if (vocab.model == "gpt2") return tokenizer_detail::make_bpe_tokenizer(vocab);
  if (vocab.model == "llama") return tokenizer_detail::make_spm_tokenizer(vocab);
  fail("unsupported tokenizer model '", vocab.model, "' (supported: gpt2 = byte-level BPE, llama = SentencePiece)");
}

bool tokenizer::is_end_of_generation(int32_t id) const {
  const tokenizer_vocab& v = vocab();
  if (id < 0 || id >= (int32_t)v.tokens.size()) return false;
  if (id == v.eos_id) return true;
  if (v.kinds[(size_t)id] != token_kind::token_control) return false;
  static constexpr std::array<std::string_view, 5> k_turn_enders = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>",
                                                                    "</s>", "<|end_of_text|>"};
  const std::string& text = v.tokens[(size_t)id];
  return std::find(k_turn_enders.begin(), k_turn_enders.end(), text) != k_turn_enders.end();
}

int32_t tokenizer::find_token(std::string_view text) const {
  if (const auto* base = dynamic_cast<const tokenizer_detail::tokenizer_base*>(this)) return base->lookup(text);
  const auto& tokens = vocab().tokens;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] == text) return (int32_t)i;
  return -1;
}

namespace tokenizer_detail {

tokenizer_base::tokenizer_base(const tokenizer_vocab& vocab) : vocab_(vocab) {
  const size_t n = vocab_.tokens.size();
  XCTX_CHECK(n > 0, "tokenizer vocabulary (model '", vocab_.model, "') has no tokens");
  if (vocab_.kinds.empty()) vocab_.kinds.assign(n, token_kind::token_normal);
  XCTX_CHECK(vocab_.kinds.size() == n, "tokenizer vocabulary has ", vocab_.kinds.size(), " token kinds for ", n,
             " tokens");
  XCTX_CHECK(vocab_.scores.empty() || vocab_.scores.size() == n, "tokenizer vocabulary has ", vocab_.scores.size(),
             " scores for ", n, " tokens");
  const std::array<std::pair<const char*, int32_t>, 4> ids = {
      {{"bos_id", vocab_.bos_id}, {"eos_id", vocab_.eos_id}, {"unk_id", vocab_.unk_id}, {"pad_id", vocab_.pad_id}}};
  for (const auto& [name, id] : ids)
    XCTX_CHECK(id >= -1 && id < (int64_t)n, "tokenizer vocabulary: ", name, " = ", id, " is outside the ", n,
               "-token vocabulary");

  index_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    // A repeated text maps to its last id, as in llama.cpp.
    index_[vocab_.tokens[i]] = (int32_t)i;
    const token_kind k = vocab_.kinds[i];
    const bool splittable = k == token_kind::token_control || k == token_kind::token_user_defined ||
                            k == token_kind::token_unknown;
    if (splittable && !vocab_.tokens[i].empty()) special_ids_.push_back((int32_t)i);
  }
  std::stable_sort(special_ids_.begin(), special_ids_.end(), [&](int32_t a, int32_t b) {
    return vocab_.tokens[(size_t)a].size() > vocab_.tokens[(size_t)b].size();
  });
}

void tokenizer_base::check_id(int32_t id) const {
  XCTX_CHECK(id >= 0 && id < n_vocab(), "token id ", id, " is outside the ", n_vocab(), "-token vocabulary");
}

std::vector<text_fragment> tokenizer_base::split_special(std::string_view text, bool parse_special) const {
  std::vector<text_fragment> frags;
  if (text.empty()) return frags;
  frags.push_back({text, -1});
  std::vector<text_fragment> next;
  for (int32_t id : special_ids_) {
    const token_kind k = kind(id);
    if (!parse_special && k != token_kind::token_user_defined) continue;
    const std::string& tok = vocab_.tokens[(size_t)id];
    next.clear();
    bool found = false;
    for (const text_fragment& f : frags) {
      if (f.special_id >= 0) {
        next.push_back(f);
        continue;
      }
      size_t start = 0;
      for (size_t hit; (hit = f.text.find(tok, start)) != std::string_view::npos; start = hit + tok.size()) {
        if (hit > start) next.push_back({f.text.substr(start, hit - start), -1});
        next.push_back({f.text.substr(hit, tok.size()), id});
        found = true;
      }
      if (start < f.text.size()) next.push_back({f.text.substr(start), -1});
    }
    if (found) frags.swap(next);
  }
  return frags;
}

}  // namespace tokenizer_detail

}  // namespace xctx
