// The HTTP front's parts without a model run: OpenAI request decoding and answer shapes, the
// streamed text's holdback of stop strings and split characters, and the front itself over a
// job table whose "job loop" is a test thread (health before and after ready, auth, streams).
#include <gtest/gtest.h>
#include <httplib.h>

#include <thread>

#include "coordinator/service/generate_text.h"
#include "coordinator/service/http_front.h"
#include "coordinator/service/openai_api.h"
#include "coordinator/jobs/session.h"
#include "test_util.h"

namespace xctx {
namespace {

using json = nlohmann::json;

api_error parse_error(const std::string& body, api_endpoint ep = api_endpoint::completions) {
  try {
    parse_openai_request(body, ep, 100);
  } catch (const api_error& e) {
    return e;
  }
  ADD_FAILURE() << "accepted: " << body;
  return api_error(0, "", "");
}

TEST(openai_api, completion_defaults_follow_openai) {
  const openai_request r = parse_openai_request(R"({"model": "m", "prompt": "Hello"})", api_endpoint::completions, 100);
  EXPECT_EQ(r.job.prompt, "Hello");
  EXPECT_FALSE(r.job.chat);
  EXPECT_EQ(r.job.max_tokens, 16);  // OpenAI's completions default
  EXPECT_DOUBLE_EQ(r.job.temperature, 1.0);
  EXPECT_DOUBLE_EQ(r.job.top_p, 1.0);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.max_tokens_given);
  EXPECT_EQ(r.model, "m");
}

TEST(openai_api, every_sampler_field_reaches_the_job) {
  const openai_request r = parse_openai_request(
      R"({"prompt": ["one"], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
          "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.1, "repeat_last_n": 32,
          "no_repeat_ngram": 3, "seed": -5, "stop": ["\n\n", "END"], "stream": true,
          "stream_options": {"include_usage": true}, "user": "ignored", "n": 1, "logprobs": null})",
      api_endpoint::completions, 100);
  const rpc::GenerateJob& g = r.job;
  EXPECT_EQ(g.prompt, "one");
  EXPECT_EQ(g.max_tokens, 7);
  EXPECT_DOUBLE_EQ(g.temperature, 0.5);
  EXPECT_DOUBLE_EQ(g.top_p, 0.9);
  EXPECT_EQ(g.top_k, 40);
  EXPECT_DOUBLE_EQ(g.min_p, 0.05);
  EXPECT_DOUBLE_EQ(g.frequency_penalty, 0.5);
  EXPECT_DOUBLE_EQ(g.presence_penalty, -0.5);
  EXPECT_DOUBLE_EQ(g.repetition_penalty, 1.1);
  EXPECT_EQ(g.repeat_last_n, 32);
  EXPECT_EQ(g.no_repeat_ngram, 3);
  EXPECT_EQ(g.seed, -5);
  EXPECT_EQ(g.stop, (std::vector<std::string>{"\n\n", "END"}));
  EXPECT_TRUE(r.stream && r.include_usage && r.max_tokens_given);
}

TEST(openai_api, chat_messages_with_text_parts_and_the_developer_role) {
  const openai_request r = parse_openai_request(
      R"({"messages": [{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]})",
      api_endpoint::chat_completions, 100);
  ASSERT_EQ(r.job.messages.size(), 4u);
  EXPECT_TRUE(r.job.chat);
  EXPECT_EQ(r.job.messages[0].role, "system");
  EXPECT_EQ(r.job.messages[1].content, "Hi there");
  EXPECT_EQ(r.job.max_tokens, 100);  // chat: up to the service's limit unless asked
  EXPECT_FALSE(r.max_tokens_given);
  EXPECT_EQ(parse_openai_request(R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9})",
                                 api_endpoint::chat_completions, 100)
                .job.max_tokens,
            9);
}

