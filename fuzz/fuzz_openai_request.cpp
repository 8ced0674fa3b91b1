// The HTTP front's request decoding (coordinator/service/openai_api.cpp): the first byte picks the
// endpoint (completions or chat), the rest is the body as parse_openai_request reads it. An
// accepted request is checked against the contract the front relies on (fields in OpenAI's
// ranges, at most 4 non-empty stop strings, messages with known roles), then answered: the
// answer body, each stream chunk and its server-sent event are encoded with the request's text
// as the output, and every event must be one "data: " line ending in a blank line.
//
// Documented outcome: api_error (status 400) for every refused body; nothing else may escape.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "coordinator/service/openai_api.h"

using namespace xctx;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

void check_event(const std::string& e) {
  require(e.rfind("data: ", 0) == 0);
  require(e.size() >= 8 && e.compare(e.size() - 2, 2, "\n\n") == 0);
  require(e.find('\n') == e.size() - 2);  // the payload holds no raw newline
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > (1 << 16)) return 0;
  const api_endpoint ep = (data[0] & 1) ? api_endpoint::chat_completions : api_endpoint::completions;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  openai_request r;
  try {
    r = parse_openai_request(body, ep, 100);
  } catch (const api_error& e) {
    require(e.status == 400);
    return 0;
  }
  const rpc::GenerateJob& g = r.job;
  require(g.max_tokens >= 1);
  require(g.temperature >= 0 && g.temperature <= 2);
  require(g.top_p > 0 && g.top_p <= 1);
  require(g.stop.size() <= 4);
  for (const std::string& s : g.stop) require(!s.empty());
  if (ep == api_endpoint::chat_completions) {
    require(g.chat && !g.messages.empty());
    for (const rpc::ChatMessage& m : g.messages)
      require(m.role == "system" || m.role == "user" || m.role == "assistant");
  } else {
    require(!g.prompt.empty());
  }
  // Answer with the request's own text as the output: arbitrary bytes, invalid UTF-8 included.
  answer_context c{"cmpl-1", r.model, 0, 1, "fp16", "full"};
  rpc::JobResult res;
  res.text = ep == api_endpoint::completions ? g.prompt : g.messages.back().content;
  res.finish_reason = "stop";
  check_event(sse_event(completion_body(ep, c, res)));
  check_event(sse_event(stream_chunk(ep, c, res.text, "", true)));
  check_event(sse_event(stream_chunk(ep, c, "", "length", false)));
  check_event(sse_event(usage_chunk(ep, c, res)));
  return 0;
}
