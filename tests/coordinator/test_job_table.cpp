// The service's job table and request checks, without a server: the IDL round trip, every
// refusal with its code and message, queue order, cancellation, forgetting old jobs, shutdown.
#include <gtest/gtest.h>

#include <thread>

#include "common/error.h"
#include "coordinator/service/job_table.h"

namespace xctx {
namespace {

using rpc::ErrorCode;
using rpc::JobPhase;

rpc::Job generate_job(const std::string& prompt, int max_tokens = 16) {
  rpc::Job job;
  job.kind = rpc::JobKind::GENERATE;
  rpc::GenerateJob g;
  g.prompt = prompt;
  g.max_tokens = max_tokens;
  job.__set_generate(g);
  return job;
}

rpc::Job batch_job(const std::string& jsonl) {
  rpc::Job job;
  job.kind = rpc::JobKind::BATCH;
  rpc::BatchJob b;
  b.jsonl = jsonl;
  job.__set_batch(b);
  return job;
}

// The code of the RequestError that f throws (or -1), its message in *msg.
template <class F>
int refusal(F&& f, std::string* msg = nullptr) {
  try {
    f();
  } catch (const rpc::RequestError& e) {
    if (msg) *msg = e.message;
    return e.code;
  }
  return -1;
}

TEST(job_codec, every_kind_round_trips_through_the_wire_format) {
  std::vector<rpc::Job> jobs = {generate_job("The capital of France is", 8), batch_job("{\"id\":\"a\",\"text\":\"x\"}\n")};
  rpc::Job p;
  p.kind = rpc::JobKind::PASSKEY;
  rpc::PasskeyJob pk;
  pk.context = 2048, pk.trials = 3, pk.depths = {0.0, 0.25, 1.0}, pk.seed = 7, pk.filler = "austen";
  p.__set_passkey(pk);
  jobs.push_back(p);
  rpc::Job s;
  s.kind = rpc::JobKind::SUMMARIZE;
  rpc::SummarizeJob sj;
  sj.document.id = "ch1", sj.document.text = std::string(5000, 'x') + "\xe2\x80\x94", sj.document.max_tokens = 99;
  s.__set_summarize(sj);
  jobs.push_back(s);
  for (const rpc::Job& job : jobs) {
    const std::string bytes = serialize_job(job);
    EXPECT_EQ(parse_job(bytes), job) << rpc::to_string(job.kind);
    EXPECT_THROW(parse_job(bytes.substr(0, bytes.size() / 2)), Error) << "truncated " << rpc::to_string(job.kind);
  }
}

// Found by fuzz/fuzz_thrift_job: a string length of 90 MB in a 20-byte request was allocated
// before the read failed (Thrift sets no string limit by default; up to 2 GB), so a few bytes
// cost 90 MB. The input's own size now bounds strings and lists.
TEST(job_wire, parse_job_refuses_lengths_past_the_input) {
  // Job{1: kind = GENERATE, 2: generate{1: prompt = <90,000,000 bytes claimed, 3 present>}}
  const std::string bytes("\x08\x00\x01\x00\x00\x00\x01"
                          "\x0c\x00\x02"
                          "\x0b\x00\x01\x05\x5d\x4a\x80"
                          "abc",
                          20);
  try {
    parse_job(bytes);
    FAIL() << "parse_job accepted a truncated job";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a serialized xctx job (20 bytes)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("size limit"), std::string::npos) << e.what();
  }
}

TEST(job_requests, valid_jobs_pass) {
  service_limits lim;
  lim.max_output_tokens = 64;
  EXPECT_NO_THROW(check_job_request(generate_job("hi", 64), lim));
  EXPECT_NO_THROW(check_job_request(batch_job("{\"id\":\"a\",\"text\":\"x\"}\n\n{\"id\":\"b\",\"text\":\"y\"}"), lim));
}

struct bad_request {
  const char* name;
  rpc::Job job;
  int code;
  const char* message_part;
};

TEST(job_requests, every_bad_field_is_named) {
  service_limits lim;
  lim.max_output_tokens = 64;
  lim.max_request_bytes = 4096;
  lim.max_context = 2048;
  rpc::Job no_struct;
  no_struct.kind = rpc::JobKind::SUMMARIZE;
  rpc::Job bad_temp = generate_job("x");
  bad_temp.generate.temperature = -1;
  rpc::Job bad_ngram = generate_job("x");
  bad_ngram.generate.no_repeat_ngram = 1;
  rpc::Job bad_penalty = generate_job("x");
  bad_penalty.generate.frequency_penalty = 3;
  rpc::Job passkey_long;
  passkey_long.kind = rpc::JobKind::PASSKEY;
  rpc::PasskeyJob pk;
  pk.context = 4096;
  passkey_long.__set_passkey(pk);
  rpc::Job passkey_depth = passkey_long;
  passkey_depth.passkey.context = 1024, passkey_depth.passkey.depths = {0.5, 1.5};
  rpc::Job unknown_kind = generate_job("x");
  unknown_kind.kind = (rpc::JobKind::type)42;
  const std::vector<bad_request> cases = {
      {"oversized", generate_job(std::string(5000, 'a')), ErrorCode::TOO_LARGE, "bytes"},
      {"output over limit", generate_job("x", 65), ErrorCode::TOO_LARGE, "generate.max_tokens 65"},
      {"output zero", generate_job("x", 0), ErrorCode::BAD_REQUEST, "generate.max_tokens must be >= 1"},
      {"empty prompt", generate_job(""), ErrorCode::BAD_REQUEST, "generate.prompt is empty"},
      {"kind without struct", no_struct, ErrorCode::BAD_REQUEST, "needs its \"summarize\" field"},
      {"negative temperature", bad_temp, ErrorCode::BAD_REQUEST, "temperature"},
      {"no-repeat 1-gram", bad_ngram, ErrorCode::BAD_REQUEST, "generate: --no-repeat-ngram must be 0 (off) or >= 2"},
      {"frequency penalty past OpenAI's range", bad_penalty, ErrorCode::BAD_REQUEST, "--frequency-penalty"},
      {"passkey over context", passkey_long, ErrorCode::TOO_LARGE, "passkey.context 4096"},
      {"passkey bad depth", passkey_depth, ErrorCode::BAD_REQUEST, "outside [0, 1]"},
      {"batch not json", batch_job("{\"id\":\"a\",\"text\":\"x\"}\n{oops"), ErrorCode::BAD_REQUEST, "line 2"},
      {"batch path", batch_job("{\"id\":\"a\",\"path\":\"/etc/passwd\"}"), ErrorCode::BAD_REQUEST, "\"path\""},
      {"batch duplicate", batch_job("{\"id\":\"a\",\"text\":\"x\"}\n{\"id\":\"a\",\"text\":\"y\"}"),
       ErrorCode::BAD_REQUEST, "appears twice"},
      {"batch empty", batch_job("\n\n"), ErrorCode::BAD_REQUEST, "no documents"},
      {"batch doc output", batch_job("{\"id\":\"a\",\"text\":\"x\",\"max_tokens\":100}"), ErrorCode::TOO_LARGE,
       "id \"a\""},
      {"unknown kind", unknown_kind, ErrorCode::BAD_REQUEST, "unknown job kind 42"},
  };
  for (const bad_request& c : cases) {
    std::string msg;
    EXPECT_EQ(refusal([&] { check_job_request(c.job, lim); }, &msg), c.code) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.message_part), std::string::npos) << c.name << ": " << msg;
  }
}

