// Helpers for jobs that run on every rank with rank 0 as the coordinator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "worker/sequence_parallel.h"

namespace xctx {

// Progress of a long step on stderr: an updating line on a terminal; in a log (not a tty) a
// line at each further 25% only, so logs stay readable.
class progress_line {
 public:
  progress_line(std::string label, bool enabled);
  void operator()(int64_t done, int64_t total);
  void finish();  // ends the updating line

 private:
  std::string label_;
  bool enabled_, tty_, open_ = false;
  int64_t next_quarter_ = 1;
};

// Rank 0's vector reaches every rank (size first, then the elements).
void broadcast_tokens(communicator& comm, std::vector<int32_t>& ids);

// One line per rank on rank 0: tokens held and cache bytes (used / allocated), plus the bytes
// the rank moved. Collective.
void report_shards(communicator& comm, const sequence_parallel_runner& runner, cache_format fmt);

}  // namespace xctx
