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
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <vector>

#include "cache/x_cache.h"
#include "cache/slot_positions.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "common/half.h"

namespace xctx {
namespace {

size_t pad8(size_t b) { return (b + 7) / 8 * 8; }
constexpr int64_t kAccBlock = 1024;  // rows per accumulator update (bounds the decode scratch)

struct cl_layer {
  int64_t n = 0;
  int C = 0, bits = 0, n_g = 0;
  size_t rb = 0;
  std::vector<uint8_t> codes;      // [capacity, rb]
  std::vector<kvq_affine> params;  // [capacity, n_g]
};

// Deltas ring mode: the accumulator of one foreign source block. The ring prefill passes each
// source rank's tokens as one block per layer with the same positions at every layer, so the
// positions identify it; `layer` is the layer x holds (a block's layers arrive in order).
struct foreign_acc {
  std::vector<int32_t> pos;  // [n] the block's positions
  std::vector<float> x;      // [n, n_embd] X̂_layer of the block's tokens
  int layer = -1;
};

class x_cl_cache final : public kv_cache {
 public:
  x_cl_cache(const cache_spec& spec, const cache_geometry& g, backend& be)
      : spec_(spec),
        geo_(g),
        traits_(format_traits(spec.format)),
        use_ref_(be.name() == "ref"),
        deltas_(spec.options.cl_ring != cl_ring_mode::cl_ring_latent),
        pos_(be, g.capacity) {
    XCTX_CHECK(g.n_layer > 0 && g.n_head_kv > 0 && g.head_dim > 0 && g.n_head % g.n_head_kv == 0 && g.n_embd > 0,
               "cache geometry invalid: n_layer=", g.n_layer, " n_head=", g.n_head, " n_head_kv=", g.n_head_kv,
               " head_dim=", g.head_dim, " n_embd=", g.n_embd);
    XCTX_CHECK(g.capacity > 0, "cache capacity must be positive, got ", g.capacity);
    XCTX_CHECK(be.name() == "ref" || be.name() == "cpu", "cache ", traits_.name,
               " runs on the host backends (ref, cpu), not on ", be.name());
    check_x_factors(spec.options.factors.get(), spec.format, g);
    factors_ = spec.options.factors;
    G_ = spec.options.group_size;
    XCTX_CHECK(G_ >= 8 && G_ % 8 == 0 && G_ <= 65536, "cache ", traits_.name, ": group size ", G_,
               " must be a multiple of 8 in [8, 65536]");
    XCTX_CHECK(g.n_embd % 8 == 0, "cache ", traits_.name, ": n_embd ", g.n_embd, " must be a multiple of 8");
    d_ = g.n_embd, kv_ = g.n_head_kv * g.head_dim, r_ = xquant_cl_rank(g);
    base_ = xquant_cl_hi_layers(spec.options, g.n_layer) - 1;
    layers_.resize(g.n_layer);
    for (int l = 0; l < g.n_layer; ++l) {
      cl_layer& L = layers_[l];
      L.C = xquant_cl_channels(g, spec.options, l);
      L.bits = xquant_cl_bits(spec.format, spec.options, g.n_layer, l);
      L.n_g = (L.C + G_ - 1) / G_;
      L.rb = kvq_row_bytes(L.C, L.bits);
      L.codes.resize((size_t)g.capacity * L.rb);
      L.params.resize((size_t)g.capacity * L.n_g);
    }
  }

  cache_format format() const override { return spec_.format; }
  const cache_geometry& geometry() const override { return geo_; }
  int64_t n_tokens(int layer) const override { return layers_.at(layer).n; }

