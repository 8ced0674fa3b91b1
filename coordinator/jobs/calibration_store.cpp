// The default nuq calibration of a model: found next to it, or made once (calibration_store.h).
#include "coordinator/jobs/calibration_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "common/error.h"
#include "common/sys.h"
#include "model/corpus.h"
#include "coordinator/jobs/distributed.h"
#include "model/tokenizer.h"
#include "worker/calibrate.h"
#include "worker/llama_engine.h"
#include "worker/run_params.h"

namespace xctx {

namespace fs = std::filesystem;

namespace {

// The text `xctx calibrate` documents for the bundled model (docs/kv_formats.md).
constexpr const char* kDefaultCalibrationText = "austen:sensesensibility";

bool writable_dir(const fs::path& dir) { return !dir.empty() && ::access(dir.c_str(), W_OK) == 0; }

fs::path user_cache_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && x[0] != '\0') return fs::path(x) / "xctx";
  if (const char* h = std::getenv("HOME"); h != nullptr && h[0] != '\0') return fs::path(h) / ".cache" / "xctx";
  return fs::temp_directory_path() / "xctx";
}

// An exclusive flock on `path` held for the object's lifetime (released by close, also when the
// process dies, so a killed maker never leaves the others waiting).
class file_lock {
 public:
  explicit file_lock(const std::string& path) : fd_(::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644)) {
    XCTX_CHECK(fd_ >= 0, "cannot open the calibration lock ", path, ": ", std::strerror(errno));
    while (::flock(fd_, LOCK_EX) != 0) {
      XCTX_CHECK(errno == EINTR, "cannot lock ", path, ": ", std::strerror(errno));
    }
  }
  ~file_lock() { ::close(fd_); }
  file_lock(const file_lock&) = delete;
  file_lock& operator=(const file_lock&) = delete;

 private:
  int fd_;
};

}  // namespace

std::string stored_calibration::describe() const {
  if (made_by_another) return "calibration " + path + " (made now by another process of this job)";
  if (!made_now) return "calibration " + path + " (found)";
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.0f s", make_seconds);
  return "calibration " + path + " (made now in " + secs + " from " + (cal ? cal->text_source : "?") + ")";
}

std::string default_calibration_path(const std::string& model_path, uint64_t fingerprint) {
  fs::path model = fs::path(model_path);
  if (!model.has_filename()) model = model.parent_path();  // "dir/" of a checkpoint
  char key[24];
  std::snprintf(key, sizeof key, "%016" PRIx64, fingerprint);
  const std::string name = model.stem().string() + "." + key + ".calib";
  if (const char* dir = std::getenv("XCTX_CALIB_DIR"); dir != nullptr && dir[0] != '\0') return (fs::path(dir) / name).string();
  fs::path dir = fs::absolute(model).parent_path();
  if (!writable_dir(dir)) dir = user_cache_dir();
  return (dir / name).string();
}

stored_calibration find_or_make_calibration(const std::string& path, uint64_t fingerprint,
                                            const std::function<calibration()>& make) {
  stored_calibration out;
  out.path = path;
  const fs::path dir = fs::path(path).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    XCTX_CHECK(!ec, "cannot create ", dir.string(), " for the calibration file: ", ec.message(),
               " (set XCTX_CALIB_DIR, or pass --calib FILE)");
  }
  if (!fs::exists(path)) {
    file_lock lock(path + ".lock");
    out.made_by_another = fs::exists(path);  // another rank made it while this one waited
    if (!out.made_by_another) {
      stopwatch clock;
      const calibration c = make();
      XCTX_CHECK(c.model_fingerprint == fingerprint, "the calibration made for ", path, " has another model's fingerprint");
      const std::string tmp = path + ".tmp." + std::to_string(::getpid());
      save_calibration(c, tmp);
      fs::rename(tmp, path);
      out.made_now = true;
      out.make_seconds = clock.seconds();
    }
  }
  auto c = std::make_shared<calibration>(load_calibration(path));
  XCTX_CHECK(c->model_fingerprint == fingerprint, "calibration file ", path,
             " does not belong to this model (its fingerprint differs from the one in its name); delete it to "
             "remake it, or pass --calib FILE");
  out.cal = std::move(c);
  return out;
}

calibration make_calibration(const model_weights& w, backend& be, const tokenizer& tok, const run_params& rp,
                             const calibrate_options& co, bool report) {
  run_params crp = rp;
  crp.cache = cache_format::cache_fp32;  // calibration reads the exact activations
  crp.n_ctx = co.seq_len;
  crp.se_group = 1;  // the model's own positions: the datatypes fit its trained activations
  crp.rope_scale = rope_scaling::rope_scaling_none;
  crp.rope_factor = 1.0f;
  const std::vector<int32_t> ids = tok.encode(load_text(co.text_source), false, false);
  const size_t C = (size_t)w.hp.kv_dim();
  if (report)
    std::fprintf(stderr, "[xctx] calibrating %s on %s: %zu tokens, %d windows of %d, seed %llu, %s weighting (~%s of keys held)\n",
                 w.hp.name.c_str(), co.text_source.c_str(), ids.size(), co.n_samples, co.seq_len,
                 (unsigned long long)co.seed, co.weighted ? "attention" : "none",
                 format_bytes(2.0 * 4 * C * w.hp.n_layer * (double)co.n_samples * co.seq_len).c_str());
  llama_engine engine(w, be, crp);
  progress_line fwd("calibrate: forward", report, "windows"), fit("calibrate: k-means", report, "layers");
  calibration c = calibrate_model(engine, be, ids, model_fingerprint(w), co,
                                  [&](const std::string& stage, int64_t done, int64_t total) {
                                    if (stage == "forward") {
                                      fwd(done, total);
                                    } else {
                                      fwd.finish();
                                      fit(done, total);
                                    }
                                  });
  fit.finish();
  return c;
}

calibration make_default_calibration(const model_weights& w, backend& be, const tokenizer& tok, const run_params& rp,
                                     bool report) {
  calibrate_options co;  // xctx calibrate's defaults
  co.text_source = kDefaultCalibrationText;
  if (report)
    std::fprintf(stderr, "[xctx] no calibration for this model yet: making one, once (`xctx calibrate`'s defaults; "
                         "--calib FILE uses another)\n");
  return make_calibration(w, be, tok, rp, co, report);
}

}  // namespace xctx
