#include <cmath>
#include <memory>
#include <set>
#include <string>

#include "common/error.h"
#include "model/corpus.h"
#include "coordinator/jobs/passkey.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "test_util.h"

namespace xctx {
namespace {

constexpr int64_t kContext = 4096;
constexpr uint64_t kSeed = 7;
constexpr const char* kQuestion = " What is the pass key? The pass key is";
// Where the key may sit relative to depth × n_tokens: the non-filler text (intro, needle,
// question, template) shifts it by up to its own length, and the key sits on the sentence
// boundary nearest the target, up to half a sentence away. Austen's longest sentence has 237
// words (~300 tokens); the classic filler's have at most 6 tokens.
constexpr int64_t kHalfSentenceClassic = 3;
constexpr int64_t kHalfSentenceAusten = 150;

struct model_tok {
  std::unique_ptr<tokenizer> tok;
  std::string chat_template;
};
const model_tok& load_tokenizer(const std::string& path) {
  static model_tok t = [&] {
    auto f = gguf_file::open(path);
    return model_tok{make_tokenizer(read_gguf_vocab(*f)), f->get_string("tokenizer.chat_template", "")};
  }();
  return t;
}

struct prompt_case {
  std::string filler;
  double depth;
  bool chat;
};
void PrintTo(const prompt_case& c, std::ostream* os) {
  *os << c.filler << " depth " << c.depth << (c.chat ? " chat" : "");
}
std::string case_name(const testing::TestParamInfo<prompt_case>& info) {
  return info.param.filler + "_depth" + std::to_string((int)std::lround(info.param.depth * 100)) +
         (info.param.chat ? "_chat" : "");
}

class passkey_prompt_test : public testing::TestWithParam<prompt_case> {};

TEST_P(passkey_prompt_test, key_at_depth_and_length_on_target) {
  XCTX_REQUIRE_MODEL(model_path);
  const prompt_case& c = GetParam();
  if (c.filler == "austen" && !std::filesystem::exists(std::string(kAustenDataDir) + "/Rdata.rdb")) {
    if (std::getenv("CI")) FAIL() << "r-cran-janeaustenr missing under CI";
    GTEST_SKIP() << "r-cran-janeaustenr not installed (run launch/install-deps)";
  }
  const model_tok& mt = load_tokenizer(model_path);
  const int key = passkey_for_seed(kSeed);
  SCOPED_TRACE("seed " + std::to_string(kSeed) + " key " + std::to_string(key));
  const passkey_prompt p = make_passkey_prompt(*mt.tok, kContext, c.depth, key, c.filler, kSeed, c.chat, mt.chat_template);
  const int64_t n = (int64_t)p.ids.size();

  EXPECT_LE(std::llabs(n - kContext), passkey_token_tolerance(kContext)) << "tokens " << n;
  EXPECT_EQ(p.key, key);

  // context ‖ suffix is the prompt, and the suffix is the question (plus the template's tail).
  std::vector<int32_t> joined = p.context_ids;
  joined.insert(joined.end(), p.suffix_ids.begin(), p.suffix_ids.end());
  EXPECT_EQ(joined, p.ids);
  const std::string suffix = mt.tok->decode(p.suffix_ids, /*render_special=*/true);
  if (c.chat) {
    EXPECT_EQ(suffix.rfind(kQuestion, 0), 0u) << suffix;
    EXPECT_NE(suffix.find("<|im_start|>assistant\n"), std::string::npos) << suffix;
    EXPECT_EQ(mt.tok->decode(p.ids, true), p.text);
  } else {
    EXPECT_EQ(suffix, kQuestion);
    EXPECT_EQ(mt.tok->decode(p.ids), p.text);
  }

  // The key's first token starts the digits.
  ASSERT_LT(p.key_token + 6, n);
  const std::vector<int32_t> key_ids(p.ids.begin() + p.key_token, p.ids.begin() + p.key_token + 6);
  std::string key_text = mt.tok->decode(key_ids);
  key_text.erase(0, key_text.find_first_not_of(' '));
  EXPECT_EQ(key_text.rfind(std::to_string(key), 0), 0u) << key_text;
  const std::string before = mt.tok->decode(std::vector<int32_t>(p.ids.begin(), p.ids.begin() + p.key_token));
  EXPECT_EQ(before.find(std::to_string(key)), std::string::npos) << "key appears before key_token";

  // Depth: fraction of the prompt before the key.
  const int64_t n_fixed = n - p.filler_tokens;
  const int64_t slack = n_fixed + (c.filler == "austen" ? kHalfSentenceAusten : kHalfSentenceClassic);
  const double where = (double)p.key_token / (double)n;
  EXPECT_NEAR(where, c.depth, (double)slack / (double)n) << "key at token " << p.key_token << " of " << n;
  EXPECT_GT(p.filler_tokens, n * 9 / 10) << "the filler should dominate the prompt";
}

INSTANTIATE_TEST_SUITE_P(
    passkey, passkey_prompt_test,
    testing::Values(prompt_case{"classic", 0.0, false}, prompt_case{"classic", 0.5, false},
                    prompt_case{"classic", 1.0, false}, prompt_case{"austen", 0.0, false},
                    prompt_case{"austen", 0.5, false}, prompt_case{"austen", 1.0, false},
                    prompt_case{"classic", 0.5, true}, prompt_case{"austen", 0.25, true}),
    case_name);

TEST(passkey, classic_depth_is_tight) {
  // With 6-token sentences the key lands within a sentence of depth × filler.
  XCTX_REQUIRE_MODEL(model_path);
  const model_tok& mt = load_tokenizer(model_path);
  for (double depth : {0.0, 0.3, 0.5, 1.0}) {
    const passkey_prompt p = make_passkey_prompt(*mt.tok, 2048, depth, 12345, "classic", kSeed);
    const int64_t intro = p.key_token - (int64_t)std::lround(depth * (double)p.filler_tokens);
    const passkey_prompt p0 = make_passkey_prompt(*mt.tok, 2048, 0.0, 12345, "classic", kSeed);
    EXPECT_LE(std::llabs(intro - p0.key_token), kHalfSentenceClassic + 1) << "depth " << depth;
  }
}

TEST(passkey, prompt_is_deterministic_and_seeded) {
  XCTX_REQUIRE_MODEL(model_path);
  const model_tok& mt = load_tokenizer(model_path);
  const passkey_prompt a = make_passkey_prompt(*mt.tok, 1024, 0.5, 11111, "classic", 1);
  const passkey_prompt b = make_passkey_prompt(*mt.tok, 1024, 0.5, 11111, "classic", 1);
  EXPECT_EQ(a.ids, b.ids);
  const passkey_prompt c = make_passkey_prompt(*mt.tok, 1024, 0.5, 22222, "classic", 1);
  EXPECT_NE(a.ids, c.ids);
  EXPECT_NE(c.text.find("The pass key is 22222. Remember it. 22222 is the pass key."), std::string::npos);
  if (std::filesystem::exists(std::string(kAustenDataDir) + "/Rdata.rdb")) {
    const passkey_prompt x = make_passkey_prompt(*mt.tok, 1024, 0.5, 11111, "austen", 1);
    const passkey_prompt y = make_passkey_prompt(*mt.tok, 1024, 0.5, 11111, "austen", 2);
    EXPECT_NE(x.text, y.text) << "the seed picks where in the novels the filler starts";
  }
}

TEST(passkey, too_small_context_is_an_error) {
  XCTX_REQUIRE_MODEL(model_path);
  const model_tok& mt = load_tokenizer(model_path);
  EXPECT_THROW(make_passkey_prompt(*mt.tok, 20, 0.5, 12345, "classic", 1), Error);
  EXPECT_THROW(make_passkey_prompt(*mt.tok, 1024, 1.5, 12345, "classic", 1), Error);
  EXPECT_THROW(make_passkey_prompt(*mt.tok, 1024, 0.5, 1234, "classic", 1), Error);
  EXPECT_THROW(make_passkey_prompt(*mt.tok, 1024, 0.5, 12345, "bible", 1), Error);
}

TEST(passkey, keys_differ_across_seeds) {
  std::set<int> keys;
  for (uint64_t seed = 1; seed <= 50; ++seed) {
    const int k = passkey_for_seed(seed);
    EXPECT_GE(k, 10000);
    EXPECT_LE(k, 99999);
    keys.insert(k);
  }
  // 50 draws from 90000 values: a collision has probability ~1.4%, two ~0.01%.
  EXPECT_GE(keys.size(), 49u);
  EXPECT_EQ(passkey_for_seed(3), passkey_for_seed(3));
}

TEST(passkey, answer_extraction) {
  EXPECT_EQ(extract_passkey(" 81528. The"), 81528);
  EXPECT_EQ(extract_passkey("81528"), 81528);
  EXPECT_EQ(extract_passkey(" is 1234, no: 56789."), 56789);  // a 4-digit run is skipped
  EXPECT_EQ(extract_passkey(" 123456"), -1);                  // six digits is not the key
  EXPECT_EQ(extract_passkey(" the pass key."), -1);
  EXPECT_EQ(extract_passkey(""), -1);
  EXPECT_EQ(extract_passkey("x12345y67890"), 12345);
}

TEST(passkey, answer_complete_only_when_more_tokens_cannot_change_it) {
  EXPECT_FALSE(passkey_answer_complete(" the pass key. The pass key is"));
  EXPECT_FALSE(passkey_answer_complete(" 8152"));    // still growing
  EXPECT_FALSE(passkey_answer_complete(" 81528"));   // a sixth digit could follow
  EXPECT_TRUE(passkey_answer_complete(" 81528."));
  EXPECT_FALSE(passkey_answer_complete(" 123456 "));  // six digits: not a key, keep decoding
  EXPECT_TRUE(passkey_answer_complete(" 123456, no, 65432 "));
  for (const char* a : {" 81528.", "x12345y", " is 1234, no: 56789."})
    EXPECT_NE(extract_passkey(a), -1) << a;  // complete implies something was extracted
}

TEST(passkey, wilson_interval_matches_published_values) {
  // Reference values (Wilson 1927; e.g. Newcombe 1998, Table I): 0/10, 10/10, 5/10, 81/263 at z = 1.96.
  const auto close = [](std::pair<double, double> got, double lo, double hi) {
    EXPECT_NEAR(got.first, lo, 5e-4);
    EXPECT_NEAR(got.second, hi, 5e-4);
  };
  close(wilson_interval(0, 10), 0.0, 0.2775);
  close(wilson_interval(10, 10), 0.7225, 1.0);
  close(wilson_interval(5, 10), 0.2366, 0.7634);
  close(wilson_interval(81, 263), 0.2553, 0.3662);
  close(wilson_interval(0, 0), 0.0, 1.0);  // no trials: no information
}

TEST(passkey, depth_parsing) {
  EXPECT_EQ(parse_depths("0,0.25,1"), (std::vector<double>{0.0, 0.25, 1.0}));
  EXPECT_EQ(parse_depths("0.5"), (std::vector<double>{0.5}));
  EXPECT_THROW(parse_depths("0,,1"), Error);
  EXPECT_THROW(parse_depths("0,1.5"), Error);
  EXPECT_THROW(parse_depths("half"), Error);
  EXPECT_THROW(parse_depths("0.5x"), Error);
}

TEST(passkey, tolerance_is_one_percent_or_32) {
  EXPECT_EQ(passkey_token_tolerance(1024), 32);
  EXPECT_EQ(passkey_token_tolerance(3200), 32);
  EXPECT_EQ(passkey_token_tolerance(8192), 82);
  EXPECT_EQ(passkey_token_tolerance(131072), 1311);
}

}  // namespace
}  // namespace xctx
