#include "coordinator/service/job_journal.h"

#include <fcntl.h>
#include <glog/logging.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>

#include "common/error.h"
#include "common/sys.h"
#include "coordinator/service/thrift_wire.h"

namespace xctx {
namespace {

constexpr char kMagic[4] = {'X', 'J', 'R', '1'};
constexpr uint8_t kAccepted = 1, kStarted = 2, kEnded = 3;
constexpr size_t kHeader = 4 + 1 + 8 + 4, kTrailer = 4;
constexpr uint32_t kMaxPayload = 1u << 30;

template <class T>
void put_le(std::string& s, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) s.push_back((char)((uint64_t)v >> (8 * i) & 0xff));
}
template <class T>
T get_le(const char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= (uint64_t)(uint8_t)p[i] << (8 * i);
  return (T)v;
}

uint32_t crc_of(const char* p, size_t n) { return (uint32_t)crc32(0L, reinterpret_cast<const Bytef*>(p), (uInt)n); }

void write_all(int fd, const std::string& bytes, const std::string& path) {
  write_all_bytes(fd, bytes.data(), bytes.size(), "the job journal " + path);
  XCTX_CHECK(::fdatasync(fd) == 0 || errno == EINVAL, "cannot sync the job journal ", path, ": ", std::strerror(errno));
}

}  // namespace

std::string journal_record(uint8_t type, int64_t id, const std::string& payload) {
  std::string r(kMagic, 4);
  r.push_back((char)type);
  put_le<int64_t>(r, id);
  put_le<uint32_t>(r, (uint32_t)payload.size());
  r += payload;
  put_le<uint32_t>(r, crc_of(r.data() + 4, r.size() - 4));
  return r;
}

job_journal::job_journal(const std::string& dir, int keep_ended)
    : dir_(dir), path_((std::filesystem::path(dir) / "jobs.journal").string()), keep_ended_(keep_ended) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  XCTX_CHECK(!ec && std::filesystem::is_directory(dir_), "--journal ", dir_, " is not a directory we can create: ",
             ec ? ec.message() : "exists and is not a directory");
  load();
  compact();
}

job_journal::~job_journal() {
  if (fd_ >= 0) ::close(fd_);
}

void job_journal::load() {
  if (!std::filesystem::exists(path_)) return;
  const std::string bytes = read_file_bytes(path_, "--journal");
  std::map<int64_t, pending> open;  // by id: ids grow with submission order
  std::map<int64_t, rpc::JobResult> ended;
  size_t at = 0;
  std::string problem;
  while (at < bytes.size()) {
    if (bytes.size() - at < kHeader + kTrailer) {
      problem = "a torn last record";
      break;
    }
    const char* p = bytes.data() + at;
    const uint32_t n = get_le<uint32_t>(p + 13);
    if (std::memcmp(p, kMagic, 4) != 0 || n > kMaxPayload) {
      problem = "a corrupt record header";
      break;
    }
    if (bytes.size() - at < kHeader + n + kTrailer) {
      problem = "a torn last record";
      break;
    }
    if (get_le<uint32_t>(p + kHeader + n) != crc_of(p + 4, kHeader - 4 + n)) {
      problem = at + kHeader + n + kTrailer == bytes.size() ? "a torn last record" : "a record with a bad checksum";
      break;
    }
    const uint8_t type = (uint8_t)p[4];
    const int64_t id = get_le<int64_t>(p + 5);
    const std::string payload(p + kHeader, n);
    std::string why;
    bool ok = id >= 1;
    if (ok && type == kAccepted) {
      pending j;
      j.id = id;
      ok = from_thrift_bytes(payload, j.job, &why);
      if (ok) open[id] = std::move(j);
    } else if (ok && type == kStarted) {
      if (auto it = open.find(id); it != open.end()) ++it->second.starts;
    } else if (ok && type == kEnded) {
      rpc::JobResult r;
      ok = from_thrift_bytes(payload, r, &why);
      if (ok) {
        r.id = id;
        open.erase(id);
        ended[id] = std::move(r);
      }
    } else {
      ok = false;
    }
    if (!ok) {
      problem = "an unreadable record (" + (why.empty() ? "type " + std::to_string(type) : why) + ")";
      break;
    }
    replay_.next_id = std::max(replay_.next_id, id + 1);
    at += kHeader + n + kTrailer;
  }
  if (!problem.empty()) {
    replay_.torn_bytes = (int64_t)(bytes.size() - at);
    if (problem != "a torn last record") {  // keep the evidence; the good prefix is replayed
      for (int k = 1;; ++k) {
        const std::string keep = path_ + ".corrupt-" + std::to_string(k);
        if (!std::filesystem::exists(keep)) {
          std::filesystem::copy_file(path_, keep);
          break;
        }
      }
    }
    LOG(WARNING) << "job journal " << path_ << ": " << problem << " at byte " << at << "; its last "
                 << replay_.torn_bytes << " bytes are left out";
    std::fprintf(stderr, "[xctx] job journal %s: %s at byte %zu; the last %lld bytes are left out\n", path_.c_str(),
                 problem.c_str(), at, (long long)replay_.torn_bytes);
  }
  for (auto& [id, j] : open) replay_.jobs.push_back(std::move(j));
  for (auto& [id, r] : ended) replay_.ended.push_back(std::move(r));
  if ((int)replay_.ended.size() > keep_ended_)
    replay_.ended.erase(replay_.ended.begin(), replay_.ended.end() - keep_ended_);
}

void job_journal::compact() {
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  XCTX_CHECK(fd >= 0, "cannot write the job journal ", tmp, ": ", std::strerror(errno));
  std::string bytes;
  for (const rpc::JobResult& r : replay_.ended) {
    bytes += journal_record(kAccepted, r.id, to_thrift_bytes(rpc::Job()));
    bytes += journal_record(kEnded, r.id, to_thrift_bytes(r));
  }
  for (const pending& j : replay_.jobs) {
    bytes += journal_record(kAccepted, j.id, to_thrift_bytes(j.job));
    for (int s = 0; s < j.starts; ++s) bytes += journal_record(kStarted, j.id, "");
  }
  try {
    write_all(fd, bytes, tmp);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  std::filesystem::rename(tmp, path_);
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  XCTX_CHECK(fd_ >= 0, "cannot open the job journal ", path_, ": ", std::strerror(errno));
  // The rename itself is durable once the directory is synced.
  const int dfd = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void job_journal::append(uint8_t type, int64_t id, const std::string& payload) {
  XCTX_CHECK(payload.size() <= kMaxPayload, "a job journal record of ", payload.size(), " bytes is over 1 GiB");
  const off_t end = ::lseek(fd_, 0, SEEK_END);
  try {
    write_all(fd_, journal_record(type, id, payload), path_);
  } catch (...) {
    // A record the disk took only part of is cut off again, so the next one does not follow a
    // torn record (which replay would stop at).
    if (end >= 0 && ::ftruncate(fd_, end) != 0) LOG(ERROR) << "cannot cut the torn record off " << path_;
    throw;
  }
}

void job_journal::accepted(int64_t id, const rpc::Job& job) { append(kAccepted, id, to_thrift_bytes(job)); }
void job_journal::started(int64_t id) { append(kStarted, id, ""); }
void job_journal::ended(const rpc::JobResult& r) { append(kEnded, r.id, to_thrift_bytes(r)); }

}  // namespace xctx
