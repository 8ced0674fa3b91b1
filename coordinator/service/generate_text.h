// A generate job's prompt as token ids and its output as text that can be streamed: what the
// Thrift job loop and the HTTP front both need, so a prompt is tokenized (and its length checked)
// the same way on either surface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/tokenizer.h"
#include "xctx_types.h"

namespace xctx {

// The prompt the model reads: the job's text, or with chat on its messages (or system + prompt)
// rendered by the model's chat template with the assistant header last.
std::vector<int32_t> generate_prompt_ids(const tokenizer& tok, const std::string& chat_template,
                                         const rpc::GenerateJob& job);

// Generated ids in, text out, in pieces that never split a UTF-8 character or show part of a stop
// string: text that might begin a stop string is held back until the next token settles it. The
// whole output is decoded again on each token (byte-level BPE can merge across tokens); outputs
// are bounded by the service's --max-output-tokens, so that costs O(output²) bytes at most.
class text_stream {
 public:
  text_stream(const tokenizer& tok, std::vector<std::string> stops);
  // Adds a token; true when the text now holds a stop string (the generation should end).
  bool push(int32_t id);
  // Text that became final since the last call (empty when nothing did).
  std::string take_ready();
  // Everything after the last token: the text, cut before the stop string when one ended it.
  // take_ready() afterwards returns what was still held back.
  void finish();
  const std::string& text() const { return text_; }
  bool stopped_by_string() const { return stop_at_ != std::string::npos; }

 private:
  const tokenizer& tok_;
  std::vector<std::string> stops_;
  std::vector<int32_t> ids_;
  std::string text_;          // decoded output (cut at the stop string once one is found)
  size_t sent_ = 0;           // bytes handed out by take_ready
  size_t ready_ = 0;          // bytes that are final
  size_t stop_at_ = std::string::npos;
  bool finished_ = false;
};

// Bytes of s that end on a whole UTF-8 character (an incomplete sequence at the end is left out).
size_t utf8_complete_prefix(const std::string& s);

}  // namespace xctx
