// The service's jobs on rank 0: a FIFO queue, each job's phase and progress, results, cancel
// flags and the counters behind metrics(). Thread-safe: the Thrift handler threads submit and
// ask; the job loop (rank 0's main thread) takes jobs and reports progress.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "coordinator/jobs/sampler.h"
#include "xctx_types.h"

namespace xctx {

// A refusal the client sees as RequestError{code, message}.
rpc::RequestError request_error(rpc::ErrorCode::type code, const std::string& message);

// A job in the service's wire format (Thrift binary protocol) and back: the size limit counts
// these bytes. parse_job throws xctx::Error on bytes that are not a Job.
std::string serialize_job(const rpc::Job& job);
rpc::Job parse_job(const std::string& bytes);

struct service_limits {
  int64_t max_request_bytes = 8 << 20;  // a Job, serialized
  int64_t max_context = 8192;          // prompt + output tokens of one sequence
  int max_output_tokens = 1024;
};
// The checks a job passes before it is queued; throws RequestError (BAD_REQUEST, TOO_LARGE)
// naming the field. Token counts are checked when the job runs (tokenizing belongs there).
void check_job_request(const rpc::Job& job, const service_limits& limits);

// A generate job's sampler settings (unchecked: check_job_request checks them).
sampler_params sampling_of(const rpc::GenerateJob& g);

class job_journal;

// What a restarted service does with a job that was running when the last one stopped.
enum class interrupted_policy { retry_once, fail };

class job_table {
 public:
  // max_queue: jobs waiting at most; keep_ended: ended jobs whose status and result stay
  // answerable (older ones are forgotten, so a long-running service holds bounded memory).
  // journal (optional, not owned): every accepted job, start and end is written to it before
  // the table acknowledges it; the table starts from what it replayed (coordinator/service/job_journal.h).
  job_table(int max_queue, int keep_ended, job_journal* journal = nullptr,
            interrupted_policy policy = interrupted_policy::retry_once);

  // Queues a job. Throws RequestError QUEUE_FULL, SHUTTING_DOWN, or INTERNAL when the journal
  // cannot be written (the job is then not accepted).
  int64_t submit(const rpc::Job& job);
  // The next queued job, marked running, or nothing after `wait` (or at once once closed).
  std::optional<std::pair<int64_t, rpc::Job>> next(std::chrono::milliseconds wait);

  // Throw RequestError NOT_FOUND for an unknown (or forgotten) id; result() NOT_FINISHED for a
  // job that has not ended.
  rpc::JobStatus status(int64_t id) const;
  rpc::JobResult result(int64_t id) const;
  // A queued job ends CANCELLED at once; a running one is flagged and ends at its next step
  // boundary. False when the job had ended already.
  bool cancel(int64_t id);
  bool cancel_requested(int64_t id) const;

  // Progress of the running job (tokens: prompt read + generated; items: documents or trials).
  void set_phase(int64_t id, rpc::JobPhase::type phase);
  void set_tokens(int64_t id, int64_t done, int64_t total);
  void set_items(int64_t id, int done, int total);
  // Ends the running job: result.phase is DONE, FAILED or CANCELLED. durable false: the end is
  // not journaled (a job stopped by the service's own shutdown runs again after a restart).
  void finish(int64_t id, rpc::JobResult result, bool durable = true);

  // Streaming (the HTTP front's server-sent events): the running job appends its output text as
  // it becomes final; a reader takes what lies past `offset`, waiting up to `wait` for more.
  void append_text(int64_t id, const std::string& piece);
  struct stream_read {
    std::string text;        // streamed bytes past the offset
    bool ended = false;      // the job has ended: `result` is its result
    rpc::JobResult result;
  };
  stream_read read_stream(int64_t id, size_t offset, std::chrono::milliseconds wait) const;
  // Seconds since the job was submitted (its time to first token counts the queue).
  double seconds_since_submitted(int64_t id) const;

  // Submissions are refused from now on; jobs still queued end CANCELLED.
  void close();
  void count_rejected();
  rpc::Metrics metrics() const;

 private:
  struct entry {
    rpc::Job job;
    rpc::JobStatus status;
    rpc::JobResult result;
    bool cancel = false;
    std::chrono::steady_clock::time_point submitted, started;
    std::string streamed;  // append_text's pieces (bounded by the job's output tokens)
  };
  entry& find(int64_t id);
  const entry& find(int64_t id) const;
  void ended(int64_t id);  // bookkeeping of a job that just ended (lock held)
  void record(const std::function<void()>& write);  // a journal write after acceptance (lock held)

  const int max_queue_, keep_ended_;
  job_journal* journal_;
  std::string journal_error_;  // set once a start or end could not be written: no new jobs
  mutable std::mutex mu_;
  std::condition_variable cv_;
  mutable std::condition_variable stream_cv_;  // text appended or a job ended
  std::map<int64_t, entry> jobs_;
  std::deque<int64_t> queue_;      // waiting, in order
  std::deque<int64_t> ended_;      // ended, oldest first (forgotten beyond keep_ended_)
  int64_t next_id_ = 1;
  bool closed_ = false;
  const std::chrono::steady_clock::time_point born_ = std::chrono::steady_clock::now();
  rpc::Metrics counters_;
  std::optional<int64_t> running_;
};

}  // namespace xctx
