// Helpers for jobs that run on every rank with rank 0 as the coordinator.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "worker/sequence_parallel.h"

namespace xctx {

// Rank 0's vector reaches every rank (size first, then the elements).
void broadcast_tokens(communicator& comm, std::vector<int32_t>& ids);

// One line per rank on rank 0: tokens held and cache bytes (used / allocated), plus the bytes
// the rank moved. Collective.
void report_shards(communicator& comm, const sequence_parallel_runner& runner, cache_format fmt);

}  // namespace xctx
