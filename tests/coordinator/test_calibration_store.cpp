// The stored default calibration (coordinator/jobs/calibration_store.h): keyed by the model's
// fingerprint, made once however many processes ask at the same time, written atomically, and
// refused when the file under a fingerprint's name holds another model's calibration.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "cache/quant_test_util.h"
#include "coordinator/jobs/calibration_store.h"
#include "test_util.h"

namespace xctx {
namespace {

calibration synthetic(uint64_t fingerprint) {
  calibration c = *test::make_synthetic_calibration(test::quant_geometry(8), 3);
  c.model_fingerprint = fingerprint;
  c.text_source = "synthetic";
  return c;
}

TEST(calibration_store, default_path_is_keyed_by_the_fingerprint_next_to_the_model) {
  const auto dir = test::scratch_dir();
  unsetenv("XCTX_CALIB_DIR");
  const std::string model = (dir / "tiny.Q4_1.gguf").string();
  EXPECT_EQ(default_calibration_path(model, 0xabcULL), (dir / "tiny.Q4_1.0000000000000abc.calib").string());
  EXPECT_NE(default_calibration_path(model, 1), default_calibration_path(model, 2));
  setenv("XCTX_CALIB_DIR", (dir / "elsewhere").c_str(), 1);
  EXPECT_EQ(default_calibration_path(model, 0xabcULL), (dir / "elsewhere" / "tiny.Q4_1.0000000000000abc.calib").string());
  unsetenv("XCTX_CALIB_DIR");
}

TEST(calibration_store, concurrent_callers_make_it_once_and_load_the_same_file) {
  const auto dir = test::scratch_dir();
  const std::string path = (dir / "sub" / "m.0000000000000007.calib").string();
  std::atomic<int> made{0};
  const auto make = [&] {
    ++made;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others must be waiting by now
    return synthetic(7);
  };
  std::vector<stored_calibration> got(4);
  std::vector<std::thread> callers;
  for (size_t i = 0; i < got.size(); ++i)
    callers.emplace_back([&, i] { got[i] = find_or_make_calibration(path, 7, make); });
  for (auto& t : callers) t.join();
  EXPECT_EQ(made.load(), 1);
  int makers = 0, waiters = 0;
  for (const auto& g : got) {
    ASSERT_TRUE(g.cal);
    EXPECT_EQ(g.cal->model_fingerprint, 7u);
    EXPECT_EQ(g.path, path);
    makers += g.made_now, waiters += g.made_by_another;
  }
  EXPECT_EQ(makers, 1);
  EXPECT_EQ(makers + waiters, (int)got.size());  // nobody saw the file before it was complete
  for (const auto& e : std::filesystem::directory_iterator(dir / "sub"))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << "left behind: " << e.path();

  const stored_calibration again = find_or_make_calibration(path, 7, [&]() -> calibration {
    ADD_FAILURE() << "made a second time";
    return synthetic(7);
  });
  EXPECT_FALSE(again.made_now);
  EXPECT_FALSE(again.made_by_another);
  EXPECT_NE(again.describe().find("(found)"), std::string::npos) << again.describe();
}

TEST(calibration_store, a_file_of_another_model_under_the_name_is_refused) {
  const auto dir = test::scratch_dir();
  const std::string path = (dir / "m.0000000000000007.calib").string();
  save_calibration(synthetic(8), path);
  test::expect_error_contains([&] { find_or_make_calibration(path, 7, [] { return synthetic(7); }); },
                              "does not belong to this model");
}

TEST(calibration_store, a_maker_that_fails_leaves_no_file_and_the_next_caller_retries) {
  const auto dir = test::scratch_dir();
  const std::string path = (dir / "m.0000000000000009.calib").string();
  EXPECT_THROW(find_or_make_calibration(path, 9, []() -> calibration { throw Error("no text"); }), Error);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_TRUE(find_or_make_calibration(path, 9, [] { return synthetic(9); }).made_now);
}

}  // namespace
}  // namespace xctx
