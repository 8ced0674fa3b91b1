// The nuq calibration: k-means fitting and Q-Norm on known distributions, the file round trip,
// and every bad-input path of the loader (missing, foreign, truncated, corrupt, wrong version,
// wrong model).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

#include "cache/calibration.h"
#include "cache/quant_test_util.h"
#include "common/error.h"
#include "model/hparams.h"
#include "test_util.h"

namespace xctx {
namespace {

// Bin width of the histogram the k-means runs on: centroids are exact up to it.
constexpr double kBinWidth = 2.0 / kNuqBins;

TEST(nuq_fit, two_tight_clusters_are_found) {
  nuq_histogram h;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 0.01f);
  for (int i = 0; i < 20000; ++i) h.add(-0.5f + nd(rng), 1.0), h.add(0.3f + nd(rng), 1.0);
  const nuq_datatype t = fit_nuq_datatype(h, 2);
  ASSERT_EQ(t.centroids.size(), 4u);
  for (size_t i = 1; i < 4; ++i) EXPECT_LT(t.centroids[i - 1], t.centroids[i]);
  // Four signposts for two clusters: two split each cluster, all within a few sigma of a centre.
  for (float c : t.centroids) EXPECT_LT(std::min(std::fabs(c + 0.5f), std::fabs(c - 0.3f)), 0.04f) << c;
}

TEST(nuq_fit, uniform_data_gives_the_uniform_grid) {
  nuq_histogram h;
  for (int i = 0; i < 200000; ++i) h.add(-1.0f + 2.0f * (i + 0.5f) / 200000.0f, 1.0);
  for (int bits : {2, 3}) {
    const nuq_datatype t = fit_nuq_datatype(h, bits);
    const int m = 1 << bits;
    // Lloyd's fixed point for a uniform density: cell midpoints -1 + (2i + 1) / m.
    for (int i = 0; i < m; ++i) EXPECT_NEAR(t.centroids[i], -1.0 + (2.0 * i + 1.0) / m, 4 * kBinWidth) << bits;
  }
}

TEST(nuq_fit, weights_pull_signposts_to_sensitive_values) {
  nuq_histogram plain, weighted;
  for (int i = 0; i < 100000; ++i) {
    const float y = -1.0f + 2.0f * (i + 0.5f) / 100000.0f;
    plain.add(y, 1.0);
    weighted.add(y, std::fabs(y) < 0.2f ? 50.0 : 1.0);  // values near 0 matter more
  }
  const nuq_datatype a = fit_nuq_datatype(plain, 3), b = fit_nuq_datatype(weighted, 3);
  int near_a = 0, near_b = 0;
  for (int i = 0; i < 8; ++i) near_a += std::fabs(a.centroids[i]) < 0.25f, near_b += std::fabs(b.centroids[i]) < 0.25f;
  EXPECT_GT(near_b, near_a);
}

TEST(nuq_fit, qnorm_restores_mean_and_spread) {
  nuq_histogram h;
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.1f, 0.3f);
  std::vector<float> ys;
  for (int i = 0; i < 50000; ++i) ys.push_back(std::clamp(nd(rng), -1.0f, 1.0f)), h.add(ys.back(), 1.0);
  const nuq_datatype t = fit_nuq_datatype(h, 2);
  const std::vector<float> lut = t.lut(true);
  double m = 0, m2 = 0;
  for (float y : ys) {
    int best = 0;
    for (int i = 1; i < 4; ++i)
      if (std::fabs(y - t.centroids[i]) < std::fabs(y - t.centroids[best])) best = i;
    m += lut[best], m2 += (double)lut[best] * lut[best];
  }
  m /= ys.size(), m2 = std::sqrt(m2 / ys.size() - m * m);
  EXPECT_NEAR(m, t.mean_pre, 2 * kBinWidth);
  EXPECT_NEAR(m2, t.std_pre, 2 * kBinWidth);
  EXPECT_EQ(t.lut(false), t.centroids);
}

