// The small cache and identity the cache-snapshot fuzz target restores into, shared with
// make_seeds.cpp (which writes the seed snapshots from a cache of the same shape), and the
// checksum fix-up that lets fuzzed files past the layer and file checksums.
#pragma once

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cache/format.h"
#include "common/hash.h"
#include "worker/cache_snapshot.h"

namespace xctx_fuzz {

// The formats a rank file is restored into (the mode byte picks one).
inline constexpr xctx::cache_format kSnapshotFormats[] = {
    xctx::cache_format::cache_fp16, xctx::cache_format::cache_fp32, xctx::cache_format::cache_kivi4,
    xctx::cache_format::cache_kivi2};

inline xctx::cache_geometry snapshot_geometry() {
  xctx::cache_geometry g;
  g.n_layer = 2, g.n_head = 2, g.n_head_kv = 1, g.head_dim = 8, g.n_embd = 16;
  g.rope.head_dim = 8, g.rope.n_rot = 8, g.rope.freq_base = 10000.0f;
  g.capacity = 64;
  return g;
}

inline xctx::snapshot_identity snapshot_identity_for(xctx::cache_format f) {
  const xctx::cache_geometry g = snapshot_geometry();
  xctx::snapshot_identity id;
  id.model_name = "fuzz";
  id.model_fingerprint = 0x1234;
  id.format = xctx::format_traits(f).name;
  id.spec_digest = xctx::cache_spec_digest(xctx::cache_spec(f));
  id.n_layer = g.n_layer, id.n_head = g.n_head, id.n_head_kv = g.n_head_kv, id.head_dim = g.head_dim;
  id.n_embd = g.n_embd;
  id.post_rope_keys = xctx::format_traits(f).family == xctx::cache_family::family_fp;
  id.n_rot = g.rope.n_rot, id.freq_base = g.rope.freq_base;
  return id;
}

// Rewrites the per-layer checksums and the file checksum of a rank file so they match its
// bytes, following the layout its header describes as far as the bytes go (worker/cache_snapshot.h).
inline void fix_snapshot_checksums(std::vector<uint8_t>& f) {
  constexpr uint64_t kLayerSeed = 0x6c61796572;
  const auto pad8 = [](uint64_t b) { return (b + 7) / 8 * 8; };
  if (f.size() >= 24) {
    uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, f.data() + 16, 8);
    if (header_bytes <= f.size() - 24) {
      try {
        const nlohmann::json j = nlohmann::json::parse(f.begin() + 24, f.begin() + 24 + (ptrdiff_t)header_bytes);
        // Only non-negative integers are followed: get<uint64_t>() of a float out of range is
        // undefined behaviour (UBSan stopped the fuzzer here, in the harness, not the reader).
        const nlohmann::json &lb = j.at("layer_bytes"), &nt = j.at("n_tokens_stored");
        std::vector<uint64_t> layers;
        if (lb.is_array()) {
          for (const nlohmann::json& e : lb) {
            if (!e.is_number_unsigned()) break;
            layers.push_back(e.get<uint64_t>());
          }
        }
        uint64_t pos = pad8(24 + header_bytes);
        if (nt.is_number_unsigned() && nt.get<uint64_t>() <= f.size()) pos += pad8(nt.get<uint64_t>() * 4);
        for (uint64_t b : layers) {
          if (b > f.size() || pos + b > f.size()) break;
          xctx::hash64 h(kLayerSeed);
          h.update(f.data() + pos, b);
          pos = pad8(pos + b);
          if (pos + 8 > f.size()) break;
          const uint64_t sum = h.digest();
          std::memcpy(f.data() + pos, &sum, 8);
          pos += 8;
        }
      } catch (const nlohmann::json::exception&) {
      }
    }
  }
  if (f.size() >= 8) {
    xctx::hash64 h;
    h.update(f.data(), f.size() - 8);
    const uint64_t sum = h.digest();
    std::memcpy(f.data() + f.size() - 8, &sum, 8);
  }
}

}  // namespace xctx_fuzz