  size_t bytes_allocated() const override {
    size_t b = pos_.bytes() + acc_.capacity() * 4 + acc_layer_.capacity() * 2;
    for (const cl_layer& L : layers_) b += L.codes.capacity() + L.params.capacity() * sizeof(kvq_affine);
    for (const foreign_acc& f : foreign_) b += f.pos.capacity() * 4 + f.x.capacity() * 4;
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
    delta_.resize((size_t)in.n * d_);
    for (int64_t e = 0; e < in.n * d_; ++e) delta_[e] = in.x[e] - acc_[(size_t)a0 * d_ + e];
    const float* rows = delta_.data();
    const auto& F = factors_->layers[layer];
    if (!F.u_kv.empty()) {
      lat_.resize((size_t)in.n * r_);
      if (use_ref_)
        ref::xq_project(delta_.data(), F.u_kv.data(), in.n, d_, r_, lat_.data());
      else
        cpu::xq_project(delta_.data(), F.u_kv.data(), in.n, d_, r_, lat_.data());
      rows = lat_.data();
    }
    encode_rows(layer, a0, rows, in.n);
    advance(a0, a0 + in.n, layer);
  }

  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, attend_path path, softmax_acc& out) override {
    const cl_layer& L = layers_.at(layer);
    if (layer < base_) {
      run_w(layer, stream_view(layer), L.n, pos_.host(), q, q_pos, n_q, path, out);
      return;
    }
    if (deltas_) {  // from the f32 accumulator, as foreign blocks (attend_exported)
      advance(0, L.n, layer);
      run_w(layer, dense_view(acc_.data()), L.n, pos_.host(), q, q_pos, n_q, path, out);
      return;
    }
    // The own shard is attended through the same fp16 latent a ring block carries, so a token's
    // keys and values are the same bits whichever rank attends it (rank-count invariance).
    const std::vector<uint16_t> y = latent_fp16(layer, L.n);
    run_latent(layer, y.data(), L.n, pos_.host(), q, q_pos, n_q, path, out);
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
    size_t at = 8;
    const auto put = [&](const void* p, size_t bytes) {
      if (bytes) std::memcpy(out + at, p, bytes);
      at += pad8(bytes);
    };
    put(pos_.host(), n * 4);
    if (layer < base_ || deltas_) {
      put(L.codes.data(), n * L.rb);
      put(L.params.data(), n * L.n_g * sizeof(kvq_affine));
    } else {
      const std::vector<uint16_t> h = latent_fp16(layer, n);
      put(h.data(), h.size() * 2);
    }
    XCTX_ASSERT(at == exported_bytes(layer));
  }

  void attend_exported(int layer, const void* block, size_t bytes, const float* q, const int32_t* q_pos, int64_t n_q,
                       attend_path path, softmax_acc& out) override {
    const auto* in = static_cast<const uint8_t*>(block);
    XCTX_CHECK(bytes >= 8, "cache block of ", bytes, " bytes is too short for its header");
    int64_t n = 0;
    std::memcpy(&n, in, 8);
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer, "cache block for layer ", layer, " of a ", geo_.n_layer,
               "-layer cache");
    XCTX_CHECK(n >= 0 && n <= (int64_t)(bytes / 2) && block_bytes(layer, n) == bytes, "cache block for layer ", layer,
               " claims ", n, " tokens (", n >= 0 && n <= (int64_t)(bytes / 2) ? block_bytes(layer, n) : 0,
               " bytes) but holds ", bytes, " bytes");
    const auto* pos = reinterpret_cast<const int32_t*>(in + 8);
    for (int64_t i = 1; i < n; ++i)
      XCTX_CHECK(pos[i - 1] < pos[i], "cache block for layer ", layer, ": positions not increasing at index ", i,
                 " (", pos[i - 1], " then ", pos[i], ")");
    const uint8_t* body = in + 8 + pad8(n * 4);
    if (layer >= base_ && !deltas_) {
      run_latent(layer, reinterpret_cast<const uint16_t*>(body), n, pos, q, q_pos, n_q, path, out);
      return;
    }
    const xq_stream s = block_stream(layer, body, n);
    if (layer < base_) {
      run_w(layer, s, n, pos, q, q_pos, n_q, path, out);
      return;
    }
    if (n == 0) return;  // a source rank without tokens: nothing to accumulate or attend
    foreign_acc& f = foreign_for(layer, pos, n);
    if (f.layer != layer) {  // the layer's first query chunk advances it; later chunks reuse it
      if (layer == base_) {
        decode(s, 0, n, f.x.data());
      } else {
        for (int64_t t = 0; t < n; t += kAccBlock)
          add_delta(layer, s, t, std::min(kAccBlock, n - t), f.x.data() + (size_t)t * d_);
      }
      f.layer = layer;
    }
    run_w(layer, dense_view(f.x.data()), n, pos, q, q_pos, n_q, path, out);
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
    std::memcpy(out + 8, pos_.host(), n * 4);
    std::memcpy(out + 8 + pad8(n * 4), L.codes.data(), n * L.rb);
    std::memcpy(out + 8 + pad8(n * 4) + pad8(n * L.rb), L.params.data(), n * L.n_g * sizeof(kvq_affine));
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
    std::memcpy(L.codes.data(), in + 8 + pad8(n * 4), n * L.rb);
    std::memcpy(L.params.data(), in + 8 + pad8(n * 4) + pad8(n * L.rb), n * L.n_g * sizeof(kvq_affine));
    L.n = n;
  }

