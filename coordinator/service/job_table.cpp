#include "coordinator/service/job_table.h"

#include <glog/logging.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>

#include "common/error.h"
#include "coordinator/service/job_journal.h"
#include "coordinator/jobs/summarize.h"
#include "coordinator/service/thrift_wire.h"

namespace xctx {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

bool has_ended(rpc::JobPhase::type p) {
  return p == rpc::JobPhase::DONE || p == rpc::JobPhase::FAILED || p == rpc::JobPhase::CANCELLED;
}

}  // namespace

rpc::RequestError request_error(rpc::ErrorCode::type code, const std::string& message) {
  rpc::RequestError e;
  e.code = code;
  e.message = message;
  return e;
}

std::string serialize_job(const rpc::Job& job) { return to_thrift_bytes(job); }

rpc::Job parse_job(const std::string& bytes) {
  rpc::Job job;
  std::string why;
  if (!from_thrift_bytes(bytes, job, &why)) fail("not a serialized xctx job (", bytes.size(), " bytes): ", why);
  return job;
}

sampler_params sampling_of(const rpc::GenerateJob& g) {
  sampler_params s;
  s.temperature = (float)g.temperature, s.top_p = (float)g.top_p, s.seed = (uint64_t)g.seed;
  s.top_k = g.top_k, s.min_p = (float)g.min_p, s.repetition_penalty = (float)g.repetition_penalty;
  s.repeat_last_n = g.repeat_last_n, s.frequency_penalty = (float)g.frequency_penalty;
  s.presence_penalty = (float)g.presence_penalty, s.no_repeat_ngram = g.no_repeat_ngram;
  return s;
}

void check_job_request(const rpc::Job& job, const service_limits& lim) {
  const auto bad = [](const std::string& m) { return request_error(rpc::ErrorCode::BAD_REQUEST, m); };
  const auto too_large = [](const std::string& m) { return request_error(rpc::ErrorCode::TOO_LARGE, m); };
  const int64_t bytes = (int64_t)serialize_job(job).size();
  if (bytes > lim.max_request_bytes)
    throw too_large("the request is " + std::to_string(bytes) + " bytes, over the service's limit of " +
                    std::to_string(lim.max_request_bytes) + " bytes (--max-request-bytes)");
  const auto check_output = [&](int64_t n, const std::string& field, bool zero_ok) {
    if (n < (zero_ok ? 0 : 1)) throw bad(field + " must be >= " + (zero_ok ? "0" : "1") + ", got " + std::to_string(n));
    if (n > lim.max_output_tokens)
      throw too_large(field + " " + std::to_string(n) + " is over the service's limit of " +
                      std::to_string(lim.max_output_tokens) + " output tokens (--max-output-tokens)");
  };
  switch (job.kind) {
    case rpc::JobKind::GENERATE: {
      if (!job.__isset.generate) throw bad("a GENERATE job needs its \"generate\" field");
      const rpc::GenerateJob& g = job.generate;
      if (g.chat && !g.messages.empty()) {
        if (g.messages.size() > 4096) throw bad("generate.messages holds more than 4096 messages");
        for (size_t i = 0; i < g.messages.size(); ++i)
          if (g.messages[i].role != "system" && g.messages[i].role != "user" && g.messages[i].role != "assistant")
            throw bad("generate.messages[" + std::to_string(i) + "].role: '" + g.messages[i].role +
                      "' is not one of system, user, assistant");
      } else if (!g.messages.empty()) {
        throw bad("generate.messages needs generate.chat");
      } else if (g.prompt.empty()) {
        throw bad("generate.prompt is empty");
      }
      if (g.stop.size() > 16) throw bad("generate.stop holds more than 16 sequences");
      for (const std::string& st : g.stop)
        if (st.empty() || st.size() > 256) throw bad("generate.stop: each sequence must hold 1 to 256 bytes");
      check_output(g.max_tokens, "generate.max_tokens", false);
      if (!(g.temperature >= 0.0) || !std::isfinite(g.temperature))
        throw bad("generate.temperature must be a finite number >= 0");
      if (!(g.top_p > 0.0 && g.top_p <= 1.0)) throw bad("generate.top_p must be in (0, 1]");
      try {  // the other processors, in the CLI's words (each message names its flag)
        check_sampler_params(sampling_of(g));
      } catch (const Error& e) {
        throw bad(std::string("generate: ") + e.what());
      }
      return;
    }
    case rpc::JobKind::PASSKEY: {
      if (!job.__isset.passkey) throw bad("a PASSKEY job needs its \"passkey\" field");
      const rpc::PasskeyJob& p = job.passkey;
      if (p.context < 64) throw bad("passkey.context must be >= 64 tokens, got " + std::to_string(p.context));
      if (p.context > lim.max_context)
        throw too_large("passkey.context " + std::to_string(p.context) + " is over the service's context of " +
                        std::to_string(lim.max_context) + " tokens");
      if (p.trials < 1 || p.trials > 1000) throw bad("passkey.trials must be in [1, 1000]");
      if (p.depths.empty() || p.depths.size() > 100) throw bad("passkey.depths must hold 1 to 100 depths");
      for (double d : p.depths)
        if (!(d >= 0.0 && d <= 1.0)) throw bad("passkey.depths: " + std::to_string(d) + " is outside [0, 1]");
      if (p.filler != "classic" && p.filler != "austen")
        throw bad("passkey.filler: unknown '" + p.filler + "' (classic, austen)");
      return;
    }
    case rpc::JobKind::SUMMARIZE: {
      if (!job.__isset.summarize) throw bad("a SUMMARIZE job needs its \"summarize\" field");
      const rpc::Document& d = job.summarize.document;
      if (d.text.empty()) throw bad("summarize.document.text is empty");
      check_output(d.max_tokens, "summarize.document.max_tokens", true);
      return;
    }
    case rpc::JobKind::BATCH: {
      if (!job.__isset.batch) throw bad("a BATCH job needs its \"batch\" field");
      check_output(job.batch.max_tokens, "batch.max_tokens", true);
      std::vector<summary_document> docs;
      try {
        docs = parse_summary_jsonl(job.batch.jsonl, "batch.jsonl", /*allow_paths=*/false);
      } catch (const Error& e) {
        throw bad(e.what());
      }
      if (docs.empty()) throw bad("batch.jsonl holds no documents");
      for (const summary_document& d : docs)
        if (d.max_tokens > lim.max_output_tokens)
          throw too_large("batch.jsonl line " + std::to_string(d.line) + " (id \"" + d.id + "\"): max_tokens " +
                          std::to_string(d.max_tokens) + " is over the service's limit of " +
                          std::to_string(lim.max_output_tokens) + " output tokens");
      return;
    }
  }
  throw bad("unknown job kind " + std::to_string((int)job.kind));
}

