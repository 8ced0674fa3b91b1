#include "coordinator/service/openai_api.h"

#include <cmath>

namespace xctx {
namespace {

using json = nlohmann::json;

api_error bad(const std::string& message, const std::string& param = "") {
  return api_error(400, "invalid_request_error", message, param);
}

const char* type_name(const json& v) { return v.type_name(); }

double number(const json& body, const char* key, double fallback, double lo, double hi) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_number()) throw bad(std::string(key) + " must be a number, got " + type_name(*it), key);
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < lo || v > hi)
    throw bad(std::string(key) + " must be in [" + json(lo).dump() + ", " + json(hi).dump() + "], got " + json(v).dump(),
              key);
  return v;
}

int64_t integer(const json& body, const char* key, int64_t fallback, int64_t lo, int64_t hi) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_number_integer() && !(it->is_number_float() && std::floor(it->get<double>()) == it->get<double>()))
    throw bad(std::string(key) + " must be an integer, got " + it->dump(), key);
  const double d = it->get<double>();
  if (d < (double)lo || d > (double)hi)
    throw bad(std::string(key) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + it->dump(),
              key);
  return it->is_number_integer() ? it->get<int64_t>() : (int64_t)d;
}

bool flag(const json& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_boolean()) throw bad(std::string(key) + " must be true or false, got " + it->dump(), key);
  return it->get<bool>();
}

// Fields xctx does not implement: refused when set to anything but their neutral value.
void refuse_unsupported(const json& body, api_endpoint ep) {
  const auto set = [&](const char* k) {
    const auto it = body.find(k);
    return it != body.end() && !it->is_null();
  };
  if (set("n") && !(body["n"].is_number_integer() && body["n"].get<int64_t>() == 1))
    throw bad("n must be 1: one choice per request", "n");
  if (set("best_of") && !(body["best_of"].is_number_integer() && body["best_of"].get<int64_t>() == 1))
    throw bad("best_of must be 1", "best_of");
  if (set("logprobs") && !(body["logprobs"].is_boolean() && !body["logprobs"].get<bool>()))
    throw bad("logprobs are not supported by this service", "logprobs");
  if (set("top_logprobs")) throw bad("top_logprobs are not supported by this service", "top_logprobs");
  if (set("echo") && !(body["echo"].is_boolean() && !body["echo"].get<bool>()))
    throw bad("echo is not supported by this service", "echo");
  if (set("suffix")) throw bad("suffix (insertion) is not supported by this service", "suffix");
  if (set("logit_bias") && !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
    throw bad("logit_bias is not supported by this service", "logit_bias");
  if (ep == api_endpoint::chat_completions) {
    if (set("tools") && !(body["tools"].is_array() && body["tools"].empty()))
      throw bad("tools (function calling) are not supported by this service", "tools");
    if (set("response_format") && !(body["response_format"].is_object() &&
                                    body["response_format"].value("type", std::string()) == "text"))
      throw bad("response_format other than text is not supported by this service", "response_format");
  }
}

std::string message_content(const json& m, size_t i) {
  const std::string param = "messages[" + std::to_string(i) + "].content";
  const auto it = m.find("content");
  if (it == m.end() || it->is_null()) throw bad(param + " is missing", param);
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) throw bad(param + " must be a string or an array of text parts", param);
  std::string text;
  for (const json& part : *it) {  // [{"type": "text", "text": "..."}]
    if (!part.is_object() || part.value("type", std::string()) != "text" || !part.contains("text") ||
        !part["text"].is_string())
      throw bad(param + ": only text parts ({\"type\": \"text\", \"text\": ...}) are supported", param);
    text += part["text"].get<std::string>();
  }
  return text;
}

}  // namespace