TEST(job_table, jobs_run_in_order_and_end_with_their_results) {
  job_table t(4, 10);
  const int64_t a = t.submit(generate_job("a")), b = t.submit(generate_job("b"));
  EXPECT_EQ(t.status(b).phase, JobPhase::QUEUED);
  EXPECT_EQ(t.status(b).queue_position, 2);
  EXPECT_EQ(refusal([&] { t.result(a); }), ErrorCode::NOT_FINISHED);
  auto first = t.next(std::chrono::milliseconds(0));
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->first, a);
  EXPECT_EQ(first->second.generate.prompt, "a");
  EXPECT_EQ(t.status(b).queue_position, 1);
  t.set_tokens(a, 50, 100);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const rpc::JobStatus running = t.status(a);
  EXPECT_EQ(running.phase, JobPhase::PREFILL);
  EXPECT_GT(running.tokens_per_s, 0.0);
  EXPECT_NEAR(running.eta_s, 50.0 / running.tokens_per_s, 1e-6 * running.eta_s + 1e-9);
  rpc::JobResult r;
  r.phase = JobPhase::DONE;
  r.text = "Paris";
  r.prompt_tokens = 5, r.generated_tokens = 3;
  t.finish(a, r);
  EXPECT_EQ(t.result(a).text, "Paris");
  EXPECT_EQ(t.status(a).tokens_done, 8);
  EXPECT_FALSE(t.cancel(a)) << "an ended job is not cancelled";
  const rpc::Metrics m = t.metrics();
  EXPECT_EQ(m.submitted, 2);
  EXPECT_EQ(m.completed, 1);
  EXPECT_EQ(m.queued, 1);
  EXPECT_EQ(m.generated_tokens, 3);
  EXPECT_FALSE(m.busy);
}

