// The quantized KV caches: KIVI* (uniform) and KVQuant nuqX (non-uniform, optional 1%
// dense-and-sparse outliers, attention sink). Layout and math: kernels/kv_quant.h; the
// encoders and the fused attention are backend kernels (ref / cpu / cuda).
//
// When tokens are compressed (the rule perplexity and generation share):
//  kivi  a token's K and V stay fp16 in the residual window until its key group of `group`
//        consecutive slots is complete; then the group is encoded (keys per channel over the
//        group, values per token). Shard plans align rank boundaries to the group, so slot
//        groups are position groups [gG, (g+1)G) on any number of ranks.
//  nuq   every token is encoded when appended (key scales are offline, value scales online),
//        except position 0, the attention sink, kept in fp16 (option).
// Encoding starts from the fp16-rounded residual rows for kivi (what the window stores) and
// from the f32 activations for nuq.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cache/block_on_backend.h"
#include "cache/cache.h"
#include "cache/slot_positions.h"
#include "cache/calibration.h"
#include "common/error.h"
#include "common/half.h"
#include "kernels/kv_quant.h"

namespace xctx {
namespace {

size_t pad8(size_t b) { return (b + 7) / 8 * 8; }

// One layer's arrays, in the backend's memory (the host's on ref/cpu, the device's on cuda): one
// allocation, `arena`, carved at construction, and the key outlier lists (nuq -1%), which grow
// with the data in an allocation of their own.
//
// The number of key outlier entries, k_out_off[nq], is written by the backend (kvq_append_outliers)
// and read by the host only when it must be exact (export, bytes_used, a possible overflow): on a
// device that read waits for the stream, so appends keep an upper bound instead (nk read last +
// nk_unread, every appended element counted as an outlier) and read the count only when that
// bound passes the lists' capacity.
struct layer_store {
  explicit layer_store(backend& be) : arena(be), k_out(be) {}
  int64_t n = 0;       // slots held
  int64_t n_sink = 0;  // 0 or 1
  int64_t n_tail = 0;  // kivi residual rows
  int64_t nq = 0;      // quantized rows
  mutable int64_t nk = 0;         // key outlier entries when last read (k_out_off[nq] then)
  mutable int64_t nk_unread = 0;  // at most this many appended since (0: nk is exact)
  backend_buffer arena;
  backend_buffer k_out;  // nuq -1%: k_out_idx [k_out_cap], then k_out_val [k_out_cap]
  size_t k_out_cap = 0;
  uint16_t *k_sink = nullptr, *v_sink = nullptr;    // [1, C] fp16 (nuq with a sink)
  uint16_t *k_tail = nullptr, *v_tail = nullptr;    // [group, C] fp16 (kivi)
  uint8_t *k_codes = nullptr, *v_codes = nullptr;   // [capacity, C*bits/8]
  kvq_affine *k_group = nullptr, *v_aff = nullptr;  // kivi [cap/G, C], [cap, n_vg]; nuq v_aff [cap]
  float *lut_k = nullptr, *lut_v = nullptr;         // nuq [2^bits]
  float *ch_scale = nullptr, *ch_zero = nullptr;    // nuq [C]
  float *ch_lo = nullptr, *ch_hi = nullptr;         // nuq -1% [C]
  uint32_t* k_out_off = nullptr;                    // nuq -1% [capacity + 1]
  uint16_t *v_out_idx = nullptr, *v_out_val = nullptr;  // nuq -1% [capacity, 2*side]
  uint16_t *k_out_idx = nullptr, *k_out_val = nullptr;  // nuq -1%, in k_out: [nk] used
};

class quant_cache final : public kv_cache {
 public:
  quant_cache(const cache_spec& spec, const cache_geometry& g, backend& be)
      : spec_(spec), geo_(g), be_(be), traits_(format_traits(spec.format)), pos_(be, g.capacity), block_(be), outlier_scratch_(be) {
    XCTX_CHECK(g.n_layer > 0 && g.n_head_kv > 0 && g.head_dim > 0 && g.n_head % g.n_head_kv == 0,
               "cache geometry invalid: n_layer=", g.n_layer, " n_head=", g.n_head, " n_head_kv=", g.n_head_kv,
               " head_dim=", g.head_dim);
    XCTX_CHECK(g.capacity > 0, "cache capacity must be positive, got ", g.capacity);
    C_ = g.n_head_kv * g.head_dim;
    XCTX_CHECK(C_ % 8 == 0 && C_ <= 65536, "cache ", traits_.name, ": a token row of ", C_,
               " channels must be a multiple of 8 (and at most 65536)");
    bits_ = traits_.bits_per_element;
    rb_ = kvq_row_bytes(C_, bits_);
    kivi_ = traits_.family == cache_family::family_kivi;
    outliers_ = !kivi_ && traits_.outlier_fraction > 0.0;
    if (kivi_) {
      G_ = spec.options.group_size;
      XCTX_CHECK(G_ >= 8 && G_ % 8 == 0 && G_ <= 65536, "cache ", traits_.name, ": group size ", G_,
                 " must be a multiple of 8 in [8, 65536]");
      n_vg_ = (C_ + G_ - 1) / G_;
    } else {
      XCTX_CHECK(spec.options.calib != nullptr, "cache ", traits_.name,
                 " needs a calibration file (--calib FILE, made by `xctx calibrate`)");
      const calibration& cal = *spec.options.calib;
      XCTX_CHECK(cal.n_layer == g.n_layer && cal.channels() == C_, "calibration for ", cal.model_name, " has ",
                 cal.n_layer, " layers x ", cal.channels(), " channels; this model has ", g.n_layer, " x ", C_);
      v_side_ = value_outliers_per_side(traits_.outlier_fraction, C_);
    }
    const bool qn = qnorm_enabled(spec.format, spec.options);
    layers_.reserve(g.n_layer);
    for (int l = 0; l < g.n_layer; ++l) {
      layer_store& s = layers_.emplace_back(be);
      carve(s, static_cast<uint8_t*>(s.arena.reserve(carve(s, nullptr))));
      if (kivi_) continue;
      // The layer's tables, computed on the host, where the kernels read them.
      const calib_layer_setting& cl = spec.options.calib->layer(traits_.outlier_fraction, l);
      const std::vector<float> lut_k = cl.key_type(bits_).lut(qn), lut_v = cl.value_type(bits_).lut(qn);
      XCTX_CHECK(lut_k.size() == (size_t)1 << bits_ && lut_v.size() == (size_t)1 << bits_, "calibration for ",
                 spec.options.calib->model_name, ": layer ", l, " has no ", bits_, "-bit datatype");
      std::vector<float> zero((size_t)C_), scale((size_t)C_);
      for (int c = 0; c < C_; ++c) {
        zero[c] = 0.5f * (cl.k_hi[c] + cl.k_lo[c]);
        scale[c] = 0.5f * (cl.k_hi[c] - cl.k_lo[c]);
      }
      be.upload(s.lut_k, lut_k.data(), lut_k.size() * 4), be.upload(s.lut_v, lut_v.data(), lut_v.size() * 4);
      be.upload(s.ch_scale, scale.data(), (size_t)C_ * 4), be.upload(s.ch_zero, zero.data(), (size_t)C_ * 4);
      if (outliers_) {
        be.upload(s.ch_lo, cl.k_lo.data(), (size_t)C_ * 4), be.upload(s.ch_hi, cl.k_hi.data(), (size_t)C_ * 4);
        const uint32_t first = 0;
        be.upload(s.k_out_off, &first, sizeof first);
        grow_key_outliers(s, reserved_key_outliers(traits_.outlier_fraction, C_, g.capacity));
      }
    }
  }

