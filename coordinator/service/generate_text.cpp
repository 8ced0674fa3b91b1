#include "coordinator/service/generate_text.h"

#include <algorithm>

#include "common/error.h"

namespace xctx {

std::vector<int32_t> generate_prompt_ids(const tokenizer& tok, const std::string& chat_template,
                                         const rpc::GenerateJob& g) {
  if (!g.chat) return tok.encode(g.prompt, tok.vocab().add_bos, false);
  std::vector<chat_message> msgs;
  if (!g.messages.empty()) {
    for (const rpc::ChatMessage& m : g.messages) msgs.push_back({m.role, m.content});
  } else {
    if (!g.system.empty()) msgs.push_back({"system", g.system});
    msgs.push_back({"user", g.prompt});
  }
  return tok.encode(apply_chat_template(detect_chat_style(chat_template), msgs, true), tok.vocab().add_bos, true);
}

size_t utf8_complete_prefix(const std::string& s) {
  // Walk back over at most 3 continuation bytes to the lead byte of the last character.
  size_t i = s.size(), back = 0;
  while (i > 0 && back < 4 && ((unsigned char)s[i - 1] & 0xC0) == 0x80) --i, ++back;
  if (i == 0) return s.size();  // no lead byte in reach: not UTF-8 we can mend; send as is
  const unsigned char lead = (unsigned char)s[i - 1];
  const size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  return back + 1 >= need ? s.size() : i - 1;
}

text_stream::text_stream(const tokenizer& tok, std::vector<std::string> stops) : tok_(tok) {
  for (std::string& s : stops)
    if (!s.empty()) stops_.push_back(std::move(s));
}

bool text_stream::push(int32_t id) {
  XCTX_CHECK(!finished_ && stop_at_ == std::string::npos, "text_stream: a token after the end");
  ids_.push_back(id);
  const std::string now = tok_.decode(ids_);
  // A later token can re-render earlier bytes (rare); what was already sent stays sent.
  text_ = now;
  size_t longest = 0;
  for (const std::string& s : stops_) longest = std::max(longest, s.size());
  const size_t from = ready_ >= longest ? ready_ - longest + 1 : 0;
  for (const std::string& s : stops_) {
    const size_t at = text_.find(s, std::min(from, text_.size()));
    if (at != std::string::npos && at < stop_at_) stop_at_ = at;
  }
  if (stop_at_ != std::string::npos) {
    text_.resize(stop_at_);
    ready_ = std::max(sent_, utf8_complete_prefix(text_));
    return true;
  }
  // Hold back the longest tail that could still grow into a stop string.
  size_t hold = 0;
  for (const std::string& s : stops_)
    for (size_t k = std::min(s.size() - 1, text_.size()); k > hold; --k)
      if (text_.compare(text_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  ready_ = std::max(sent_, std::min(utf8_complete_prefix(text_), text_.size() - hold));
  return false;
}

void text_stream::finish() {
  finished_ = true;
  ready_ = std::max(sent_, text_.size());
}

std::string text_stream::take_ready() {
  if (ready_ <= sent_ || sent_ >= text_.size()) return {};
  std::string piece = text_.substr(sent_, std::min(ready_, text_.size()) - sent_);
  sent_ = std::min(ready_, text_.size());
  return piece;
}

}  // namespace xctx