TEST(openai_api, refusals_name_the_field) {
  const struct {
    const char* body;
    const char* param;
  } cases[] = {
      {R"({"prompt": "x", "n": 2})", "n"},
      {R"({"prompt": "x", "logprobs": 1})", "logprobs"},
      {R"({"prompt": "x", "echo": true})", "echo"},
      {R"({"prompt": "x", "suffix": "y"})", "suffix"},
      {R"({"prompt": "x", "logit_bias": {"1": 2}})", "logit_bias"},
      {R"({"prompt": "x", "temperature": 2.5})", "temperature"},
      {R"({"prompt": "x", "temperature": "hot"})", "temperature"},
      {R"({"prompt": "x", "top_p": 0})", "top_p"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 1.5})", "max_tokens"},
      {R"({"prompt": "x", "presence_penalty": 3})", "presence_penalty"},
      {R"({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})", "stop"},
      {R"({"prompt": "x", "stop": [""]})", "stop"},
      {R"({"prompt": "x", "stop": 5})", "stop"},
      {R"({"prompt": "x", "stream": "yes"})", "stream"},
      {R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"prompt": [1, 2]})", "prompt"},
      {R"({"prompt": ["a", "b"]})", "prompt"},
      {R"({"prompt": ""})", "prompt"},
      {R"({"max_tokens": 3})", "prompt"},
  };
  for (const auto& c : cases) {
    const api_error e = parse_error(c.body);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.what();
  }
  EXPECT_EQ(parse_error("[1]").param, "");
  EXPECT_NE(std::string(parse_error("{oops").what()).find("not JSON"), std::string::npos);
  EXPECT_EQ(parse_error(R"({"messages": []})", api_endpoint::chat_completions).param, "messages");
  EXPECT_EQ(parse_error(R"({"messages": [{"role": "tool", "content": "x"}]})", api_endpoint::chat_completions).param,
            "messages[0].role");
  EXPECT_EQ(parse_error(R"({"messages": [{"role": "user"}]})", api_endpoint::chat_completions).param,
            "messages[0].content");
  EXPECT_EQ(parse_error(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
                        api_endpoint::chat_completions)
                .param,
            "messages[0].content");
  EXPECT_EQ(parse_error(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{}]})",
                        api_endpoint::chat_completions)
                .param,
            "tools");
}

TEST(openai_api, thrift_refusals_map_to_http_statuses) {
  const auto status_of = [](rpc::ErrorCode::type c) { return api_error_of(request_error(c, "m")).status; };
  EXPECT_EQ(status_of(rpc::ErrorCode::BAD_REQUEST), 400);
  EXPECT_EQ(status_of(rpc::ErrorCode::UNAUTHORIZED), 401);
  EXPECT_EQ(status_of(rpc::ErrorCode::NOT_FOUND), 404);
  EXPECT_EQ(status_of(rpc::ErrorCode::TOO_LARGE), 413);
  EXPECT_EQ(status_of(rpc::ErrorCode::QUEUE_FULL), 429);
  EXPECT_EQ(status_of(rpc::ErrorCode::SHUTTING_DOWN), 503);
  const json body = error_body(api_error(429, "rate_limit_error", "full", "", "queue_full"));
  EXPECT_EQ(body["error"]["message"], "full");
  EXPECT_EQ(body["error"]["code"], "queue_full");
  EXPECT_TRUE(body["error"]["param"].is_null());
}

TEST(openai_api, answer_and_chunk_shapes) {
  answer_context c{"chatcmpl-3", "model", 1700000000, 3, "nuq3-1%", "retrieval"};
  rpc::JobResult r;
  r.text = "Paris.", r.finish_reason = "stop", r.prompt_tokens = 10, r.generated_tokens = 3;
  const json chat = completion_body(api_endpoint::chat_completions, c, r);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "Paris.");
  EXPECT_EQ(chat["usage"]["total_tokens"], 13);
  EXPECT_EQ(chat["xctx"]["cache"], "nuq3-1%");
  const json first = stream_chunk(api_endpoint::chat_completions, c, "Pa", "", true);
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "Pa");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  const json last = stream_chunk(api_endpoint::chat_completions, c, "", "stop", false);
  EXPECT_TRUE(last["choices"][0]["delta"].empty());
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  const json text = stream_chunk(api_endpoint::completions, c, "ris", "", false);
  EXPECT_EQ(text["object"], "text_completion");
  EXPECT_EQ(text["choices"][0]["text"], "ris");
  EXPECT_TRUE(usage_chunk(api_endpoint::completions, c, r)["choices"].empty());
}

