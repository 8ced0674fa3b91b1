// xquant-cl2/3/4 (XQuant §3.2, §3.3.2, App. A; Table 4's "first layers at 4 bits" option).
//
// Layers [0, hi) cache their input X at 4 bits per token (hi = cl_hi_layers, 3 by default as in
// Table 4; the paper's plain variant is hi = 1). Layer base = hi - 1 is the accumulator's start:
// X̂_base = deq(Q(X_base)). Every later layer i caches the quantized delta against the
// accumulator, per token (channel groups of group_size):
//     δ̂_i = Q((X_i - X̂_{i-1})·U_i)      X̂_i = X̂_{i-1} + δ̂_i·U_iᵀ
// with U_i the left singular vectors of [W_k | W_v] for GQA models (identity for MHA), and K|V of
// layer i rebuilt from X̂_i·[W_k | W_v] + b. Per token, because the delta of a token has to be
// final the moment the next layer needs X̂ (a per-channel group over tokens would close later).
//
// The accumulator X̂ is per token ([n, n_embd] f32) and lives here between calls: append at layer
// i needs X̂_{i-1} of the new tokens, attention at layer i needs X̂_i of every token. Each row
// records the layer it holds; bringing a row to layer i adds the missing deltas (one per layer
// in the usual order: append and attend of layer i follow those of layer i-1) or restarts from
// X̂_base (a new forward step starts over at layer 0). This is the paper's accumulator (Figure 4,
// Figure A.1): working memory like the rebuilt K/V of other formats, not part of bytes_used().
//
// Under sequence parallelism a token's accumulator lives on its rank. Ring blocks of layers
// < base carry the 4-bit X codes; for layers >= base the mode (cache_options::cl_ring) decides:
//  deltas (default): the block carries what the layer stores (base: its X codes; above: the
//    quantized deltas + fp16 params), below fp16 K|V bytes (SmolLM2 at np 4: 0.17-0.28 of
//    fp16's ring bytes, docs/x_formats.md). The receiver keeps an f32 accumulator for each
//    foreign source block ([n, n_embd], identified by the block's positions, which a source
//    rank repeats at every layer), started at the base layer and advanced by each layer's block
//    with the owner's decode and row-invariant update, so X̂_i of a foreign token is the owner's
//    bits; K|V = X̂_i·[W_k | W_v] + b for own and foreign tokens alike (the paper's rebuild).
//    Cost: n_foreign·(n_embd + 1)·4 bytes per rank while the prefill ring runs (in
//    bytes_allocated(), dropped by release_ring_state() and clear()): 23 GB per rank for SmolLM2
//    at 10M tokens.
//  latent: the block carries the fp16 latent X̂_i·U_i (GQA: 2·kv_dim channels, the same bytes as
//    fp16 K and V; MHA: X̂_i itself, half of fp16 K and V), which rebuilds K|V exactly through
//    Σ_kv B_kvᵀ, with O(block) receiver memory. Attention reads that fp16 latent for the own
//    shard too (deviation from the paper, which rebuilds from the f32 X̂: one fp16 rounding of
//    the latent), so a token's keys and values are the same bits on every rank.
// In both modes the result does not depend on the rank count. Deltas is the default: it is what
// a compressed ring is for (latent moves 0.96 of fp16's bytes) and it is the paper's arithmetic;
// latent is for lengths where n·n_embd·4 bytes per rank defeat sharding (164 GB at n_embd = 4096).
//
// Every array lives in the backend's memory (the device's on cuda): codes and parameters carved
// per layer, the accumulator (allocated at capacity on first use), foreign accumulators, the
// latent a ring block carries; the host keeps counts, the layer each accumulator row holds and
// positions. The steps are backend ops (xq_encode, xq_project, sub, xq_decode_rows,
// xq_add_projected, add, convert_rows, attention_xq), the same on the host as before.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "cache/block_on_backend.h"
#include "cache/slot_positions.h"
#include "cache/x_cache.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "common/half.h"