  cache_format format() const override { return spec_.format; }
  const cache_geometry& geometry() const override { return geo_; }
  int64_t n_tokens(int layer) const override { return layers_.at(layer).n; }

  size_t bytes_allocated() const override {
    size_t b = pos_.bytes();
    for (const layer_store& s : layers_) b += s.arena.bytes() + s.k_out.bytes();
    return b;
  }

  // Sum of what the layers hold now, array by array (tests compare it with cache_bytes_for).
  size_t bytes_used() const override {
    int64_t n_max = 0;
    size_t b = 0;
    for (const layer_store& s : layers_) {
      n_max = std::max(n_max, s.n);
      const size_t C = (size_t)C_;
      b += 2 * (size_t)s.n_sink * C * 2 + 2 * (size_t)s.n_tail * C * 2;
      b += 2 * (size_t)s.nq * rb_;
      if (kivi_) {
        b += (size_t)(s.nq / G_) * C * sizeof(kvq_affine) + (size_t)s.nq * n_vg_ * sizeof(kvq_affine);
        continue;
      }
      b += (size_t)s.nq * sizeof(kvq_affine);
      b += (2 * ((size_t)1 << bits_) + (outliers_ ? 4 : 2) * C) * sizeof(float);  // tables
      if (outliers_) b += ((size_t)s.nq + 1) * 4 + (size_t)key_entries(s) * 4 + (size_t)s.nq * 2 * v_side_ * 4;
    }
    return b + (size_t)n_max * sizeof(int32_t);
  }

