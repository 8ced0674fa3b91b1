#include "common/sys.h"

#include <glog/logging.h>
#include <malloc.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>

#include "common/error.h"

namespace xctx {
namespace {

size_t read_status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t len = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, len, field) == 0) return std::strtoull(line.c_str() + len + 1, nullptr, 10);
  }
  return 0;
}

}  // namespace

size_t peak_rss_bytes() { return read_status_kib("VmHWM") * 1024; }
size_t current_rss_bytes() { return read_status_kib("VmRSS") * 1024; }
rss_parts current_rss_parts() {
  rss_parts p;
  p.anon = read_status_kib("RssAnon") * 1024;
  p.file = read_status_kib("RssFile") * 1024;
  p.shmem = read_status_kib("RssShmem") * 1024;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  p.malloc_free = mallinfo2().fordblks;
#endif
  return p;
}

std::string format_bytes(double bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

int node_local_ranks() {
  // OpenMPI, MPICH/Hydra, Slurm's srun: the ranks of this job placed on this node.
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    if (const char* env = std::getenv(var)) {
      const int n = std::atoi(env);
      if (n > 0) return n;
    }
  }
  return 1;
}

std::string where_am_i() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  std::string s = std::string("host ") + (host[0] ? host : "?");
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    if (const char* r = std::getenv(var)) return s + " rank " + r;
  }
  return s;
}

int node_local_rank(std::string* source) {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    const char* env = std::getenv(var);
    if (env == nullptr || *env == '\0') continue;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    XCTX_CHECK(*end == '\0' && v >= 0 && v < (1L << 30), "environment ", var, "='", env,
               "' is not a node-local rank (a non-negative integer)");
    if (source != nullptr) *source = var;
    return (int)v;
  }
  return -1;
}

int default_threads() {
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  cpu_set_t set;
  const int usable = sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : 1;
  // Under mpirun every unbound rank sees all of the node's cores; OpenMP would start that many
  // threads in each rank and oversubscribe the node (measured 3x slower at 4 ranks on 2 cores).
  // A rank bound to its own cores keeps them (the min).
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  const int share = (int)std::max<long>(1, (online > 0 ? online : usable) / node_local_ranks());
  return std::max(1, std::min(usable, share));
}

void init_logging(const char* argv0) {
  static std::once_flag once;
  std::call_once(once, [argv0] {
    FLAGS_logtostderr = true;
    google::InitGoogleLogging(argv0);
  });
}

void write_all_bytes(int fd, const char* data, size_t n, const std::string& path) {
  size_t done = 0;
  while (done < n) {
    const ssize_t w = ::write(fd, data + done, n - done);
    if (w < 0 && errno == EINTR) continue;
    XCTX_CHECK(w > 0, "cannot write ", path, ": ", std::strerror(errno));
    done += (size_t)w;
  }
}

std::string read_file_bytes(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  XCTX_CHECK(in.good(), "cannot read ", what.empty() ? "" : what + " ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  XCTX_CHECK(!in.bad(), "read error on ", path);
  return ss.str();
}

long long parse_count(const std::string& text, const std::string& what) {
  XCTX_CHECK(!text.empty(), what, ": empty value");
  size_t i = 0;
  while (i < text.size() && std::isdigit((unsigned char)text[i])) ++i;
  XCTX_CHECK(i > 0, what, ": '", text, "' is not a count (examples: 2048, 32K, 1M)");
  XCTX_CHECK(i <= 15, what, ": '", text, "' is too large");
  const long long n = std::stoll(text.substr(0, i));
  const std::string suffix = text.substr(i);
  long long mult = 1;
  if (suffix == "K" || suffix == "k") {
    mult = 1024;
  } else if (suffix == "M" || suffix == "m") {
    mult = 1024 * 1024;
  } else {
    XCTX_CHECK(suffix.empty(), what, ": unknown suffix '", suffix, "' in '", text, "' (use K or M)");
  }
  // No count the project takes comes near 2^62; refuse before the product could wrap.
  constexpr long long kMaxCount = 1LL << 62;
  XCTX_CHECK(n <= kMaxCount / mult, what, ": '", text, "' is too large");
  return n * mult;
}

}  // namespace xctx