job_table::job_table(int max_queue, int keep_ended, job_journal* journal, interrupted_policy policy)
    : max_queue_(max_queue), keep_ended_(keep_ended), journal_(journal) {
  XCTX_CHECK(max_queue >= 1, "--max-queue must be >= 1, got ", max_queue);
  XCTX_CHECK(keep_ended >= 1, "ended jobs kept must be >= 1, got ", keep_ended);
  if (!journal_) return;
  const job_journal::replay& r = journal_->replayed();
  next_id_ = r.next_id;
  for (const rpc::JobResult& res : r.ended) {  // answerable again, as before the restart
    entry& e = jobs_[res.id];
    e.status.id = res.id;
    e.status.phase = res.phase;
    e.status.error = res.error;
    e.status.tokens_done = e.status.tokens_total = res.prompt_tokens + res.generated_tokens;
    e.result = res;
    ended_.push_back(res.id);
  }
  // Interrupted jobs go first (they were first in line), then the queue in its order; the queue
  // limit does not apply to what the service already accepted.
  std::vector<const job_journal::pending*> order;
  for (const auto& j : r.jobs)
    if (j.starts > 0) order.push_back(&j);
  for (const auto& j : r.jobs)
    if (j.starts == 0) order.push_back(&j);
  for (const job_journal::pending* j : order) {
    entry& e = jobs_[j->id];
    e.job = j->job;
    e.status.id = j->id;
    e.status.kind = j->job.kind;
    e.status.eta_s = -1;
    e.submitted = std::chrono::steady_clock::now();
    const bool retry = j->starts > 0 && policy == interrupted_policy::retry_once && j->starts < 2;
    if (j->starts > 0 && !retry) {
      rpc::JobResult res;
      res.id = j->id;
      res.phase = rpc::JobPhase::FAILED;
      res.error = "interrupted: the service stopped while this job ran (a rank died or the service was killed)" +
                  std::string(j->starts >= 2 ? " twice; not retried again" : "; not retried (--on-interrupt fail)");
      e.status.phase = res.phase;
      e.status.error = res.error;
      e.result = res;
      journal_->ended(res);
      ended(j->id);
      continue;
    }
    e.status.phase = rpc::JobPhase::QUEUED;
    queue_.push_back(j->id);
    LOG(INFO) << "job " << j->id << " " << (retry ? "retried (interrupted by the last stop)" : "queued again")
              << " from the journal";
  }
  counters_.submitted = (int64_t)queue_.size();
}