TEST(generate_text, utf8_prefix_never_splits_a_character) {
  EXPECT_EQ(utf8_complete_prefix("abc"), 3u);
  const std::string euro = "\xE2\x82\xAC";  // 3 bytes
  EXPECT_EQ(utf8_complete_prefix("a" + euro), 4u);
  EXPECT_EQ(utf8_complete_prefix("a" + euro.substr(0, 2)), 1u);
  EXPECT_EQ(utf8_complete_prefix("a" + euro.substr(0, 1)), 1u);
  const std::string emoji = "\xF0\x9F\x98\x80";  // 4 bytes
  EXPECT_EQ(utf8_complete_prefix(emoji.substr(0, 3)), 0u);
  EXPECT_EQ(utf8_complete_prefix(emoji), 4u);
}

TEST(generate_text, stream_holds_back_stop_strings_and_cuts_before_them) {
  XCTX_REQUIRE_MODEL(path);
  const model_session s = open_session(path, "", run_params{}, false);
  const std::string text = " one two three four five six";
  const std::vector<int32_t> ids = s.tok->encode(text, false, false);
  for (const std::string& stop : {std::string(" four"), std::string("ee f"), std::string("absent")}) {
    text_stream ts(*s.tok, {stop, "zz"});
    std::string streamed;
    bool ended = false;
    for (int32_t id : ids) {
      ended = ts.push(id);
      const std::string piece = ts.take_ready();
      streamed += piece;
      // Nothing streamed ever holds the stop string or ends in a proper prefix of it that the
      // next token could complete into it.
      EXPECT_EQ(streamed.find(stop), std::string::npos) << stop;
      if (ended) break;
    }
    ts.finish();
    streamed += ts.take_ready();
    const size_t at = text.find(stop);
    EXPECT_EQ(streamed, at == std::string::npos ? text : text.substr(0, at)) << stop;
    EXPECT_EQ(ts.text(), streamed);
    EXPECT_EQ(ended, at != std::string::npos);
    EXPECT_EQ(ts.stopped_by_string(), at != std::string::npos);
  }
}

// The front over a job table served by a test thread: no model runs.
struct fake_service {
  job_table table{2, 100};
  service_metrics metrics;
  model_session s;
  std::unique_ptr<http_front> front;
  std::thread loop;
  std::atomic<bool> done{false};

