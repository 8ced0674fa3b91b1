// The uncompressed baselines: fp32 and fp16 caches of post-RoPE keys and values.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "cache/cache.h"
#include "cache/block_summary.h"
#include "cache/slot_positions.h"
#include "cache/x_cache.h"
#include "common/error.h"
#include "common/half.h"

namespace xctx {
namespace {

class fp_cache final : public kv_cache {
 public:
  fp_cache(cache_format f, const cache_geometry& g, backend& be)
      : format_(f), geo_(g), be_(be), host_mem_(be.host_memory()), pos_(be, g.capacity), kscratch_(be), block_(be) {
    XCTX_CHECK(g.n_layer > 0 && g.n_head_kv > 0 && g.head_dim > 0 && g.n_head % g.n_head_kv == 0,
               "cache geometry invalid: n_layer=", g.n_layer, " n_head=", g.n_head, " n_head_kv=", g.n_head_kv,
               " head_dim=", g.head_dim);
    XCTX_CHECK(g.capacity > 0, "cache capacity must be positive, got ", g.capacity);
    elem_bytes_ = f == cache_format::cache_fp32 ? 4 : 2;
    type_ = f == cache_format::cache_fp32 ? kv_dtype::kv_f32 : kv_dtype::kv_f16;
    row_elems_ = (size_t)g.n_head_kv * g.head_dim;
    const size_t layer_bytes = (size_t)g.capacity * row_elems_ * elem_bytes_;
    bytes_ = 2 * layer_bytes * g.n_layer + (size_t)g.capacity * sizeof(int32_t);
    XCTX_ASSERT(bytes_ == cache_bytes_for(f, g, g.capacity, 0, 0).total());
    // K and V in one allocation; the slot positions (pos_) in their own.
    base_ = static_cast<uint8_t*>(be_.alloc(bytes_ - pos_.bytes()));
    XCTX_CHECK(base_ != nullptr, "cache: cannot allocate ", bytes_, " bytes for ", g.capacity, " tokens");
    for (int l = 0; l < g.n_layer; ++l) {
      k_.push_back(base_ + (2 * (size_t)l) * layer_bytes);
      v_.push_back(base_ + (2 * (size_t)l + 1) * layer_bytes);
    }
    n_.assign(g.n_layer, 0);
  }
  ~fp_cache() override { be_.free(base_); }

  cache_format format() const override { return format_; }
  const cache_geometry& geometry() const override { return geo_; }
  int64_t n_tokens(int layer) const override { return n_.at(layer); }
  size_t bytes_allocated() const override { return bytes_; }
  size_t bytes_used() const override {
    const int64_t n = *std::max_element(n_.begin(), n_.end());
    return cache_bytes_for(format_, geo_, n, 0, 0).total();
  }
  void clear() override {
    std::fill(n_.begin(), n_.end(), 0);
    pos_.clear();
  }

  void append(int layer, const layer_input& in) override {
    XCTX_ASSERT(layer >= 0 && layer < geo_.n_layer);
    const int64_t at = n_[layer];
    XCTX_CHECK(at + in.n <= geo_.capacity, "cache full: layer ", layer, " holds ", at, " tokens, appending ", in.n,
               " exceeds the capacity of ", geo_.capacity, " (raise the context size)");
    if (in.n == 0) return;
    pos_.store(layer, at, in);
    // Keys are stored after RoPE at their positions (pos_ + at: the same values as in.pos, where
    // the backend reads them); fp32 rotates in place, fp16 through an f32 scratch.
    const size_t n_elems = (size_t)in.n * row_elems_;
    uint8_t* k_dst = k_[layer] + (size_t)at * row_elems_ * elem_bytes_;
    float* k_rot = type_ == kv_dtype::kv_f32 ? reinterpret_cast<float*>(k_dst) : kscratch_.reserve_as<float>(n_elems);
    be_.convert_rows(k_rot, kv_dtype::kv_f32, in.k, (int64_t)n_elems);
    be_.rope(k_rot, pos_.on_backend() + at, in.n, geo_.n_head_kv, geo_.rope);
    if (type_ != kv_dtype::kv_f32) be_.convert_rows(k_dst, type_, k_rot, (int64_t)n_elems);
    be_.convert_rows(v_[layer] + (size_t)at * row_elems_ * elem_bytes_, type_, in.v, (int64_t)n_elems);
    n_[layer] = at + in.n;
  }

