// The quantized caches (kivi*, nuq*, nuq* -1%) on a backend whose memory is not the host's
// (tests/device_space_backend.h): their arrays live in that memory, are written only by the
// backend's ops (convert_rows, kvq_encode, kvq_append_outliers) and read only by attention_kvq
// and downloads.
// Against the same cache on the CPU backend: the same bytes (ring block / snapshot) after every
// append pattern, bitwise the same (o, lse) partials (the same CPU kernels run behind the
// emulation), blocks from either side attended and restored on the other.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cache/quant_test_util.h"
#include "common/error.h"
#include "cache/device_partials.h"
#include "device_space_backend.h"
#include "registry/registry.h"
#include "test_util.h"

namespace xctx {
namespace {

using test::make_synthetic_calibration;
using test::make_synthetic_kv;
using test::quant_geometry;

constexpr int kGroup = 24;  // kivi: key groups of 24 tokens; 32-channel rows split 24 + 8 for values

cache_spec device_spec(cache_format f, const cache_geometry& g) {
  cache_options o;
  o.group_size = kGroup;
  if (format_traits(f).needs_calibration) o.calib = make_synthetic_calibration(g, 11);
  return cache_spec(f, o);
}

std::vector<cache_format> device_formats() { return test::quantized_formats(); }

// A host cache and a device cache of one format, filled with the same rows in uneven chunks
// (kivi: groups completed mid-chunk, a partial window left; nuq: the sink at position 0).
struct twin_caches {
  cache_geometry g = quant_geometry(160);
  test::device_space_backend dev;
  std::unique_ptr<backend> cpu = make_backend(backend_kind::backend_cpu);
  std::unique_ptr<kv_cache> host, device;
  int C = g.n_head_kv * g.head_dim;
  int64_t n = 131;
  std::vector<int32_t> pos;

