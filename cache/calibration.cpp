#include "cache/calibration.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "common/error.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace xctx {
namespace {

constexpr char kMagic[8] = {'X', 'C', 'T', 'X', 'C', 'A', 'L', 'B'};

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

class writer {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void put_str(const std::string& s) {
    put<uint32_t>((uint32_t)s.size());
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  void put_floats(const std::vector<float>& v) {
    put<uint32_t>((uint32_t)v.size());
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    buf_.insert(buf_.end(), p, p + v.size() * sizeof(float));
  }
  std::vector<uint8_t>& bytes() { return buf_; }

 private:
  std::vector<uint8_t> buf_;
};

class reader {
 public:
  reader(const std::vector<uint8_t>& b, size_t end, const std::string& path) : b_(b), end_(end), path_(path) {}
  template <typename T>
  T get(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string get_str(const char* what) {
    const uint32_t n = get<uint32_t>(what);
    need(n, what);
    std::string s(reinterpret_cast<const char*>(b_.data() + at_), n);
    at_ += n;
    return s;
  }
  std::vector<float> get_floats(size_t expect, const char* what) {
    const uint32_t n = get<uint32_t>(what);
    XCTX_CHECK(n == expect, "calibration ", path_, ": ", what, " has ", n, " entries, expected ", expect);
    need((size_t)n * sizeof(float), what);
    std::vector<float> v(n);
    std::memcpy(v.data(), b_.data() + at_, (size_t)n * sizeof(float));
    at_ += (size_t)n * sizeof(float);
    return v;
  }
  size_t at() const { return at_; }

 private:
  void need(size_t n, const char* what) {
    XCTX_CHECK(at_ + n <= end_, "calibration ", path_, " is truncated (reading ", what, " at byte ", at_, ")");
  }
  const std::vector<uint8_t>& b_;
  size_t end_;
  std::string path_;
  size_t at_ = 0;
};

void put_type(writer& w, const nuq_datatype& t) {
  w.put_floats(t.centroids);
  w.put(t.mean_pre), w.put(t.std_pre), w.put(t.mean_post), w.put(t.std_post);
}
nuq_datatype get_type(reader& r, int bits, const std::string& path) {
  nuq_datatype t;
  t.centroids = r.get_floats((size_t)1 << bits, "centroids");
  t.mean_pre = r.get<double>("statistics"), t.std_pre = r.get<double>("statistics");
  t.mean_post = r.get<double>("statistics"), t.std_post = r.get<double>("statistics");
  for (size_t i = 0; i < t.centroids.size(); ++i)
    XCTX_CHECK(std::isfinite(t.centroids[i]) && (i == 0 || t.centroids[i - 1] < t.centroids[i]), "calibration ",
               path, ": centroids of a ", bits, "-bit datatype are not finite and strictly ascending");
  XCTX_CHECK(t.std_pre > 0.0 && t.std_post > 0.0 && std::isfinite(t.mean_pre) && std::isfinite(t.mean_post),
             "calibration ", path, ": bad Q-Norm statistics");
  return t;
}

}  // namespace

std::vector<float> nuq_datatype::lut(bool qnorm) const {
  if (!qnorm) return centroids;
  std::vector<float> out(centroids.size());
  // KVQuant eq. 3: C^ = (C - mu2) * sigma1 / sigma2 + mu1 keeps the quantized distribution's
  // mean and spread equal to the original's. An affine map with positive slope: order kept.
  for (size_t i = 0; i < centroids.size(); ++i)
    out[i] = (float)(((double)centroids[i] - mean_post) * std_pre / std_post + mean_pre);
  return out;
}

int calibration::setting_for(double outlier_fraction) {
  for (int s = 0; s < kCalibSettings; ++s)
    if (std::fabs(kCalibOutlierFraction[s] - outlier_fraction) < 1e-9) return s;
  fail("calibration holds outlier fractions 0 and 0.01, not ", outlier_fraction);
}

const calib_layer_setting& calibration::layer(double outlier_fraction, int l) const {
  const auto& v = layers.at(setting_for(outlier_fraction));
  XCTX_CHECK(l >= 0 && l < (int)v.size(), "calibration has ", v.size(), " layers, asked for layer ", l);
  return v[l];
}

void calibration::check_model(uint64_t fingerprint, const model_hparams& hp, const std::string& path) const {
  XCTX_CHECK(n_layer == hp.n_layer && n_head_kv == hp.n_head_kv && head_dim == hp.head_dim, "calibration ", path,
             " was made for ", model_name, " (", n_layer, " layers, ", n_head_kv, " kv heads of ", head_dim,
             "), not for ", hp.name, " (", hp.n_layer, " layers, ", hp.n_head_kv, " kv heads of ", hp.head_dim,
             ")");
  XCTX_CHECK(fingerprint == model_fingerprint, "calibration ", path, " was made for ", model_name,
             " (fingerprint ", std::hex, model_fingerprint, ") and does not match this model ", hp.name,
             " (fingerprint ", fingerprint, std::dec, "): run `xctx calibrate` for it");
}

uint64_t model_fingerprint(const model_weights& w) {
  const int fields[] = {w.hp.n_layer, w.hp.n_embd, w.hp.n_ff, w.hp.n_head, w.hp.n_head_kv, w.hp.head_dim,
                        w.hp.n_vocab};
  uint64_t h = fnv1a(fields, sizeof fields);
  h = fnv1a(&w.hp.rope_freq_base, sizeof w.hp.rope_freq_base, h);
  for (const layer_weights& l : w.layers) h = fnv1a(l.wk.data, l.wk.bytes(), h);
  return h;
}

void save_calibration(const calibration& c, const std::string& path) {
  writer w;
  for (char ch : kMagic) w.put(ch);
  w.put<uint32_t>(calibration::kVersion);
  w.put(c.model_fingerprint);
  w.put_str(c.model_name);
  w.put<int32_t>(c.n_layer), w.put<int32_t>(c.n_head_kv), w.put<int32_t>(c.head_dim);
  w.put_str(c.text_source), w.put_str(c.weighting);
  w.put<int32_t>(c.n_samples), w.put<int32_t>(c.seq_len), w.put<uint64_t>(c.seed);
  for (int s = 0; s < kCalibSettings; ++s) {
    XCTX_CHECK((int)c.layers[s].size() == c.n_layer, "save_calibration: setting ", s, " has ", c.layers[s].size(),
               " layers, expected ", c.n_layer);
    for (const calib_layer_setting& l : c.layers[s]) {
      w.put_floats(l.k_lo), w.put_floats(l.k_hi);
      for (int b = 0; b < 3; ++b) put_type(w, l.k[b]), put_type(w, l.v[b]);
    }
  }
  const uint64_t sum = fnv1a(w.bytes().data(), w.bytes().size());
  w.put(sum);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    XCTX_CHECK(f.good(), "cannot write calibration file ", tmp);
    f.write(reinterpret_cast<const char*>(w.bytes().data()), (std::streamsize)w.bytes().size());
    XCTX_CHECK(f.good(), "error writing calibration file ", tmp);
  }
  XCTX_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot move ", tmp, " to ", path);
}

calibration load_calibration(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  XCTX_CHECK(f.good(), "cannot open calibration file ", path);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  XCTX_CHECK(b.size() >= sizeof kMagic + 4 + 8 && std::memcmp(b.data(), kMagic, sizeof kMagic) == 0, path,
             " is not an xctx calibration file (bad magic)");
  uint32_t version = 0;
  std::memcpy(&version, b.data() + sizeof kMagic, 4);
  XCTX_CHECK(version == calibration::kVersion, "calibration ", path, " has version ", version,
             "; this xctx reads version ", calibration::kVersion, " (re-run `xctx calibrate`)");
  const size_t body = b.size() - 8;
  uint64_t stored = 0;
  std::memcpy(&stored, b.data() + body, 8);
  XCTX_CHECK(stored == fnv1a(b.data(), body), "calibration ", path, " is corrupt (checksum mismatch)");
  reader r(b, body, path);
  for (size_t i = 0; i < sizeof kMagic; ++i) r.get<char>("magic");
  r.get<uint32_t>("version");
  calibration c;
  c.model_fingerprint = r.get<uint64_t>("fingerprint");
  c.model_name = r.get_str("model name");
  c.n_layer = r.get<int32_t>("n_layer"), c.n_head_kv = r.get<int32_t>("n_head_kv");
  c.head_dim = r.get<int32_t>("head_dim");
  // The product in 64 bits: channels() of two large int32 fields would overflow.
  XCTX_CHECK(c.n_layer > 0 && c.n_layer < 100000 && c.n_head_kv > 0 && c.head_dim > 0 &&
                 (int64_t)c.n_head_kv * c.head_dim <= 65536,
             "calibration ", path, ": bad shape ", c.n_layer, " layers, ", c.n_head_kv, " x ", c.head_dim);
  c.text_source = r.get_str("text source"), c.weighting = r.get_str("weighting");
  c.n_samples = r.get<int32_t>("samples"), c.seq_len = r.get<int32_t>("seq_len"), c.seed = r.get<uint64_t>("seed");
  const size_t C = (size_t)c.channels();
  for (int s = 0; s < kCalibSettings; ++s) {
    c.layers[s].resize(c.n_layer);
    for (calib_layer_setting& l : c.layers[s]) {
      l.k_lo = r.get_floats(C, "key thresholds"), l.k_hi = r.get_floats(C, "key thresholds");
      for (size_t i = 0; i < C; ++i)
        XCTX_CHECK(std::isfinite(l.k_lo[i]) && std::isfinite(l.k_hi[i]) && l.k_lo[i] <= l.k_hi[i], "calibration ",
                   path, ": key channel ", i, " has range [", l.k_lo[i], ", ", l.k_hi[i], "]");
      for (int bi = 0; bi < 3; ++bi) {
        l.k[bi] = get_type(r, kCalibBits[bi], path);
        l.v[bi] = get_type(r, kCalibBits[bi], path);
      }
    }
  }
  XCTX_CHECK(r.at() == body, "calibration ", path, " has ", body - r.at(), " unexpected trailing bytes");
  return c;
}

// ---- fitting ---------------------------------------------------------------------------------

nuq_histogram::nuq_histogram() : w(kNuqBins), wy(kNuqBins), n(kNuqBins), y(kNuqBins), y2(kNuqBins) {}

void nuq_histogram::add(float yn, double weight) {
  if (!std::isfinite(yn)) return;
  const float yc = std::clamp(yn, -1.0f, 1.0f);
  const int b = std::clamp((int)((yc + 1.0f) * 0.5f * kNuqBins), 0, kNuqBins - 1);
  w[b] += weight, wy[b] += weight * yc;
  n[b] += 1.0, y[b] += yc, y2[b] += (double)yc * yc;
}

void nuq_histogram::merge(const nuq_histogram& o) {
  for (int b = 0; b < kNuqBins; ++b)
    w[b] += o.w[b], wy[b] += o.wy[b], n[b] += o.n[b], y[b] += o.y[b], y2[b] += o.y2[b];
}

nuq_datatype fit_nuq_datatype(const nuq_histogram& h, int bits) {
  const int m = 1 << bits;
  nuq_datatype t;
  std::vector<double> rep(kNuqBins), wt(kNuqBins);  // bin representative (weighted mean) and weight
  double total = 0.0;
  for (int b = 0; b < kNuqBins; ++b) {
    const double center = -1.0 + (b + 0.5) * 2.0 / kNuqBins;
    // Bins seen only with zero sensitivity weigh nothing but still locate by their samples.
    rep[b] = h.w[b] > 0.0 ? h.wy[b] / h.w[b] : (h.n[b] > 0.0 ? h.y[b] / h.n[b] : center);
    wt[b] = h.w[b];
    total += wt[b];
  }
  if (!(total > 0.0)) {  // no weighted data: fall back to counts, then to a uniform grid
    for (int b = 0; b < kNuqBins; ++b) total += (wt[b] = h.n[b]);
  }
  std::vector<double> c((size_t)m);
  if (total > 0.0) {
    // Initialization at the weighted quantiles (i + 0.5) / m: deterministic, no seed needed.
    double acc = 0.0;
    int i = 0;
    for (int b = 0; b < kNuqBins && i < m; ++b) {
      acc += wt[b];
      while (i < m && acc >= (i + 0.5) / m * total) c[i++] = rep[b];
    }
    for (; i < m; ++i) c[i] = rep[kNuqBins - 1];
  }
  for (int i = 0; i < m; ++i)  // degenerate or empty data: keep signposts distinct
    if (!(total > 0.0) || (i > 0 && c[i] <= c[i - 1])) c[i] = i == 0 ? -1.0 : std::max(c[i - 1] + 1e-4, c[i]);
  if (total > 0.0) {
    std::vector<double> sw((size_t)m), swy((size_t)m);
    for (int it = 0; it < 500; ++it) {
      std::fill(sw.begin(), sw.end(), 0.0), std::fill(swy.begin(), swy.end(), 0.0);
      int k = 0;
      for (int b = 0; b < kNuqBins; ++b) {
        if (wt[b] == 0.0) continue;
        while (k + 1 < m && rep[b] > 0.5 * (c[k] + c[k + 1])) ++k;
        sw[k] += wt[b], swy[k] += wt[b] * rep[b];
      }
      bool moved = false;
      for (int i = 0; i < m; ++i) {
        if (sw[i] == 0.0) continue;  // an empty cluster keeps its signpost
        const double nc = swy[i] / sw[i];
        moved |= std::fabs(nc - c[i]) > 1e-12;
        c[i] = nc;
      }
      std::sort(c.begin(), c.end());
      for (int i = 1; i < m; ++i)
        if (c[i] <= c[i - 1]) c[i] = c[i - 1] + 1e-6;
      if (!moved) break;
    }
  }
  t.centroids.assign(c.begin(), c.end());
  for (int i = 1; i < m; ++i)  // float rounding must not merge neighbours
    if (t.centroids[i] <= t.centroids[i - 1]) t.centroids[i] = std::nextafter(t.centroids[i - 1], 2.0f);
  // Q-Norm statistics of the unweighted distribution, before and after quantization (each bin
  // quantized by its mean; bins are 2/8192 wide).
  double N = 0, s1 = 0, s2 = 0, q1 = 0, q2 = 0;
  for (int b = 0; b < kNuqBins; ++b) {
    if (h.n[b] == 0.0) continue;
    N += h.n[b], s1 += h.y[b], s2 += h.y2[b];
    int k = 0;
    const double yb = h.y[b] / h.n[b];
    while (k + 1 < m && yb > 0.5 * ((double)t.centroids[k] + t.centroids[k + 1])) ++k;
    q1 += h.n[b] * t.centroids[k], q2 += h.n[b] * (double)t.centroids[k] * t.centroids[k];
  }
  if (N > 0.0) {
    t.mean_pre = s1 / N, t.std_pre = std::sqrt(std::max(1e-30, s2 / N - t.mean_pre * t.mean_pre));
    t.mean_post = q1 / N, t.std_post = std::sqrt(std::max(1e-30, q2 / N - t.mean_post * t.mean_post));
  }
  return t;
}

}  // namespace xctx
