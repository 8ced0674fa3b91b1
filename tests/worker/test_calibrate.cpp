// The calibration pipeline on a tiny random model: deterministic given the seed (byte-identical
// files), different for another seed, weighted and unweighted k-means differ, ranges ordered,
// windows chosen without overlap, and a too-short text is a clear error.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "cache/calibration.h"
#include "common/error.h"
#include "model/gguf_writer.h"
#include "registry/registry.h"
#include "test_util.h"
#include "worker/calibrate.h"

namespace xctx {
namespace {

model_weights tiny_model() {
  model_hparams hp;
  hp.name = "tiny";
  hp.n_layer = 2, hp.n_embd = 64, hp.n_ff = 128, hp.n_head = 4, hp.n_head_kv = 2, hp.head_dim = 16, hp.n_rot = 16;
  hp.n_vocab = 97, hp.n_ctx_train = 512, hp.rope_freq_base = 10000.0f;
  const auto path = test::scratch_dir() / "tiny.gguf";
  make_tiny_model_writer(hp, ggml_type::ggml_q8_0, 5).write(path.string());
  return load_model(path.string());
}

std::vector<uint8_t> file_bytes(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(calibrate, deterministic_given_the_seed) {
  const model_weights w = tiny_model();
  auto be = make_backend(backend_kind::backend_cpu);
  run_params rp;
  llama_engine engine(w, *be, rp);
  std::vector<int32_t> text(2000);
  for (size_t i = 0; i < text.size(); ++i) text[i] = (int32_t)((i * 31 + i / 7) % 97);
  calibrate_options o;
  o.n_samples = 3, o.seq_len = 128, o.queries_per_sample = 8;
  const auto dir = test::scratch_dir();
  const auto make = [&](uint64_t seed, bool weighted, const std::string& name) {
    calibrate_options oo = o;
    oo.seed = seed, oo.weighted = weighted;
    const std::string p = (dir / name).string();
    save_calibration(calibrate_model(engine, *be, text, model_fingerprint(w), oo), p);
    return p;
  };
  const std::string a = make(7, true, "a"), b = make(7, true, "b"), c = make(8, true, "c"), d = make(7, false, "d");
  EXPECT_EQ(file_bytes(a), file_bytes(b));
  EXPECT_NE(file_bytes(a), file_bytes(c));
  const calibration ca = load_calibration(a), cd = load_calibration(d);
  EXPECT_EQ(ca.weighting, "attention-output");
  EXPECT_EQ(cd.weighting, "none");
  EXPECT_NE(ca.layers[0][0].key_type(3).centroids, cd.layers[0][0].key_type(3).centroids);
  EXPECT_EQ(ca.layers[0][0].k_lo, cd.layers[0][0].k_lo);  // ranges do not depend on weights
  for (int l = 0; l < ca.n_layer; ++l)
    for (int c = 0; c < ca.channels(); ++c) {
      // The 1% thresholds sit inside the plain min/max range.
      EXPECT_LE(ca.layers[0][l].k_lo[c], ca.layers[1][l].k_lo[c]);
      EXPECT_GE(ca.layers[0][l].k_hi[c], ca.layers[1][l].k_hi[c]);
      EXPECT_LE(ca.layers[1][l].k_lo[c], ca.layers[1][l].k_hi[c]);
    }
  EXPECT_THROW(calibrate_model(engine, *be, std::vector<int32_t>(100, 1), 0, o), Error);
}

TEST(calibrate, windows_do_not_overlap_when_the_text_allows) {
  const auto s = calibration_windows(10000, 8, 1000, 3);
  ASSERT_EQ(s.size(), 8u);
  for (size_t i = 1; i < s.size(); ++i) EXPECT_GE(s[i] - s[i - 1], 1000);
  for (int64_t x : s) EXPECT_LE(x + 1000, 10000);
  EXPECT_EQ(s, calibration_windows(10000, 8, 1000, 3));
  EXPECT_NE(s, calibration_windows(10000, 8, 1000, 4));
  const auto short_text = calibration_windows(1500, 4, 1000, 3);  // overlapping, still inside
  for (int64_t x : short_text) EXPECT_LE(x + 1000, 1500);
}

}  // namespace
}  // namespace xctx
