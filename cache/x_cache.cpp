// The windowed X caches: xquant2/3/4 (XQuant §3.1, §3.3, App. B) and clkv (the ACL paper's
// cross-layer shared codes with data-free calibration). Both store two streams per layer:
//   stream 0 ("key side")   per channel over token groups    xquant: X·U_k [n, r]   clkv: K pre-RoPE
//   stream 1 ("value side") per token over channel groups    xquant: X·U_v [n, r]   clkv: V
// (xquant on an MHA model stores X once, per token, and rebuilds both K and V from it.)
// Like kivi, a token's rows stay fp16 in the residual window until its window of `group_size`
// consecutive slots is full; then the window is encoded. xquant uses one scale group = the window
// (XQuant §4: group size 128); clkv uses KIVI's group size 32 inside a 128-token window (ACL §4.1).
// clkv layers flagged shared store no codes: their rows decode layer l-1's codes with their own
// (calibrated) scale and zero (ACL Algorithm 1, gamma_0 = 1).
// Attention rebuilds K (and absorbs V) in the fused kernels of kernels/x_quant.h, reached through
// the backend (backend::xq_encode / xq_project / attention_xq). Every array lives in the backend's
// memory (the device's on cuda), as the quantized caches' do: the residual window is filled by
// convert_rows, a full window encoded from its fp16 rows by the backend, the factors uploaded once
// per layer; the host keeps only counts and positions. (clkv's streams are K and V in KIVI's
// layout: its decode step on the CPU runs the quantized-KV fused kernel, kernels/cpu/kvq/xq.cpp
// attend_decode_as_kvq.)
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cache/x_cache.h"
#include "cache/block_on_backend.h"
#include "cache/slot_positions.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "common/half.h"
#include "kernels/x_quant.h"