  int64_t key_outliers() const {
    int64_t k = 0;
    for (const layer_store& s : layers_) k += key_entries(s);
    return k;
  }

  void clear() override {
    for (layer_store& s : layers_) {
      s.n = s.n_sink = s.n_tail = s.nq = s.nk = s.nk_unread = 0;  // k_out_off[0] stays 0
    }
    pos_.clear();
  }

  void append(int layer, const layer_input& in) override {
    XCTX_ASSERT(layer >= 0 && layer < geo_.n_layer);
    layer_store& s = layers_[layer];
    XCTX_CHECK(s.n + in.n <= geo_.capacity, "cache full: layer ", layer, " holds ", s.n, " tokens, appending ", in.n,
               " exceeds the capacity of ", geo_.capacity, " (raise the context size)");
    if (in.n == 0) return;
    pos_.store(layer, s.n, in);
    int64_t i = 0;
    if (kivi_) {
      while (i < in.n) {  // fill the residual window; a full window becomes a quantized group
        const int64_t take = std::min<int64_t>(in.n - i, G_ - s.n_tail);
        be_.convert_rows(s.k_tail + s.n_tail * C_, kv_dtype::kv_f16, in.k + i * C_, take * C_);
        be_.convert_rows(s.v_tail + s.n_tail * C_, kv_dtype::kv_f16, in.v + i * C_, take * C_);
        s.n_tail += take, s.n += take, i += take;
        if (s.n_tail == G_) encode_kivi_group(s);
      }
      return;
    }
    if (s.n == 0 && spec_.options.sink && in.pos[0] == 0) {  // the attention sink stays fp16
      be_.convert_rows(s.k_sink, kv_dtype::kv_f16, in.k, C_);
      be_.convert_rows(s.v_sink, kv_dtype::kv_f16, in.v, C_);
      s.n_sink = 1, s.n = 1, i = 1;
    }
    if (i < in.n) encode_nuq_rows(s, in.k + i * C_, in.v + i * C_, in.n - i);
  }

  size_t exported_bytes(int layer) const override {
    const layer_store& s = layers_.at(layer);
    return block_bytes(s.n, s.n_sink, s.n_tail, s.nq, outliers_ ? key_entries(s) : 0);
  }

  void export_layer(int layer, void* dst) const override {
    const layer_store& s = layers_.at(layer);
    uint8_t* out = static_cast<uint8_t*>(dst);
    const int64_t hdr[5] = {s.n, s.n_sink, s.n_tail, s.nq, outliers_ ? key_entries(s) : 0};
    std::memcpy(out, hdr, sizeof hdr);
    size_t at = sizeof hdr;
    // Host arrays are copied, the backend's downloaded (a plain copy on host-memory backends).
    const auto put = [&](const void* p, size_t bytes, bool on_host = false) {
      if (bytes && on_host) std::memcpy(out + at, p, bytes);
      else if (bytes) be_.download(out + at, p, bytes);
      at += pad8(bytes);
    };
    put(pos_.host(), s.n * 4, true);
    put(s.k_sink, s.n_sink * C_ * 2), put(s.v_sink, s.n_sink * C_ * 2);
    put(s.k_tail, s.n_tail * C_ * 2), put(s.v_tail, s.n_tail * C_ * 2);
    put(s.k_codes, s.nq * rb_), put(s.v_codes, s.nq * rb_);
    if (kivi_) {
      put(s.k_group, (s.nq / G_) * C_ * sizeof(kvq_affine));
      put(s.v_aff, s.nq * n_vg_ * sizeof(kvq_affine));
    } else {
      put(s.v_aff, s.nq * sizeof(kvq_affine));
      if (outliers_) {
        put(s.k_out_off, (s.nq + 1) * 4);
        put(s.k_out_idx, hdr[4] * 2), put(s.k_out_val, hdr[4] * 2);
        put(s.v_out_idx, s.nq * 2 * v_side_ * 2), put(s.v_out_val, s.nq * 2 * v_side_ * 2);
      }
    }
    XCTX_ASSERT(at == exported_bytes(layer));
  }