namespace xctx {
namespace {

size_t pad8(size_t b) { return (b + 7) / 8 * 8; }
constexpr int64_t kAccBlock = 1024;  // rows per accumulator update (bounds the decode scratch)

struct cl_layer {
  explicit cl_layer(backend& be) : arena(be) {}
  int64_t n = 0;
  int C = 0, bits = 0, n_g = 0;
  size_t rb = 0;
  backend_buffer arena;           // codes, then params
  uint8_t* codes = nullptr;       // [capacity, rb]
  kvq_affine* params = nullptr;   // [capacity, n_g]
};

// Deltas ring mode: the accumulator of one foreign source block. The ring prefill passes each
// source rank's tokens as one block per layer with the same positions at every layer, so the
// positions identify it; `layer` is the layer x holds (a block's layers arrive in order).
struct foreign_acc {
  explicit foreign_acc(backend& be) : x(be) {}
  std::vector<int32_t> pos;  // [n] the block's positions (host)
  backend_buffer x;          // [n, n_embd] X̂_layer of the block's tokens
  int layer = -1;
};

class x_cl_cache final : public kv_cache {
 public:
  x_cl_cache(const cache_spec& spec, const cache_geometry& g, backend& be)
      : spec_(spec),
        geo_(g),
        be_(be),
        traits_(format_traits(spec.format)),
        deltas_(spec.options.cl_ring != cl_ring_mode::cl_ring_latent),
        pos_(be, g.capacity),
        acc_(be),
        scratch_(be),
        delta_(be),
        lat_(be),
        latent16_(be),
        block_(be) {
    XCTX_CHECK(g.n_layer > 0 && g.n_head_kv > 0 && g.head_dim > 0 && g.n_head % g.n_head_kv == 0 && g.n_embd > 0,
               "cache geometry invalid: n_layer=", g.n_layer, " n_head=", g.n_head, " n_head_kv=", g.n_head_kv,
               " head_dim=", g.head_dim, " n_embd=", g.n_embd);
    XCTX_CHECK(g.capacity > 0, "cache capacity must be positive, got ", g.capacity);
    check_x_factors(spec.options.factors.get(), spec.format, g);
    factors_ = spec.options.factors;
    G_ = spec.options.group_size;
    XCTX_CHECK(G_ >= 8 && G_ % 8 == 0 && G_ <= 65536, "cache ", traits_.name, ": group size ", G_,
               " must be a multiple of 8 in [8, 65536]");
    XCTX_CHECK(g.n_embd % 8 == 0, "cache ", traits_.name, ": n_embd ", g.n_embd, " must be a multiple of 8");
    d_ = g.n_embd, kv_ = g.n_head_kv * g.head_dim, r_ = xquant_cl_rank(g);
    base_ = xquant_cl_hi_layers(spec.options, g.n_layer) - 1;
    layers_.reserve(g.n_layer);
    for (int l = 0; l < g.n_layer; ++l) {
      cl_layer& L = layers_.emplace_back(be);
      L.C = xquant_cl_channels(g, spec.options, l);
      L.bits = xquant_cl_bits(spec.format, spec.options, g.n_layer, l);
      L.n_g = (L.C + G_ - 1) / G_;
      L.rb = kvq_row_bytes(L.C, L.bits);
      const size_t code_bytes = ((size_t)g.capacity * L.rb + 63) / 64 * 64;
      auto* base = static_cast<uint8_t*>(L.arena.reserve(code_bytes + (size_t)g.capacity * L.n_g * sizeof(kvq_affine)));
      L.codes = base;
      L.params = reinterpret_cast<kvq_affine*>(base + code_bytes);
    }
    factors_on_be_ = x_factors_on_backend::get(be, *factors_);
  }

  cache_format format() const override { return spec_.format; }
  const cache_geometry& geometry() const override { return geo_; }
  int64_t n_tokens(int layer) const override { return layers_.at(layer).n; }

  size_t bytes_allocated() const override {
    size_t b = pos_.bytes() + acc_.bytes() + acc_layer_.capacity() * 2;
    for (const cl_layer& L : layers_) b += L.arena.bytes();
    for (const foreign_acc& f : foreign_) b += f.pos.capacity() * 4 + f.x.bytes();
    return b;
  }

