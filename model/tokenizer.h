// Tokenizers built from a model file's vocabulary: byte-level BPE (GGUF `gpt2` model, merges,
// pre-tokenizer named by tokenizer.ggml.pre) and SentencePiece-style (GGUF `llama` model, scores).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace xctx {

// GGUF tokenizer.ggml.token_type values.
enum class token_kind : int32_t {
  token_normal = 1,
  token_unknown = 2,
  token_control = 3,
  token_user_defined = 4,
  token_unused = 5,
  token_byte = 6,
};

struct tokenizer_vocab {
  std::string model;  // "gpt2" (byte-level BPE) | "llama" (SentencePiece)
  std::string pre;    // pre-tokenizer name, e.g. "smollm", "llama-bpe", "default"
  std::vector<std::string> tokens;
  std::vector<float> scores;          // SentencePiece piece scores (may be empty for BPE)
  std::vector<token_kind> kinds;      // [n_vocab]
  std::vector<std::string> merges;    // "a b" pairs, rank = index (BPE)
  int32_t bos_id = -1, eos_id = -1, unk_id = -1, pad_id = -1;
  bool add_bos = false;
  bool add_eos = false;
  bool add_space_prefix = false;      // SentencePiece: prepend "▁" to the text
};

class tokenizer {
 public:
  virtual ~tokenizer() = default;
  // `parse_special`: text like "<|im_start|>" becomes the control token rather than characters.
  // `add_bos` prepends BOS unconditionally (pass vocab().add_bos for the model's own choice, which
  // is what llama.cpp's add_special does); EOS is never appended.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const = 0;
  // Exact inverse on normal text; control tokens render as their text only if `render_special`.
  virtual std::string decode(const std::vector<int32_t>& ids, bool render_special = false) const = 0;
  // The bytes one token contributes (for streaming; may be an incomplete UTF-8 sequence).
  virtual std::string token_piece(int32_t id, bool render_special = false) const = 0;
  virtual const tokenizer_vocab& vocab() const = 0;
  int32_t n_vocab() const { return (int32_t)vocab().tokens.size(); }
  bool is_end_of_generation(int32_t id) const;  // eos, or a control token like <|im_end|>
  int32_t find_token(std::string_view text) const;  // -1 if absent
};

class gguf_file;
tokenizer_vocab read_gguf_vocab(const gguf_file& file);
std::unique_ptr<tokenizer> make_tokenizer(const tokenizer_vocab& vocab);  // throws on unknown model/pre

// Chat templates: renders messages into the prompt text the model was trained on.
struct chat_message {
  std::string role;  // system | user | assistant
  std::string content;
};
enum class chat_style : uint8_t { chat_chatml, chat_llama2, chat_llama3 };
// Picks the style from the GGUF tokenizer.chat_template string (ChatML when it uses <|im_start|>).
chat_style detect_chat_style(const std::string& jinja_template);
// With add_generation_prompt, ends with the assistant header so the model answers next.
// ChatML adds SmolLM2's default system prompt when the first message is not a system message,
// as the model's own template does.
std::string apply_chat_template(chat_style style, const std::vector<chat_message>& messages,
                                bool add_generation_prompt = true);

}  // namespace xctx