  explicit fake_service(const std::string& model) {
    s = open_session(model, "", run_params{}, false);
    http_front_options o;
    o.port = 0;
    o.secret = "secret-token";
    o.max_request_bytes = 4096;
    front = std::make_unique<http_front>(o, table, metrics);
    front->start();
    loop = std::thread([this] {
      while (!done) {
        auto next = table.next(std::chrono::milliseconds(20));
        if (!next) continue;
        const int64_t id = next->first;
        for (const char* piece : {"Hel", "lo", " world"}) {
          table.append_text(id, piece);
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        rpc::JobResult r;
        r.phase = rpc::JobPhase::DONE;
        r.text = "Hello world", r.finish_reason = "length", r.prompt_tokens = 2, r.generated_tokens = 3;
        table.finish(id, r);
      }
    });
  }
  void ready() {
    http_model_view v;
    v.tok = s.tok.get();
    v.info.model = "fake";
    v.info.cache = "fp16";
    v.attention = "full";
    v.limits.max_context = 256, v.limits.max_output_tokens = 16, v.limits.max_request_bytes = 4096;
    front->set_ready(v);
  }
  ~fake_service() {
    done = true;
    loop.join();
    table.close();
    front->stop();
  }
};

TEST(http_front, health_is_503_until_ready_and_requests_need_the_token) {
  XCTX_REQUIRE_MODEL(path);
  fake_service f(path);
  httplib::Client c("127.0.0.1", f.front->port());
  const httplib::Headers auth = {{"Authorization", "Bearer secret-token"}};
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  auto early = c.Post("/v1/completions", auth, R"({"prompt": "hi"})", "application/json");
  ASSERT_TRUE(early);
  EXPECT_EQ(early->status, 503);
  EXPECT_EQ(json::parse(early->body)["error"]["code"], "loading");
  f.ready();
  EXPECT_EQ(c.Get("/health")->status, 200);
  EXPECT_EQ(c.Post("/v1/completions", R"({"prompt": "hi"})", "application/json")->status, 401);
  EXPECT_EQ(c.Post("/v1/completions", {{"Authorization", "Bearer secret-tokeX"}}, R"({"prompt": "hi"})",
                   "application/json")->status,
            401);
  auto ok = c.Post("/v1/completions", auth, R"({"prompt": "hi", "max_tokens": 3})", "application/json");
  ASSERT_TRUE(ok);
  ASSERT_EQ(ok->status, 200) << ok->body;
  const json body = json::parse(ok->body);
  EXPECT_EQ(body["choices"][0]["text"], "Hello world");
  EXPECT_EQ(body["model"], "fake");
  EXPECT_EQ(ok->get_header_value("X-Xctx-Job-Id"), std::to_string(body["xctx"]["job_id"].get<int64_t>()));
  auto big = c.Post("/v1/completions", auth, std::string(5000, ' '), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  EXPECT_EQ(json::parse(big->body)["error"]["code"], "request_too_large");
  auto too_many = c.Post("/v1/completions", auth, R"({"prompt": "hi", "max_tokens": 17})", "application/json");
  EXPECT_EQ(too_many->status, 413);
  const std::string metrics = c.Get("/metrics")->body;
  EXPECT_NE(metrics.find("xctx_requests_refused_total{reason=\"invalid_api_key\"} 2"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("xctx_requests_refused_total{reason=\"loading\"} 1"), std::string::npos) << metrics;
}

TEST(http_front, a_stream_is_the_pieces_then_the_finish_then_done) {
  XCTX_REQUIRE_MODEL(path);
  fake_service f(path);
  f.ready();
  httplib::Client c("127.0.0.1", f.front->port());
  auto r = c.Post("/v1/chat/completions", {{"Authorization", "Bearer secret-token"}},
                  R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}})",
                  "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  std::string content, finish;
  bool usage = false, done = false;
  size_t pos = 0;
  while (pos < r->body.size()) {
    const size_t end = r->body.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos) << "an unterminated event: " << r->body.substr(pos);
    const std::string frame = r->body.substr(pos, end - pos);
    pos = end + 2;
    if (frame.rfind(":", 0) == 0) continue;  // a progress comment
    ASSERT_EQ(frame.rfind("data: ", 0), 0u) << frame;
    ASSERT_FALSE(done) << "an event after [DONE]";
    if (frame == "data: [DONE]") {
      done = true;
      continue;
    }
    const json ch = json::parse(frame.substr(6));
    EXPECT_EQ(ch["object"], "chat.completion.chunk");
    if (ch.contains("usage")) {
      usage = true;
      EXPECT_EQ(ch["usage"]["completion_tokens"], 3);
      continue;
    }
    const json& choice = ch["choices"][0];
    if (choice["delta"].contains("content")) content += choice["delta"]["content"].get<std::string>();
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
  }
  EXPECT_EQ(content, "Hello world");
  EXPECT_EQ(finish, "length");
  EXPECT_TRUE(usage && done);
}

}  // namespace
}  // namespace xctx