  // The accumulator of tokens [0, n) at `layer` in the [W_k | W_v] latent, rounded to fp16: what
  // ring blocks carry and what every rank attends (own shard included).
  std::vector<uint16_t> latent_fp16(int layer, int64_t n) const {
    advance(0, n, layer);
    const auto& F = factors_->layers[layer];
    std::vector<float> y((size_t)n * r_);
    if (F.u_kv.empty())
      std::copy(acc_.begin(), acc_.begin() + n * d_, y.begin());
    else if (use_ref_)
      ref::xq_project(acc_.data(), F.u_kv.data(), n, d_, r_, y.data());
    else
      cpu::xq_project(acc_.data(), F.u_kv.data(), n, d_, r_, y.data());
    std::vector<uint16_t> h(y.size());
    for (size_t e = 0; e < y.size(); ++e) h[e] = fp32_to_fp16(y[e]);
    return h;
  }

  void run_latent(int layer, const uint16_t* y /*[n, r]*/, int64_t n, const int32_t* pos, const float* q,
                  const int32_t* q_pos, int64_t n_q, attend_path path, softmax_acc& out) const {
    xq_stream s;
    s.axis = xq_axis::xq_per_token, s.channels = r_, s.bits = 4, s.group = G_, s.nq = 0;
    s.tail = y;
    const auto& F = factors_->layers[layer];
    xq_attn_args a = args(layer, s, n, pos, q, q_pos, n_q, path, out);
    a.m_k = F.m_kv.data(), a.ld_mk = 2 * kv_, a.m_v = F.m_kv.data() + kv_, a.ld_mv = 2 * kv_;
    attention(a);
  }

  // The stored stream of a layer as it sits in a ring block of n tokens (body: after positions).
  xq_stream block_stream(int layer, const uint8_t* body, int64_t n) const {
    xq_stream s = stream_view(layer);
    s.nq = n;
    s.codes = body;
    s.params = reinterpret_cast<const kvq_affine*>(body + pad8(n * layers_[layer].rb));
    return s;
  }

  // Accumulator rows ([n, n_embd] f32) as the attention kernel's stream. bits/group are unused
  // with dense rows; they are set so the stream stays valid when x is null (no rows yet).
  xq_stream dense_view(const float* x /*[n, n_embd]*/) const {
    xq_stream s;
    s.axis = xq_axis::xq_per_token, s.channels = d_, s.bits = 4, s.group = G_, s.nq = 0;
    s.dense = x;
    return s;
  }

  xq_stream stream_view(int layer) const {
    const cl_layer& L = layers_.at(layer);
    xq_stream s;
    s.axis = xq_axis::xq_per_token, s.channels = L.C, s.bits = L.bits, s.group = G_;
    s.nq = L.n, s.codes = L.codes.data(), s.params = L.params.data();
    return s;
  }

