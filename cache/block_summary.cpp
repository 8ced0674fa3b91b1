#include "cache/block_summary.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/half.h"

namespace xctx {

int64_t summary_blocks_for(int64_t capacity, int64_t block) {
  XCTX_CHECK(block > 0 && block % kAttnUnit == 0, "block summaries: block size ", block,
             " must be a positive multiple of ", kAttnUnit);
  return std::max<int64_t>(capacity, 0) / block + 2;
}

size_t summary_bytes_per_block(const cache_geometry& g) {
  return sizeof(int64_t) + sizeof(int32_t) + 3 * (size_t)g.n_head_kv * g.head_dim * sizeof(uint16_t);
}

namespace {
size_t shadow_bytes(const cache_geometry& g) { return 3 * (size_t)g.n_head_kv * g.head_dim * sizeof(float); }
}  // namespace

size_t summary_bytes_for(const cache_geometry& g, int64_t capacity, int64_t block) {
  return (size_t)g.n_layer * ((size_t)summary_blocks_for(capacity, block) * summary_bytes_per_block(g) + shadow_bytes(g));
}

// bf16 is the top half of a float: dropping the low half rounds toward zero, so a value that
// lost bits moves one step away from zero to round up (positive) or down (negative).
uint16_t bf16_round_down(float x) {
  const uint32_t b = float_to_bits(x);
  const uint16_t t = (uint16_t)(b >> 16);
  return (b & 0xffffu) != 0 && (b >> 31) != 0 ? (uint16_t)(t + 1) : t;
}

uint16_t bf16_round_up(float x) {
  const uint32_t b = float_to_bits(x);
  const uint16_t t = (uint16_t)(b >> 16);
  return (b & 0xffffu) != 0 && (b >> 31) == 0 ? (uint16_t)(t + 1) : t;
}

namespace {

class summarized_cache final : public kv_cache {
 public:
  summarized_cache(std::unique_ptr<kv_cache> inner, int64_t block, backend& be)
      : inner_(std::move(inner)), be_(be), block_(block) {
    const cache_geometry& g = inner_->geometry();
    C_ = g.n_head_kv * g.head_dim;
    max_blocks_ = summary_blocks_for(g.capacity, block_);
    layers_.resize((size_t)g.n_layer);
    for (layer_sums& L : layers_) {  // allocated once at the capacity: the bytes the formula states
      L.ids.resize((size_t)max_blocks_);
      L.count.resize((size_t)max_blocks_);
      L.kmin.resize((size_t)max_blocks_ * C_);
      L.kmax.resize((size_t)max_blocks_ * C_);
      L.kmean.resize((size_t)max_blocks_ * C_);
      L.shadow.resize((size_t)3 * C_);
    }
  }

  cache_format format() const override { return inner_->format(); }
  const cache_geometry& geometry() const override { return inner_->geometry(); }
  int64_t n_tokens(int layer) const override { return inner_->n_tokens(layer); }

  void append(int layer, const layer_input& in) override {
    inner_->append(layer, in);  // first: it checks the capacity and the input
    const float* k = in.k;
    if (!be_.host_memory() && in.n > 0) {  // keys live in the backend's memory
      host_k_.resize((size_t)in.n * C_);
      be_.download(host_k_.data(), in.k, host_k_.size() * sizeof(float));
      k = host_k_.data();
    }
    layer_sums& L = layers_.at((size_t)layer);
    float* mn = L.shadow.data();  // the open block's running min, max, sum
    float* mx = mn + C_;
    float* sm = mx + C_;
    for (int64_t t = 0; t < in.n; ++t) {
      const int64_t id = floor_div(in.pos[t], block_);
      if (L.n == 0 || L.ids[(size_t)L.n - 1] != id) {
        XCTX_CHECK(L.n == 0 || id > L.ids[(size_t)L.n - 1], "block summaries: positions must ascend (block ", id,
                   " after ", L.ids[(size_t)L.n - 1], ")");
        XCTX_CHECK(L.n < max_blocks_, "block summaries: layer ", layer, " touches more than ", max_blocks_,
                   " blocks of ", block_, " (shard boundaries off the block grid?)");
        if (L.n > 0) store_open(L);  // the block before is complete
        const size_t b = (size_t)L.n++;
        L.ids[b] = id;
        L.count[b] = 0;
        std::fill_n(mn, C_, std::numeric_limits<float>::infinity());
        std::fill_n(mx, C_, -std::numeric_limits<float>::infinity());
        std::fill_n(sm, C_, 0.0f);
      }
      if (t < in.summary_skip) continue;  // stored, not summarized (the block is still opened)
      const float* row = k + (size_t)t * C_;
      for (int c = 0; c < C_; ++c) {
        mn[c] = std::min(mn[c], row[c]);
        mx[c] = std::max(mx[c], row[c]);
        sm[c] += row[c];
      }
      ++L.count[(size_t)L.n - 1];
    }
    if (L.n > 0 && in.n > 0) store_open(L);
  }