  size_t bytes_used() const override {
    int64_t n_max = 0;
    size_t b = 0;
    for (const cl_layer& L : layers_) {
      n_max = std::max(n_max, L.n);
      b += (size_t)L.n * L.rb + (size_t)L.n * L.n_g * sizeof(kvq_affine);
    }
    return b + (size_t)n_max * sizeof(int32_t);
  }

  void clear() override {
    for (cl_layer& L : layers_) L.n = 0;
    std::fill(acc_layer_.begin(), acc_layer_.end(), (int16_t)-1);
    pos_.clear();
    release_ring_state();
  }

  void release_ring_state() override { std::vector<foreign_acc>().swap(foreign_); }

  void append(int layer, const layer_input& in) override {
    XCTX_ASSERT(layer >= 0 && layer < geo_.n_layer);
    cl_layer& L = layers_[layer];
    XCTX_CHECK(L.n + in.n <= geo_.capacity, "cache full: layer ", layer, " holds ", L.n, " tokens, appending ", in.n,
               " exceeds the capacity of ", geo_.capacity, " (raise the context size)");
    if (in.n == 0) return;
    XCTX_CHECK(in.x != nullptr, "cache ", traits_.name, ": layer ", layer, " input lacks the layer input x");
    XCTX_CHECK(layer == 0 || layers_[layer - 1].n >= L.n + in.n, "cache ", traits_.name, ": layer ", layer,
               " appended before layer ", layer - 1, " holds its tokens (the cross-layer accumulator needs them)");
    pos_.store(layer, L.n, in);
    const int64_t a0 = L.n;
    ensure_acc(a0 + in.n);
    if (layer <= base_) {
      encode_rows(layer, a0, in.x, in.n);
      if (layer == base_) advance(a0, a0 + in.n, base_);
      return;
    }
    advance(a0, a0 + in.n, layer - 1);
    float* delta = delta_.reserve_as<float>(in.n * d_);
    be_.sub(delta, in.x, acc() + (size_t)a0 * d_, in.n * d_);
    const float* rows = delta;
    const x_layer_factor_ptrs& F = factors_on_be_->layer(layer);
    if (F.u_kv != nullptr) {
      float* lat = lat_.reserve_as<float>(in.n * r_);
      be_.xq_project(delta, F.u_kv, in.n, d_, r_, lat);
      rows = lat;
    }
    encode_rows(layer, a0, rows, in.n);
    advance(a0, a0 + in.n, layer);
  }

  // Block: int64 n | pos [n] int32 | codes [n, rb], params [n, n_g] of the layer (layers < base,
  // and every layer in deltas mode) or the fp16 latent [n, r] (layers >= base, latent mode);
  // each part padded to 8 bytes.
  size_t exported_bytes(int layer) const override { return block_bytes(layer, layers_.at(layer).n); }

  void export_layer(int layer, void* dst) const override {
    const cl_layer& L = layers_.at(layer);
    auto* out = static_cast<uint8_t*>(dst);
    const int64_t n = L.n;
    std::memcpy(out, &n, 8);
    std::memcpy(out + 8, pos_.host(), (size_t)n * 4);
    uint8_t* body = out + 8 + pad8(n * 4);
    if (layer < base_ || deltas_) {
      download(body, L.codes, n * L.rb);
      download(body + pad8(n * L.rb), L.params, n * L.n_g * sizeof(kvq_affine));
    } else {
      download(body, latent_fp16(layer, n), (size_t)n * r_ * 2);
    }
  }

  // Own tokens through own_args (in deltas mode advancing only the selected units' rows); a ring
  // block's bytes go to the backend unread (exported_args checks them on the host before any
  // kernel reads them).
  void attend_impl(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
                   const attend_sink& sink) override {
    const int32_t* q_pos = sink.exact() ? qs.pos : pos_.queries_on_backend(qs.pos, qs.n);
    xq_attn_args a;
    if (src.own()) {
      a = own_args(layer, sink.exact() ? pos_.host() : pos_.on_backend(), qs.q, q_pos, qs.n, qs.path, select);
    } else {
      const void* on_be =
          be_.host_memory() ? src.block : block_on(be_, block_, src.block, src.bytes, src.on_backend);
      a = exported_args(layer, src.block, src.bytes, on_be, qs.q, q_pos, qs.n, qs.path);
    }
    a.select = select;
    if (sink.exact()) a.acc = sink.acc;
    else a.o = sink.o, a.lse = sink.lse;
    be_.attention_xq(a);
  }