namespace xctx {
namespace {

size_t pad8(size_t b) { return (b + 7) / 8 * 8; }

// One stream of a layer; the arrays are carved from the layer's arena (backend memory).
struct stream_store {
  int C = 0, bits = 0, group = 0;
  xq_axis axis = xq_axis::xq_per_token;
  float eta = 0.0f;
  bool shared = false;              // codes are the previous layer's
  bool ch0 = false;                 // first channel kept fp16
  size_t rb = 0;                    // code bytes per row
  int64_t params_per_window = 0;    // kvq_affine entries per encoded window
  uint8_t* codes = nullptr;         // [capacity, rb] (null when shared)
  kvq_affine* params = nullptr;     // [capacity / window * params_per_window]
  uint16_t* tail = nullptr;         // [window, C] fp16
  uint16_t* ch0_vals = nullptr;     // [capacity] fp16 (null unless ch0)
};

struct layer_store {
  explicit layer_store(backend& be) : arena(be) {}
  int64_t n = 0, nq = 0, n_tail = 0;
  int n_streams = 2;
  stream_store s[2];
  backend_buffer arena;  // every stream array
};

class x_window_cache final : public kv_cache {
 public:
  x_window_cache(const cache_spec& spec, const cache_geometry& g, backend& be)
      : spec_(spec), geo_(g), be_(be), traits_(format_traits(spec.format)), pos_(be, g.capacity), proj_{backend_buffer(be), backend_buffer(be)},
        block_(be) {
    XCTX_CHECK(g.n_layer > 0 && g.n_head_kv > 0 && g.head_dim > 0 && g.n_head % g.n_head_kv == 0 && g.n_embd > 0,
               "cache geometry invalid: n_layer=", g.n_layer, " n_head=", g.n_head, " n_head_kv=", g.n_head_kv,
               " head_dim=", g.head_dim, " n_embd=", g.n_embd);
    XCTX_CHECK(g.capacity > 0, "cache capacity must be positive, got ", g.capacity);
    kv_ = g.n_head_kv * g.head_dim;
    xquant_ = traits_.family == cache_family::family_xquant;
    W_ = spec.options.group_size;
    XCTX_CHECK(W_ >= 8 && W_ % 8 == 0 && W_ <= 65536, "cache ", traits_.name, ": group size ", W_,
               " must be a multiple of 8 in [8, 65536]");
    int kgroup = W_, vgroup = W_;
    if (xquant_) {
      check_x_factors(spec.options.factors.get(), spec.format, g);
      factors_ = spec.options.factors;
      latent_ = xquant_uses_latents(g);
    } else {
      const int G = spec.options.clkv_group;
      XCTX_CHECK(G > 0 && W_ % G == 0, "cache clkv: group ", G, " must divide the residual window ", W_);
      kgroup = vgroup = G;
    }
    const int C = xquant_ ? xquant_rank(g) : kv_;
    XCTX_CHECK(C % 8 == 0 && C <= 65536, "cache ", traits_.name, ": ", C, " channels per row must be a multiple of 8");
    layers_.reserve(g.n_layer);
    for (int l = 0; l < g.n_layer; ++l) {
      layer_store& L = layers_.emplace_back(be);
      L.n_streams = (xquant_ && !latent_) ? 1 : 2;
      for (int k = 0; k < L.n_streams; ++k) {
        stream_store& s = L.s[k];
        s.C = C;
        const bool key_side = k == 0 && L.n_streams == 2;
        s.axis = key_side ? xq_axis::xq_per_channel : xq_axis::xq_per_token;
        s.group = key_side ? kgroup : vgroup;
        if (xquant_) {
          s.bits = traits_.bits_per_element;
          s.ch0 = key_side && spec.options.x_fp16_first_channel;
        } else {
          const clkv_layer c = clkv_layer_config(spec.options, g.n_layer, l);
          s.bits = k == 0 ? c.key_bits : c.value_bits;
          s.eta = k == 0 ? c.key_eta : c.value_eta;
          s.shared = k == 0 ? c.key_shared : c.value_shared;
          XCTX_CHECK(s.eta >= 0.0f && s.eta < 0.5f, "cache clkv: eta ", s.eta, " must be in [0, 0.5)");
          if (s.shared)
            XCTX_ASSERT(l > 0 && layers_[l - 1].s[k].bits == s.bits && !layers_[l - 1].s[k].shared);
        }
        s.rb = kvq_row_bytes(C, s.bits);
        s.params_per_window = s.axis == xq_axis::xq_per_channel ? (int64_t)(W_ / s.group) * C
                                                                 : (int64_t)W_ * ((C + s.group - 1) / s.group);
      }
      carve(L, static_cast<uint8_t*>(L.arena.reserve(carve(L, nullptr))));
    }
    if (xquant_) factors_on_be_ = x_factors_on_backend::get(be, *factors_);
  }

  cache_format format() const override { return spec_.format; }
  const cache_geometry& geometry() const override { return geo_; }
  int64_t n_tokens(int layer) const override { return layers_.at(layer).n; }

  // The layers' arenas and the slot positions (the factors are model data, shared).
  size_t bytes_allocated() const override {
    size_t b = pos_.bytes();
    for (const layer_store& L : layers_) b += L.arena.bytes();
    return b;
  }

  size_t bytes_used() const override {
    int64_t n_max = 0;
    size_t b = 0;
    for (const layer_store& L : layers_) {
      n_max = std::max(n_max, L.n);
      for (int k = 0; k < L.n_streams; ++k) {
        const stream_store& s = L.s[k];
        if (!s.shared) b += (size_t)L.nq * s.rb;
        b += (size_t)(L.nq / W_) * s.params_per_window * sizeof(kvq_affine);
        b += (size_t)L.n_tail * s.C * 2;
        if (s.ch0) b += (size_t)L.nq * 2;
      }
    }
    return b + (size_t)n_max * sizeof(int32_t);
  }

  void clear() override {
    for (layer_store& L : layers_) L.n = L.nq = L.n_tail = 0;
    pos_.clear();
  }