  block_summary_view view(int layer) const {
    const layer_sums& L = layers_.at((size_t)layer);
    const cache_geometry& g = geometry();
    block_summary_view v;
    v.block = block_;
    v.n_head_kv = g.n_head_kv, v.head_dim = g.head_dim;
    v.n_blocks = L.n;
    v.ids = L.ids.data(), v.count = L.count.data();
    v.kmin = L.kmin.data(), v.kmax = L.kmax.data(), v.kmean = L.kmean.data();
    return v;
  }

  void attend_impl(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
                   const attend_sink& sink) override {
    inner_->attend(layer, src, qs, select, sink);
  }
  size_t exported_bytes(int layer) const override { return inner_->exported_bytes(layer); }
  void export_layer(int layer, void* dst) const override { inner_->export_layer(layer, dst); }

  // Snapshot: uint64 inner bytes | the inner snapshot | int64 n_blocks | ids | counts | min | max |
  // mean | the open block's f32 shadow (min, max, sum), so appends after a restore go on exactly.
  size_t snapshot_bytes(int layer) const override {
    return 16 + inner_->snapshot_bytes(layer) + (size_t)layers_.at((size_t)layer).n * summary_bytes_per_block(geometry()) +
           shadow_bytes(geometry());
  }
  void snapshot_layer(int layer, void* dst) const override {
    auto* out = static_cast<uint8_t*>(dst);
    const uint64_t inner_bytes = inner_->snapshot_bytes(layer);
    std::memcpy(out, &inner_bytes, 8);
    inner_->snapshot_layer(layer, out + 8);
    out += 8 + inner_bytes;
    const layer_sums& L = layers_.at((size_t)layer);
    std::memcpy(out, &L.n, 8);
    out += 8;
    const auto put = [&](const void* p, size_t bytes) {
      std::memcpy(out, p, bytes);
      out += bytes;
    };
    put(L.ids.data(), (size_t)L.n * 8), put(L.count.data(), (size_t)L.n * 4);
    put(L.kmin.data(), (size_t)L.n * C_ * 2), put(L.kmax.data(), (size_t)L.n * C_ * 2);
    put(L.kmean.data(), (size_t)L.n * C_ * 2), put(L.shadow.data(), L.shadow.size() * 4);
  }
  void restore_layer(int layer, const void* block, size_t bytes) override {
    const auto* in = static_cast<const uint8_t*>(block);
    uint64_t inner_bytes = 0;
    XCTX_CHECK(bytes >= 16, "cache snapshot: layer ", layer, " is ", bytes, " bytes, too short for block summaries");
    std::memcpy(&inner_bytes, in, 8);
    XCTX_CHECK(inner_bytes <= bytes - 16, "cache snapshot: layer ", layer, " names ", inner_bytes,
               " bytes of codes in a record of ", bytes);
    inner_->restore_layer(layer, in + 8, inner_bytes);
    in += 8 + inner_bytes;
    int64_t n = 0;
    std::memcpy(&n, in, 8);
    in += 8;
    const size_t per = summary_bytes_per_block(geometry());
    XCTX_CHECK(n >= 0 && n <= max_blocks_ && (size_t)n * per + shadow_bytes(geometry()) == bytes - 16 - inner_bytes,
               "cache snapshot: layer ", layer, " has ", bytes - 16 - inner_bytes, " bytes of block summaries, not ", n,
               " blocks of ", per, " bytes and the open block's ", shadow_bytes(geometry()),
               " (a cache of another block size?)");
    layer_sums& L = layers_.at((size_t)layer);
    L.n = n;
    const auto get = [&](void* p, size_t bytes_) {
      std::memcpy(p, in, bytes_);
      in += bytes_;
    };
    get(L.ids.data(), (size_t)n * 8), get(L.count.data(), (size_t)n * 4);
    get(L.kmin.data(), (size_t)n * C_ * 2), get(L.kmax.data(), (size_t)n * C_ * 2);
    get(L.kmean.data(), (size_t)n * C_ * 2), get(L.shadow.data(), L.shadow.size() * 4);
    for (int64_t b = 1; b < n; ++b)
      XCTX_CHECK(L.ids[(size_t)b] > L.ids[(size_t)b - 1], "cache snapshot: layer ", layer,
                 " block summaries out of order");
  }
  void release_ring_state() override { inner_->release_ring_state(); }
  void clear() override {
    inner_->clear();
    for (layer_sums& L : layers_) L.n = 0;
  }
  size_t bytes_allocated() const override {
    return inner_->bytes_allocated() +
           layers_.size() * ((size_t)max_blocks_ * summary_bytes_per_block(geometry()) + shadow_bytes(geometry()));
  }
  size_t bytes_used() const override {
    size_t n = 0;
    for (const layer_sums& L : layers_) n += (size_t)L.n;
    return inner_->bytes_used() + n * summary_bytes_per_block(geometry()) + layers_.size() * shadow_bytes(geometry());
  }

