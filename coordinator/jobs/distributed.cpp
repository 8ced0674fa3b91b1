#include "coordinator/jobs/distributed.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "common/sys.h"

namespace xctx {

progress_line::progress_line(std::string label, bool enabled, std::string unit, int log_percent)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      enabled_(enabled),
      tty_(isatty(STDERR_FILENO) != 0),
      log_percent_(std::clamp(log_percent, 1, 100)) {}

std::string progress_line::format(int64_t done, int64_t total, const std::string& unit, double seconds) {
  char buf[160];
  int n = std::snprintf(buf, sizeof buf, "%lld/%lld %s (%.0f%%)", (long long)done, (long long)total, unit.c_str(),
                        total > 0 ? 100.0 * done / total : 0.0);
  if (seconds > 0 && done > 0) {
    const double rate = done / seconds;
    n += std::snprintf(buf + n, sizeof buf - n, " | %.1f %s/s", rate, unit.c_str());
    if (done < total) {
      const double eta = (total - done) / rate;
      if (eta < 120)
        std::snprintf(buf + n, sizeof buf - n, " | ETA %.0f s", eta);
      else if (eta < 7200)
        std::snprintf(buf + n, sizeof buf - n, " | ETA %.0f min %02.0f s", std::floor(eta / 60), std::fmod(eta, 60));
      else
        std::snprintf(buf + n, sizeof buf - n, " | ETA %.0f h %02.0f min", std::floor(eta / 3600),
                      std::floor(std::fmod(eta, 3600) / 60));
    }
  }
  return buf;
}

void progress_line::operator()(int64_t done, int64_t total) {
  if (!enabled_ || total <= 0) return;
  if (tty_) {
    std::fprintf(stderr, "\r%s %s\033[K", label_.c_str(), format(done, total, unit_, clock_.seconds()).c_str());
    open_ = true;
  } else if (done * 100 >= next_step_ * log_percent_ * total) {
    std::fprintf(stderr, "%s %s\n", label_.c_str(), format(done, total, unit_, clock_.seconds()).c_str());
    next_step_ = done * 100 / (log_percent_ * total) + 1;
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

void broadcast_string(communicator& comm, std::string& text) {
  uint64_t n = text.size();
  comm.broadcast(&n, sizeof n, 0);
  text.resize(n);
  if (n > 0) comm.broadcast(text.data(), n, 0);
}

nlohmann::json report_shards(communicator& comm, const sequence_parallel_runner& runner, cache_format fmt,
                             size_t base_rss, const rss_parts& base_parts) {
  struct shard_report {
    int64_t tokens;
    uint64_t used, allocated, ring_sent, gather_sent, gather_recv, peak_rss, base_rss, planned;
    rss_parts now, base;
    uint64_t selection_sent, summary_read, units_attended, decode_tokens;
  } mine{runner.cache().n_tokens(0), runner.cache().bytes_used(), runner.cache().bytes_allocated(),
         runner.stats().ring_bytes_sent, runner.stats().gather_bytes_sent, runner.stats().gather_bytes_recv,
         peak_rss_bytes(), base_rss, runner.planned_bytes(), current_rss_parts(), base_parts,
         runner.stats().retrieval_bytes_sent, runner.stats().retrieval_summary_bytes_read,
         runner.stats().retrieval_units_attended, runner.stats().decode_tokens};
  const auto parts_json = [](const rss_parts& p) {
    return nlohmann::json{{"anon", p.anon}, {"file", p.file}, {"shmem", p.shmem}, {"malloc_free", p.malloc_free}};
  };
  std::vector<shard_report> all(comm.size());
  comm.all_gather(&mine, all.data(), sizeof mine);
  nlohmann::json out = nlohmann::json::array();
  if (comm.rank() != 0) return out;
  for (const shard_report& s : all)
    out.push_back({{"tokens", s.tokens}, {"cache_used", s.used}, {"cache_allocated", s.allocated},
                   {"ring_sent", s.ring_sent}, {"peak_rss_bytes", s.peak_rss}, {"base_rss_bytes", s.base_rss},
                   {"planned_bytes", s.planned}, {"partials_sent", s.gather_sent},
                   {"selection_sent", s.selection_sent}, {"summary_bytes_read", s.summary_read},
                   {"units_attended", s.units_attended}, {"merged_tokens", s.decode_tokens},
                   {"rss_parts", parts_json(s.now)}, {"base_rss_parts", parts_json(s.base)}});
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
  if (runner.selector() != nullptr) {  // retrieval: the selection's own collective and reads, per merged token
    const shard_report& s = all[0];
    const double t = (double)std::max<uint64_t>(s.decode_tokens, 1);
    std::fprintf(stderr,
                 "[xctx] retrieval (rank 0, per merged token): selection gather %s beside the merge's %s, block "
                 "summaries read %s, %.0f units of %d tokens attended over all layers\n",
                 format_bytes(s.selection_sent / t).c_str(), format_bytes(s.gather_sent / t).c_str(),
                 format_bytes(s.summary_read / t).c_str(), s.units_attended / t, kAttnUnit);
  }
  return out;
}

}  // namespace xctx
