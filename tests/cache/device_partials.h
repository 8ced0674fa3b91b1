// Shared by the device-space cache suites (test_quant_cache_device.cpp, test_x_cache_device.cpp):
// one layer's (o, lse) attention partial taken from a cache on the CPU backend (host arrays) or
// on a device_space_backend (queries uploaded, results downloaded), from the cache itself or
// from a ring block.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "cache/cache.h"
#include "device_space_backend.h"

namespace xctx::test {

struct attn_partial {
  std::vector<float> o, lse;
};

inline attn_partial host_partial(kv_cache& c, int l, const std::vector<float>& q, const std::vector<int32_t>& q_pos,
                                 attend_path path, const std::vector<uint8_t>* block = nullptr) {
  const int64_t n_q = (int64_t)q_pos.size();
  attn_partial p{std::vector<float>(q.size()), std::vector<float>(n_q * c.geometry().n_head)};
  if (block == nullptr)
    c.attend_partial(l, q.data(), q_pos.data(), n_q, path, p.o.data(), p.lse.data());
  else
    c.attend_exported_partial(l, block->data(), block->size(), q.data(), q_pos.data(), n_q, path, p.o.data(),
                              p.lse.data());
  return p;
}

inline attn_partial device_partial(device_space_backend& dev, kv_cache& c, int l, const std::vector<float>& q,
                                   const std::vector<int32_t>& q_pos, attend_path path,
                                   const std::vector<uint8_t>* block = nullptr) {
  const cache_geometry& g = c.geometry();
  const int64_t n_q = (int64_t)q_pos.size(), rows = n_q * g.n_head;
  backend_buffer dq(dev), dout(dev), dlse(dev);
  dev.upload(dq.reserve(q.size() * 4), q.data(), q.size() * 4);
  float* o = dout.reserve_as<float>(rows * g.head_dim);
  float* lse = dlse.reserve_as<float>(rows);
  if (block == nullptr)
    c.attend_partial(l, dq.as<float>(), q_pos.data(), n_q, path, o, lse);
  else
    c.attend_exported_partial(l, block->data(), block->size(), dq.as<float>(), q_pos.data(), n_q, path, o, lse);
  attn_partial p{std::vector<float>(q.size()), std::vector<float>(rows)};
  dev.download(p.o.data(), o, p.o.size() * 4), dev.download(p.lse.data(), lse, p.lse.size() * 4);
  return p;
}

// Deterministic queries [n_q, n_head, head_dim] of size ~1.
inline std::vector<float> some_queries(int64_t n_q, const cache_geometry& g) {
  std::vector<float> q((size_t)n_q * g.n_head * g.head_dim);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.37f * (float)i + 0.5f);
  return q;
}

// A layer as a ring block / snapshot (export_layer's bytes).
inline std::vector<uint8_t> exported_block(const kv_cache& c, int layer) {
  std::vector<uint8_t> b(c.exported_bytes(layer));
  c.export_layer(layer, b.data());
  return b;
}

// The device cache's partials equal the host twin's bit for bit (the same CPU kernels run behind
// the emulation): on both attention paths, and over a ring block exported by the host cache.
inline void expect_device_attends_as_host(device_space_backend& dev, kv_cache& host, kv_cache& device) {
  const cache_geometry& g = host.geometry();
  const std::vector<int32_t> q_pos = {0, 40, 200, 390};  // from the first slot to past the last
  const std::vector<float> q = some_queries((int64_t)q_pos.size(), g);
  const std::vector<int32_t> one = {390};
  const std::vector<float> q1 = some_queries(1, g);
  for (int l = 0; l < g.n_layer; ++l) {
    const attn_partial hp = host_partial(host, l, q, q_pos, attend_path::attend_prefill);
    const attn_partial dp = device_partial(dev, device, l, q, q_pos, attend_path::attend_prefill);
    EXPECT_EQ(dp.o, hp.o) << "layer " << l;
    EXPECT_EQ(dp.lse, hp.lse) << "layer " << l;
    const attn_partial hd = host_partial(host, l, q1, one, attend_path::attend_decode);
    const attn_partial dd = device_partial(dev, device, l, q1, one, attend_path::attend_decode);
    EXPECT_EQ(dd.o, hd.o) << "layer " << l;
    EXPECT_EQ(dd.lse, hd.lse) << "layer " << l;
    const std::vector<uint8_t> block = exported_block(host, l);
    const attn_partial hb = host_partial(host, l, q, q_pos, attend_path::attend_prefill, &block);
    const attn_partial db = device_partial(dev, device, l, q, q_pos, attend_path::attend_prefill, &block);
    EXPECT_EQ(hb.o, hp.o) << "layer " << l;  // a block attends as the cache it came from
    EXPECT_EQ(db.o, hp.o) << "layer " << l;
    EXPECT_EQ(db.lse, hp.lse) << "layer " << l;
  }
}

// The device's (o, lse) partials agree with the host twin's exact accumulator to `rel` (a
// different summation order of the same softmax; o of size ~1, lse ~10).
inline void expect_partials_near_the_accumulator(device_space_backend& dev, kv_cache& host, kv_cache& device,
                                                 double rel) {
  const cache_geometry& g = host.geometry();
  const std::vector<int32_t> q_pos = {2, 130, 390};
  const std::vector<float> q = some_queries((int64_t)q_pos.size(), g);
  for (int l = 0; l < g.n_layer; ++l) {
    const attn_partial dp = device_partial(dev, device, l, q, q_pos, attend_path::attend_prefill);
    std::vector<float> o(q.size()), lse(dp.lse.size());
    host.attend(l, q.data(), q_pos.data(), (int64_t)q_pos.size(), o.data(), lse.data(), attend_path::attend_prefill);
    for (size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(dp.o[i], o[i], rel * (1.0 + std::fabs(o[i]))) << i;
    for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(dp.lse[i], lse[i], rel * (1.0 + std::fabs(lse[i]))) << i;
  }
}

}  // namespace xctx::test
