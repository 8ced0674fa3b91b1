// Chat templates for the three prompt formats we support, written out by hand instead of
// running the GGUF's Jinja: ChatML (SmolLM2, Qwen), Llama 2 [INST] and Llama 3 headers.
//
// The rendered text holds special tokens as text (<|im_start|>, <|eot_id|>, ...) and must be
// encoded with parse_special. The sequence-initial BOS is left to the tokenizer (encode's
// add_bos with vocab().add_bos), so it is not written here.
#include <string_view>

#include "common/error.h"
#include "model/tokenizer.h"

namespace xctx {

namespace {

// SmolLM2-Instruct's template adds this system turn when the conversation does not open with one.
constexpr std::string_view k_smollm_default_system =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

std::string_view trim(std::string_view s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

void check_role(const chat_message& m, size_t i) {
  XCTX_CHECK(m.role == "system" || m.role == "user" || m.role == "assistant", "chat message ", i, " has role '",
             m.role, "', expected system, user or assistant");
}

// {% if loop.first and messages[0]['role'] != 'system' %}<default system turn>{% endif %}
// <|im_start|>{role}\n{content}<|im_end|>\n ... {% if add_generation_prompt %}<|im_start|>assistant\n
std::string render_chatml(const std::vector<chat_message>& msgs, bool add_generation_prompt) {
  std::string s;
  if (!msgs.empty() && msgs[0].role != "system") {
    s += "<|im_start|>system\n";
    s += k_smollm_default_system;
    s += "<|im_end|>\n";
  }
  for (const chat_message& m : msgs) {
    s += "<|im_start|>";
    s += m.role;
    s += "\n";
    s += m.content;
    s += "<|im_end|>\n";
  }
  if (add_generation_prompt) s += "<|im_start|>assistant\n";
  return s;
}

// Meta's Llama-2-chat format: the system prompt is wrapped in <<SYS>> at the head of the first
// turn; each later user turn opens with BOS, each assistant reply closes with EOS. A turn's
// content (with the <<SYS>> block) is stripped as a whole. The prompt ends with [/INST], so
// there is no separate generation prompt.
std::string render_llama2(const std::vector<chat_message>& msgs) {
  std::string s;
  size_t first = 0;
  if (!msgs.empty() && msgs[0].role == "system") first = 1;
  for (size_t i = first; i < msgs.size(); ++i) {
    const chat_message& m = msgs[i];
    XCTX_CHECK(m.role != "system", "chat message ", i, ": the llama2 format takes a system message only first");
    std::string content;
    if (i == first && first == 1) content = "<<SYS>>\n" + msgs[0].content + "\n<</SYS>>\n\n";
    content += m.content;
    if (m.role == "user") {
      if (i != first) s += "<s>";
      s += "[INST] ";
      s += trim(content);
      s += " [/INST]";
    } else {
      s += " ";
      s += trim(content);
      s += " </s>";
    }
  }
  return s;
}

// <|start_header_id|>{role}<|end_header_id|>\n\n{content | trim}<|eot_id|> ...
std::string render_llama3(const std::vector<chat_message>& msgs, bool add_generation_prompt) {
  std::string s;
  for (const chat_message& m : msgs) {
    s += "<|start_header_id|>";
    s += m.role;
    s += "<|end_header_id|>\n\n";
    s += trim(m.content);
    s += "<|eot_id|>";
  }
  if (add_generation_prompt) s += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return s;
}

}  // namespace

chat_style detect_chat_style(const std::string& jinja_template) {
  // Files without a template get ChatML, as llama.cpp does.
  if (jinja_template.empty() || jinja_template.find("<|im_start|>") != std::string::npos)
    return chat_style::chat_chatml;
  if (jinja_template.find("<|start_header_id|>") != std::string::npos) return chat_style::chat_llama3;
  if (jinja_template.find("[INST]") != std::string::npos) return chat_style::chat_llama2;
  fail("unrecognised tokenizer.chat_template (supported: ChatML <|im_start|>, Llama 2 [INST], Llama 3 "
       "<|start_header_id|>): \"",
       jinja_template.substr(0, 120), jinja_template.size() > 120 ? "...\"" : "\"");
}

std::string apply_chat_template(chat_style style, const std::vector<chat_message>& messages,
                                bool add_generation_prompt) {
  for (size_t i = 0; i < messages.size(); ++i) check_role(messages[i], i);
  switch (style) {
    case chat_style::chat_chatml: return render_chatml(messages, add_generation_prompt);
    case chat_style::chat_llama2: return render_llama2(messages);
    case chat_style::chat_llama3: return render_llama3(messages, add_generation_prompt);
  }
  fail("unknown chat style ", (int)style);
}

}  // namespace xctx
