// Tokenizers against llama.cpp: tests/data/tokenizer_golden.json holds ids llama-cpp-python
// produced (tests/data/make_tokenizer_golden.py) for the real SmolLM2 GGUF (byte-level BPE), a
// small SentencePiece vocabulary, and the pre-tokenizer splits of five tokenizer.ggml.pre names.
// Every comparison is exact.
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "common/sys.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "model/unicode.h"
#include "spm_vocab_json.h"
#include "test_util.h"

namespace xctx {
namespace {

using json = nlohmann::json;

const json& golden() {
  static const json j = [] {
    const std::string path = test::data_path("tokenizer_golden.json");
    std::ifstream f(path);
    if (!f) throw Error("cannot open " + path + " (run tests/data/make_tokenizer_golden.py)");
    return json::parse(f);
  }();
  return j;
}

// Golden ids of one case; variants equal to bos0_sp0 are omitted from the file.
std::vector<int32_t> golden_ids(const json& c, bool bos, bool special) {
  const std::string key = std::string("bos") + (bos ? "1" : "0") + "_sp" + (special ? "1" : "0");
  const json& ids = c.at("ids");
  return (ids.contains(key) ? ids.at(key) : ids.at("bos0_sp0")).get<std::vector<int32_t>>();
}

std::string sanitize_name(std::string s) {
  for (char& ch : s)
    if (!std::isalnum((unsigned char)ch)) ch = '_';
  return s;
}

// The SmolLM2 tokenizer, read through the GGUF reader once for all tests; null if the model
// file is absent.
const tokenizer* smollm_tokenizer() {
  static const std::unique_ptr<tokenizer> tok = []() -> std::unique_ptr<tokenizer> {
    const std::string path = test::default_model_path();
    if (!std::filesystem::exists(path)) return nullptr;
    return make_tokenizer(read_gguf_vocab(*gguf_file::open(path)));
  }();
  return tok.get();
}

#define REQUIRE_SMOLLM(tok)                          \
  XCTX_REQUIRE_MODEL(model_path_for_##tok);          \
  const tokenizer& tok = *smollm_tokenizer();

std::string ids_to_string(const std::vector<int32_t>& ids) {
  std::string s;
  for (int32_t id : ids) s += std::to_string(id) + " ";
  return s;
}

// ---- the real vocabulary ----------------------------------------------------------------------

TEST(tokenizer_vocab, reads_smollm_gguf) {
  XCTX_REQUIRE_MODEL(path);
  const tokenizer_vocab v = read_gguf_vocab(*gguf_file::open(path));
  EXPECT_EQ(v.model, "gpt2");
  EXPECT_EQ(v.pre, "smollm");
  ASSERT_EQ(v.tokens.size(), 49152u);
  EXPECT_EQ(v.kinds.size(), v.tokens.size());
  EXPECT_EQ(v.merges.size(), 48900u);
  EXPECT_EQ(v.bos_id, 1);
  EXPECT_EQ(v.eos_id, 2);
  EXPECT_EQ(v.unk_id, 0);
  EXPECT_FALSE(v.add_bos);
  EXPECT_EQ(v.tokens[2], "<|im_end|>");
  const auto n_control = std::count(v.kinds.begin(), v.kinds.end(), token_kind::token_control);
  EXPECT_EQ(n_control, 17);
}

TEST(tokenizer_bpe, golden_file_has_enough_cases) {
  EXPECT_GE(golden().at("bpe").at("cases").size(), 40u);
  EXPECT_GE(golden().at("spm").at("cases").size(), 5u);
}

class bpe_golden : public testing::TestWithParam<int> {};

// The core acceptance test: every case, with and without BOS and special-token parsing, gives
// llama.cpp's ids; and decoding gives the text back.
TEST_P(bpe_golden, matches_llama_cpp) {
  REQUIRE_SMOLLM(tok);
  const json& c = golden().at("bpe").at("cases").at(GetParam());
  const std::string text = c.at("text").get<std::string>();
  for (bool bos : {false, true}) {
    for (bool special : {false, true}) {
      // llama.cpp's add_bos means "the special tokens the model asks for"; ours is literal.
      const std::vector<int32_t> ours = tok.encode(text, bos && tok.vocab().add_bos, special);
      const std::vector<int32_t> want = golden_ids(c, bos, special);
      EXPECT_EQ(ours, want) << "bos=" << bos << " special=" << special << "\n ours: " << ids_to_string(ours)
                            << "\n want: " << ids_to_string(want);
    }
  }
  const std::vector<int32_t> plain = tok.encode(text, false, false);
  EXPECT_EQ(tok.decode(plain), text);
  const std::vector<int32_t> with_special = tok.encode(text, false, true);
  EXPECT_EQ(tok.decode(with_special, /*render_special=*/true), text);
  // Streaming: the pieces concatenate to the decoded text.
  std::string streamed;
  for (int32_t id : with_special) streamed += tok.token_piece(id, true);
  EXPECT_EQ(streamed, text);
}

INSTANTIATE_TEST_SUITE_P(cases, bpe_golden, testing::Range(0, (int)golden().at("bpe").at("cases").size()),
                         [](const testing::TestParamInfo<int>& p) {
                           return sanitize_name(golden().at("bpe").at("cases").at(p.param).at("name"));
                         });

TEST(tokenizer_bpe, add_bos_prepends_bos_literally) {
  REQUIRE_SMOLLM(tok);
  const auto ids = tok.encode("Hello", true, false);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(ids[0], tok.vocab().bos_id);
  EXPECT_EQ(tok.encode("", true, false), std::vector<int32_t>{tok.vocab().bos_id});
}

TEST(tokenizer_bpe, special_tokens_only_when_parsed_and_rendered_only_when_asked) {
  REQUIRE_SMOLLM(tok);
  const std::string text = "<|im_start|>user\nHi<|im_end|>";
  const auto parsed = tok.encode(text, false, true);
  ASSERT_GE(parsed.size(), 3u);
  EXPECT_EQ(parsed.front(), tok.find_token("<|im_start|>"));
  EXPECT_EQ(parsed.back(), tok.find_token("<|im_end|>"));
  const auto literal = tok.encode(text, false, false);
  EXPECT_EQ(std::count(literal.begin(), literal.end(), parsed.front()), 0);
  EXPECT_EQ(tok.decode(parsed, false), "user\nHi");
  EXPECT_EQ(tok.decode(parsed, true), text);
  EXPECT_EQ(tok.token_piece(parsed.back(), false), "");
  EXPECT_EQ(tok.token_piece(parsed.back(), true), "<|im_end|>");
}

TEST(tokenizer_bpe, end_of_generation_and_find_token) {
  REQUIRE_SMOLLM(tok);
  const int32_t im_end = tok.find_token("<|im_end|>");
  const int32_t endoftext = tok.find_token("<|endoftext|>");
  const int32_t im_start = tok.find_token("<|im_start|>");
  EXPECT_EQ(im_end, 2);
  EXPECT_EQ(endoftext, 0);
  EXPECT_EQ(im_start, 1);
  EXPECT_TRUE(tok.is_end_of_generation(tok.vocab().eos_id));
  EXPECT_TRUE(tok.is_end_of_generation(im_end));
  EXPECT_TRUE(tok.is_end_of_generation(endoftext));
  EXPECT_FALSE(tok.is_end_of_generation(im_start));
  EXPECT_FALSE(tok.is_end_of_generation(tok.find_token("Hello")));
  EXPECT_FALSE(tok.is_end_of_generation(-1));
  EXPECT_FALSE(tok.is_end_of_generation(tok.n_vocab()));
  EXPECT_GE(tok.find_token("Hello"), 0);
  EXPECT_EQ(tok.find_token("no such token \x01"), -1);
  EXPECT_THROW(tok.token_piece(tok.n_vocab()), Error);
  EXPECT_THROW(tok.decode({-5}), Error);
}

TEST(tokenizer_bpe, pieces_of_a_multibyte_character_stream_in_parts) {
  REQUIRE_SMOLLM(tok);
  // A rare CJK character has no token of its own: its UTF-8 bytes are spread over tokens, so a
  // single piece is not valid UTF-8 but the concatenation is.
  const std::string text = "\xe9\xbe\x98";  // U+9F98
  const auto ids = tok.encode(text, false, false);
  ASSERT_GT(ids.size(), 1u);
  std::string joined;
  bool some_piece_partial = false;
  for (int32_t id : ids) {
    const std::string p = tok.token_piece(id);
    size_t pos = 0;
    if (!p.empty() && utf8_decode(p, pos) >= k_invalid_byte_base) some_piece_partial = true;
    joined += p;
  }
  EXPECT_TRUE(some_piece_partial);
  EXPECT_EQ(joined, text);
}

// llama.cpp turns malformed UTF-8 into U+FFFD; we keep the bytes, so text survives a round
// trip as long as the vocabulary has a token for each byte (SmolLM2's lacks C0, C1, F5..FF and
// a few control bytes, which are dropped as in llama.cpp).
TEST(tokenizer_bpe, invalid_utf8_round_trips_byte_for_byte) {
  REQUIRE_SMOLLM(tok);
  const std::string text = "ok \x80\xbf stray \xc3(\xe2\x82 cut) \xf4\x90\x80\x80 past U+10FFFF";
  const auto ids = tok.encode(text, false, false);
  EXPECT_EQ(tok.decode(ids), text) << ids_to_string(ids);
}

// Encoding throughput on ~100 KB of English; printed, not asserted (machines differ).
TEST(tokenizer_bpe, throughput_100k_english) {
  REQUIRE_SMOLLM(tok);
  const json* austen = nullptr;
  for (const json& c : golden().at("bpe").at("cases"))
    if (c.at("name") == "austen") austen = &c;
  ASSERT_NE(austen, nullptr);
  const std::string passage = austen->at("text").get<std::string>();
  const std::vector<int32_t> passage_ids = golden_ids(*austen, false, false);
  std::string text;
  std::vector<int32_t> want;
  while (text.size() < 100 * 1024) {
    text += passage;
    want.insert(want.end(), passage_ids.begin(), passage_ids.end());
  }
  stopwatch clock;
  const auto ids = tok.encode(text, false, false);
  const double enc_s = clock.seconds();
  clock.reset();
  const std::string back = tok.decode(ids);
  const double dec_s = clock.seconds();
  // The passage ends with a newline and starts a word, so copies tokenize independently.
  EXPECT_EQ(ids, want);
  EXPECT_EQ(back, text);
  std::printf("[ throughput ] encode %.1f KB -> %zu tokens in %.1f ms (%.2f MB/s, %.0f ktok/s); decode %.2f ms\n",
              text.size() / 1024.0, ids.size(), enc_s * 1e3, text.size() / enc_s / 1e6, ids.size() / enc_s / 1e3,
              dec_s * 1e3);
}

// ---- pre-tokenizers ---------------------------------------------------------------------------

// The vocabulary make_tokenizer_golden.py builds: the 256 byte tokens, every byte substring of
// the texts, and a merge for every split of every substring, so each pre-tokenizer piece
// merges into exactly one token and the tokens spell the pieces.
tokenizer_vocab all_substring_vocab(const std::vector<std::string>& texts, const std::string& pre) {
  tokenizer_vocab v;
  v.model = "gpt2";
  v.pre = pre;
  auto enc = [](std::string_view bytes) {
    std::string s;
    for (char c : bytes) utf8_append(s, gpt2_byte_to_cpt((uint8_t)c));
    return s;
  };
  std::set<std::string> seen;
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(enc(std::string(1, (char)b)));
    seen.insert(v.tokens.back());
  }
  for (const std::string& t : texts) {
    for (size_t n = 2; n <= t.size(); ++n) {
      for (size_t i = 0; i + n <= t.size(); ++i) {
        const std::string_view sub = std::string_view(t).substr(i, n);
        std::string e = enc(sub);
        if (!seen.insert(e).second) continue;
        v.tokens.push_back(e);
        for (size_t k = 1; k < n; ++k) v.merges.push_back(enc(sub.substr(0, k)) + " " + enc(sub.substr(k)));
      }
    }
  }
  v.tokens.push_back("<|bos|>");
  v.tokens.push_back("<|eos|>");
  v.kinds.assign(v.tokens.size(), token_kind::token_normal);
  v.kinds[v.tokens.size() - 2] = v.kinds[v.tokens.size() - 1] = token_kind::token_control;
  v.bos_id = (int32_t)v.tokens.size() - 2;
  v.eos_id = (int32_t)v.tokens.size() - 1;
  return v;
}

class pretok_golden : public testing::TestWithParam<std::string> {};

TEST_P(pretok_golden, splits_like_llama_cpp) {
  const json& g = golden().at("pretok");
  const auto texts = g.at("texts").get<std::vector<std::string>>();
  const auto tok = make_tokenizer(all_substring_vocab(texts, GetParam()));
  const json& want = g.at("pieces").at(GetParam());
  ASSERT_EQ(want.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    std::vector<std::string> pieces;
    for (int32_t id : tok->encode(texts[i], false, false)) pieces.push_back(tok->token_piece(id));
    EXPECT_EQ(pieces, want.at(i).get<std::vector<std::string>>()) << "text " << i << ": " << json(texts[i]).dump();
  }
}

INSTANTIATE_TEST_SUITE_P(pre, pretok_golden, testing::Values("default", "gpt-2", "llama-bpe", "qwen2", "smollm"),
                         [](const testing::TestParamInfo<std::string>& p) { return sanitize_name(p.param); });

TEST(tokenizer_bpe, unknown_pre_or_model_throws_naming_it) {
  tokenizer_vocab v = all_substring_vocab({"ab"}, "no-such-pre");
  try {
    make_tokenizer(v);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no-such-pre"), std::string::npos) << e.what();
  }
  v.pre = "gpt2";
  v.model = "wordpiece";
  try {
    make_tokenizer(v);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("wordpiece"), std::string::npos) << e.what();
  }
}

TEST(tokenizer_bpe, inconsistent_vocab_throws) {
  tokenizer_vocab v = all_substring_vocab({"ab"}, "gpt2");
  v.kinds.pop_back();
  EXPECT_THROW(make_tokenizer(v), Error);
  v = all_substring_vocab({"ab"}, "gpt2");
  v.eos_id = (int32_t)v.tokens.size();
  EXPECT_THROW(make_tokenizer(v), Error);
  v = all_substring_vocab({"ab"}, "gpt2");
  v.merges.push_back("nospace");
  EXPECT_THROW(make_tokenizer(v), Error);
}

// ---- SentencePiece ----------------------------------------------------------------------------

using test::spm_vocab_from_json;

class spm_golden : public testing::TestWithParam<int> {};

TEST_P(spm_golden, matches_llama_cpp) {
  const json& g = golden().at("spm");
  static const auto tok = make_tokenizer(spm_vocab_from_json(g));
  const json& c = g.at("cases").at(GetParam());
  const std::string text = c.at("text").get<std::string>();
  for (bool bos : {false, true}) {
    for (bool special : {false, true}) {
      const auto ours = tok->encode(text, bos && tok->vocab().add_bos, special);
      const auto want = golden_ids(c, bos, special);
      EXPECT_EQ(ours, want) << "bos=" << bos << " special=" << special << "\n ours: " << ids_to_string(ours)
                            << "\n want: " << ids_to_string(want);
    }
  }
  if (text.find("<|sep|>") == std::string::npos) {
    EXPECT_EQ(tok->decode(tok->encode(text, true, false)), text);
    EXPECT_EQ(tok->decode(tok->encode(text, false, true)), text);
  }
}

INSTANTIATE_TEST_SUITE_P(cases, spm_golden, testing::Range(0, (int)golden().at("spm").at("cases").size()),
                         [](const testing::TestParamInfo<int>& p) {
                           return sanitize_name(golden().at("spm").at("cases").at(p.param).at("name"));
                         });

// A hand-checked vocabulary: scores decide the merge order, not piece length.
TEST(tokenizer_spm, merges_by_score_with_byte_fallback) {
  tokenizer_vocab v;
  v.model = "llama";
  v.tokens = {"<unk>", "<s>", "</s>"};
  v.kinds = {token_kind::token_unknown, token_kind::token_control, token_kind::token_control};
  v.scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    v.tokens.push_back(name);
    v.kinds.push_back(token_kind::token_byte);
    v.scores.push_back(0);
  }
  const std::vector<std::pair<std::string, float>> pieces = {
      {"\xe2\x96\x81", -1}, {"a", -2},   {"b", -2},        {"c", -2},          {"\xe2\x96\x81" "a", -3},
      {"ab", -0.5f},        {"bc", -0.25f}, {"abc", -0.1f}, {"\xe2\x96\x81" "ab", -5}};
  const int32_t first = (int32_t)v.tokens.size();
  for (const auto& [t, s] : pieces) {
    v.tokens.push_back(t);
    v.kinds.push_back(token_kind::token_normal);
    v.scores.push_back(s);
  }
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  v.add_bos = true;
  v.add_space_prefix = true;
  const auto tok = make_tokenizer(v);
  auto id = [&](int k) { return first + k; };
  // "▁abc": bc (-0.25) beats ab (-0.5) and ▁a (-3); then a + bc = abc (-0.1); "▁abc" is no
  // piece, and the queued ▁a is stale since "a" grew. Result: ▁, abc.
  EXPECT_EQ(tok->encode("abc", false, false), (std::vector<int32_t>{id(0), id(7)}));
  // Without the prefix the text starts at "a": bc first, then a + bc = abc.
  v.add_space_prefix = false;
  const auto tok2 = make_tokenizer(v);
  EXPECT_EQ(tok2->encode("abc", false, false), (std::vector<int32_t>{id(7)}));
  // "ab": ab (-0.5) beats ▁a (-3); then ▁ + ab = ▁ab (-5).
  EXPECT_EQ(tok->encode("ab", true, false), (std::vector<int32_t>{1, id(8)}));
  // Characters outside the vocabulary are spelled as UTF-8 bytes: é = C3 A9.
  EXPECT_EQ(tok2->encode("\xc3\xa9", false, false), (std::vector<int32_t>{3 + 0xC3, 3 + 0xA9}));
  EXPECT_EQ(tok->decode(tok->encode("ab abc \xc3\xa9", true, false)), "ab abc \xc3\xa9");
  EXPECT_TRUE(tok->is_end_of_generation(2));
  EXPECT_FALSE(tok->is_end_of_generation(1));
}