  // Snapshot: the stored codes of every layer in either ring mode (the fp16 latent a latent-mode
  // ring block carries is derived, not stored): int64 n | pos [n] | codes [n, rb] | params
  // [n, n_g], each part padded to 8 bytes. The accumulators are rebuilt from the codes on use.
  size_t snapshot_bytes(int layer) const override { return codes_block_bytes(layer, layers_.at(layer).n); }

  void snapshot_layer(int layer, void* dst) const override {
    const cl_layer& L = layers_.at(layer);
    auto* out = static_cast<uint8_t*>(dst);
    const int64_t n = L.n;
    std::memcpy(out, &n, 8);
    std::memcpy(out + 8, pos_.host(), (size_t)n * 4);
    download(out + 8 + pad8(n * 4), L.codes, n * L.rb);
    download(out + 8 + pad8(n * 4) + pad8(n * L.rb), L.params, n * L.n_g * sizeof(kvq_affine));
  }

  void restore_layer(int layer, const void* block, size_t bytes) override {
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer && layers_[layer].n == 0, "cache snapshot: layer ", layer,
               " is not an empty layer of this ", geo_.n_layer, "-layer cache");
    const auto* in = static_cast<const uint8_t*>(block);
    XCTX_CHECK(bytes >= 8, "cache snapshot of ", bytes, " bytes is too short for its header");
    int64_t n = 0;
    std::memcpy(&n, in, 8);
    const bool plausible = n >= 0 && (size_t)n <= bytes;
    XCTX_CHECK(plausible && codes_block_bytes(layer, n) == bytes, "cache snapshot for layer ", layer, " claims ", n,
               " tokens (", plausible ? codes_block_bytes(layer, n) : 0, " bytes) but holds ", bytes, " bytes");
    XCTX_CHECK(n <= geo_.capacity, "cache snapshot: layer ", layer, " holds ", n, " tokens; the cache has room for ",
               geo_.capacity);
    XCTX_CHECK(layer == 0 || layers_[layer - 1].n >= n, "cache snapshot: layer ", layer, " holds ", n,
               " tokens, more than layer ", layer - 1, " below it (restore the layers in order)");
    if (layer == 0) std::fill(acc_layer_.begin(), acc_layer_.end(), (int16_t)-1);
    pos_.restore(layer, reinterpret_cast<const int32_t*>(in + 8), n);
    cl_layer& L = layers_[layer];
    upload(L.codes, in + 8 + pad8(n * 4), n * L.rb);
    upload(L.params, in + 8 + pad8(n * 4) + pad8(n * L.rb), n * L.n_g * sizeof(kvq_affine));
    L.n = n;
  }

  xq_stream stream_view(int layer) const {
    const cl_layer& L = layers_.at(layer);
    xq_stream s;
    s.axis = xq_axis::xq_per_token, s.channels = L.C, s.bits = L.bits, s.group = G_;
    s.nq = L.n, s.codes = L.codes, s.params = L.params;
    return s;
  }

  // For tests and tools: X̂_layer of every token the layer holds, into host memory.
  void accumulator(int layer, float* out) {
    XCTX_CHECK(layer >= base_ && layer < geo_.n_layer, "cache ", traits_.name, ": layer ", layer,
               " has no accumulator (base layer ", base_, ")");
    const int64_t n = layers_[layer].n;
    advance(0, n, layer);
    download(out, acc(), (size_t)n * d_ * 4);
  }

 private:
  size_t block_bytes(int layer, int64_t n) const {
    if (layer < base_ || deltas_) return codes_block_bytes(layer, n);
    return 8 + pad8(n * 4) + pad8((size_t)n * r_ * 2);
  }
  size_t codes_block_bytes(int layer, int64_t n) const {
    const cl_layer& L = layers_[layer];
    return 8 + pad8(n * 4) + pad8(n * L.rb) + pad8(n * L.n_g * sizeof(kvq_affine));
  }