  // Own tokens through the layer's view; a ring block parsed (checked where the host reads it)
  // and, on a device backend, rebased onto its bytes there.
  void attend_impl(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
                   const attend_sink& sink) override {
    kvq_layer_view v;
    if (src.own()) {
      v = view_of(layer);
    } else {
      v = parse_block(layer, src.block, src.bytes);
      if (!be_.host_memory()) rebase(v, src.block, block_on(be_, block_, src.block, src.bytes, src.on_backend));
    }
    const int32_t* q_pos = sink.exact() ? qs.pos : pos_.queries_on_backend(qs.pos, qs.n);
    kvq_attn_args a = attention_args(v, qs.q, q_pos, qs.n, qs.path);
    a.select = select;
    if (sink.exact()) a.acc = sink.acc;
    else a.o = sink.o, a.lse = sink.lse;
    be_.attention_kvq(a);
  }

  void restore_layer(int layer, const void* block, size_t bytes) override {
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer && layers_[layer].n == 0, "cache snapshot: layer ", layer,
               " is not an empty layer of this ", geo_.n_layer, "-layer cache");
    const kvq_layer_view v = parse_block(layer, block, bytes);
    layer_store& s = layers_[layer];
    const int64_t nq = v.q_end - v.n_sink, n_tail = v.n - v.q_end;
    XCTX_CHECK(v.n <= geo_.capacity, "cache snapshot: layer ", layer, " holds ", v.n, " tokens; the cache has room for ",
               geo_.capacity);
    XCTX_CHECK(v.n_sink == 0 || s.k_sink != nullptr, "cache snapshot: layer ", layer,
               " keeps an attention sink; this cache was made without one (--no-sink)");
    pos_.restore(layer, v.pos, v.n);
    const auto copy = [&](auto* dst, const auto* src, int64_t count) {
      if (count > 0) be_.upload(dst, src, (size_t)count * sizeof(*src));
    };
    copy(s.k_sink, v.k_sink, v.n_sink * C_), copy(s.v_sink, v.v_sink, v.n_sink * C_);
    copy(s.k_tail, v.k_tail, n_tail * C_), copy(s.v_tail, v.v_tail, n_tail * C_);
    copy(s.k_codes, v.k_codes, nq * (int64_t)rb_), copy(s.v_codes, v.v_codes, nq * (int64_t)rb_);
    if (kivi_) {
      copy(s.k_group, v.k_group, nq / G_ * C_), copy(s.v_aff, v.v_group, nq * n_vg_);
    } else {
      copy(s.v_aff, v.v_tok, nq);
      if (outliers_) {
        const int64_t nk = v.k_out_off[nq];
        copy(s.k_out_off, v.k_out_off, nq + 1);
        s.nk = s.nk_unread = 0;  // an empty layer: nothing to keep when the lists grow
        if ((size_t)nk > s.k_out_cap) grow_key_outliers(s, (size_t)nk);
        copy(s.k_out_idx, v.k_out_idx, nk), copy(s.k_out_val, v.k_out_val, nk);
        s.nk = nk;
        copy(s.v_out_idx, v.v_out_idx, nq * 2 * v_side_), copy(s.v_out_val, v.v_out_val, nq * 2 * v_side_);
      }
    }
    s.n = v.n, s.n_sink = v.n_sink, s.nq = nq, s.n_tail = n_tail;
  }

