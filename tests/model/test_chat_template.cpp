// Chat templates against jinja2 renderings (tests/data/tokenizer_golden.json "chat", made by
// tests/data/make_tokenizer_golden.py): ChatML from the SmolLM2 GGUF's own template, Llama 2 and
// Llama 3 from Meta's published templates.
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "test_util.h"

namespace xctx {
namespace {

using json = nlohmann::json;

const json& chat_golden() {
  static const json j = [] {
    const std::string path = test::data_path("tokenizer_golden.json");
    std::ifstream f(path);
    if (!f) throw Error("cannot open " + path + " (run tests/data/make_tokenizer_golden.py)");
    return json::parse(f).at("chat");
  }();
  return j;
}

std::vector<chat_message> messages_of(const json& c) {
  std::vector<chat_message> msgs;
  for (const json& m : c.at("messages")) msgs.push_back({m.at("role"), m.at("content")});
  return msgs;
}

class chat_render : public testing::TestWithParam<int> {};

TEST_P(chat_render, matches_jinja) {
  const json& c = chat_golden().at("cases").at(GetParam());
  const auto msgs = messages_of(c);
  const std::pair<const char*, chat_style> styles[] = {
      {"chatml", chat_style::chat_chatml}, {"llama2", chat_style::chat_llama2}, {"llama3", chat_style::chat_llama3}};
  for (const auto& [name, style] : styles) {
    for (bool gen : {false, true}) {
      const std::string key = std::string(name) + (gen ? "_gen1" : "_gen0");
      EXPECT_EQ(apply_chat_template(style, msgs, gen), c.at("rendered").at(key).get<std::string>()) << key;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(cases, chat_render, testing::Range(0, (int)chat_golden().at("cases").size()),
                         [](const testing::TestParamInfo<int>& p) {
                           return chat_golden().at("cases").at(p.param).at("name").get<std::string>();
                         });

// The same expectation written out by hand, independent of the golden file.
TEST(chat_template, chatml_adds_smollm_default_system_prompt) {
  const std::string got = apply_chat_template(chat_style::chat_chatml, {{"user", "Hi"}}, true);
  EXPECT_EQ(got,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(apply_chat_template(chat_style::chat_chatml, {{"system", "S"}, {"user", "U"}}, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
  EXPECT_EQ(apply_chat_template(chat_style::chat_llama3, {{"user", " U "}}, true),
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(apply_chat_template(chat_style::chat_llama2, {{"system", "S"}, {"user", "U"}}, true),
            "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST]");
}

TEST(chat_template, detects_style_from_jinja) {
  const json& g = chat_golden();
  EXPECT_EQ(detect_chat_style(g.at("smollm_template")), chat_style::chat_chatml);
  EXPECT_EQ(detect_chat_style(g.at("llama2_template")), chat_style::chat_llama2);
  EXPECT_EQ(detect_chat_style(g.at("llama3_template")), chat_style::chat_llama3);
  EXPECT_EQ(detect_chat_style(""), chat_style::chat_chatml);
  EXPECT_THROW(detect_chat_style("{% for m in messages %}{{ m.content }}{% endfor %}"), Error);
}

TEST(chat_template, rejects_unknown_roles) {
  EXPECT_THROW(apply_chat_template(chat_style::chat_chatml, {{"tool", "x"}}), Error);
  EXPECT_THROW(apply_chat_template(chat_style::chat_llama2, {{"user", "a"}, {"system", "late"}}), Error);
}

// End to end on the real file: its template is ChatML, and the rendered prompt tokenizes with
// the turn markers as single control tokens.
TEST(chat_template, smollm_gguf_prompt_tokenizes_with_control_tokens) {
  XCTX_REQUIRE_MODEL(path);
  const auto file = gguf_file::open(path);
  const chat_style style = detect_chat_style(file->get_string("tokenizer.chat_template", ""));
  EXPECT_EQ(style, chat_style::chat_chatml);
  const auto tok = make_tokenizer(read_gguf_vocab(*file));
  const std::string prompt = apply_chat_template(style, {{"user", "Hello!"}}, true);
  const auto ids = tok->encode(prompt, tok->vocab().add_bos, true);
  const int32_t im_start = tok->find_token("<|im_start|>"), im_end = tok->find_token("<|im_end|>");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), im_start), 3);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), im_end), 2);
  EXPECT_EQ(ids.front(), im_start);
  EXPECT_EQ(tok->decode(ids, true), prompt);
}

}  // namespace
}  // namespace xctx