api_error api_error_of(const rpc::RequestError& e) {
  switch (e.code) {
    case rpc::ErrorCode::BAD_REQUEST: return api_error(400, "invalid_request_error", e.message);
    case rpc::ErrorCode::UNAUTHORIZED: return api_error(401, "authentication_error", e.message, "", "invalid_api_key");
    case rpc::ErrorCode::NOT_FOUND: return api_error(404, "not_found_error", e.message);
    case rpc::ErrorCode::TOO_LARGE: return api_error(413, "invalid_request_error", e.message, "", "request_too_large");
    case rpc::ErrorCode::QUEUE_FULL: return api_error(429, "rate_limit_error", e.message, "", "queue_full");
    case rpc::ErrorCode::NOT_FINISHED: return api_error(409, "invalid_request_error", e.message);
    case rpc::ErrorCode::SHUTTING_DOWN: return api_error(503, "service_unavailable", e.message, "", "shutting_down");
    case rpc::ErrorCode::INTERNAL: return api_error(503, "service_unavailable", e.message, "", "journal_unavailable");
  }
  return api_error(500, "server_error", e.message);
}

json error_body(const api_error& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

openai_request parse_openai_request(const std::string& text, api_endpoint ep, int default_max_tokens) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {
    throw bad(std::string("the body is not JSON: ") + e.what());
  }
  if (!body.is_object()) throw bad(std::string("the body must be a JSON object, got ") + type_name(body));
  refuse_unsupported(body, ep);

  openai_request r;
  r.endpoint = ep;
  rpc::GenerateJob& g = r.job;
  if (body.contains("model") && !body["model"].is_null()) {
    if (!body["model"].is_string()) throw bad("model must be a string", "model");
    r.model = body["model"].get<std::string>();
  }
  if (ep == api_endpoint::completions) {
    const auto it = body.find("prompt");
    if (it == body.end() || it->is_null()) throw bad("prompt is missing", "prompt");
    if (it->is_string()) {
      g.prompt = it->get<std::string>();
    } else if (it->is_array() && it->size() == 1 && (*it)[0].is_string()) {
      g.prompt = (*it)[0].get<std::string>();
    } else if (it->is_array() && !it->empty() && (*it)[0].is_number_integer()) {
      throw bad("token-id prompts are not supported: send the prompt as a string", "prompt");
    } else {
      throw bad("prompt must be a string (or an array of one string: one prompt per request)", "prompt");
    }
    if (g.prompt.empty()) throw bad("prompt is empty", "prompt");
  } else {
    const auto it = body.find("messages");
    if (it == body.end() || !it->is_array() || it->empty())
      throw bad("messages must be a non-empty array of {role, content}", "messages");
    for (size_t i = 0; i < it->size(); ++i) {
      const json& m = (*it)[i];
      const std::string param = "messages[" + std::to_string(i) + "].role";
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) throw bad(param + " is missing", param);
      std::string role = m["role"].get<std::string>();
      if (role == "developer") role = "system";  // OpenAI's newer name for the system role
      if (role != "system" && role != "user" && role != "assistant")
        throw bad(param + ": '" + role + "' is not one of system, user, assistant", param);
      rpc::ChatMessage cm;
      cm.role = role;
      cm.content = message_content(m, i);
      g.messages.push_back(std::move(cm));
    }
    g.chat = true;
  }

  const int64_t fallback_max = ep == api_endpoint::completions ? 16 : default_max_tokens;
  int64_t max_tokens = integer(body, "max_tokens", fallback_max, 1, INT32_MAX);
  if (ep == api_endpoint::chat_completions)
    max_tokens = integer(body, "max_completion_tokens", max_tokens, 1, INT32_MAX);
  g.max_tokens = (int32_t)max_tokens;
  r.max_tokens_given = (body.contains("max_tokens") && !body["max_tokens"].is_null()) ||
                       (body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null());
  g.temperature = number(body, "temperature", 1.0, 0.0, 2.0);
  g.top_p = number(body, "top_p", 1.0, 0.0, 1.0);
  if (g.top_p == 0.0) throw bad("top_p must be in (0, 1]", "top_p");
  g.frequency_penalty = number(body, "frequency_penalty", 0.0, -2.0, 2.0);
  g.presence_penalty = number(body, "presence_penalty", 0.0, -2.0, 2.0);
  g.seed = integer(body, "seed", 0, INT64_MIN, INT64_MAX);
  g.top_k = (int32_t)integer(body, "top_k", 0, 0, INT32_MAX);
  g.min_p = number(body, "min_p", 0.0, 0.0, 1.0);
  g.repetition_penalty = number(body, "repetition_penalty", 1.0, 1e-3, 1e3);
  g.repeat_last_n = (int32_t)integer(body, "repeat_last_n", 64, 0, INT32_MAX);
  g.no_repeat_ngram = (int32_t)integer(body, "no_repeat_ngram", 0, 0, 64);

  if (const auto it = body.find("stop"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      g.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      if (it->size() > 4) throw bad("stop holds at most 4 sequences", "stop");
      for (const json& s : *it) {
        if (!s.is_string()) throw bad("stop must be a string or an array of strings", "stop");
        g.stop.push_back(s.get<std::string>());
      }
    } else {
      throw bad("stop must be a string or an array of strings", "stop");
    }
    for (const std::string& s : g.stop)
      if (s.empty()) throw bad("stop sequences must not be empty", "stop");
  }
  r.stream = flag(body, "stream");
  if (const auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) throw bad("stream_options must be an object", "stream_options");
    if (!r.stream) throw bad("stream_options is only allowed with stream: true", "stream_options");
    r.include_usage = flag(*it, "include_usage");
  }
  return r;
}