int64_t job_table::submit(const rpc::Job& job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) throw request_error(rpc::ErrorCode::SHUTTING_DOWN, "the service is shutting down");
  if ((int)queue_.size() >= max_queue_)
    throw request_error(rpc::ErrorCode::QUEUE_FULL, std::to_string(queue_.size()) +
                                                        " jobs are waiting, the limit (--max-queue); try again later");
  if (!journal_error_.empty())
    throw request_error(rpc::ErrorCode::INTERNAL, "the service cannot record jobs: " + journal_error_);
  const int64_t id = next_id_;
  if (journal_) {  // durable before acknowledged: a failed write accepts nothing
    try {
      journal_->accepted(id, job);
    } catch (const Error& e) {
      throw request_error(rpc::ErrorCode::INTERNAL, std::string("the job was not accepted: ") + e.what());
    }
  }
  ++next_id_;
  entry& e = jobs_[id];
  e.job = job;
  e.status.id = id;
  e.status.kind = job.kind;
  e.status.phase = rpc::JobPhase::QUEUED;
  e.status.eta_s = -1;
  e.submitted = std::chrono::steady_clock::now();
  queue_.push_back(id);
  ++counters_.submitted;
  cv_.notify_one();
  return id;
}

std::optional<std::pair<int64_t, rpc::Job>> job_table::next(std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, wait, [this] { return !queue_.empty() || closed_; });
  if (queue_.empty()) return std::nullopt;
  const int64_t id = queue_.front();
  queue_.pop_front();
  entry& e = jobs_.at(id);
  e.status.phase = rpc::JobPhase::PREFILL;
  e.started = std::chrono::steady_clock::now();
  running_ = id;
  record([&] { journal_->started(id); });
  return std::make_pair(id, e.job);
}

job_table::entry& job_table::find(int64_t id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    const bool forgotten = id >= 1 && id < next_id_;
    throw request_error(rpc::ErrorCode::NOT_FOUND,
                        forgotten ? "job " + std::to_string(id) + " ended long ago; the service keeps the last " +
                                        std::to_string(keep_ended_) + " ended jobs"
                                  : "no job " + std::to_string(id));
  }
  return it->second;
}

const job_table::entry& job_table::find(int64_t id) const { return const_cast<job_table*>(this)->find(id); }

rpc::JobStatus job_table::status(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const entry& e = find(id);
  rpc::JobStatus s = e.status;
  if (s.phase == rpc::JobPhase::QUEUED) {
    s.queue_position = (int32_t)(std::find(queue_.begin(), queue_.end(), id) - queue_.begin()) + 1;
  } else if (!has_ended(s.phase)) {
    s.elapsed_s = seconds_since(e.started);
    s.tokens_per_s = s.elapsed_s > 0 ? (double)s.tokens_done / s.elapsed_s : 0.0;
    s.eta_s = s.tokens_per_s > 0 && s.tokens_total >= s.tokens_done
                  ? (double)(s.tokens_total - s.tokens_done) / s.tokens_per_s
                  : -1.0;
  }
  return s;
}

rpc::JobResult job_table::result(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const entry& e = find(id);
  if (!has_ended(e.status.phase))
    throw request_error(rpc::ErrorCode::NOT_FINISHED,
                        "job " + std::to_string(id) + " has not ended yet (" +
                            rpc::to_string(e.status.phase) + "); poll status() or cancel() it");
  return e.result;
}

bool job_table::cancel(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  entry& e = find(id);
  if (has_ended(e.status.phase)) return false;
  if (e.status.phase == rpc::JobPhase::QUEUED) {
    queue_.erase(std::find(queue_.begin(), queue_.end(), id));
    e.status.phase = rpc::JobPhase::CANCELLED;
    e.result.id = id;
    e.result.phase = rpc::JobPhase::CANCELLED;
    e.result.error = "cancelled before it started";
    record([&] { journal_->ended(e.result); });
    ended(id);
    return true;
  }
  e.cancel = true;
  return true;
}

