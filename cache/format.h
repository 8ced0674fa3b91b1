// The cache formats users name with --cache: one enum and one traits table. Every switch over
// the enum has no default, so the build breaks wherever a new format is not handled.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace xctx {

struct calibration;  // cache/calibration.h

// The shape of what one shard caches.
struct cache_geometry {
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  int n_embd = 0;
  rope_config rope;
  int64_t capacity = 0;  // tokens this shard may hold
};

enum class cache_format : uint8_t {
  cache_fp32,
  cache_fp16,
  cache_kivi4,  // KIVI* (XQuant §4): uniform, keys per channel pre-RoPE, values per token
  cache_kivi3,
  cache_kivi2,
  cache_nuq4,  // KVQuant: non-uniform per-layer datatypes, offline key scaling, attention sink
  cache_nuq3,
  cache_nuq2,
  cache_nuq4_1pct,  // ... plus 1% per-vector dense-and-sparse outliers
  cache_nuq3_1pct,
  cache_nuq2_1pct,
};

enum class cache_family : uint8_t { family_fp, family_kivi, family_nuq };

struct cache_format_traits {
  const char* name;
  cache_family family;
  int bits_per_element;    // of a stored K or V code (16/32 for the baselines)
  double outlier_fraction;  // of each vector kept sparse in fp16 (nuq-1%)
  bool pre_rope_keys;       // keys stored before RoPE (applied at attention time)
  bool needs_calibration;   // nuq: datatypes and key scales come from `xctx calibrate`
};

cache_format_traits format_traits(cache_format f);
cache_format parse_cache_format(const std::string& name);  // throws listing the valid names
std::vector<cache_format> all_cache_formats();

// How a quantized format is run (defaults follow the papers).
struct cache_options {
  int group_size = 128;  // kivi: tokens per key group = channels per value group (XQuant §4)
  int qnorm = -1;        // nuq: Q-Norm of the centroids; -1 = the paper's choice (on at 2 bits)
  bool sink = true;      // nuq: the sequence's first token (position 0) kept in fp16
  std::shared_ptr<const calibration> calib;  // nuq: required
};
bool qnorm_enabled(cache_format f, const cache_options& o);

// A format with its options: what make_cache needs. Converts from a bare format.
struct cache_spec {
  cache_format format = cache_format::cache_fp16;
  cache_options options;
  cache_spec() = default;
  cache_spec(cache_format f) : format(f) {}  // NOLINT: implicit on purpose
  cache_spec(cache_format f, cache_options o) : format(f), options(std::move(o)) {}
};

// Outliers per side of a value vector of `channels` elements for a fraction (at least one per
// side when the fraction is positive).
int value_outliers_per_side(double fraction, int channels);

// Exact bytes a cache holds, by component, summed over layers.
struct cache_bytes {
  size_t positions = 0;    // int32 per token, shared by the layers
  size_t codes = 0;        // packed K and V codes (or the fp16/fp32 elements of the baselines)
  size_t fp16_rows = 0;    // attention sink and residual window, K and V in fp16
  size_t scales = 0;       // per-group / per-token fp16 scales and zero points
  size_t tables = 0;       // per-layer LUTs, key channel scales/zeros, outlier thresholds
  size_t outliers = 0;     // sparse values + indices (+ key column offsets)
  size_t total() const { return positions + codes + fp16_rows + scales + tables + outliers; }
};

// The bytes a cache of this spec uses while every layer holds n tokens, of which n_sink are
// the sink (0 or 1) and n_key_outliers (summed over layers) are sparse key entries.
cache_bytes cache_bytes_for(const cache_spec& spec, const cache_geometry& g, int64_t n, int64_t n_sink,
                            int64_t n_key_outliers);
// Bytes per token for long contexts (per-layer tables and windows amortized away; key
// outliers at their nominal fraction): the figure to compare formats by.
double cache_bytes_per_token(const cache_spec& spec, const cache_geometry& g);

}  // namespace xctx