TEST(calibration_file, round_trip_is_exact) {
  const cache_geometry g = test::quant_geometry(8);
  auto c = test::make_synthetic_calibration(g, 3);
  c->model_fingerprint = 0x1234abcd, c->seed = 77, c->n_samples = 3, c->seq_len = 99, c->text_source = "x";
  const std::string path = (test::scratch_dir() / "c.bin").string();
  save_calibration(*c, path);
  const calibration r = load_calibration(path);
  EXPECT_EQ(r.model_fingerprint, c->model_fingerprint);
  EXPECT_EQ(r.seed, 77u);
  EXPECT_EQ(r.text_source, "x");
  for (int s = 0; s < kCalibSettings; ++s)
    for (int l = 0; l < g.n_layer; ++l) {
      EXPECT_EQ(r.layers[s][l].k_lo, c->layers[s][l].k_lo);
      EXPECT_EQ(r.layers[s][l].k_hi, c->layers[s][l].k_hi);
      for (int b = 0; b < 3; ++b) {
        EXPECT_EQ(r.layers[s][l].k[b].centroids, c->layers[s][l].k[b].centroids);
        EXPECT_EQ(r.layers[s][l].v[b].std_post, c->layers[s][l].v[b].std_post);
      }
    }
}

std::string error_of(const std::string& path) {
  try {
    load_calibration(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(calibration_file, bad_files_are_clear_errors) {
  const auto dir = test::scratch_dir();
  const std::string good = (dir / "good.bin").string();
  save_calibration(*test::make_synthetic_calibration(test::quant_geometry(8), 3), good);
  std::ifstream in(good, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto write = [&](const std::string& name, const std::vector<char>& b) {
    const std::string p = (dir / name).string();
    std::ofstream(p, std::ios::binary).write(b.data(), (std::streamsize)b.size());
    return p;
  };
  EXPECT_NE(error_of((dir / "missing.bin").string()).find("cannot open"), std::string::npos);
  EXPECT_NE(error_of(write("text.bin", {'h', 'e', 'l', 'l', 'o', '\n'})).find("bad magic"), std::string::npos);
  std::vector<char> flipped = bytes;
  flipped[bytes.size() / 2] ^= 1;
  EXPECT_NE(error_of(write("flip.bin", flipped)).find("checksum"), std::string::npos);
  std::vector<char> cut(bytes.begin(), bytes.begin() + bytes.size() / 3);
  EXPECT_NE(error_of(write("cut.bin", cut)).find("corrupt"), std::string::npos);  // the tail is no checksum
  std::vector<char> v2 = bytes;
  v2[8] = 2;
  EXPECT_NE(error_of(write("v2.bin", v2)).find("version 2"), std::string::npos);
}

// Found by fuzz/fuzz_calibration: a checksummed file with n_head_kv * head_dim past INT32_MAX
// overflowed int in channels() before the shape check could refuse it.
TEST(calibration_file, huge_shape_is_refused_without_overflow) {
  std::vector<uint8_t> b = {'X', 'C', 'T', 'X', 'C', 'A', 'L', 'B'};
  const auto put = [&](const auto& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof v);
  };
  put(uint32_t{1}), put(uint64_t{0}), put(uint32_t{0});             // version, fingerprint, empty name
  put(int32_t{1}), put(int32_t{343621377}), put(int32_t{2061584302});  // n_layer, n_head_kv, head_dim
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the body, as save_calibration writes it
  for (uint8_t x : b) h = (h ^ x) * 1099511628211ull;
  put(h);
  const std::string path = (test::scratch_dir() / "huge_shape.bin").string();
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), (std::streamsize)b.size());
  const std::string err = error_of(path);
  EXPECT_NE(err.find("bad shape 1 layers, 343621377 x 2061584302"), std::string::npos) << err;
}

TEST(calibration_file, another_models_calibration_is_refused) {
  auto c = test::make_synthetic_calibration(test::quant_geometry(8), 3);
  c->model_fingerprint = 42;
  model_hparams hp;
  hp.name = "other";
  hp.n_layer = c->n_layer, hp.n_head_kv = c->n_head_kv, hp.head_dim = c->head_dim;
  EXPECT_NO_THROW(c->check_model(42, hp, "c.bin"));
  try {
    c->check_model(43, hp, "c.bin");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not match"), std::string::npos) << e.what();
  }
  hp.n_layer += 1;
  EXPECT_THROW(c->check_model(42, hp, "c.bin"), Error);
}

}  // namespace
}  // namespace xctx
