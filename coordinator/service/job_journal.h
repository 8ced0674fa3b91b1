// The service's job journal (`xctx serve --journal DIR`, docs/service.md): every accepted job is
// written and fsync'd before the client hears its id, and every start and end after it, so a
// service that dies (a rank killed, the node rebooted) and is started again on the same DIR knows
// what it owed: jobs still queued run, a job that was running is retried or failed by policy,
// ended jobs keep answering status() and result(). Ids continue where they stopped.
//
// DIR/jobs.journal is a sequence of records, each
//   "XJR1" | type u8 (1 accepted, 2 started, 3 ended) | job id i64 | payload bytes u32 | payload | crc32
// (little-endian; crc32 over type..payload; payload: the Job or the JobResult, Thrift binary).
// Opening replays the file, stops at a torn last record (a crash mid-write leaves one) or at a
// corrupt one (kept beside as jobs.journal.corrupt-N), and rewrites it compacted: the pending
// jobs and the last keep_ended ended ones, so the file stays bounded.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xctx_types.h"

namespace xctx {

class job_journal {
 public:
  struct pending {
    int64_t id = 0;
    rpc::Job job;
    int starts = 0;  // times it was started before: > 0 means it was running when the service stopped
  };
  struct replay {
    std::vector<pending> jobs;           // accepted, not ended, in submission order
    std::vector<rpc::JobResult> ended;   // oldest first (result.id set)
    int64_t next_id = 1;
    int64_t torn_bytes = 0;              // a torn or corrupt tail that was left out
  };

  // Creates DIR when needed, replays and compacts DIR/jobs.journal. Throws naming the path.
  job_journal(const std::string& dir, int keep_ended);
  ~job_journal();
  job_journal(const job_journal&) = delete;
  job_journal& operator=(const job_journal&) = delete;

  const replay& replayed() const { return replay_; }
  const std::string& path() const { return path_; }

  // Each record is written whole and fsync'd before these return; they throw xctx::Error naming
  // the file and the system's reason (a full disk: "No space left on device").
  void accepted(int64_t id, const rpc::Job& job);
  void started(int64_t id);
  void ended(const rpc::JobResult& result);

 private:
  void append(uint8_t type, int64_t id, const std::string& payload);
  void load();
  void compact();

  std::string dir_, path_;
  int keep_ended_;
  int fd_ = -1;
  replay replay_;
};

// A record's bytes (exposed for the tests that write torn and corrupt journals).
std::string journal_record(uint8_t type, int64_t id, const std::string& payload);

}  // namespace xctx
