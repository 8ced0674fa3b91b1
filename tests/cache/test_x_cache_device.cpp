// The X caches (xquant2-4 with latents or X itself, clkv, xquant-cl2-4 in both ring modes) on a
// backend whose memory is not the host's (tests/device_space_backend.h): every stream array, the
// accumulators and the rebuild factors live in that memory, written only by the backend's ops
// and read only by attention_xq and downloads.
// Against the same cache on the CPU backend (the same CPU kernels run behind the emulation): the
// same bytes after an uneven append pattern, bitwise the same (o, lse) partials on both paths and
// over ring blocks, snapshots crossing both ways, no transfer in a decode step.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cache/quant_test_util.h"
#include "cache/x_test_util.h"
#include "common/error.h"
#include "cache/device_partials.h"
#include "device_space_backend.h"
#include "registry/registry.h"
#include "test_util.h"

namespace xctx {
namespace {

constexpr int kWindow = 24;

struct device_case {
  cache_format format;
  bool gqa;  // GQA: xquant stores the latents X·U_k, X·U_v; MHA: X itself (one stream)
  bool ch0;  // xquant: the key-side latent's first channel kept fp16
  cl_ring_mode ring = cl_ring_mode::cl_ring_deltas;  // xquant-cl: what its ring blocks carry
};
std::string case_name(const device_case& c) {
  const bool cl = format_traits(c.format).family == cache_family::family_xquant_cl;
  return test::format_test_name(c.format) + (c.gqa ? "_gqa" : "_mha") + (c.ch0 ? "_ch0" : "") +
         (cl ? (c.ring == cl_ring_mode::cl_ring_latent ? "_latent" : "_deltas") : "");
}
void PrintTo(const device_case& c, std::ostream* os) { *os << case_name(c); }

cache_spec spec_for(const device_case& c, const model_weights& w) {
  cache_options o;
  o.group_size = kWindow;
  o.clkv_group = 8;
  o.x_fp16_first_channel = c.ch0;
  o.clkv_value_share_from = 2;  // layers 2-3 decode layer 1-2's value codes with their own scales
  o.cl_hi_layers = 2;           // xquant-cl: layers 0-1 X at 4 bits, base 1, deltas 2-3
  o.cl_ring = c.ring;
  if (format_needs_x_factors(c.format)) o.factors = build_x_factors(w, x_factor_kind_for(c.format));
  return cache_spec(c.format, o);
}

// A host cache and a device cache of one case, filled with the same layer inputs in uneven
// chunks (windows completed mid-chunk, a partial window left), layers in the engine's order.
struct twin_x_caches {
  device_case c;
  cache_geometry g;
  test::x_model model;
  cache_spec spec;
  test::device_space_backend dev;
  std::unique_ptr<backend> cpu = make_backend(backend_kind::backend_cpu);
  std::unique_ptr<kv_cache> host, device;
  std::vector<std::vector<float>> x, k, v;
  std::vector<int32_t> pos;
  int64_t n = 131;

  explicit twin_x_caches(const device_case& dc, test::self_extend_case se = {1, 0})
      : c(dc), g(test::x_geometry(dc.gqa, 160)) {
    g.rope = test::with_self_extend(g.rope, se);
    model = test::make_x_model(g, 17, true);
    spec = spec_for(c, model.w);
    host = make_cache(spec, g, *cpu);
    device = make_cache(spec, g, dev);
    x = test::make_layer_inputs(g, n, 18);
    k.resize(g.n_layer), v.resize(g.n_layer);
    for (int l = 0; l < g.n_layer; ++l) test::project_kv(model, l, x[l], n, k[l], v[l]);
    pos.resize(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)(3 * i);
    append_rows(0, n, {1, 7, 30, 1, 1, 64, 27});
  }

