// Helpers for jobs that run on every rank with rank 0 as the coordinator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "common/sys.h"
#include "worker/sequence_parallel.h"

namespace xctx {

// Progress of a long step on stderr -- done/total, percent, rate and ETA (rate measured from
// construction): an updating line on a terminal; in a log (not a tty) one line per further
// `log_percent` percent, so a million-token prefill shows signs of life without flooding logs.
class progress_line {
 public:
  progress_line(std::string label, bool enabled, std::string unit = "tokens", int log_percent = 5);
  void operator()(int64_t done, int64_t total);
  void finish();  // ends the updating line

  // "1234/5678 tokens (21%) | 95.0 tokens/s | ETA 45 s" (rate and ETA once seconds > 0).
  static std::string format(int64_t done, int64_t total, const std::string& unit, double seconds);

 private:
  std::string label_, unit_;
  bool enabled_, tty_, open_ = false;
  int log_percent_;
  int64_t next_step_ = 1;
  stopwatch clock_;  // from construction
};

// Rank 0's vector reaches every rank (size first, then the elements).
void broadcast_tokens(communicator& comm, std::vector<int32_t>& ids);
// Rank 0's string reaches every rank.
void broadcast_string(communicator& comm, std::string& text);

// One line per rank on rank 0: tokens held and cache bytes (used / allocated), plus the bytes
// the rank moved. Collective.
// Collective: the per-rank table (tokens, cache bytes, traffic) on rank 0's stderr. Returns, on
// rank 0, per rank: tokens, cache_used/allocated bytes, peak_rss_bytes, base_rss_bytes (the
// caller's RSS before the sequence: weights and code), planned_bytes (the memory plan), and
// rss_parts / base_rss_parts (anonymous, file-backed and shared-memory pages now and before the
// sequence: where RSS beyond the plan went); an empty array elsewhere.
nlohmann::json report_shards(communicator& comm, const sequence_parallel_runner& runner, cache_format fmt,
                             size_t base_rss = 0, const rss_parts& base_parts = {});

}  // namespace xctx