  void download(void* dst_host, const void* src, size_t bytes) const {
    if (bytes != 0) be_.download(dst_host, src, bytes);
  }
  void upload(void* dst, const void* src_host, size_t bytes) const {
    if (bytes != 0) be_.upload(dst, src_host, bytes);
  }
  float* acc() const { return acc_.as<float>(); }

  // The accumulator takes the whole capacity on first use, which is what the memory plan counts.
  // (Growing it by doubling held the old and the new buffer together: on the tail rank, whose
  // capacity exceeds a power-of-two shard by the question and the answer budget, that was one
  // accumulator more than planned, 1.29x the plan at 512K tokens.) Every row index is below the
  // capacity: append checks it before it gets here.
  void ensure_acc(int64_t n) const {
    XCTX_ASSERT(n <= geo_.capacity);
    if (!acc_layer_.empty()) return;
    acc_.reserve_as<float>(geo_.capacity * d_);
    acc_layer_.assign(geo_.capacity, (int16_t)-1);
  }

  void encode_rows(int layer, int64_t a0, const float* rows, int64_t n) {
    cl_layer& L = layers_[layer];
    xq_encode_job j;
    j.axis = xq_axis::xq_per_token, j.bits = L.bits, j.channels = L.C, j.group = G_, j.n = n, j.x = rows;
    j.codes = L.codes + (size_t)a0 * L.rb;
    j.params = L.params + (size_t)a0 * L.n_g;
    be_.xq_encode(j);
    L.n = a0 + n;
  }

  // acc[r, :] += δ̂_j(t0 + r)·U_jᵀ for r < m, from rows [t0, t0 + m) of layer j's delta stream s
  // (acc [m, n_embd] holds X̂_{j-1} of those rows). The owner (advance) and a ring receiver
  // (exported_args) both come through here: same decode, same row-invariant product, so a
  // token's X̂_j is the same bits on every rank.
  void add_delta(int j, const xq_stream& s, int64_t t0, int64_t m, float* acc /*[m, n_embd]*/) const {
    const x_layer_factor_ptrs& F = factors_on_be_->layer(j);
    if (F.u_kv == nullptr) {  // MHA: the delta is in X space
      float* z = scratch_.reserve_as<float>(m * d_);
      be_.xq_decode_rows(s, t0, m, z);
      be_.add(acc, z, m * d_);
      return;
    }
    float* z = scratch_.reserve_as<float>(m * r_);
    be_.xq_decode_rows(s, t0, m, z);
    be_.xq_add_projected(z, F.u_kv, m, r_, d_, acc);
  }

  // Brings accumulator rows [t0, t1) to layer `to` (>= base).
  void advance(int64_t t0, int64_t t1, int to) const {
    XCTX_ASSERT(to >= base_ && to < geo_.n_layer);
    ensure_acc(t1);
    int64_t t = t0;
    while (t < t1) {
      const int16_t at = acc_layer_[t];
      int64_t e = t + 1;
      while (e < t1 && acc_layer_[e] == at && e - t < kAccBlock) ++e;
      int from = at;
      float* rows = acc() + (size_t)t * d_;
      if (from < base_ || from > to) {
        be_.xq_decode_rows(stream_view(base_), t, e - t, rows);
        from = base_;
      }
      for (int j = from + 1; j <= to; ++j) {
        XCTX_ASSERT(layers_[j].n >= e, "accumulator row ", e - 1, " asked for layer ", j, " which holds ",
                    layers_[j].n);
        add_delta(j, stream_view(j), t, e - t, rows);
      }
      std::fill(acc_layer_.begin() + t, acc_layer_.begin() + e, (int16_t)to);
      t = e;
    }
  }