  void append(int layer, const layer_input& in) override {
    XCTX_ASSERT(layer >= 0 && layer < geo_.n_layer);
    layer_store& L = layers_[layer];
    XCTX_CHECK(L.n + in.n <= geo_.capacity, "cache full: layer ", layer, " holds ", L.n, " tokens, appending ", in.n,
               " exceeds the capacity of ", geo_.capacity, " (raise the context size)");
    if (in.n == 0) return;
    XCTX_CHECK(xquant_ ? in.x != nullptr : (in.k != nullptr && in.v != nullptr), "cache ", traits_.name,
               ": layer ", layer, " input lacks ", xquant_ ? "the layer input x" : "keys/values");
    if (!xquant_ && layer > 0)
      for (int k = 0; k < 2; ++k)
        XCTX_CHECK(!L.s[k].shared || layers_[layer - 1].n >= L.n + in.n, "cache clkv: layer ", layer,
                   " shares layer ", layer - 1, "'s codes, which must be appended first");
    pos_.store(layer, L.n, in);
    const float* rows[2] = {in.k, in.v};
    if (xquant_) {
      if (latent_) {  // the latents X·U_k and X·U_v of the new rows
        for (int k = 0; k < 2; ++k) {
          float* out = proj_[k].reserve_as<float>(in.n * L.s[k].C);
          const x_layer_factor_ptrs& F = factors_on_be_->layer(layer);
          be_.xq_project(in.x, k == 0 ? F.u_k : F.u_v, in.n, geo_.n_embd, L.s[k].C, out);
          rows[k] = out;
        }
      } else {
        rows[0] = in.x;
      }
    }
    int64_t i = 0;
    while (i < in.n) {
      const int64_t take = std::min<int64_t>(in.n - i, W_ - L.n_tail);
      for (int k = 0; k < L.n_streams; ++k) {
        stream_store& s = L.s[k];
        be_.convert_rows(s.tail + L.n_tail * s.C, kv_dtype::kv_f16, rows[k] + i * s.C, take * s.C);
      }
      L.n_tail += take, L.n += take, i += take;
      if (L.n_tail == W_) encode_window(layer);
    }
  }

  // Block: int64 {n, nq, n_tail} | pos | per stream: codes (the shared partner's for clkv),
  // params, tail, ch0; each array padded to 8 bytes.
  size_t exported_bytes(int layer) const override {
    const layer_store& L = layers_.at(layer);
    return block_bytes(layer, L.nq, L.n_tail);
  }

  void export_layer(int layer, void* dst) const override {
    const layer_store& L = layers_.at(layer);
    auto* out = static_cast<uint8_t*>(dst);
    const int64_t hdr[3] = {L.n, L.nq, L.n_tail};
    std::memcpy(out, hdr, sizeof hdr);
    size_t at = sizeof hdr;
    // Positions are the host's; the streams are downloaded (a plain copy on host-memory backends).
    const auto put = [&](const void* p, size_t bytes, bool on_host) {
      if (bytes && on_host) std::memcpy(out + at, p, bytes);
      else if (bytes) be_.download(out + at, p, bytes);
      at += pad8(bytes);
    };
    put(pos_.host(), L.n * 4, true);
    for (int k = 0; k < L.n_streams; ++k) {
      const stream_store& s = L.s[k];
      put(codes_of(layer, k), L.nq * s.rb, false);
      put(s.params, (L.nq / W_) * s.params_per_window * sizeof(kvq_affine), false);
      put(s.tail, L.n_tail * s.C * 2, false);
      if (s.ch0) put(s.ch0_vals, L.nq * 2, false);
    }
    XCTX_ASSERT(at == exported_bytes(layer));
  }