// ---- unicode helpers --------------------------------------------------------------------------

TEST(unicode, categories_and_whitespace) {
  EXPECT_EQ(unicode_category('A'), ucat::ucat_letter);
  EXPECT_EQ(unicode_category(0x00E9), ucat::ucat_letter);    // é
  EXPECT_EQ(unicode_category(0x65E5), ucat::ucat_letter);    // 日
  EXPECT_EQ(unicode_category('7'), ucat::ucat_number);
  EXPECT_EQ(unicode_category(0x0663), ucat::ucat_number);    // Arabic-Indic three
  EXPECT_EQ(unicode_category(0x216B), ucat::ucat_number);    // Roman numeral twelve (Nl)
  EXPECT_EQ(unicode_category(0x00BD), ucat::ucat_number);    // ½ (No)
  EXPECT_EQ(unicode_category(0x0301), ucat::ucat_mark);
  EXPECT_EQ(unicode_category('!'), ucat::ucat_punctuation);
  EXPECT_EQ(unicode_category(0x2014), ucat::ucat_punctuation);  // em dash
  EXPECT_EQ(unicode_category('$'), ucat::ucat_symbol);
  EXPECT_EQ(unicode_category(0x1F600), ucat::ucat_symbol);   // 😀
  EXPECT_EQ(unicode_category(' '), ucat::ucat_separator);
  EXPECT_EQ(unicode_category('\n'), ucat::ucat_control);
  EXPECT_EQ(unicode_category(0x200B), ucat::ucat_control);   // zero-width space is Cf
  EXPECT_EQ(unicode_category(0x0378), ucat::ucat_undefined); // unassigned
  EXPECT_EQ(unicode_category(0x110000), ucat::ucat_undefined);
  for (uint32_t c : {0x09u, 0x0Au, 0x0Du, 0x20u, 0x85u, 0xA0u, 0x1680u, 0x2003u, 0x2028u, 0x3000u})
    EXPECT_TRUE(unicode_is_whitespace(c)) << std::hex << c;
  for (uint32_t c : {0x1Cu, 0x200Bu, 0x41u, 0xFEFFu}) EXPECT_FALSE(unicode_is_whitespace(c)) << std::hex << c;
  EXPECT_EQ(unicode_flags(0x3000), uflag_separator | uflag_whitespace);
  EXPECT_EQ(unicode_flags(0x1D7D8), uflag_number);  // mathematical double-struck zero, off the BMP table
  std::printf("[ unicode ] tables from Unicode %s\n", unicode_version());
}

