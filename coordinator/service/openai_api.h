// The OpenAI-compatible request and response shapes of the HTTP front (docs/service.md):
// request bodies of /v1/completions and /v1/chat/completions decoded into a generate job, and the
// answers, stream chunks and errors encoded as OpenAI's clients expect. Pure functions of their
// inputs (no server, no model), so they are tested and fuzzed alone.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include "xctx_types.h"

namespace xctx {

// A request the front refuses, with the HTTP status and OpenAI's error type, param and code.
struct api_error : std::runtime_error {
  api_error(int status, std::string type, std::string message, std::string param = "", std::string code = "")
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;
};
// The Thrift surface's refusals in HTTP terms (QUEUE_FULL -> 429, TOO_LARGE -> 413, ...).
api_error api_error_of(const rpc::RequestError& e);
// {"error": {"message", "type", "param", "code"}}
nlohmann::json error_body(const api_error& e);

enum class api_endpoint { completions, chat_completions };

struct openai_request {
  api_endpoint endpoint = api_endpoint::completions;
  rpc::GenerateJob job;       // chat: job.chat with job.messages
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  std::string model;           // as the client named it (any name is served by the one model)
  bool max_tokens_given = false;  // chat: without it the answer may use what is left of the context
};

// Decodes a request body. OpenAI's defaults (temperature 1, max_tokens 16 for completions; chat:
// max_tokens up to default_max_tokens) and ranges; llama.cpp/vLLM-style extras top_k, min_p,
// repetition_penalty, repeat_last_n, no_repeat_ngram. Unknown fields are ignored as OpenAI's
// clients send extra ones; what xctx does not do (n > 1, logprobs, echo, suffix, logit_bias,
// tools, token-id prompts) is refused with 400 naming the field, never silently dropped.
openai_request parse_openai_request(const std::string& body, api_endpoint endpoint, int default_max_tokens);

// What an answer needs beside the job's result.
struct answer_context {
  std::string id;      // "cmpl-<job>" / "chatcmpl-<job>"
  std::string model;   // the served model's id
  int64_t created = 0; // Unix seconds
  int64_t job_id = 0;
  std::string cache, attention;  // xctx's extension object
};
nlohmann::json completion_body(api_endpoint endpoint, const answer_context& c, const rpc::JobResult& r);
// One server-sent-events chunk: a text piece, or (finish_reason non-empty) the closing chunk.
nlohmann::json stream_chunk(api_endpoint endpoint, const answer_context& c, const std::string& piece,
                            const std::string& finish_reason, bool first);
nlohmann::json usage_chunk(api_endpoint endpoint, const answer_context& c, const rpc::JobResult& r);
nlohmann::json usage_of(const rpc::JobResult& r);
// One server-sent event carrying j: "data: <j on one line>\n\n" (JSON escapes every newline, so
// the payload can never end the event early; invalid UTF-8 in j is replaced, not thrown on).
std::string sse_event(const nlohmann::json& j);

}  // namespace xctx