  // Own tokens through the layer's stream views; a ring block parsed (checked where the host
  // reads it) and, on a device backend, rebased onto its bytes there.
  void attend_impl(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
                   const attend_sink& sink) override {
    const int last = layers_.at(layer).n_streams - 1;
    const int32_t* q_pos = sink.exact() ? qs.pos : pos_.queries_on_backend(qs.pos, qs.n);
    xq_attn_args a;
    if (src.own()) {
      const layer_store& L = layers_.at(layer);
      a = attention_args(layer, view(layer, 0), view(layer, last), L.n, sink.exact() ? pos_.host() : pos_.on_backend(),
                         qs.q, q_pos, qs.n, qs.path);
    } else {
      parsed_block p = parse_block(layer, src.block, src.bytes);
      if (!be_.host_memory()) rebase(p, src.block, block_on(be_, block_, src.block, src.bytes, src.on_backend));
      a = attention_args(layer, p.v[0], p.v[last], p.n, p.pos, qs.q, q_pos, qs.n, qs.path);
    }
    a.select = select;
    if (sink.exact()) a.acc = sink.acc;
    else a.o = sink.o, a.lse = sink.lse;
    be_.attention_xq(a);
  }

  void restore_layer(int layer, const void* block, size_t bytes) override {
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer && layers_[layer].n == 0, "cache snapshot: layer ", layer,
               " is not an empty layer of this ", geo_.n_layer, "-layer cache");
    const parsed_block p = parse_block(layer, block, bytes);
    XCTX_CHECK(p.n <= geo_.capacity, "cache snapshot: layer ", layer, " holds ", p.n,
               " tokens; the cache has room for ", geo_.capacity);
    layer_store& L = layers_[layer];
    for (int k = 0; k < L.n_streams; ++k) {
      stream_store& s = L.s[k];
      const size_t code_bytes = (size_t)p.nq * s.rb;
      if (s.shared) {  // the layer below holds these codes: the snapshot must carry the same
        XCTX_CHECK(layers_[layer - 1].nq == p.nq && (code_bytes == 0 || same_bytes(codes_of(layer, k), p.v[k].codes,
                                                                                   code_bytes)),
                   "cache snapshot: layer ", layer, " shares layer ", layer - 1,
                   "'s codes, but its snapshot carries others (restore the layers in order)");
      } else if (code_bytes > 0) {
        be_.upload(s.codes, p.v[k].codes, code_bytes);
      }
      const size_t n_params = (size_t)(p.nq / W_) * s.params_per_window;
      if (n_params > 0) be_.upload(s.params, p.v[k].params, n_params * sizeof(kvq_affine));
      if (p.n_tail > 0) be_.upload(s.tail, p.v[k].tail, (size_t)p.n_tail * s.C * 2);
      if (s.ch0 && p.nq > 0) be_.upload(s.ch0_vals, p.v[k].ch0, (size_t)p.nq * 2);
    }
    pos_.restore(layer, p.pos, p.n);
    L.n = p.n, L.nq = p.nq, L.n_tail = p.n_tail;
  }

  xq_stream view(int layer, int k) const {
    const layer_store& L = layers_.at(layer);
    XCTX_CHECK(k >= 0 && k < L.n_streams, "cache ", traits_.name, " has no stream ", k);
    const stream_store& s = L.s[k];
    xq_stream v = base_view(s);
    v.nq = L.nq;
    v.codes = codes_of(layer, k);
    v.params = s.params;
    v.tail = s.tail;
    if (s.ch0) v.ch0 = s.ch0_vals;
    return v;
  }
  int n_streams(int layer) const { return layers_.at(layer).n_streams; }

 private:
  static xq_stream base_view(const stream_store& s) {
    xq_stream v;
    v.axis = s.axis, v.channels = s.C, v.bits = s.bits, v.group = s.group;
    return v;
  }

  const uint8_t* codes_of(int layer, int k) const {
    return layers_[layer].s[k].shared ? layers_[layer - 1].s[k].codes : layers_[layer].s[k].codes;
  }

