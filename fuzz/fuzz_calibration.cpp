// Calibration file reader (cache/calibration.cpp, load_calibration): magic, version, checksum,
// shape, per-channel thresholds and the nuq datatypes.
//
// Input: one mode byte, then the file. With bit 0 of the mode set, the harness rewrites the
// file's trailing FNV-1a checksum to match its body, so the fuzzer gets past the checksum to
// the fields behind it (a file with a wrong checksum is a case of its own, mode bit 0 clear).
#include <cstdint>
#include <cstring>
#include <vector>

#include "cache/calibration.h"
#include "common/error.h"
#include "fuzz_util.h"

using namespace xctx;

namespace {

uint64_t fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  std::vector<uint8_t> file(data + 1, data + size);
  if ((mode & 1) && file.size() >= 8) {
    const uint64_t sum = fnv1a(file.data(), file.size() - 8);
    std::memcpy(file.data() + file.size() - 8, &sum, 8);
  }
  const std::string path = xctx_fuzz::write_file("in.calib", file.data(), file.size());
  try {
    const calibration c = load_calibration(path);
    // What a loaded calibration serves: every layer's tables, with and without Q-Norm.
    for (double frac : kCalibOutlierFraction)
      for (int l = 0; l < c.n_layer; ++l)
        for (int bits : kCalibBits) {
          const calib_layer_setting& s = c.layer(frac, l);
          (void)s.key_type(bits).lut(true);
          (void)s.value_type(bits).lut(true);
        }
  } catch (const Error&) {
  }
  return 0;
}
