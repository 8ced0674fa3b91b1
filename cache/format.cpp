#include "cache/format.h"

#include <sstream>

#include "common/error.h"

namespace xctx {

cache_format_traits format_traits(cache_format f) {
  switch (f) {
    case cache_format::cache_fp32: return {"fp32", 32, false};
    case cache_format::cache_fp16: return {"fp16", 16, false};
  }
  XCTX_ASSERT(false, "bad cache_format ", (int)f);
  return {};
}

std::vector<cache_format> all_cache_formats() { return {cache_format::cache_fp32, cache_format::cache_fp16}; }

cache_format parse_cache_format(const std::string& name) {
  std::ostringstream names;
  for (cache_format f : all_cache_formats()) {
    if (name == format_traits(f).name) return f;
    names << (names.tellp() > 0 ? ", " : "") << format_traits(f).name;
  }
  fail("unknown cache format '", name, "' (known: ", names.str(), ")");
}

size_t cache_bytes_per_token(cache_format f, const cache_geometry& g) {
  // K and V of every layer, plus the token's position (stored once, shared by the layers).
  const size_t elems = 2 * (size_t)g.n_layer * (size_t)g.n_head_kv * (size_t)g.head_dim;
  switch (f) {
    case cache_format::cache_fp32: return elems * 4 + sizeof(int32_t);
    case cache_format::cache_fp16: return elems * 2 + sizeof(int32_t);
  }
  XCTX_ASSERT(false, "bad cache_format ", (int)f);
  return 0;
}

}  // namespace xctx