  // For tests and tools: the layer as the kernels see it (in the backend's memory).
  kvq_layer_view view_of(int layer) const {
    const layer_store& s = layers_.at(layer);
    kvq_layer_view v = base_view(s);
    v.n = s.n, v.n_sink = s.n_sink, v.q_end = s.n_sink + s.nq;
    v.pos = pos_.on_backend();
    v.k_sink = s.k_sink, v.v_sink = s.v_sink;
    v.k_tail = s.k_tail, v.v_tail = s.v_tail;
    v.k_codes = s.k_codes, v.v_codes = s.v_codes;
    if (kivi_) {
      v.k_group = s.k_group, v.v_group = s.v_aff;
    } else {
      v.v_tok = s.v_aff;
      if (outliers_) {
        v.k_out_off = s.k_out_off, v.k_out_idx = s.k_out_idx, v.k_out_val = s.k_out_val;
        v.v_out_idx = s.v_out_idx, v.v_out_val = s.v_out_val;
      }
    }
    return v;
  }

 private:
  // A ring block or snapshot as the kernels see it, every count and index checked (a block
  // comes from another rank or from a file).
  kvq_layer_view parse_block(int layer, const void* block, size_t bytes) const {
    XCTX_CHECK(layer >= 0 && layer < geo_.n_layer, "cache block for layer ", layer, " of a ", geo_.n_layer,
               "-layer cache");
    const auto* in = static_cast<const uint8_t*>(block);
    int64_t hdr[5] = {};
    XCTX_CHECK(bytes >= sizeof hdr, "cache block of ", bytes, " bytes is too short for its header");
    std::memcpy(hdr, in, sizeof hdr);
    const int64_t n = hdr[0], n_sink = hdr[1], n_tail = hdr[2], nq = hdr[3], nk = hdr[4];
    // Every count is bounded by the block's size before any sum (the fuzzer found nq + n_tail
    // overflowing int64 with both near 2^62).
    const bool sane = n >= 0 && n_sink >= 0 && n_sink <= 1 && n_tail >= 0 && nq >= 0 && nk >= 0 && (size_t)n <= bytes &&
                      (size_t)nq <= bytes && (size_t)n_tail <= bytes && (size_t)nk <= bytes &&
                      n == n_sink + nq + n_tail && (kivi_ ? n_sink == 0 && n_tail < G_ && nq % G_ == 0 : n_tail == 0);
    XCTX_CHECK(sane && block_bytes(n, n_sink, n_tail, nq, nk) == bytes, "cache block for layer ", layer,
               " is inconsistent: ", n, " tokens (sink ", n_sink, ", quantized ", nq, ", window ", n_tail, ", ", nk,
               " key outliers) in ", bytes, " bytes");
    const layer_store& own = layers_.at(layer);
    kvq_layer_view v = base_view(own);
    size_t at = sizeof hdr;
    const auto take = [&](size_t b) {
      const uint8_t* p = in + at;
      at += pad8(b);
      return p;
    };
    v.n = n, v.n_sink = n_sink, v.q_end = n_sink + nq;
    v.pos = reinterpret_cast<const int32_t*>(take(n * 4));
    v.k_sink = reinterpret_cast<const uint16_t*>(take(n_sink * C_ * 2));
    v.v_sink = reinterpret_cast<const uint16_t*>(take(n_sink * C_ * 2));
    v.k_tail = reinterpret_cast<const uint16_t*>(take(n_tail * C_ * 2));
    v.v_tail = reinterpret_cast<const uint16_t*>(take(n_tail * C_ * 2));
    v.k_codes = take(nq * rb_), v.v_codes = take(nq * rb_);
    if (kivi_) {
      v.k_group = reinterpret_cast<const kvq_affine*>(take((nq / G_) * C_ * sizeof(kvq_affine)));
      v.v_group = reinterpret_cast<const kvq_affine*>(take(nq * n_vg_ * sizeof(kvq_affine)));
    } else {
      v.v_tok = reinterpret_cast<const kvq_affine*>(take(nq * sizeof(kvq_affine)));
      if (outliers_) {
        v.k_out_off = reinterpret_cast<const uint32_t*>(take((nq + 1) * 4));
        XCTX_CHECK(v.k_out_off[0] == 0 && (int64_t)v.k_out_off[nq] == nk, "cache block for layer ", layer,
                   ": key outlier offsets do not span its ", nk, " entries");
        for (int64_t i = 0; i < nq; ++i)
          XCTX_CHECK(v.k_out_off[i] <= v.k_out_off[i + 1], "cache block for layer ", layer,
                     ": key outlier offsets decrease at row ", i);
        v.k_out_idx = reinterpret_cast<const uint16_t*>(take(nk * 2));
        v.k_out_val = reinterpret_cast<const uint16_t*>(take(nk * 2));
        v.v_out_idx = reinterpret_cast<const uint16_t*>(take(nq * 2 * v_side_ * 2));
        v.v_out_val = reinterpret_cast<const uint16_t*>(take(nq * 2 * v_side_ * 2));
        for (int64_t e = 0; e < nk; ++e)
          XCTX_CHECK(v.k_out_idx[e] < C_, "cache block: key outlier channel ", v.k_out_idx[e], " out of range");
        for (int64_t e = 0; e < nq * 2 * v_side_; ++e)
          XCTX_CHECK(v.v_out_idx[e] < C_, "cache block: value outlier channel ", v.v_out_idx[e], " out of range");
      }
    }
    for (int64_t i = 1; i < n; ++i)
      XCTX_CHECK(v.pos[i - 1] < v.pos[i], "cache block for layer ", layer, ": positions not increasing at ", i);
    return v;
  }

