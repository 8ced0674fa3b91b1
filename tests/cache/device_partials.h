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

}  // namespace xctx::test