  // Block layout: int64 n | int32 pos[n] | K [n, n_head_kv, head_dim] | V [same], K/V in the
  // cache's element type; the K/V arrays start 8-byte aligned (pos padded to an even count).
  size_t exported_bytes(int layer) const override { return block_bytes(n_.at(layer)); }
  void export_layer(int layer, void* dst) const override {
    const int64_t n = n_.at(layer);
    auto* out = static_cast<uint8_t*>(dst);
    std::memcpy(out, &n, sizeof n);
    std::memcpy(out + 8, pos_.host(), n * sizeof(int32_t));
    const size_t kv = (size_t)n * row_elems_ * elem_bytes_;
    be_.download(out + 8 + padded_pos_bytes(n), k_[layer], kv);
    be_.download(out + 8 + padded_pos_bytes(n) + kv, v_[layer], kv);
  }
  // Own tokens from the layer's arrays; a ring block in place on the host, or moved to the
  // backend in one upload (header, positions and K/V keep their offsets) unless the caller holds
  // it there. Query positions go to the backend for a partial; the exact sum reads them on the host.
  void attend_impl(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
                   const attend_sink& sink) override {
    const int32_t* q_pos = sink.exact() ? qs.pos : pos_.queries_on_backend(qs.pos, qs.n);
    attn_args a;
    if (src.own()) {
      a = args(k_[layer], v_[layer], pos_.on_backend(), n_[layer], qs.q, q_pos, qs.n);
    } else {
      const int64_t n = block_tokens(layer, src.block, src.bytes);
      const uint8_t* in = static_cast<const uint8_t*>(src.block);
      if (src.on_backend != nullptr) {
        in = static_cast<const uint8_t*>(src.on_backend);
      } else if (!host_mem_) {
        auto* dev = static_cast<uint8_t*>(block_.reserve(src.bytes));
        be_.upload(dev, src.block, src.bytes);
        in = dev;
      }
      const size_t kv = (size_t)n * row_elems_ * elem_bytes_;
      const uint8_t* k = in + 8 + padded_pos_bytes(n);
      a = args(k, k + kv, reinterpret_cast<const int32_t*>(in + 8), n, qs.q, q_pos, qs.n);
    }
    a.select = select;
    if (sink.exact()) {
      a.acc = sink.acc;
      be_.attention_partial(a);
    } else {
      run_partial(a, sink.o, sink.lse);
    }
  }

  void restore_layer(int layer, const void* block, size_t bytes) override {
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer && n_[layer] == 0, "cache snapshot: layer ", layer,
               " is not an empty layer of this ", geo_.n_layer, "-layer cache");
    const int64_t n = block_tokens(layer, block, bytes);
    XCTX_CHECK(n <= geo_.capacity, "cache snapshot: layer ", layer, " holds ", n, " tokens; the cache has room for ",
               geo_.capacity);
    const auto* in = static_cast<const uint8_t*>(block);
    pos_.restore(layer, reinterpret_cast<const int32_t*>(in + 8), n);
    const size_t kv = (size_t)n * row_elems_ * elem_bytes_;
    be_.upload(k_[layer], in + 8 + padded_pos_bytes(n), kv);
    be_.upload(v_[layer], in + 8 + padded_pos_bytes(n) + kv, kv);
    n_[layer] = n;
  }

 private:
  // The token count of a block, checked against its size.
  int64_t block_tokens(int layer, const void* block, size_t bytes) const {
    XCTX_CHECK(bytes >= 8, "cache block of ", bytes, " bytes is too short for its header");
    int64_t n = 0;
    std::memcpy(&n, block, sizeof n);
    const bool plausible = n >= 0 && (size_t)n <= bytes;
    XCTX_CHECK(plausible && block_bytes(n) == bytes, "cache block for layer ", layer, " claims ", n,
               " tokens but holds ", bytes, " bytes (expected ", plausible ? block_bytes(n) : 0, ")");
    return n;
  }

  static size_t padded_pos_bytes(int64_t n) { return (size_t)((n + 1) / 2 * 2) * sizeof(int32_t); }
  size_t block_bytes(int64_t n) const { return 8 + padded_pos_bytes(n) + 2 * (size_t)n * row_elems_ * elem_bytes_; }

  attn_args args(const void* k, const void* v, const int32_t* kv_pos, int64_t n_kv, const float* q,
                 const int32_t* q_pos, int64_t n_q) const {
    attn_args a;
    a.q = q;
    a.q_pos = q_pos;
    a.n_q = n_q;
    a.k = k;
    a.v = v;
    a.kv_pos = kv_pos;
    a.n_kv = n_kv;
    a.kv_type = type_;
    a.n_head = geo_.n_head;
    a.n_head_kv = geo_.n_head_kv;
    a.head_dim = geo_.head_dim;
    a.scale = 1.0f / std::sqrt((float)geo_.head_dim);
    a.rope = geo_.rope;  // SelfExtend turns the post-RoPE keys of its grouped side
    return a;
  }
  void run_partial(attn_args& a, float* o, float* lse) {
    a.o = o;
    a.lse = lse;
    be_.attention_partial(a);
  }

  cache_format format_;
  cache_geometry geo_;
  backend& be_;
  bool host_mem_;
  kv_dtype type_ = kv_dtype::kv_f16;
  size_t elem_bytes_ = 0;
  size_t row_elems_ = 0;
  size_t bytes_ = 0;
  uint8_t* base_ = nullptr;
  std::vector<uint8_t*> k_, v_;  // per layer: [capacity, n_head_kv, head_dim], backend memory
  slot_position_store pos_;      // [capacity]
  std::vector<int64_t> n_;       // tokens held per layer
  // Backend scratch: rotated f32 keys of an fp16 append, an uploaded ring block.
  backend_buffer kscratch_, block_;
};

}  // namespace