  void accumulator(int layer, float* out) {
    XCTX_CHECK(layer >= base_ && layer < geo_.n_layer, "cache ", traits_.name, ": layer ", layer,
               " has no accumulator (base layer ", base_, ")");
    const int64_t n = layers_[layer].n;
    advance(0, n, layer);
    std::copy(acc_.begin(), acc_.begin() + n * d_, out);
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

  void ensure_acc(int64_t n) const {
    if ((int64_t)acc_layer_.size() >= n) return;
    const int64_t cap = std::min<int64_t>(geo_.capacity, std::max<int64_t>(n, 2 * (int64_t)acc_layer_.size()));
    acc_.resize((size_t)cap * d_);
    acc_layer_.resize(cap, (int16_t)-1);
  }

  void encode_rows(int layer, int64_t a0, const float* rows, int64_t n) {
    cl_layer& L = layers_[layer];
    xq_encode_job j;
    j.axis = xq_axis::xq_per_token, j.bits = L.bits, j.channels = L.C, j.group = G_, j.n = n, j.x = rows;
    j.codes = L.codes.data() + (size_t)a0 * L.rb;
    j.params = L.params.data() + (size_t)a0 * L.n_g;
    if (use_ref_)
      ref::xq_encode(j);
    else
      cpu::xq_encode(j);
    L.n = a0 + n;
  }

  void decode(const xq_stream& s, int64_t t0, int64_t m, float* out) const {
    if (use_ref_)
      ref::xq_decode_rows(s, t0, m, out);
    else
      cpu::xq_decode_rows(s, t0, m, out);
  }

  // acc[r, :] += δ̂_j(t0 + r)·U_jᵀ for r < m, from rows [t0, t0 + m) of layer j's delta stream s
  // (acc [m, n_embd] holds X̂_{j-1} of those rows). The owner (advance) and a ring receiver
  // (attend_exported) both come through here: same decode, same row-invariant product, so a
  // token's X̂_j is the same bits on every rank.
  void add_delta(int j, const xq_stream& s, int64_t t0, int64_t m, float* acc /*[m, n_embd]*/) const {
    const auto& F = factors_->layers[j];
    if (F.u_kv.empty()) {  // MHA: the delta is in X space
      scratch_.resize((size_t)m * d_);
      decode(s, t0, m, scratch_.data());
      for (int64_t k = 0; k < m * d_; ++k) acc[k] += scratch_[k];
      return;
    }
    scratch_.resize((size_t)m * r_);
    decode(s, t0, m, scratch_.data());
    if (use_ref_)
      ref::xq_add_projected(scratch_.data(), F.u_kv.data(), m, r_, d_, acc);
    else
      cpu::xq_add_projected(scratch_.data(), F.u_kv.data(), m, r_, d_, acc);
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
      if (it == foreign_.end()) it = foreign_.insert(foreign_.end(), foreign_acc{});
      it->pos.assign(pos, pos + n);
      it->x.resize((size_t)n * d_);  // [n, n_embd]
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
      float* acc = acc_.data() + (size_t)t * d_;
      if (from < base_ || from > to) {
        decode(stream_view(base_), t, e - t, acc);
        from = base_;
      }
      for (int j = from + 1; j <= to; ++j) {
        XCTX_ASSERT(layers_[j].n >= e, "accumulator row ", e - 1, " asked for layer ", j, " which holds ",
                    layers_[j].n);
        add_delta(j, stream_view(j), t, e - t, acc);
      }
      std::fill(acc_layer_.begin() + t, acc_layer_.begin() + e, (int16_t)to);
      t = e;
    }
  }

  xq_attn_args args(int layer, const xq_stream& s, int64_t n, const int32_t* pos, const float* q,
                    const int32_t* q_pos, int64_t n_q, attend_path path, softmax_acc& out) const {
    const auto& F = factors_->layers[layer];
    xq_attn_args a;
    a.n = n, a.pos = pos, a.zk = s, a.zv = s, a.same_stream = true;
    a.m_k = F.w_kv.data(), a.ld_mk = 2 * kv_, a.m_v = F.w_kv.data() + kv_, a.ld_mv = 2 * kv_;
    a.b_k = F.b_k.empty() ? nullptr : F.b_k.data();
    a.b_v = F.b_v.empty() ? nullptr : F.b_v.data();
    a.q = q, a.q_pos = q_pos, a.n_q = n_q;
    a.n_head = geo_.n_head, a.n_head_kv = geo_.n_head_kv, a.head_dim = geo_.head_dim;
    a.scale = 1.0f / std::sqrt((float)geo_.head_dim);
    a.rope = geo_.rope;
    a.acc = &out;
    a.absorb_v = path == attend_path::attend_decode;
    return a;
  }

  // Attention over an X stream (or the accumulator) with K|V = X·[W_k | W_v] + b.
  void run_w(int layer, const xq_stream& s, int64_t n, const int32_t* pos, const float* q, const int32_t* q_pos,
             int64_t n_q, attend_path path, softmax_acc& out) const {
    attention(args(layer, s, n, pos, q, q_pos, n_q, path, out));
  }

  void attention(const xq_attn_args& a) const {
    if (use_ref_)
      ref::attention_xq(a);
    else
      cpu::attention_xq(a);
  }


  cache_spec spec_;
  cache_geometry geo_;
  cache_format_traits traits_;
  bool use_ref_ = false;
  bool deltas_ = true;  // cl_ring_mode::cl_ring_deltas
  std::shared_ptr<const x_factors> factors_;
  int G_ = 0, d_ = 0, kv_ = 0, r_ = 0, base_ = 0;
  slot_position_store pos_;  // [capacity], shared by the layers (host backends only)
  std::vector<cl_layer> layers_;
  mutable std::vector<float> acc_;          // [rows, n_embd] the accumulator X̂
  mutable std::vector<int16_t> acc_layer_;  // [rows] layer each accumulator row holds (-1: none)
  mutable std::vector<float> scratch_;      // [block, r] decoded deltas
  std::vector<float> delta_, lat_;          // [n, n_embd], [n, r] rows being appended
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
