// Cache snapshot reader (worker/cache_snapshot.cpp), no MPI needed: the manifest, a rank file's
// preamble and JSON header (read_snapshot_state), and the restore of every layer into a small
// cache (restore_cache_snapshot), which hands each layer's bytes to the cache format's own
// restore_layer parser.
//
// Input: one mode byte, then the file. Mode bit 0 clear: the bytes are DIR/manifest.json.
// Set: they are DIR/rank-0-of-1.xsnap next to a fixed valid manifest; bit 1 set rewrites the
// layer and file checksums to match (so the fuzzer reaches the parsers behind them); bits 2-3
// pick the cache format restored into (fp16, fp32, kivi4, kivi2; the identity checked is fp16's).
#include <cstdint>
#include <vector>

#include "cache/cache.h"
#include "common/error.h"
#include "fuzz_util.h"
#include "kernels/ops.h"
#include "registry/registry.h"
#include "snapshot_fixture.h"

using namespace xctx;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const auto be = make_backend(backend_kind::backend_cpu);
  const uint8_t mode = data[0];
  std::vector<uint8_t> file(data + 1, data + size);
  const std::string& dir = xctx_fuzz::scratch_dir();
  if (!(mode & 1)) {
    xctx_fuzz::write_file("manifest.json", file.data(), file.size());
    try {
      (void)read_snapshot_manifest(dir);
    } catch (const Error&) {
    }
    return 0;
  }
  xctx_fuzz::write_file("manifest.json", R"({"ranks": 1, "tokens": 4, "format": "fp16", "model": "fuzz"})");
  if (mode & 2) xctx_fuzz::fix_snapshot_checksums(file);
  xctx_fuzz::write_file("rank-0-of-1.xsnap", file.data(), file.size());
  try {
    (void)read_snapshot_state(dir, 0, 1, xctx_fuzz::snapshot_identity_for(cache_format::cache_fp16));
  } catch (const Error&) {
  }
  const cache_format fmt = xctx_fuzz::kSnapshotFormats[(mode >> 2) & 3];
  const auto cache = make_cache(cache_spec(fmt), xctx_fuzz::snapshot_geometry(), *be);
  try {
    (void)restore_cache_snapshot(dir, 0, 1, *cache);
  } catch (const Error&) {
    for (int l = 0; l < cache->geometry().n_layer; ++l)
      if (cache->n_tokens(l) != 0) __builtin_trap();  // a failed restore leaves the cache empty
    return 0;
  }
  // Attend over what was restored: values a damaged file smuggled past the checksums must give
  // an Error (softmax_acc: "too large for the exact accumulator"), never an abort.
  const cache_geometry g = cache->geometry();
  std::vector<float> q((size_t)g.n_head * g.head_dim, 0.5f), o(q.size()), lse((size_t)g.n_head);
  const int32_t q_pos = 1 << 20;
  for (int l = 0; l < g.n_layer; ++l) {
    try {
      cache->attend(l, q.data(), &q_pos, 1, o.data(), lse.data());
    } catch (const Error&) {
    }
  }
  return 0;
}