namespace {

std::unique_ptr<kv_cache> make_format_cache(const cache_spec& spec, const cache_geometry& g, backend& be) {
  switch (spec.format) {
    case cache_format::cache_fp32:
    case cache_format::cache_fp16: return std::make_unique<fp_cache>(spec.format, g, be);
    case cache_format::cache_kivi4:
    case cache_format::cache_kivi3:
    case cache_format::cache_kivi2:
    case cache_format::cache_nuq4:
    case cache_format::cache_nuq3:
    case cache_format::cache_nuq2:
    case cache_format::cache_nuq4_1pct:
    case cache_format::cache_nuq3_1pct:
    case cache_format::cache_nuq2_1pct: return make_quant_cache(spec, g, be);
    case cache_format::cache_xquant4:
    case cache_format::cache_xquant3:
    case cache_format::cache_xquant2:
    case cache_format::cache_clkv: return make_x_window_cache(spec, g, be);
    case cache_format::cache_xquant_cl4:
    case cache_format::cache_xquant_cl3:
    case cache_format::cache_xquant_cl2: return make_x_cl_cache(spec, g, be);
  }
  fail("make_cache: unknown format ", (int)spec.format);
}

}  // namespace

void check_cache_options(const cache_spec& spec) {
  XCTX_CHECK(spec.options.group_size >= 1 && spec.options.group_size <= (1 << 20),
             "--group-size must be in [1, 1048576] (tokens per quantization group), got ", spec.options.group_size);
}

std::unique_ptr<kv_cache> make_cache(const cache_spec& spec, const cache_geometry& g, backend& be) {
  check_cache_options(spec);
  std::unique_ptr<kv_cache> c = make_format_cache(spec, g, be);
  if (spec.options.summary_block > 0) return make_summarized_cache(std::move(c), spec.options.summary_block, be);
  return c;
}

int64_t cache_alignment(const cache_spec& spec) {
  // Attention deposits one partial per unit of kAttnUnit positions, so no unit may straddle two
  // ranks; the windowed formats also need whole quantization groups on one rank.
  check_cache_options(spec);
  int64_t group = 1;
  switch (format_traits(spec.format).family) {
    case cache_family::family_fp:
    case cache_family::family_nuq:
    case cache_family::family_xquant_cl: break;  // every token encoded when appended
    case cache_family::family_kivi:
    case cache_family::family_xquant:  // residual window of group_size tokens, as kivi
    case cache_family::family_clkv: group = spec.options.group_size; break;
  }
  const int64_t align = std::lcm<int64_t>(kAttnUnit, group);
  // Retrieval: a block's summary is one rank's, so blocks do not straddle ranks either.
  return spec.options.summary_block > 0 ? std::lcm<int64_t>(align, spec.options.summary_block) : align;
}

void kv_cache::attend(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
                      const attend_sink& sink) {
  const cache_geometry& g = geometry();
  XCTX_CHECK(layer >= 0 && layer < g.n_layer, "attention: layer ", layer, " of a ", g.n_layer, "-layer cache");
  XCTX_CHECK(qs.n >= 0 && (qs.n == 0 || (qs.q != nullptr && qs.pos != nullptr)), "attention: ", qs.n,
             " queries without their rows or positions");
  XCTX_CHECK(sink.exact() != (sink.o != nullptr && sink.lse != nullptr) && (sink.exact() || sink.o != nullptr),
             "attention: the sink must be the exact accumulator or an (o, lse) partial, not both or neither");
  if (sink.exact())
    XCTX_CHECK(sink.acc->rows() == qs.n * g.n_head && sink.acc->width() == g.head_dim, "attention: accumulator of ",
               sink.acc->rows(), " x ", sink.acc->width(), " for ", qs.n, " queries x ", g.n_head, " heads x ",
               g.head_dim);
  // Ring blocks are attended whole (the exact prefill sees every key); retrieval selects over
  // the own tokens in the merged steps.
  XCTX_CHECK(select == nullptr || src.own(), "attention: a unit selection over a ring block (retrieval selects over "
             "a rank's own tokens only)");
  if (select != nullptr) check_selection(*select, qs.n, g.n_head_kv, "attention");
  attend_impl(layer, src, qs, select, sink);
}

void kv_cache::attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o, float* lse,
                      attend_path path) {
  const cache_geometry& g = geometry();
  softmax_acc acc(n_q * g.n_head, g.head_dim);
  attend(layer, q, q_pos, n_q, path, acc, nullptr);
  acc.finish(o, lse);
}

void kv_cache::attend_exported(int layer, const void* block, size_t bytes, const float* q, const int32_t* q_pos,
                               int64_t n_q, float* o, float* lse, attend_path path) {
  const cache_geometry& g = geometry();
  softmax_acc acc(n_q * g.n_head, g.head_dim);
  attend_exported(layer, block, bytes, q, q_pos, n_q, path, acc);
  acc.finish(o, lse);
}

}  // namespace xctx
