// The SentencePiece vocabulary of the tokenizer golden file (tests/data, key "spm"), shared by the
// tokenizer tests and the tokenizer fuzz target.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/tokenizer.h"

namespace xctx::test {

inline tokenizer_vocab spm_vocab_from_json(const nlohmann::json& g) {
  tokenizer_vocab v;
  v.model = "llama";
  v.tokens = g.at("tokens").get<std::vector<std::string>>();
  for (double s : g.at("scores").get<std::vector<double>>()) v.scores.push_back((float)s);
  for (int t : g.at("types").get<std::vector<int>>()) v.kinds.push_back((token_kind)t);
  v.bos_id = g.at("bos_id");
  v.eos_id = g.at("eos_id");
  v.unk_id = g.at("unk_id");
  v.add_bos = g.at("add_bos");
  v.add_space_prefix = g.at("add_space_prefix");
  return v;
}

}  // namespace xctx::test