  // Lays out a layer's stream arrays from `base` (null: only measures); returns the bytes.
  size_t carve(layer_store& L, uint8_t* base) const {
    size_t at = 0;
    const auto take = [&](auto*& ptr, size_t bytes) {
      ptr = base != nullptr ? reinterpret_cast<std::remove_reference_t<decltype(ptr)>>(base + at) : nullptr;
      at += (bytes + 63) / 64 * 64;  // every array on its own cache line
    };
    const size_t cap = (size_t)geo_.capacity;
    for (int k = 0; k < L.n_streams; ++k) {
      stream_store& s = L.s[k];
      if (!s.shared) take(s.codes, cap * s.rb);
      take(s.params, cap / W_ * s.params_per_window * sizeof(kvq_affine));
      take(s.tail, (size_t)W_ * s.C * 2);
      if (s.ch0) take(s.ch0_vals, cap * 2);
    }
    return at;
  }

  // Whether n bytes at p (backend memory) equal the host bytes at h.
  bool same_bytes(const void* p, const void* h, size_t n) const {
    if (be_.host_memory()) return std::memcmp(p, h, n) == 0;
    std::vector<uint8_t> copy(n);
    be_.download(copy.data(), p, n);
    return std::memcmp(copy.data(), h, n) == 0;
  }

  // A ring block or snapshot as stream views, every count checked (it comes from another rank
  // or from a file).
  struct parsed_block {
    int64_t n = 0, nq = 0, n_tail = 0;
    const int32_t* pos = nullptr;
    xq_stream v[2];
  };
  parsed_block parse_block(int layer, const void* block, size_t bytes) const {
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer, "cache block for layer ", layer, " of a ", geo_.n_layer,
               "-layer cache");
    const auto* in = static_cast<const uint8_t*>(block);
    int64_t hdr[3] = {};
    XCTX_CHECK(bytes >= sizeof hdr, "cache block of ", bytes, " bytes is too short for its header");
    std::memcpy(hdr, in, sizeof hdr);
    parsed_block p;
    p.n = hdr[0], p.nq = hdr[1], p.n_tail = hdr[2];
    // Every count is bounded by the block's size before the sum can overflow.
    const bool sane = p.n >= 0 && p.nq >= 0 && p.n_tail >= 0 && (size_t)p.n <= bytes && (size_t)p.nq <= bytes &&
                      (size_t)p.n_tail <= bytes && p.n == p.nq + p.n_tail && p.nq % W_ == 0 && p.n_tail < W_;
    XCTX_CHECK(sane && block_bytes(layer, p.nq, p.n_tail) == bytes, "cache block for layer ", layer,
               " is inconsistent: ", p.n, " tokens (", p.nq, " quantized, window ", p.n_tail, ") in ", bytes, " bytes");
    const layer_store& L = layers_[layer];
    size_t at = sizeof hdr;
    const auto take = [&](size_t b) {
      const uint8_t* ptr = in + at;
      at += pad8(b);
      return ptr;
    };
    p.pos = reinterpret_cast<const int32_t*>(take(p.n * 4));
    for (int64_t i = 1; i < p.n; ++i)
      XCTX_CHECK(p.pos[i - 1] < p.pos[i], "cache block for layer ", layer, ": positions not increasing at ", i);
    for (int k = 0; k < L.n_streams; ++k) {
      const stream_store& s = L.s[k];
      p.v[k] = base_view(s);
      p.v[k].nq = p.nq;
      p.v[k].codes = take(p.nq * s.rb);
      p.v[k].params =
          reinterpret_cast<const kvq_affine*>(take((p.nq / W_) * s.params_per_window * sizeof(kvq_affine)));
      p.v[k].tail = reinterpret_cast<const uint16_t*>(take(p.n_tail * s.C * 2));
      if (s.ch0) p.v[k].ch0 = reinterpret_cast<const uint16_t*>(take(p.nq * 2));
    }
    return p;
  }

