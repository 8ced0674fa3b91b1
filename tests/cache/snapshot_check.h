// Shared by the cache tests: a cache restored from its snapshot is the same cache -- every layer's
// snapshot and ring block bitwise equal, attention bitwise equal, and appending more tokens to
// both keeps them equal (windows, sinks, outlier lists and accumulators went on like the
// original's) -- and damaged snapshots are refused.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "cache/cache.h"
#include "common/error.h"

namespace xctx::test {

inline std::vector<uint8_t> snapshot_of(const kv_cache& c, int layer) {
  std::vector<uint8_t> b(c.snapshot_bytes(layer));
  c.snapshot_layer(layer, b.data());
  return b;
}

inline std::vector<uint8_t> block_of(const kv_cache& c, int layer) {
  std::vector<uint8_t> b(c.exported_bytes(layer));
  c.export_layer(layer, b.data());
  return b;
}

// make: a fresh, empty cache of src's spec. more: appends the same further tokens to a cache.
inline void expect_restores_like(kv_cache& src, const std::function<std::unique_ptr<kv_cache>()>& make,
                                 const std::function<void(kv_cache&)>& more) {
  const cache_geometry& g = src.geometry();
  auto dst = make();
  for (int l = 0; l < g.n_layer; ++l) {
    const std::vector<uint8_t> snap = snapshot_of(src, l);
    dst->restore_layer(l, snap.data(), snap.size());
  }
  const int qd = g.n_head * g.head_dim;
  const std::vector<int32_t> q_pos = {3, 40, 100000};
  std::vector<float> q(3 * qd);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.05f * (float)((i * 7) % 23) - 0.5f;
  const auto same = [&](const char* when) {
    for (int l = 0; l < g.n_layer; ++l) {
      ASSERT_EQ(dst->n_tokens(l), src.n_tokens(l)) << when << ", layer " << l;
      EXPECT_EQ(snapshot_of(*dst, l), snapshot_of(src, l)) << when << ", layer " << l;
      EXPECT_EQ(block_of(*dst, l), block_of(src, l)) << when << ", layer " << l;
      std::vector<float> o1(3 * qd), o2(3 * qd), l1(3 * g.n_head), l2(3 * g.n_head);
      src.attend(l, q.data(), q_pos.data(), 3, o1.data(), l1.data());
      dst->attend(l, q.data(), q_pos.data(), 3, o2.data(), l2.data());
      EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.size() * 4)) << when << ", layer " << l;
      EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4)) << when << ", layer " << l;
    }
    EXPECT_EQ(dst->bytes_used(), src.bytes_used()) << when;
  };
  same("restored");
  more(src);
  more(*dst);
  same("after appending to both");

  // Refusals: a layer that holds tokens, a block cut short, a block whose count is off, a
  // layer restored before the one below holds its tokens is not tested here (format-specific).
  const std::vector<uint8_t> snap = snapshot_of(src, 0);
  EXPECT_THROW(dst->restore_layer(0, snap.data(), snap.size()), Error);
  auto empty = make();
  EXPECT_THROW(empty->restore_layer(0, snap.data(), snap.size() - 8), Error);
  std::vector<uint8_t> bad = snap;
  bad[0] ^= 0x40;  // the token count no longer matches the layout
  EXPECT_THROW(empty->restore_layer(0, bad.data(), bad.size()), Error);
  EXPECT_THROW(empty->restore_layer(g.n_layer, snap.data(), snap.size()), Error);
  EXPECT_EQ(empty->n_tokens(0), 0);
}

// Two adjacent int64 counts of a layer block's header (words w and w + 1) set to the
// cache_snapshot fuzzer's values, whose sum overflows int64: refused with an Error (under
// UBSan, the overflow itself used to stop the run).
inline void expect_overflowing_counts_refused(const std::function<std::unique_ptr<kv_cache>()>& make,
                                              const std::vector<uint8_t>& snap, int w) {
  std::vector<uint8_t> bad = snap;
  const int64_t huge[2] = {7957695015293251440, 6878254907934113797};
  ASSERT_GE(bad.size(), (size_t)(w + 2) * 8);
  std::memcpy(bad.data() + 8 * w, huge, sizeof huge);
  auto empty = make();
  EXPECT_THROW(empty->restore_layer(0, bad.data(), bad.size()), Error);
  EXPECT_EQ(empty->n_tokens(0), 0);
}

}  // namespace xctx::test
