// The JSON numbers of a cache snapshot's manifest and rank-file headers: anything but an integer
// in range is refused with the file and key named (worker/cache_snapshot.cpp, json_int). The
// first case is the cache_snapshot fuzzer's finding: a rank count too large for int64 parses as a
// float, which nlohmann's get<int>() converted with undefined behaviour.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "common/error.h"
#include "test_util.h"
#include "worker/cache_snapshot.h"

namespace xctx {
namespace {

void write_text(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

// The error read_snapshot_manifest raises for this manifest ("" if none).
std::string manifest_error(const std::string& manifest) {
  const std::filesystem::path dir = test::scratch_dir();
  write_text(dir / "manifest.json", manifest);
  try {
    (void)read_snapshot_manifest(dir.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(cache_snapshot_json, manifest_numbers_must_be_integers_in_range) {
  const std::string tail = R"(, "format": "fp16", "model": "m"})";
  // The fuzzer's input, reduced: 2.9e19 does not fit int64, so the parser stores a float.
  std::string err = manifest_error(R"({"ranks": 29223372036854775807, "tokens": 9)" + tail);
  EXPECT_NE(err.find("\"ranks\" holds 2.9223372036854776e+19, not an integer in [-2147483648, 2147483647]"),
            std::string::npos)
      << err;
  err = manifest_error(R"({"ranks": 1099511627776, "tokens": 9)" + tail);  // 2^40: was truncated to 0
  EXPECT_NE(err.find("\"ranks\" holds 1099511627776, not an integer"), std::string::npos) << err;
  err = manifest_error(R"({"ranks": 2, "tokens": 1.5)" + tail);
  EXPECT_NE(err.find("\"tokens\" holds 1.5, not an integer"), std::string::npos) << err;
  err = manifest_error(R"({"ranks": "2", "tokens": 9)" + tail);
  EXPECT_NE(err.find("\"ranks\" holds \"2\", not an integer"), std::string::npos) << err;
  EXPECT_EQ(manifest_error(R"({"ranks": 2, "tokens": 9)" + tail), "");
}

TEST(cache_snapshot_json, header_numbers_must_be_integers_in_range) {
  const std::filesystem::path dir = test::scratch_dir();
  write_text(dir / "manifest.json", R"({"ranks": 1, "tokens": 1, "format": "fp16", "model": "m"})");
  const auto rank_file_error = [&](const std::string& header) -> std::string {
    std::ofstream out(snapshot_file(dir.string(), 0, 1), std::ios::binary);
    const uint32_t version = kSnapshotVersion, reserved = 0;
    const uint64_t n = header.size();
    out.write("XCTXSNAP", 8);
    out.write(reinterpret_cast<const char*>(&version), 4).write(reinterpret_cast<const char*>(&reserved), 4);
    out.write(reinterpret_cast<const char*>(&n), 8).write(header.data(), (std::streamsize)n);
    out.write("\0\0\0\0\0\0\0\0", (std::streamsize)((8 - n % 8) % 8));
    out.close();
    try {
      (void)read_snapshot_state(dir.string(), 0, 1, snapshot_identity{});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string ident = R"("identity": {"format": "fp16"}, "state": {"held_per_rank": [1]})";
  std::string err = rank_file_error(R"({"layer_bytes": [8, 1e30], "n_tokens_stored": 0, )" + ident + "}");
  EXPECT_NE(err.find("\"layer_bytes\" holds 1e+30, not an integer in [0, 18446744073709551615]"), std::string::npos)
      << err;
  err = rank_file_error(R"({"layer_bytes": [8], "n_tokens_stored": -1, )" + ident + "}");
  EXPECT_NE(err.find("\"n_tokens_stored\" holds -1, not an integer"), std::string::npos) << err;
  err = rank_file_error(R"({"layer_bytes": 8, "n_tokens_stored": 0, )" + ident + "}");
  EXPECT_NE(err.find("\"layer_bytes\" holds 8, not an array of integers"), std::string::npos) << err;
  err = rank_file_error(
      R"({"layer_bytes": [8], "n_tokens_stored": 0, "identity": {"format": "fp16"}, "state": {"held_per_rank": [1e19]}})");
  EXPECT_NE(err.find("\"held_per_rank\" holds 1e+19, not an integer"), std::string::npos) << err;
}

}  // namespace
}  // namespace xctx