  // The exact number of s's key outlier entries (one read from the backend when appends have
  // left it unread; see layer_store).
  int64_t key_entries(const layer_store& s) const {
    if (s.nk_unread > 0) {
      uint32_t nk = 0;
      be_.download(&nk, s.k_out_off + s.nq, sizeof nk);
      s.nk = nk, s.nk_unread = 0;
    }
    return s.nk;
  }

  // Room for `need` key outlier entries. The first call allocates the reserve; text denser in
  // outliers than the reserve grows the lists by a quarter of it (or what is needed), not by
  // doubling, so an overrun costs memory in proportion to it. The s.nk entries held (exact:
  // callers read the count first) move to the new allocation through the host (rare).
  void grow_key_outliers(layer_store& s, size_t need) {
    if (need <= s.k_out_cap && s.k_out_idx != nullptr) return;
    XCTX_ASSERT(s.nk_unread == 0, "quant cache: growing key outlier lists with an unread count");
    const size_t cap = s.k_out_idx == nullptr
                           ? need
                           : std::max(need, s.k_out_cap + reserved_key_outliers(traits_.outlier_fraction, C_, geo_.capacity) / 4);
    XCTX_CHECK(cap <= UINT32_MAX, "cache ", traits_.name, ": ", cap, " key outliers in one layer exceed the 2^32 the offsets address");
    backend_buffer grown(be_);
    auto* idx = static_cast<uint16_t*>(grown.reserve(cap * 4));
    if (s.nk > 0) {
      std::vector<uint16_t> held((size_t)s.nk);
      be_.download(held.data(), s.k_out_idx, held.size() * 2), be_.upload(idx, held.data(), held.size() * 2);
      be_.download(held.data(), s.k_out_val, held.size() * 2), be_.upload(idx + cap, held.data(), held.size() * 2);
    }
    s.k_out.swap(grown);
    s.k_out_cap = cap, s.k_out_idx = idx, s.k_out_val = idx + cap;
  }

  // Appends the key outliers of n rows just encoded by job j (its per-row scratch) to s's lists,
  // in the backend's memory. The count is read back only when the bound on it (every element an
  // outlier) could pass the capacity; if the append did overflow, the lists grow and the same
  // append runs again from the scratch, which nothing has overwritten yet.
  void append_key_outliers(layer_store& s, const kvq_encode_job& j, int64_t n) {
    kvq_outlier_append a;
    a.channels = C_, a.n = n, a.count = j.out_count, a.row_idx = j.out_idx, a.row_val = j.out_val;
    a.off = s.k_out_off + s.nq;
    const int64_t most = n * C_, cap = (int64_t)s.k_out_cap;
    if (s.nk + s.nk_unread + most > cap) key_entries(s);  // the bound may not fit: make it exact
    const bool may_overflow = s.nk + s.nk_unread + most > cap;  // with the exact count, when it was read
    a.idx = s.k_out_idx, a.val = s.k_out_val, a.capacity = s.k_out_cap;
    be_.kvq_append_outliers(a);
    if (!may_overflow) {
      s.nk_unread += most;
      return;
    }
    uint32_t total = 0;
    be_.download(&total, a.off + n, sizeof total);
    if (total > s.k_out_cap) {
      grow_key_outliers(s, total);
      a.idx = s.k_out_idx, a.val = s.k_out_val, a.capacity = s.k_out_cap;
      be_.kvq_append_outliers(a);
    }
    s.nk = total;
  }