TEST(unicode, utf8_round_trip_and_invalid_bytes) {
  for (uint32_t c : {0x0u, 0x7Fu, 0x80u, 0x7FFu, 0x800u, 0xFFFFu, 0x10000u, 0x10FFFFu}) {
    const std::string s = utf8_encode(c);
    size_t pos = 0;
    EXPECT_EQ(utf8_decode(s, pos), c);
    EXPECT_EQ(pos, s.size());
  }
  const std::string bad = "\xff\xc3(\xf4\x90\x80\x80";
  std::string back;
  for (size_t pos = 0; pos < bad.size();) {
    const uint32_t c = utf8_decode(bad, pos);
    utf8_append(back, c);
  }
  EXPECT_EQ(back, bad);
}

TEST(unicode, gpt2_byte_alphabet_is_a_bijection) {
  std::set<uint32_t> seen;
  for (int b = 0; b < 256; ++b) {
    const uint32_t c = gpt2_byte_to_cpt((uint8_t)b);
    EXPECT_TRUE(seen.insert(c).second);
    EXPECT_EQ(gpt2_cpt_to_byte(c), b);
  }
  EXPECT_EQ(gpt2_byte_to_cpt(' '), 0x120u);  // Ġ
  EXPECT_EQ(gpt2_byte_to_cpt('\n'), 0x10Au);  // Ċ
  EXPECT_EQ(gpt2_byte_to_cpt('A'), (uint32_t)'A');
  EXPECT_EQ(gpt2_cpt_to_byte(0x3000), -1);
}

}  // namespace
}  // namespace xctx
