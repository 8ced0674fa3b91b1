// The cache formats users name with --cache: one enum and one traits table. Later formats
// (kivi*, nuq*, xquant*, clkv) join the enum; every switch over it has no default, so the build
// breaks wherever a new format is not handled.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace xctx {

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
};

struct cache_format_traits {
  const char* name;
  int bits_per_element;  // of a stored K or V element, before per-block side data
  bool pre_rope_keys;    // keys stored before RoPE (applied at attention time)
};

cache_format_traits format_traits(cache_format f);
cache_format parse_cache_format(const std::string& name);  // throws listing the valid names
std::vector<cache_format> all_cache_formats();

// Bytes one cached token costs across all layers, computed from what the format stores
// (equal to what the cache allocates per token of capacity).
size_t cache_bytes_per_token(cache_format f, const cache_geometry& g);

}  // namespace xctx