  size_t block_bytes(int64_t n, int64_t n_sink, int64_t n_tail, int64_t nq, int64_t nk) const {
    size_t b = 5 * 8 + pad8(n * 4) + 2 * pad8(n_sink * C_ * 2) + 2 * pad8(n_tail * C_ * 2) + 2 * pad8(nq * rb_);
    if (kivi_) return b + pad8((nq / G_) * C_ * sizeof(kvq_affine)) + pad8(nq * n_vg_ * sizeof(kvq_affine));
    b += pad8(nq * sizeof(kvq_affine));
    if (traits_.outlier_fraction > 0.0)
      b += pad8((nq + 1) * 4) + 2 * pad8(nk * 2) + 2 * pad8(nq * 2 * v_side_ * 2);
    return b;
  }

  kvq_layer_view base_view(const layer_store& s) const {
    kvq_layer_view v;
    v.scheme = kivi_ ? kvq_scheme::kvq_uniform : kvq_scheme::kvq_lut;
    v.bits = bits_, v.n_head_kv = geo_.n_head_kv, v.head_dim = geo_.head_dim, v.group = G_;
    if (!kivi_) {
      v.lut_k = s.lut_k, v.lut_v = s.lut_v;
      v.k_ch_scale = s.ch_scale, v.k_ch_zero = s.ch_zero;
      v.v_out_per_tok = outliers_ ? 2 * v_side_ : 0;
    }
    return v;
  }


  // Points s's arrays into the arena at base, each 64-byte aligned, and returns its size (base =
  // null: the size alone, every pointer null).
  size_t carve(layer_store& s, uint8_t* base) const {
    size_t at = 0;
    const auto take = [&](auto*& p, size_t count) {
      using T = std::remove_reference_t<decltype(*p)>;
      p = base == nullptr ? nullptr : reinterpret_cast<T*>(base + at);
      at += (count * sizeof(T) + 63) / 64 * 64;
    };
    const size_t cap = (size_t)geo_.capacity, C = (size_t)C_;
    take(s.k_codes, cap * rb_), take(s.v_codes, cap * rb_);
    if (kivi_) {
      take(s.k_tail, (size_t)G_ * C), take(s.v_tail, (size_t)G_ * C);
      take(s.k_group, cap / G_ * C), take(s.v_aff, cap * n_vg_);
      return at;
    }
    if (spec_.options.sink) take(s.k_sink, C), take(s.v_sink, C);
    take(s.v_aff, cap);
    take(s.lut_k, (size_t)1 << bits_), take(s.lut_v, (size_t)1 << bits_);
    take(s.ch_scale, C), take(s.ch_zero, C);
    if (outliers_) {
      take(s.ch_lo, C), take(s.ch_hi, C), take(s.k_out_off, cap + 1);
      take(s.v_out_idx, cap * 2 * v_side_), take(s.v_out_val, cap * 2 * v_side_);
    }
    return at;
  }

  // v's arrays, which point into the host block `host`, moved to the same offsets in `dev`.
  static void rebase(kvq_layer_view& v, const void* host, const void* dev) {
    const auto move = [&](auto*& p) { rebase_into(p, host, dev); };
    move(v.pos), move(v.k_sink), move(v.v_sink), move(v.k_tail), move(v.v_tail), move(v.k_codes), move(v.v_codes);
    move(v.k_group), move(v.v_group), move(v.v_tok);
    move(v.k_out_off), move(v.k_out_idx), move(v.k_out_val), move(v.v_out_idx), move(v.v_out_val);
  }