  explicit twin_caches(cache_format f, test::self_extend_case se = {1, 0}) {
    g.rope = test::with_self_extend(g.rope, se);
    host = make_cache(device_spec(f, g), g, *cpu);
    device = make_cache(device_spec(f, g), g, dev);
    const test::synthetic_kv d = make_synthetic_kv(n, C, 5);
    pos.resize(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)(3 * i);
    backend_buffer dk(dev), dv(dev);
    for (int l = 0; l < g.n_layer; ++l) {
      int64_t at = 0;
      for (int64_t m : {1, 7, 30, 1, 1, 64, 27}) {
        const float *k = d.k.data() + at * C, *v = d.v.data() + at * C;
        host->append(l, layer_input{nullptr, k, v, pos.data() + at, m});
        dev.upload(dk.reserve(m * C * 4), k, m * C * 4), dev.upload(dv.reserve(m * C * 4), v, m * C * 4);
        device->append(l, layer_input{nullptr, dk.as<float>(), dv.as<float>(), pos.data() + at, m});
        at += m;
      }
      EXPECT_EQ(at, n);
    }
  }
  std::vector<uint8_t> block(const kv_cache& c, int layer) const { return test::exported_block(c, layer); }
};

using test::device_partial;
using test::host_partial;
using test::some_queries;
using partial = test::attn_partial;

class quant_cache_device : public ::testing::TestWithParam<cache_format> {};

TEST_P(quant_cache_device, stores_the_host_caches_bytes) {
  twin_caches t(GetParam());
  for (int l = 0; l < t.g.n_layer; ++l) {
    EXPECT_EQ(t.device->n_tokens(l), t.n);
    EXPECT_EQ(t.block(*t.device, l), t.block(*t.host, l)) << "layer " << l;
  }
  EXPECT_EQ(t.device->bytes_used(), t.host->bytes_used());
  EXPECT_EQ(t.device->bytes_allocated(), t.host->bytes_allocated());
}

// The same kernels behind the emulation: the device's partials are the host's, bit for bit, on
// both paths and over a ring block from the host cache.
TEST_P(quant_cache_device, attends_as_the_host_cache) {
  twin_caches t(GetParam());
  test::expect_device_attends_as_host(t.dev, *t.host, *t.device);
}

// The (o, lse) partial agrees with the exact accumulator's result on the CPU backend to float
// rounding: a different summation order of the same softmax.
TEST_P(quant_cache_device, partials_agree_with_the_exact_accumulator) {
  twin_caches t(GetParam());
  test::expect_partials_near_the_accumulator(t.dev, *t.host, *t.device, 1e-5);
}

// With SelfExtend the CPU kernels take (o, lse) calls through an accumulator of the call's rows
// (attend_via_accumulator): the device's partials are then the exact sum's.
TEST_P(quant_cache_device, self_extend_partials_agree_with_the_exact_accumulator) {
  for (const test::self_extend_case se : {test::self_extend_case{4, 64}, test::self_extend_case{3, 77}}) {
    SCOPED_TRACE("G " + std::to_string(se.group) + " W " + std::to_string(se.window));
    twin_caches t(GetParam(), se);
    test::expect_partials_near_the_accumulator(t.dev, *t.host, *t.device, 1e-6);
  }
}

// A snapshot of the host cache restores into an empty device cache (uploaded array by array)
// and exports the same bytes again; the device's snapshot restores on the host.
TEST_P(quant_cache_device, snapshots_cross_between_host_and_device) {
  twin_caches t(GetParam());
  auto dev2 = make_cache(device_spec(GetParam(), t.g), t.g, t.dev);
  auto host2 = make_cache(device_spec(GetParam(), t.g), t.g, *t.cpu);
  for (int l = 0; l < t.g.n_layer; ++l) {
    const std::vector<uint8_t> from_host = t.block(*t.host, l), from_dev = t.block(*t.device, l);
    dev2->restore_layer(l, from_host.data(), from_host.size());
    host2->restore_layer(l, from_dev.data(), from_dev.size());
    EXPECT_EQ(t.block(*dev2, l), from_host) << "layer " << l;
    EXPECT_EQ(t.block(*host2, l), from_dev) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(formats, quant_cache_device, ::testing::ValuesIn(device_formats()),
                         [](const auto& info) { return test::format_test_name(info.param); });

// Feeds the same rows to a host cache and a device cache, m rows per append.
void append_twice(kv_cache& host, kv_cache& device, test::device_space_backend& dev, const test::synthetic_kv& d,
                  const std::vector<int32_t>& pos, int64_t m) {
  const cache_geometry& g = host.geometry();
  const int64_t C = g.n_head_kv * g.head_dim, n = (int64_t)pos.size();
  backend_buffer dk(dev), dv(dev);
  for (int l = 0; l < g.n_layer; ++l)
    for (int64_t at = 0; at < n; at += m) {
      const int64_t r = std::min(m, n - at);
      const float *k = d.k.data() + at * C, *v = d.v.data() + at * C;
      host.append(l, layer_input{nullptr, k, v, pos.data() + at, r});
      dev.upload(dk.reserve(r * C * 4), k, r * C * 4), dev.upload(dv.reserve(r * C * 4), v, r * C * 4);
      device.append(l, layer_input{nullptr, dk.as<float>(), dv.as<float>(), pos.data() + at, r});
    }
}

// Text far denser in key outliers than the reserve (every key 20x past its calibrated range):
// the device lists grow as the host's do, the overflowing append runs again from its scratch,
// and the layers export the host's bytes and attend as the host's.
TEST(quant_cache_device, key_outlier_lists_grow_past_the_reserve) {
  const cache_geometry g = quant_geometry(96);
  const int C = g.n_head_kv * g.head_dim;
  test::synthetic_kv d = make_synthetic_kv(90, C, 9);
  for (float& x : d.k) x *= 20.0f;
  std::vector<int32_t> pos(90);
  for (int i = 0; i < 90; ++i) pos[i] = i;
  test::device_space_backend dev;
  auto cpu = make_backend(backend_kind::backend_cpu);
  const cache_format f = cache_format::cache_nuq3_1pct;
  auto host = make_cache(device_spec(f, g), g, *cpu), device = make_cache(device_spec(f, g), g, dev);
  const size_t reserved = reserved_key_outliers(format_traits(f).outlier_fraction, C, g.capacity);
  append_twice(*host, *device, dev, d, pos, 13);
  EXPECT_GT((size_t)quant_cache_key_outliers(*host), 2 * g.n_layer * reserved);  // grown in every layer
  EXPECT_EQ(quant_cache_key_outliers(*device), quant_cache_key_outliers(*host));
  EXPECT_EQ(device->bytes_used(), host->bytes_used());
  const std::vector<int32_t> q_pos = {89};
  const std::vector<float> q = some_queries(1, g);
  for (int l = 0; l < g.n_layer; ++l) {
    std::vector<uint8_t> hb(host->exported_bytes(l)), db(device->exported_bytes(l));
    host->export_layer(l, hb.data()), device->export_layer(l, db.data());
    EXPECT_EQ(db, hb) << "layer " << l;
    const partial hp = host_partial(*host, l, q, q_pos, attend_path::attend_decode);
    const partial dp = device_partial(dev, *device, l, q, q_pos, attend_path::attend_decode);
    EXPECT_EQ(dp.o, hp.o) << "layer " << l;
    EXPECT_EQ(dp.lse, hp.lse) << "layer " << l;
  }
}

// Decode appends (one token per layer and step) never wait for the outlier count while the
// bound on it fits the reserve: no download per step; the count is read once, when asked for.
TEST(quant_cache_device, decode_appends_do_not_read_the_outlier_count) {
  const cache_geometry g = quant_geometry(4096);
  const int C = g.n_head_kv * g.head_dim;
  const int64_t n = 64;
  const test::synthetic_kv d = make_synthetic_kv(n, C, 21);
  std::vector<int32_t> pos(n);
  for (int i = 0; i < n; ++i) pos[i] = 5 + i;
  test::device_space_backend dev;
  auto cpu = make_backend(backend_kind::backend_cpu);
  const cache_format f = cache_format::cache_nuq3_1pct;
  auto host = make_cache(device_spec(f, g), g, *cpu), device = make_cache(device_spec(f, g), g, dev);
  const int64_t downloads = dev.downloads, appends = dev.outlier_appends;
  append_twice(*host, *device, dev, d, pos, 1);
  EXPECT_EQ(dev.downloads - downloads, 0);
  EXPECT_EQ(dev.outlier_appends - appends, n * g.n_layer);
  EXPECT_GT(quant_cache_key_outliers(*host), 0);
  EXPECT_EQ(quant_cache_key_outliers(*device), quant_cache_key_outliers(*host));
  EXPECT_EQ(dev.downloads - downloads, g.n_layer);  // one read per layer, for the question
}

}  // namespace
}  // namespace xctx
