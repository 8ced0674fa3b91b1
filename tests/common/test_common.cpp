#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "common/hash.h"
#include "common/sys.h"
#include "kernels/device.h"
#include "kernels/ops.h"

namespace xctx {
namespace {

// Every finite half converts to float and back exactly; inf/nan keep their class.
TEST(half, all_bit_patterns_round_trip) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = fp16_to_fp32((uint16_t)b);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_fp32(fp32_to_fp16(f)))) << b;
      continue;
    }
    ASSERT_EQ(fp32_to_fp16(f), (uint16_t)b) << "bits " << b << " value " << f;
  }
}

// fp32 -> fp16 rounds to the nearest representable half (ties to even): the result is never
// farther from x than any neighbouring half.
TEST(half, rounding_is_nearest) {
  uint32_t seed = 12345;
  for (int i = 0; i < 200000; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const float x = std::ldexp((float)(seed >> 8) / (1 << 24) * 2.0f - 1.0f, (int)(seed % 40) - 24);
    const uint16_t h = fp32_to_fp16(x);
    const float r = fp16_to_fp32(h);
    const float up = fp16_to_fp32((uint16_t)(h + 1)), down = fp16_to_fp32((uint16_t)(h - 1));
    if (std::isfinite(up)) {
      ASSERT_LE(std::fabs(r - x), std::fabs(up - x)) << x;
    }
    if (std::isfinite(down) && (h & 0x7fff) != 0) {
      ASSERT_LE(std::fabs(r - x), std::fabs(down - x)) << x;
    }
  }
  EXPECT_TRUE(std::isinf(fp16_to_fp32(fp32_to_fp16(70000.0f))));
  EXPECT_EQ(fp16_to_fp32(fp32_to_fp16(65504.0f)), 65504.0f);
  EXPECT_EQ(fp16_to_fp32(fp32_to_fp16(5.9604645e-08f)), 5.9604645e-08f);  // smallest subnormal
}

TEST(bf16, round_trip_and_rounding) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = bf16_to_fp32((uint16_t)b);
    if (std::isnan(f)) continue;
    ASSERT_EQ(fp32_to_bf16(f), (uint16_t)b);
  }
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(1.00390625f)), 1.0f);  // tie rounds to even
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(1.01171875f)), 1.015625f);
}

TEST(parse_count, suffixes_and_errors) {
  EXPECT_EQ(parse_count("2048", "x"), 2048);
  EXPECT_EQ(parse_count("32K", "x"), 32768);
  EXPECT_EQ(parse_count("1M", "x"), 1048576);
  EXPECT_EQ(parse_count("10M", "x"), 10485760);
  EXPECT_THROW(parse_count("", "--context"), Error);
  EXPECT_THROW(parse_count("abc", "--context"), Error);
  EXPECT_THROW(parse_count("12G", "--context"), Error);
  // Products past 2^62 are refused, not wrapped (a wrapped --ctx once became the trained window).
  EXPECT_EQ(parse_count("4398046511104M", "x"), 1LL << 62);
  EXPECT_THROW(parse_count("4398046511105M", "--ctx"), Error);
  EXPECT_THROW(parse_count("9999999999999M", "--ctx"), Error);
  EXPECT_THROW(parse_count("9999999999999999", "--ctx"), Error);  // 16 digits
  try {
    parse_count("7Q", "--context");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--context"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("7Q"), std::string::npos);
  }
}

TEST(sys, memory_and_threads) {
  EXPECT_GT(peak_rss_bytes(), 0u);
  EXPECT_GE(peak_rss_bytes(), current_rss_bytes());
  EXPECT_GE(default_threads(), 1);
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
}

// The memory reports split VmRSS by page kind: a touched heap block shows as anonymous pages,
// the test binary's own code as file-backed ones.
TEST(sys, rss_parts_split_the_resident_set) {
  const rss_parts before = current_rss_parts();
  EXPECT_GT(before.file, 0u);
  const size_t bytes = size_t{64} << 20;
  std::unique_ptr<char[]> block(new char[bytes]);
  std::memset(block.get(), 1, bytes);
  const rss_parts after = current_rss_parts();
  EXPECT_EQ(block[bytes - 1], 1);
  EXPECT_GE(after.anon, before.anon + bytes * 9 / 10);
  const size_t rss = current_rss_bytes();
  const rss_parts now = current_rss_parts();
  EXPECT_NEAR((double)(now.anon + now.file + now.shmem), (double)rss, double(size_t{1} << 20));
}