  // The accumulator of tokens [0, n) at `layer` in the [W_k | W_v] latent, rounded to fp16 (in
  // the backend's memory): what ring blocks carry and what every rank attends (own shard too).
  const uint16_t* latent_fp16(int layer, int64_t n) const {
    advance(0, n, layer);
    const x_layer_factor_ptrs& F = factors_on_be_->layer(layer);
    uint16_t* h = latent16_.reserve_as<uint16_t>(std::max<int64_t>(n * r_, 1));
    if (F.u_kv == nullptr) {  // MHA: the latent is X̂ itself
      be_.convert_rows(h, kv_dtype::kv_f16, acc(), n * r_);
      return h;
    }
    float* y = lat_.reserve_as<float>(std::max<int64_t>(n * r_, 1));
    be_.xq_project(acc(), F.u_kv, n, d_, r_, y);
    be_.convert_rows(h, kv_dtype::kv_f16, y, n * r_);
    return h;
  }

  xq_attn_args base_args(int layer, const xq_stream& s, int64_t n, const int32_t* pos, const float* q,
                         const int32_t* q_pos, int64_t n_q, attend_path path) const {
    const x_layer_factor_ptrs& F = factors_on_be_->layer(layer);
    xq_attn_args a;
    a.n = n, a.pos = pos, a.zk = s, a.zv = s, a.same_stream = true;
    a.m_k = F.w_kv, a.ld_mk = 2 * kv_, a.m_v = F.w_kv + kv_, a.ld_mv = 2 * kv_;
    a.b_k = F.b_k, a.b_v = F.b_v;
    a.q = q, a.q_pos = q_pos, a.n_q = n_q;
    a.n_head = geo_.n_head, a.n_head_kv = geo_.n_head_kv, a.head_dim = geo_.head_dim;
    a.scale = 1.0f / std::sqrt((float)geo_.head_dim);
    a.rope = geo_.rope;
    a.absorb_v = path == attend_path::attend_decode;
    return a;
  }
  // Over the fp16 latent [n, r]: K|V rebuilt through Σ_kv B_kvᵀ.
  xq_attn_args latent_args(int layer, const uint16_t* y, int64_t n, const int32_t* pos, const float* q,
                           const int32_t* q_pos, int64_t n_q, attend_path path) const {
    xq_stream s;
    s.axis = xq_axis::xq_per_token, s.channels = r_, s.bits = 4, s.group = G_, s.nq = 0;
    s.tail = y;
    xq_attn_args a = base_args(layer, s, n, pos, q, q_pos, n_q, path);
    const x_layer_factor_ptrs& F = factors_on_be_->layer(layer);
    a.m_k = F.m_kv, a.m_v = F.m_kv + kv_;
    return a;
  }
  // Accumulator rows ([n, n_embd] f32) as the attention kernel's stream. bits/group are unused
  // with dense rows; they are set so the stream stays valid when x is null (no rows yet).
  xq_stream dense_view(const float* x /*[n, n_embd]*/) const {
    xq_stream s;
    s.axis = xq_axis::xq_per_token, s.channels = d_, s.bits = 4, s.group = G_, s.nq = 0;
    s.dense = x;
    return s;
  }

  // Attention over the own tokens of a layer (o/lse or acc left to the caller).
  // select (retrieval): only the selected units' rows need the accumulator at this layer.
  xq_attn_args own_args(int layer, const int32_t* pos, const float* q, const int32_t* q_pos, int64_t n_q,
                        attend_path path, const attn_selection* select = nullptr) const {
    const int64_t n = layers_.at(layer).n;
    if (layer < base_) return base_args(layer, stream_view(layer), n, pos, q, q_pos, n_q, path);
    if (deltas_) {  // from the f32 accumulator, as foreign blocks
      if (select == nullptr) {
        advance(0, n, layer);
      } else {  // a row's accumulator is the same bits however it got to this layer (row-invariant sums)
        std::vector<int64_t> units(select->units);
        std::sort(units.begin(), units.end());
        units.erase(std::unique(units.begin(), units.end()), units.end());
        const int32_t* hp = pos_.host();
        for (const int64_t u : units) {
          const int64_t b = std::lower_bound(hp, hp + n, (int64_t)u * kAttnUnit,
                                             [](int32_t p, int64_t v) { return (int64_t)p < v; }) - hp;
          const int64_t e = std::lower_bound(hp + b, hp + n, (int64_t)(u + 1) * kAttnUnit,
                                             [](int32_t p, int64_t v) { return (int64_t)p < v; }) - hp;
          if (b < e) advance(b, e, layer);
        }
      }
      return base_args(layer, dense_view(acc()), n, pos, q, q_pos, n_q, path);
    }
    // The own shard is attended through the same fp16 latent a ring block carries, so a token's
    // keys and values are the same bits whichever rank attends it (rank-count invariance).
    return latent_args(layer, latent_fp16(layer, n), n, pos, q, q_pos, n_q, path);
  }