std::string sse_event(const json& j) {
  return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
}

json usage_of(const rpc::JobResult& r) {
  return {{"prompt_tokens", r.prompt_tokens},
          {"completion_tokens", r.generated_tokens},
          {"total_tokens", r.prompt_tokens + r.generated_tokens}};
}

namespace {
json extension(const answer_context& c, const rpc::JobResult* r) {
  json x = {{"job_id", c.job_id}, {"cache", c.cache}, {"attention", c.attention}};
  if (r) x["prefill_s"] = r->prefill_s, x["decode_s"] = r->decode_s;
  return x;
}
const char* object_name(api_endpoint ep, bool chunk) {
  if (ep == api_endpoint::completions) return "text_completion";
  return chunk ? "chat.completion.chunk" : "chat.completion";
}
}  // namespace

json completion_body(api_endpoint ep, const answer_context& c, const rpc::JobResult& r) {
  json choice = {{"index", 0}, {"logprobs", nullptr}, {"finish_reason", r.finish_reason}};
  if (ep == api_endpoint::completions) choice["text"] = r.text;
  else choice["message"] = {{"role", "assistant"}, {"content", r.text}};
  return {{"id", c.id},          {"object", object_name(ep, false)}, {"created", c.created},
          {"model", c.model},    {"choices", json::array({choice})}, {"usage", usage_of(r)},
          {"xctx", extension(c, &r)}};
}

json stream_chunk(api_endpoint ep, const answer_context& c, const std::string& piece, const std::string& finish_reason,
                  bool first) {
  json choice = {{"index", 0}, {"logprobs", nullptr},
                 {"finish_reason", finish_reason.empty() ? json(nullptr) : json(finish_reason)}};
  if (ep == api_endpoint::completions) {
    choice["text"] = piece;
  } else {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!piece.empty() || (first && finish_reason.empty())) delta["content"] = piece;
    choice["delta"] = delta;
  }
  json chunk = {{"id", c.id}, {"object", object_name(ep, true)}, {"created", c.created}, {"model", c.model},
                {"choices", json::array({choice})}};
  if (first) chunk["xctx"] = extension(c, nullptr);
  return chunk;
}

json usage_chunk(api_endpoint ep, const answer_context& c, const rpc::JobResult& r) {
  return {{"id", c.id}, {"object", object_name(ep, true)}, {"created", c.created}, {"model", c.model},
          {"choices", json::array()}, {"usage", usage_of(r)}, {"xctx", extension(c, &r)}};
}

}  // namespace xctx
