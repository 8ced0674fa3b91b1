// Private to the tokenizer implementation (tokenizer.cpp, tokenizer_bpe.cpp, tokenizer_spm.cpp):
// the text -> id index and the special-token splitting both tokenizers share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/tokenizer.h"

namespace xctx::tokenizer_detail {

struct string_hash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using token_map = std::unordered_map<std::string, int32_t, string_hash, std::equal_to<>>;

// A piece of the input: plain text to tokenize, or one special token matched verbatim.
struct text_fragment {
  std::string_view text;
  int32_t special_id = -1;  // >= 0: the token this fragment is
};

// Holds the validated vocabulary and what both tokenizer kinds need from it.
class tokenizer_base : public tokenizer {
 public:
  explicit tokenizer_base(const tokenizer_vocab& vocab);  // throws on an inconsistent vocabulary
  const tokenizer_vocab& vocab() const override { return vocab_; }
  int32_t lookup(std::string_view text) const {
    auto it = index_.find(text);
    return it == index_.end() ? -1 : it->second;
  }
  token_kind kind(int32_t id) const { return vocab_.kinds[(size_t)id]; }
  void check_id(int32_t id) const;  // throws for an id outside the vocabulary

 protected:
  // Splits `text` around special-token texts, longest tokens first, as llama.cpp does: control
  // (and unknown) tokens only when `parse_special`; user-defined tokens always, since they are
  // added words the model expects as single tokens.
  std::vector<text_fragment> split_special(std::string_view text, bool parse_special) const;

  tokenizer_vocab vocab_;
  token_map index_;

 private:
  std::vector<int32_t> special_ids_;  // longest text first
};

std::unique_ptr<tokenizer> make_bpe_tokenizer(const tokenizer_vocab& vocab);
std::unique_ptr<tokenizer> make_spm_tokenizer(const tokenizer_vocab& vocab);

}  // namespace xctx::tokenizer_detail