  void encode_kivi_group(layer_store& s) {
    kvq_encode_job j;  // from the fp16 window rows: what attention read while they were residual
    j.bits = bits_, j.channels = C_, j.group = G_, j.n = G_;
    j.tensor = kvq_tensor::kvq_uniform_keys;
    j.x16 = s.k_tail, j.codes = s.k_codes + s.nq * rb_, j.affine = s.k_group + (s.nq / G_) * C_;
    be_.kvq_encode(j);
    j.tensor = kvq_tensor::kvq_uniform_values;
    j.x16 = s.v_tail, j.codes = s.v_codes + s.nq * rb_, j.affine = s.v_aff + s.nq * n_vg_;
    be_.kvq_encode(j);
    s.nq += G_;
    s.n_tail = 0;
  }

  void encode_nuq_rows(layer_store& s, const float* k, const float* v, int64_t n) {
    kvq_encode_job j;
    j.bits = bits_, j.channels = C_, j.n = n;
    j.tensor = kvq_tensor::kvq_lut_keys;
    j.x = k, j.lut = s.lut_k, j.ch_scale = s.ch_scale, j.ch_zero = s.ch_zero;
    j.codes = s.k_codes + s.nq * rb_;
    if (outliers_) {  // per-row scratch in the backend's memory: [n, C] channels, [n, C] δ, [n] counts
      j.ch_lo = s.ch_lo, j.ch_hi = s.ch_hi;
      const size_t nc = (size_t)n * C_;
      auto* scratch = static_cast<uint16_t*>(outlier_scratch_.reserve(nc * 4 + (size_t)n * 4));
      j.out_idx = scratch, j.out_val = scratch + nc, j.out_count = reinterpret_cast<uint32_t*>(scratch + 2 * nc);
    }
    be_.kvq_encode(j);
    if (outliers_) append_key_outliers(s, j, n);
    kvq_encode_job jv;
    jv.bits = bits_, jv.channels = C_, jv.n = n;
    jv.tensor = kvq_tensor::kvq_lut_values;
    jv.x = v, jv.lut = s.lut_v, jv.v_out_side = outliers_ ? v_side_ : 0;
    jv.codes = s.v_codes + s.nq * rb_, jv.affine = s.v_aff + s.nq;
    if (outliers_) {
      jv.out_idx = s.v_out_idx + s.nq * 2 * v_side_;
      jv.out_val = s.v_out_val + s.nq * 2 * v_side_;
    }
    be_.kvq_encode(jv);
    s.nq += n, s.n += n;
  }

  kvq_attn_args attention_args(const kvq_layer_view& v, const float* q, const int32_t* q_pos, int64_t n_q,
                               attend_path path) const {
    kvq_attn_args a;
    a.kv = v;
    a.q = q, a.q_pos = q_pos, a.n_q = n_q, a.n_head = geo_.n_head;
    a.scale = 1.0f / std::sqrt((float)geo_.head_dim);
    a.rope = geo_.rope;
    a.decode_step = path == attend_path::attend_decode;
    return a;
  }

  cache_spec spec_;
  cache_geometry geo_;
  backend& be_;
  cache_format_traits traits_;
  int C_ = 0, bits_ = 0, G_ = 0, n_vg_ = 0, v_side_ = 0;
  size_t rb_ = 0;
  bool kivi_ = false, outliers_ = false;
  slot_position_store pos_;  // [capacity], shared by the layers
  std::vector<layer_store> layers_;
  backend_buffer block_;                      // a ring block uploaded by attend_exported_partial
  backend_buffer outlier_scratch_;            // key outliers of one encode, per row (kvq_encode_job)
};

}  // namespace

std::unique_ptr<kv_cache> make_quant_cache(const cache_spec& spec, const cache_geometry& g, backend& be) {
  return std::make_unique<quant_cache>(spec, g, be);
}

kvq_layer_view quant_cache_view(const kv_cache& c, int layer) {
  const auto* q = dynamic_cast<const quant_cache*>(&c);
  XCTX_CHECK(q != nullptr, "cache of format ", format_traits(c.format()).name, " is not a quantized cache");
  return q->view_of(layer);
}

int64_t quant_cache_key_outliers(const kv_cache& c) {
  const auto* q = dynamic_cast<const quant_cache*>(&c);
  XCTX_CHECK(q != nullptr, "cache of format ", format_traits(c.format()).name, " is not a quantized cache");
  return q->key_outliers();
}

}  // namespace xctx