TEST(job_table, queue_limit_cancel_and_unknown_ids) {
  job_table t(2, 10);
  const int64_t a = t.submit(generate_job("a"));
  t.submit(generate_job("b"));
  std::string msg;
  EXPECT_EQ(refusal([&] { t.submit(generate_job("c")); }, &msg), ErrorCode::QUEUE_FULL);
  EXPECT_NE(msg.find("--max-queue"), std::string::npos) << msg;
  EXPECT_TRUE(t.cancel(a));
  EXPECT_EQ(t.status(a).phase, JobPhase::CANCELLED);
  EXPECT_EQ(t.result(a).phase, JobPhase::CANCELLED);
  EXPECT_NO_THROW(t.submit(generate_job("c"))) << "the cancelled job left the queue";
  auto run = t.next(std::chrono::milliseconds(0));
  ASSERT_TRUE(run.has_value());
  EXPECT_FALSE(t.cancel_requested(run->first));
  EXPECT_TRUE(t.cancel(run->first)) << "running: flagged, ends at its next step";
  EXPECT_TRUE(t.cancel_requested(run->first));
  EXPECT_EQ(refusal([&] { t.status(999); }, &msg), ErrorCode::NOT_FOUND);
  EXPECT_EQ(msg, "no job 999");
  EXPECT_EQ(refusal([&] { t.cancel(-1); }), ErrorCode::NOT_FOUND);
}

TEST(job_table, keeps_only_the_newest_ended_jobs) {
  job_table t(8, 2);
  std::vector<int64_t> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(t.submit(generate_job("x")));
  for (int64_t id : ids) t.cancel(id);
  std::string msg;
  EXPECT_EQ(refusal([&] { t.status(ids[0]); }, &msg), ErrorCode::NOT_FOUND);
  EXPECT_NE(msg.find("keeps the last 2"), std::string::npos) << msg;
  EXPECT_EQ(t.status(ids[2]).phase, JobPhase::CANCELLED);
}

TEST(job_table, close_refuses_new_jobs_and_cancels_the_queue) {
  job_table t(4, 10);
  const int64_t a = t.submit(generate_job("a"));
  t.close();
  EXPECT_EQ(refusal([&] { t.submit(generate_job("b")); }), ErrorCode::SHUTTING_DOWN);
  EXPECT_EQ(t.status(a).phase, JobPhase::CANCELLED);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(t.next(std::chrono::seconds(5)).has_value());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1)) << "next() waits after close()";
}

}  // namespace
}  // namespace xctx
