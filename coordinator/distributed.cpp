#include "coordinator/distributed.h"

#include <unistd.h>

#include <cstdio>

#include "common/sys.h"

namespace xctx {

progress_line::progress_line(std::string label, bool enabled)
    : label_(std::move(label)), enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0) {}

void progress_line::operator()(int64_t done, int64_t total) {
  if (!enabled_ || total <= 0) return;
  if (tty_) {
    std::fprintf(stderr, "\r%s %lld/%lld", label_.c_str(), (long long)done, (long long)total);
    open_ = true;
  } else if (done * 4 >= next_quarter_ * total) {
    std::fprintf(stderr, "%s %lld/%lld\n", label_.c_str(), (long long)done, (long long)total);
    next_quarter_ = done * 4 / total + 1;
  }
}

void progress_line::finish() {
  if (open_) std::fprintf(stderr, "\n");
  open_ = false;
}

void broadcast_tokens(communicator& comm, std::vector<int32_t>& ids) {
  uint64_t n = ids.size();
  comm.broadcast(&n, sizeof n, 0);
  ids.resize(n);
  if (n > 0) comm.broadcast(ids.data(), n * sizeof(int32_t), 0);
}

void report_shards(communicator& comm, const sequence_parallel_runner& runner, cache_format fmt) {
  struct shard_report {
    int64_t tokens;
    uint64_t used, allocated, ring_sent, gather_sent, gather_recv;
  } mine{runner.cache().n_tokens(0), runner.cache().bytes_used(), runner.cache().bytes_allocated(),
         runner.stats().ring_bytes_sent, runner.stats().gather_bytes_sent, runner.stats().gather_bytes_recv};
  std::vector<shard_report> all(comm.size());
  comm.all_gather(&mine, all.data(), sizeof mine);
  if (comm.rank() != 0) return;
  std::fprintf(stderr, "[xctx] %-5s %10s %12s %12s %12s %14s\n", "rank", "tokens", "cache used", "allocated",
               "ring sent", "partials sent");
  uint64_t total = 0;
  for (int r = 0; r < comm.size(); ++r) {
    const shard_report& s = all[r];
    total += s.used;
    std::fprintf(stderr, "[xctx] %-5d %10lld %12s %12s %12s %14s\n", r, (long long)s.tokens,
                 format_bytes((double)s.used).c_str(), format_bytes((double)s.allocated).c_str(),
                 format_bytes((double)s.ring_sent).c_str(), format_bytes((double)s.gather_sent).c_str());
  }
  std::fprintf(stderr, "[xctx] cache %s, %d ranks, %s in all\n", format_traits(fmt).name, comm.size(),
               format_bytes((double)total).c_str());
}

}  // namespace xctx