// The launcher variables the device binding reads, cleared for a test and restored after it
// (the suite may itself run under a launcher).
class launcher_env {
 public:
  launcher_env() {
    for (const char* v : kVars) {
      const char* s = std::getenv(v);
      saved_.emplace_back(v, s ? std::optional<std::string>(s) : std::nullopt);
      unsetenv(v);
    }
  }
  ~launcher_env() {
    for (const auto& [name, value] : saved_) {
      if (value) setenv(name, value->c_str(), 1);
      else unsetenv(name);
    }
  }
  void set(const char* name, const char* value) const { setenv(name, value, 1); }

 private:
  static constexpr const char* kVars[] = {"XCTX_CUDA_DEVICE", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                          "SLURM_LOCALID", "LOCAL_RANK"};
  std::vector<std::pair<const char*, std::optional<std::string>>> saved_;
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// What `xctx doctor` reports and the CUDA backend and NCCL communicator bind to: the override,
// else node-local rank mod device count, else device 0; bad settings are errors naming them.
TEST(sys, cuda_device_binding_rules) {
  const launcher_env env;
  std::string why;
  EXPECT_EQ(node_local_rank(), -1);
  EXPECT_EQ(cuda_device_for_process(8, &why), 0);
  EXPECT_EQ(why, "no launcher: device 0");

  env.set("OMPI_COMM_WORLD_LOCAL_RANK", "13");
  EXPECT_EQ(cuda_device_for_process(8, &why), 5);
  EXPECT_EQ(why, "OMPI_COMM_WORLD_LOCAL_RANK=13 mod 8");
  EXPECT_EQ(cuda_device_for_process(1), 0);
  env.set("SLURM_LOCALID", "2");  // OpenMPI's variable comes first
  std::string source;
  EXPECT_EQ(node_local_rank(&source), 13);
  EXPECT_EQ(source, "OMPI_COMM_WORLD_LOCAL_RANK");
  unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  EXPECT_EQ(cuda_device_for_process(4, &why), 2);
  EXPECT_EQ(why, "SLURM_LOCALID=2 mod 4");

  env.set("XCTX_CUDA_DEVICE", "3");
  EXPECT_EQ(cuda_device_for_process(4, &why), 3);
  EXPECT_EQ(why, "XCTX_CUDA_DEVICE");
  env.set("XCTX_CUDA_DEVICE", "4");
  EXPECT_NE(error_of([] { cuda_device_for_process(4); }).find("XCTX_CUDA_DEVICE='4' but 4 CUDA device(s) are visible"),
            std::string::npos);
  env.set("XCTX_CUDA_DEVICE", "1x");
  EXPECT_NE(error_of([] { cuda_device_for_process(4); }).find("XCTX_CUDA_DEVICE='1x'"), std::string::npos);
  unsetenv("XCTX_CUDA_DEVICE");

  env.set("SLURM_LOCALID", "-1");
  EXPECT_NE(error_of([] { node_local_rank(); }).find("SLURM_LOCALID='-1' is not a node-local rank"), std::string::npos);
  EXPECT_NE(error_of([] { cuda_device_for_process(0); }).find("no device to choose from"), std::string::npos);
}

TEST(error, check_throws_with_message_assert_aborts) {
  try {
    XCTX_CHECK(1 + 1 == 3, "value ", 42, " is bad");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "value 42 is bad");
  }
  EXPECT_DEATH(XCTX_ASSERT(false, "boom"), "boom");
}

// The digest depends on the bytes only: any split into update() calls, empty pieces included
// (an empty vector's data() may be null: the sanitizer lane once flagged memcpy from it), and
// length counts (a trailing zero byte changes it).
TEST(hash64, same_digest_for_any_split_and_empty_pieces) {
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = (uint8_t)(i * 131 + 7);
  hash64 whole;
  whole.update(bytes.data(), bytes.size());
  for (size_t piece : {1, 3, 7, 8, 9, 64, 999}) {
    hash64 split;
    const std::vector<uint8_t> none;
    split.update(none.data(), 0);
    split.update(nullptr, 0);
    for (size_t at = 0; at < bytes.size(); at += piece) {
      split.update(bytes.data() + at, std::min(piece, bytes.size() - at));
      split.update(nullptr, 0);
    }
    EXPECT_EQ(split.digest(), whole.digest()) << "pieces of " << piece;
  }
  hash64 longer;
  longer.update(bytes.data(), bytes.size());
  const uint8_t zero = 0;
  longer.update(&zero, 1);
  EXPECT_NE(longer.digest(), whole.digest());
}

}  // namespace
}  // namespace xctx