bool job_table::cancel_requested(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find(id).cancel;
}

void job_table::set_phase(int64_t id, rpc::JobPhase::type phase) {
  std::lock_guard<std::mutex> lock(mu_);
  find(id).status.phase = phase;
}

void job_table::set_tokens(int64_t id, int64_t done, int64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  entry& e = find(id);
  e.status.tokens_done = done;
  e.status.tokens_total = std::max(total, done);
}

void job_table::set_items(int64_t id, int done, int total) {
  std::lock_guard<std::mutex> lock(mu_);
  entry& e = find(id);
  e.status.items_done = done;
  e.status.items_total = total;
}

void job_table::finish(int64_t id, rpc::JobResult result, bool durable) {
  std::lock_guard<std::mutex> lock(mu_);
  entry& e = find(id);
  XCTX_ASSERT(has_ended(result.phase));
  result.id = id;
  if (durable) record([&] { journal_->ended(result); });
  e.status.phase = result.phase;
  e.status.error = result.error;
  if (result.phase == rpc::JobPhase::DONE)  // the estimate's upper bound gives way to what ran
    e.status.tokens_done = e.status.tokens_total = result.prompt_tokens + result.generated_tokens;
  e.status.elapsed_s = seconds_since(e.started);
  e.status.tokens_per_s = e.status.elapsed_s > 0 ? (double)e.status.tokens_done / e.status.elapsed_s : 0.0;
  e.status.eta_s = 0;
  counters_.busy_s += e.status.elapsed_s;
  counters_.prompt_tokens += result.prompt_tokens;
  counters_.generated_tokens += result.generated_tokens;
  e.result = std::move(result);
  running_.reset();
  ended(id);
}

void job_table::append_text(int64_t id, const std::string& piece) {
  if (piece.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  find(id).streamed += piece;
  stream_cv_.notify_all();
}

job_table::stream_read job_table::read_stream(int64_t id, size_t offset, std::chrono::milliseconds wait) const {
  std::unique_lock<std::mutex> lock(mu_);
  const auto ready = [&] {
    const entry& e = find(id);
    return e.streamed.size() > offset || has_ended(e.status.phase);
  };
  stream_cv_.wait_for(lock, wait, ready);
  const entry& e = find(id);
  stream_read r;
  if (e.streamed.size() > offset) r.text = e.streamed.substr(offset);
  r.ended = has_ended(e.status.phase);
  if (r.ended) r.result = e.result;
  return r;
}

double job_table::seconds_since_submitted(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return seconds_since(find(id).submitted);
}

void job_table::record(const std::function<void()>& write) {
  if (!journal_) return;
  try {
    write();
  } catch (const Error& e) {
    // The job's state stays right in memory (its client still gets its answer); what cannot be
    // made durable any more is new work, so submissions are refused from now on, by name.
    LOG(ERROR) << e.what();
    std::fprintf(stderr, "xctx: error: %s; the service takes no new jobs\n", e.what());
    journal_error_ = e.what();
  }
}

void job_table::ended(int64_t id) {
  switch (jobs_.at(id).status.phase) {
    case rpc::JobPhase::DONE: ++counters_.completed; break;
    case rpc::JobPhase::FAILED: ++counters_.failed; break;
    case rpc::JobPhase::CANCELLED: ++counters_.cancelled; break;
    default: XCTX_ASSERT(false);
  }
  jobs_.at(id).job = rpc::Job();  // the request's text is not needed any more
  ended_.push_back(id);
  stream_cv_.notify_all();
  while ((int)ended_.size() > keep_ended_) {
    jobs_.erase(ended_.front());
    ended_.pop_front();
  }
}

void job_table::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  while (!queue_.empty()) {
    const int64_t id = queue_.front();
    queue_.pop_front();
    entry& e = jobs_.at(id);
    e.status.phase = e.result.phase = rpc::JobPhase::CANCELLED;
    e.result.id = id;
    e.result.error = "the service shut down before the job started";
    ended(id);
  }
  cv_.notify_all();
}

void job_table::count_rejected() {
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.rejected;
}

rpc::Metrics job_table::metrics() const {
  std::lock_guard<std::mutex> lock(mu_);
  rpc::Metrics m = counters_;
  m.uptime_s = seconds_since(born_);
  m.queued = (int32_t)queue_.size();
  m.busy = running_.has_value();
  return m;
}

}  // namespace xctx