 private:
  struct layer_sums {
    int64_t n = 0;  // blocks in use
    std::vector<int64_t> ids;
    std::vector<int32_t> count;
    std::vector<uint16_t> kmin, kmax, kmean;  // [max_blocks, C] bf16
    std::vector<float> shadow;                // [3, C] the open block's min, max, sum in f32
  };
  // The open (last) block's bf16 summary from its shadow.
  void store_open(layer_sums& L) const {
    const size_t b = (size_t)L.n - 1;
    const float* mn = L.shadow.data();
    const float* mx = mn + C_;
    const float* sm = mx + C_;
    const float inv = 1.0f / (float)std::max<int32_t>(L.count[b], 1);
    for (int c = 0; c < C_; ++c) {
      L.kmin[b * C_ + c] = bf16_round_down(mn[c]);
      L.kmax[b * C_ + c] = bf16_round_up(mx[c]);
      L.kmean[b * C_ + c] = fp32_to_bf16(sm[c] * inv);
    }
  }
  std::unique_ptr<kv_cache> inner_;
  backend& be_;
  int64_t block_;
  int C_ = 0;
  int64_t max_blocks_ = 0;
  std::vector<layer_sums> layers_;
  std::vector<float> host_k_;  // [n, C] keys downloaded from a device backend
};

}  // namespace

std::unique_ptr<kv_cache> make_summarized_cache(std::unique_ptr<kv_cache> inner, int64_t block, backend& be) {
  (void)summary_blocks_for(0, block);  // validates the block size
  return std::make_unique<summarized_cache>(std::move(inner), block, be);
}

bool has_summaries(const kv_cache& c) { return dynamic_cast<const summarized_cache*>(&c) != nullptr; }

block_summary_view summaries_of(const kv_cache& c, int layer) {
  const auto* s = dynamic_cast<const summarized_cache*>(&c);
  XCTX_CHECK(s != nullptr, "cache of format ", format_traits(c.format()).name,
             " keeps no block summaries (retrieval attention was not asked for when it was made)");
  return s->view(layer);
}

}  // namespace xctx
