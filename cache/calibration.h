// Offline calibration of the nuqX formats (KVQuant §3.3-3.6): per-layer non-uniform datatypes
// for keys and values, per-channel key normalization and outlier thresholds, and the Q-Norm
// statistics. Made by `xctx calibrate`, stored in a versioned, checksummed binary file, and
// checked against the model it is loaded for.
//
// One file serves every nuq format: it holds both outlier settings (none and 1%) and the
// datatypes for 2, 3 and 4 bits.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace xctx {

struct model_hparams;
struct model_weights;

inline constexpr int kCalibBits[] = {2, 3, 4};
inline constexpr int kCalibSettings = 2;                                // outlier settings
inline constexpr double kCalibOutlierFraction[kCalibSettings] = {0.0, 0.01};

// A non-uniform datatype: 2^bits signposts in normalized units ([-1, 1] holds the non-outlier
// range), plus the statistics Q-Norm (KVQuant eq. 3) rescales them with.
struct nuq_datatype {
  std::vector<float> centroids;  // [2^bits] ascending
  double mean_pre = 0.0, std_pre = 1.0;    // normalized activations before quantization
  double mean_post = 0.0, std_post = 1.0;  // ... after (each replaced by its centroid)
  // The lookup table to decode with: Q-Norm'ed centroids when qnorm, else the raw ones.
  std::vector<float> lut(bool qnorm) const;
};

struct calib_layer_setting {
  std::vector<float> k_lo, k_hi;     // [C] per-channel range: quantiles (1%) or min/max (none)
  std::array<nuq_datatype, 3> k, v;  // by kCalibBits
  const nuq_datatype& key_type(int bits) const { return k.at(bits - 2); }
  const nuq_datatype& value_type(int bits) const { return v.at(bits - 2); }
};

struct calibration {
  static constexpr uint32_t kVersion = 1;
  uint64_t model_fingerprint = 0;
  std::string model_name;
  int n_layer = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  // How it was made (recorded for the user; not needed to use it).
  std::string text_source;
  std::string weighting;  // "attention-output" or "none"
  int n_samples = 0;
  int seq_len = 0;
  uint64_t seed = 0;
  std::array<std::vector<calib_layer_setting>, kCalibSettings> layers;  // [setting][layer]

  int channels() const { return n_head_kv * head_dim; }
  static int setting_for(double outlier_fraction);  // throws for fractions no file holds
  const calib_layer_setting& layer(double outlier_fraction, int l) const;
  // Throws xctx::Error naming both models when this calibration was made for another one.
  void check_model(uint64_t fingerprint, const model_hparams& hp, const std::string& calib_path) const;
};

// Identifies a model's weights: shape fields and a hash of every layer's key projection.
uint64_t model_fingerprint(const model_weights& w);

void save_calibration(const calibration& c, const std::string& path);
// Throws xctx::Error for a missing file, wrong magic, unknown version, truncation, a checksum
// mismatch or inconsistent contents, naming the file.
calibration load_calibration(const std::string& path);

// ---- fitting (used by `xctx calibrate`, tested directly) ---------------------------------
// Weighted samples of normalized activations, binned finely on [-1, 1] (the outlier-free range
// normalization produces): 1-D k-means on the bins equals k-means on the samples up to the bin
// width (2/kNuqBins), at a memory cost independent of the sample count.
inline constexpr int kNuqBins = 8192;
struct nuq_histogram {
  std::vector<double> w, wy;        // [kNuqBins] weight sum, weighted value sum
  std::vector<double> n, y, y2;     // [kNuqBins] unweighted count, sum, sum of squares (Q-Norm)
  nuq_histogram();
  void add(float y_norm, double weight);
  void merge(const nuq_histogram& o);
};
// Sensitivity-weighted k-means (Lloyd, deterministic quantile initialization, to convergence)
// plus the Q-Norm statistics of the unweighted distribution.
nuq_datatype fit_nuq_datatype(const nuq_histogram& h, int bits);

}  // namespace xctx