  // Rows [from, to) in chunks, every layer per chunk, on both caches.
  void append_rows(int64_t from, int64_t to, const std::vector<int64_t>& chunks) {
    const int d = g.n_embd, C = g.n_head_kv * g.head_dim;
    backend_buffer dx(dev), dk(dev), dv(dev);
    int64_t at = from;
    for (size_t ci = 0; at < to; ++ci) {
      const int64_t m = std::min(to - at, chunks[ci % chunks.size()]);
      for (int l = 0; l < g.n_layer; ++l) {
        const float *xs = x[l].data() + at * d, *ks = k[l].data() + at * C, *vs = v[l].data() + at * C;
        host->append(l, layer_input{xs, ks, vs, pos.data() + at, m});
        dev.upload(dx.reserve(m * d * 4), xs, m * d * 4);
        dev.upload(dk.reserve(m * C * 4), ks, m * C * 4), dev.upload(dv.reserve(m * C * 4), vs, m * C * 4);
        device->append(l, layer_input{dx.as<float>(), dk.as<float>(), dv.as<float>(), pos.data() + at, m});
      }
      at += m;
    }
  }
  std::vector<uint8_t> block(const kv_cache& c, int layer) const { return test::exported_block(c, layer); }
};

using test::device_partial;
using test::host_partial;
using test::some_queries;
using partial = test::attn_partial;

class x_cache_device : public ::testing::TestWithParam<device_case> {};

TEST_P(x_cache_device, stores_the_host_caches_bytes) {
  twin_x_caches t(GetParam());
  for (int l = 0; l < t.g.n_layer; ++l) {
    EXPECT_EQ(t.device->n_tokens(l), t.n);
    EXPECT_EQ(t.block(*t.device, l), t.block(*t.host, l)) << "layer " << l;
  }
  EXPECT_EQ(t.device->bytes_used(), t.host->bytes_used());
  EXPECT_EQ(t.device->bytes_allocated(), t.host->bytes_allocated());  // factors are model data, not counted
}

// The same kernels behind the emulation: the device's partials are the host's, bit for bit, on
// both paths and over a ring block from the host cache.
TEST_P(x_cache_device, attends_as_the_host_cache) {
  twin_x_caches t(GetParam());
  test::expect_device_attends_as_host(t.dev, *t.host, *t.device);
}

// The (o, lse) partial agrees with the exact accumulator's result on the CPU backend to float
// rounding: a different summation order of the same softmax.
TEST_P(x_cache_device, partials_agree_with_the_exact_accumulator) {
  twin_x_caches t(GetParam());
  test::expect_partials_near_the_accumulator(t.dev, *t.host, *t.device, 2e-5);
}

// With SelfExtend the CPU kernels take (o, lse) calls through an accumulator of the call's rows
// (attend_via_accumulator): the device's partials agree with the exact sum as without it.
TEST_P(x_cache_device, self_extend_partials_agree_with_the_exact_accumulator) {
  for (const test::self_extend_case se : {test::self_extend_case{4, 64}, test::self_extend_case{3, 77}}) {
    SCOPED_TRACE("G " + std::to_string(se.group) + " W " + std::to_string(se.window));
    twin_x_caches t(GetParam(), se);
    test::expect_partials_near_the_accumulator(t.dev, *t.host, *t.device, 2e-5);
  }
}

// A host snapshot restores into an empty device cache (layers in order: clkv's shared codes are
// compared with the layer below's, downloaded) and snapshots the same bytes; and the other way.
// The restored caches attend as the originals (xquant-cl rebuilds its accumulators from codes).
TEST_P(x_cache_device, snapshots_cross_between_host_and_device) {
  twin_x_caches t(GetParam());
  auto dev2 = make_cache(t.spec, t.g, t.dev);
  auto host2 = make_cache(t.spec, t.g, *t.cpu);
  const auto snapshot = [](const kv_cache& c, int l) {
    std::vector<uint8_t> b(c.snapshot_bytes(l));
    c.snapshot_layer(l, b.data());
    return b;
  };
  for (int l = 0; l < t.g.n_layer; ++l) {
    const std::vector<uint8_t> from_host = snapshot(*t.host, l), from_dev = snapshot(*t.device, l);
    EXPECT_EQ(from_dev, from_host) << "layer " << l;
    dev2->restore_layer(l, from_host.data(), from_host.size());
    host2->restore_layer(l, from_dev.data(), from_dev.size());
    EXPECT_EQ(snapshot(*dev2, l), from_host) << "layer " << l;
    EXPECT_EQ(snapshot(*host2, l), from_dev) << "layer " << l;
  }
  const std::vector<int32_t> q_pos = {5, 390};
  const std::vector<float> q = some_queries((int64_t)q_pos.size(), t.g);
  for (int l = 0; l < t.g.n_layer; ++l) {
    const partial hp = host_partial(*t.host, l, q, q_pos, attend_path::attend_prefill);
    const partial dp = device_partial(t.dev, *dev2, l, q, q_pos, attend_path::attend_prefill);
    EXPECT_EQ(dp.o, hp.o) << "layer " << l;
    EXPECT_EQ(dp.lse, hp.lse) << "layer " << l;
  }
}

// Decode steps (one token appended per layer, then a one-query partial per layer) move no
// cache data: besides the caller's own uploads of each layer's x, k and v, one upload per step
// of the new slot's position and one of the query position; no download.
TEST_P(x_cache_device, decode_steps_move_no_cache_data) {
  twin_x_caches t(GetParam());
  const int d = t.g.n_embd, C = t.g.n_head_kv * t.g.head_dim;
  const int64_t n_more = 29;  // to the capacity, across a window boundary (an encode on the device)
  const std::vector<std::vector<float>> x = test::make_layer_inputs(t.g, n_more, 29);
  backend_buffer dx(t.dev), dk(t.dev), dv(t.dev), dq(t.dev), dout(t.dev), dlse(t.dev);
  const std::vector<float> q = some_queries(1, t.g);
  t.dev.upload(dq.reserve(q.size() * 4), q.data(), q.size() * 4);
  float* o = dout.reserve_as<float>(t.g.n_head * t.g.head_dim);
  float* lse = dlse.reserve_as<float>(t.g.n_head);
  std::vector<float> k, v;
  for (int64_t s = 0; s < n_more; ++s) {
    const int32_t p = (int32_t)(3 * (t.n + s));
    const int64_t up = t.dev.uploads, down = t.dev.downloads;
    for (int l = 0; l < t.g.n_layer; ++l) {
      const std::vector<float> xs(x[l].begin() + s * d, x[l].begin() + (s + 1) * d);
      test::project_kv(t.model, l, xs, 1, k, v);
      t.dev.upload(dx.reserve(d * 4), xs.data(), d * 4);
      t.dev.upload(dk.reserve(C * 4), k.data(), C * 4), t.dev.upload(dv.reserve(C * 4), v.data(), C * 4);
      t.device->append(l, layer_input{dx.as<float>(), dk.as<float>(), dv.as<float>(), &p, 1});
      t.device->attend_partial(l, dq.as<float>(), &p, 1, attend_path::attend_decode, o, lse);
    }
    EXPECT_EQ(t.dev.uploads - up, 3 * t.g.n_layer + 2) << "step " << s;  // x, k, v per layer; the two positions
    EXPECT_EQ(t.dev.downloads - down, 0) << "step " << s;
  }
  EXPECT_EQ(t.device->n_tokens(0), t.n + n_more);
}

// The factors go up once per backend, however many caches (a rank's own, its star anchor and
// block caches) are made from them, and again only after the last of those caches is gone.
TEST(x_cache_device, caches_on_one_backend_share_one_upload_of_the_factors) {
  const cache_geometry g = test::x_geometry(true, 48);
  const test::x_model model = test::make_x_model(g, 3, true);
  const cache_spec spec = spec_for({cache_format::cache_xquant2, true, false}, model.w);
  test::device_space_backend dev, other;  // declared before the caches made on them
  const auto uploads_of = [&](auto&& make) {
    const int64_t before = dev.uploads;
    make();
    return dev.uploads - before;
  };
  const int per_layer = 6;  // u_k, u_v, m_k, m_v, b_k, b_v
  std::unique_ptr<kv_cache> a, b;
  EXPECT_EQ(uploads_of([&] { a = make_cache(spec, g, dev); }), per_layer * g.n_layer);
  EXPECT_EQ(uploads_of([&] { b = make_cache(spec, g, dev); }), 0);
  a.reset(), b.reset();
  EXPECT_EQ(uploads_of([&] { a = make_cache(spec, g, dev); }), per_layer * g.n_layer);
  const int64_t before = other.uploads;  // another backend gets its own
  b = make_cache(spec, g, other);
  EXPECT_EQ(other.uploads - before, per_layer * g.n_layer);
}

INSTANTIATE_TEST_SUITE_P(cases, x_cache_device,
                         ::testing::Values(device_case{cache_format::cache_xquant2, true, false},
                                           device_case{cache_format::cache_xquant3, true, true},
                                           device_case{cache_format::cache_xquant4, false, false},
                                           device_case{cache_format::cache_clkv, true, false},
                                           device_case{cache_format::cache_clkv, false, false},
                                           device_case{cache_format::cache_xquant_cl3, true, false},
                                           device_case{cache_format::cache_xquant_cl2, true, false,
                                                       cl_ring_mode::cl_ring_latent},
                                           device_case{cache_format::cache_xquant_cl4, false, false},
                                           device_case{cache_format::cache_xquant_cl3, false, false,
                                                       cl_ring_mode::cl_ring_latent}),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace xctx