  // Checks a ring block's header and positions (host bytes); returns its token count.
  int64_t check_block(int layer, const void* block, size_t bytes) const {
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer, "cache block for layer ", layer, " of a ", geo_.n_layer,
               "-layer cache");
    const auto* in = static_cast<const uint8_t*>(block);
    XCTX_CHECK(bytes >= 8, "cache block of ", bytes, " bytes is too short for its header");
    int64_t n = 0;
    std::memcpy(&n, in, 8);
    XCTX_CHECK(n >= 0 && n <= (int64_t)(bytes / 2) && block_bytes(layer, n) == bytes, "cache block for layer ", layer,
               " claims ", n, " tokens (", n >= 0 && n <= (int64_t)(bytes / 2) ? block_bytes(layer, n) : 0,
               " bytes) but holds ", bytes, " bytes");
    const auto* pos = reinterpret_cast<const int32_t*>(in + 8);
    for (int64_t i = 1; i < n; ++i)
      XCTX_CHECK(pos[i - 1] < pos[i], "cache block for layer ", layer, ": positions not increasing at index ", i,
                 " (", pos[i - 1], " then ", pos[i], ")");
    return n;
  }

  // The attention args over a ring block: `block` is the host bytes (checked, positions read
  // there), `on_be` the same bytes where the backend reads them (block itself on host-memory
  // backends). Deltas mode above the base: the foreign accumulator is advanced to the layer.
  xq_attn_args exported_args(int layer, const void* block, size_t bytes, const void* on_be, const float* q,
                             const int32_t* q_pos, int64_t n_q, attend_path path) {
    const int64_t n = check_block(layer, block, bytes);
    const auto* in = static_cast<const uint8_t*>(block);
    const auto* pos_host = reinterpret_cast<const int32_t*>(in + 8);
    const auto* be_bytes = static_cast<const uint8_t*>(on_be);
    const auto* pos = reinterpret_cast<const int32_t*>(be_bytes + 8);
    const uint8_t* body = be_bytes + 8 + pad8(n * 4);
    if (layer >= base_ && !deltas_)
      return latent_args(layer, reinterpret_cast<const uint16_t*>(body), n, pos, q, q_pos, n_q, path);
    xq_stream s = stream_view(layer);
    s.nq = n;
    s.codes = body;
    s.params = reinterpret_cast<const kvq_affine*>(body + pad8(n * layers_[layer].rb));
    if (layer < base_) return base_args(layer, s, n, pos, q, q_pos, n_q, path);
    // A source rank without tokens: nothing to accumulate; the attention sees no rows.
    if (n == 0) return base_args(layer, dense_view(nullptr), 0, pos, q, q_pos, n_q, path);
    foreign_acc& f = foreign_for(layer, pos_host, n);
    float* x = f.x.as<float>();
    if (f.layer != layer) {  // the layer's first query chunk advances it; later chunks reuse it
      if (layer == base_) {
        be_.xq_decode_rows(s, 0, n, x);
      } else {
        for (int64_t t = 0; t < n; t += kAccBlock)
          add_delta(layer, s, t, std::min(kAccBlock, n - t), x + (size_t)t * d_);
      }
      f.layer = layer;
    }
    return base_args(layer, dense_view(x), n, pos, q, q_pos, n_q, path);
  }