  size_t block_bytes(int layer, int64_t nq, int64_t n_tail) const {
    const layer_store& L = layers_[layer];
    size_t b = 3 * 8 + pad8((nq + n_tail) * 4);
    for (int k = 0; k < L.n_streams; ++k) {
      const stream_store& s = L.s[k];
      b += pad8(nq * s.rb) + pad8((nq / W_) * s.params_per_window * sizeof(kvq_affine)) + pad8(n_tail * s.C * 2);
      if (s.ch0) b += pad8(nq * 2);
    }
    return b;
  }

  // Moves a parsed block's pointers from the host block to its copy in the backend's memory.
  static void rebase(parsed_block& p, const void* host, const void* dev) {
    rebase_into(p.pos, host, dev);
    for (xq_stream& v : p.v)
      rebase_into(v.codes, host, dev), rebase_into(v.params, host, dev), rebase_into(v.tail, host, dev),
          rebase_into(v.ch0, host, dev);
  }

  // A full residual window encoded from its fp16 rows (what attention read while they were
  // residual); under ch0 the encoder also keeps channel 0 of each row in fp16 (XQuant App. B).
  void encode_window(int layer) {
    layer_store& L = layers_[layer];
    for (int k = 0; k < L.n_streams; ++k) {
      stream_store& s = L.s[k];
      xq_encode_job j;
      j.axis = s.axis, j.bits = s.bits, j.channels = s.C, j.group = s.group, j.eta = s.eta, j.n = W_;
      j.x16 = s.tail;
      j.codes = s.shared ? nullptr : s.codes + (size_t)L.nq * s.rb;
      j.params = s.params + (size_t)(L.nq / W_) * s.params_per_window;
      if (s.ch0) j.ch0 = s.ch0_vals + L.nq;
      be_.xq_encode(j);
    }
    L.nq += W_;
    L.n_tail = 0;
  }

  xq_attn_args attention_args(int layer, const xq_stream& zk, const xq_stream& zv, int64_t n, const int32_t* pos,
                              const float* q, const int32_t* q_pos, int64_t n_q, attend_path path) const {
    xq_attn_args a;
    a.n = n, a.pos = pos, a.zk = zk, a.zv = zv;
    a.same_stream = layers_[layer].n_streams == 1;
    if (xquant_) {
      const x_layer_factor_ptrs& F = factors_on_be_->layer(layer);
      a.m_k = F.m_k, a.ld_mk = kv_, a.m_v = F.m_v, a.ld_mv = kv_;
      a.b_k = F.b_k, a.b_v = F.b_v;
    }
    a.q = q, a.q_pos = q_pos, a.n_q = n_q;
    a.n_head = geo_.n_head, a.n_head_kv = geo_.n_head_kv, a.head_dim = geo_.head_dim;
    a.scale = 1.0f / std::sqrt((float)geo_.head_dim);
    a.rope = geo_.rope;
    a.absorb_v = path == attend_path::attend_decode;
    return a;
  }

  cache_spec spec_;
  cache_geometry geo_;
  backend& be_;
  cache_format_traits traits_;
  bool xquant_ = false, latent_ = false;
  int kv_ = 0, W_ = 0;
  std::shared_ptr<const x_factors> factors_;
  std::shared_ptr<const x_factors_on_backend> factors_on_be_;  // xquant
  slot_position_store pos_;  // [capacity], shared by the layers
  std::vector<layer_store> layers_;
  backend_buffer proj_[2];   // [n, r] latents of the rows being appended
  backend_buffer block_;     // a ring block uploaded by attend_exported_partial
};

}  // namespace

std::unique_ptr<kv_cache> make_x_window_cache(const cache_spec& spec, const cache_geometry& g, backend& be) {
  return std::make_unique<x_window_cache>(spec, g, be);
}

xq_stream x_cache_stream(const kv_cache& c, int layer, int which) {
  if (const auto* w = dynamic_cast<const x_window_cache*>(&c)) return w->view(layer, which);
  return x_cl_cache_stream(c, layer, which);
}

}  // namespace xctx