  // Deltas mode: the accumulator of the foreign block at positions pos [n] for `layer`. At the
  // base layer it is (re)started, sized for the caller to decode into, unless it already holds
  // the base layer of the same positions (a later query chunk of the layer); above it must hold
  // layer - 1, or layer itself for a later chunk (every layer's block of a source passes in
  // order, none skipped).
  foreign_acc& foreign_for(int layer, const int32_t* pos, int64_t n) {
    auto it = std::find_if(foreign_.begin(), foreign_.end(), [&](const foreign_acc& f) { return f.pos[0] == pos[0]; });
    if (layer == base_ && it != foreign_.end() && it->layer == base_ && (int64_t)it->pos.size() == n &&
        std::equal(pos, pos + n, it->pos.begin()))
      return *it;
    if (layer == base_) {
      if (it == foreign_.end()) {
        foreign_.emplace_back(be_);
        it = foreign_.end() - 1;
      }
      it->pos.assign(pos, pos + n);
      it->x.reserve_as<float>(n * d_);  // [n, n_embd]
      it->layer = -1;
      return *it;
    }
    XCTX_CHECK(it != foreign_.end(), "cache ", traits_.name, ": ring block for layer ", layer, " (positions ", pos[0],
               "..", pos[n - 1], ", ", n, " tokens) has no foreign accumulator: its base layer ", base_,
               " block was not attended");
    XCTX_CHECK((int64_t)it->pos.size() == n, "cache ", traits_.name, ": ring block for layer ", layer,
               " starts at position ", pos[0], " like the block accumulated since layer ", base_, " but holds ", n,
               " tokens, not ", it->pos.size());
    const auto diff = std::mismatch(pos, pos + n, it->pos.begin());
    XCTX_CHECK(diff.first == pos + n, "cache ", traits_.name, ": ring block for layer ", layer, " starts at position ",
               pos[0], " like the block accumulated since layer ", base_, " but has position ", *diff.first,
               " at index ", diff.first - pos, " where that block has ", *diff.second);
    XCTX_CHECK(it->layer == layer - 1 || it->layer == layer, "cache ", traits_.name, ": ring block for layer ", layer, " (positions ",
               pos[0], "..", pos[n - 1], "): its foreign accumulator holds layer ", it->layer, ", not ", layer - 1,
               " (a block was skipped)");
    return *it;
  }

  cache_spec spec_;
  cache_geometry geo_;
  backend& be_;
  cache_format_traits traits_;
  bool deltas_ = true;  // cl_ring_mode::cl_ring_deltas
  std::shared_ptr<const x_factors> factors_;
  std::shared_ptr<const x_factors_on_backend> factors_on_be_;
  int G_ = 0, d_ = 0, kv_ = 0, r_ = 0, base_ = 0;
  slot_position_store pos_;  // [capacity], shared by the layers
  std::vector<cl_layer> layers_;
  mutable backend_buffer acc_;              // [rows, n_embd] the accumulator X̂
  mutable std::vector<int16_t> acc_layer_;  // [rows] layer each accumulator row holds (-1: none)
  mutable backend_buffer scratch_;          // [block, r] decoded deltas
  backend_buffer delta_;                    // [n, n_embd] rows being appended
  mutable backend_buffer lat_;              // [n, r] their latents; the f32 latent of latent_fp16
  mutable backend_buffer latent16_;         // [n, r] fp16: latent mode's own-shard latent
  backend_buffer block_;                    // a ring block uploaded by attend_exported_partial
  std::vector<foreign_acc> foreign_;        // deltas mode: one per foreign source block (ring prefill)
};

}  // namespace

std::unique_ptr<kv_cache> make_x_cl_cache(const cache_spec& spec, const cache_geometry& g, backend& be) {
  return std::make_unique<x_cl_cache>(spec, g, be);
}

xq_stream x_cl_cache_stream(const kv_cache& c, int layer, int which) {
  const auto* x = dynamic_cast<const x_cl_cache*>(&c);
  XCTX_CHECK(x != nullptr, "cache of format ", format_traits(c.format()).name, " is not an X cache");
  XCTX_CHECK(which == 0, "cache ", format_traits(c.format()).name, " has one stream per layer, asked for ", which);
  return x->stream_view(layer);
}

void x_cl_accumulator(kv_cache& c, int layer, float* out) {
  auto* x = dynamic_cast<x_cl_cache*>(&c);
  XCTX_CHECK(x != nullptr, "cache of format ", format_traits(c.format()).name, " is not an xquant-cl cache");
  x->accumulator(layer, out);
}

}  // namespace xctx
