// The shard cache interface: a rank's compressed (or plain) store of its tokens' keys/values,
// and the attention over it. Formats decide what they store (post-RoPE K, pre-RoPE codes, X);
// the worker only hands over a layer's inputs and asks for attention partials.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cache/format.h"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "kernels/softmax_acc.h"

namespace xctx {

// Pointer spaces: activations (x, k, v, q, o, lse) are in the cache's backend memory, positions
// and ring / snapshot blocks on the host. On host-memory backends the two are the same.

// What one layer offers the cache for n new tokens.
struct layer_input {
  const float* x = nullptr;      // [n, n_embd] post-norm layer input (X formats)
  const float* k = nullptr;      // [n, n_head_kv, head_dim] keys before RoPE
  const float* v = nullptr;      // [n, n_head_kv, head_dim]
  const int32_t* pos = nullptr;  // [n] absolute positions, increasing
  int64_t n = 0;
  // Retrieval summaries only (cache/block_summary.h): the first rows left out of the block
  // summaries (still stored and attended): a star-prefill block's restart (worker/retrieval.h).
  int64_t summary_skip = 0;
};

// The caller's phase. Formats with two attention kernels (xquant: V rebuilt per unit for many
// queries, V absorbed in the latent space for a decode step) choose by it, so whether a token's
// attention runs one way or the other never depends on how many queries share the call.
enum class attend_path : uint8_t { attend_prefill, attend_decode };

// What one attention call reads: the cache's own tokens of the layer, or a block export_layer
// produced by a cache of the same format and geometry (host memory; on_backend: the same bytes
// in the backend's memory when the caller holds them there -- the ring uploads each received
// block once per layer, not once per query chunk).
struct attend_source {
  const void* block = nullptr;  // null: the own tokens
  size_t bytes = 0;
  const void* on_backend = nullptr;
  bool own() const { return block == nullptr; }
  static attend_source own_tokens() { return {}; }
  static attend_source exported(const void* b, size_t n, const void* on_be = nullptr) { return {b, n, on_be}; }
};

// The queries of one call: RoPE applied, in the backend's memory; positions on the host. `path`
// names the caller's phase so formats with two kernels pick by it, never by n.
struct attend_queries {
  const float* q = nullptr;        // [n, n_head, head_dim]
  const int32_t* pos = nullptr;    // [n]
  int64_t n = 0;
  attend_path path = attend_path::attend_prefill;
};

// Where a call's attention goes: exactly one of
//   the exact accumulator (rows n * n_head of width head_dim, host; kernels/softmax_acc.h):
//     per-unit deposits whose sum does not depend on how the sequence is split over caches
//     (backends with backend::exact_accumulator: cpu, ref);
//   one (o, lse) partial in the backend's memory: o [n, n_head, head_dim] normalised, lse
//     [n, n_head] natural log, as attn_args; partials of several calls merge with
//     backend::merge_partials (worker/attention_sum.h; the CUDA backend).
struct attend_sink {
  softmax_acc* acc = nullptr;
  float* o = nullptr;
  float* lse = nullptr;
  bool exact() const { return acc != nullptr; }
  static attend_sink exact_sum(softmax_acc& a) { return {&a, nullptr, nullptr}; }
  static attend_sink partial(float* o, float* lse) { return {nullptr, o, lse}; }
};

class kv_cache {
 public:
  virtual ~kv_cache() = default;
  virtual cache_format format() const = 0;
  virtual const cache_geometry& geometry() const = 0;
  // Appends to one layer. Throws xctx::Error when the shard's capacity would be exceeded.
  virtual void append(int layer, const layer_input& in) = 0;
  virtual int64_t n_tokens(int layer) const = 0;
  // The one attention entry: the queries over the source's tokens of the layer, causal by
  // position, into the sink. select (retrieval attention; null: every causal key; own tokens
  // only): query i sees only the units its lists hold (kernels/ops.h, attn_selection); host
  // memory. Checks what every format shares, then runs the format's attend_impl.
  void attend(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
              const attend_sink& sink);
  // The ring prefill passes a layer's tokens between ranks in the representation the format
  // stores (compressed formats send compressed bytes). export_layer writes exactly
  // exported_bytes(layer) bytes; attend_exported attends over such a block produced by a cache
  // of the same format and geometry on another rank.
  virtual size_t exported_bytes(int layer) const = 0;
  virtual void export_layer(int layer, void* dst) const = 0;
  // Save and restore (worker/cache_snapshot.h): a layer as the cache stores it. snapshot_layer
  // writes exactly snapshot_bytes(layer) bytes; restore_layer fills an empty layer from such a
  // snapshot made by a cache of the same spec and geometry, checking it as attend_exported
  // checks a block (a damaged one throws xctx::Error naming the layer). Layers are restored in
  // order: clkv's shared codes and xquant-cl's deltas build on the layer below. Most formats
  // snapshot their ring block; xquant-cl snapshots its codes whatever its ring mode.
  virtual size_t snapshot_bytes(int layer) const { return exported_bytes(layer); }
  virtual void snapshot_layer(int layer, void* dst) const { export_layer(layer, dst); }
  virtual void restore_layer(int layer, const void* block, size_t bytes) = 0;
  // Drops working memory that only the exact ring prefill needs (xquant-cl in deltas mode: the
  // f32 accumulators of foreign tokens, n_foreign * n_embd * 4 bytes). The sequence runner calls
  // it once the ring prefill / scoring is over; clear() drops it too. No-op for other formats.
  virtual void release_ring_state() {}
  // Shorthands of attend() for the four (source, sink) pairs, and (o, lse) of one call through
  // the exact accumulator (tests and tools).
  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, attend_path path, softmax_acc& out,
              const attn_selection* select = nullptr) {
    attend(layer, attend_source::own_tokens(), {q, q_pos, n_q, path}, select, attend_sink::exact_sum(out));
  }
  void attend_partial(int layer, const float* q, const int32_t* q_pos, int64_t n_q, attend_path path, float* o,
                      float* lse, const attn_selection* select = nullptr) {
    attend(layer, attend_source::own_tokens(), {q, q_pos, n_q, path}, select, attend_sink::partial(o, lse));
  }
  void attend_exported(int layer, const void* block, size_t bytes, const float* q, const int32_t* q_pos, int64_t n_q,
                       attend_path path, softmax_acc& out) {
    attend(layer, attend_source::exported(block, bytes), {q, q_pos, n_q, path}, nullptr, attend_sink::exact_sum(out));
  }
  void attend_exported_partial(int layer, const void* block, size_t bytes, const float* q, const int32_t* q_pos,
                               int64_t n_q, attend_path path, float* o, float* lse,
                               const void* block_on_backend = nullptr) {
    attend(layer, attend_source::exported(block, bytes, block_on_backend), {q, q_pos, n_q, path}, nullptr,
           attend_sink::partial(o, lse));
  }
  void attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o /*[n_q, n_head, head_dim]*/,
              float* lse /*[n_q, n_head]*/, attend_path path = attend_path::attend_prefill);
  void attend_exported(int layer, const void* block, size_t bytes, const float* q, const int32_t* q_pos, int64_t n_q,
                       float* o /*[n_q, n_head, head_dim]*/, float* lse /*[n_q, n_head]*/,
                       attend_path path = attend_path::attend_prefill);
  virtual void clear() = 0;
  virtual size_t bytes_allocated() const = 0;
  virtual size_t bytes_used() const = 0;  // for the tokens held now

 protected:
  // A format's attention, called by attend() with its arguments checked. A format resolves the
  // source (own storage, or a parsed ring block moved to the backend when it is not there) into
  // its kernel's arguments once and hands them to the kernel with the sink's output.
  virtual void attend_impl(int layer, const attend_source& src, const attend_queries& qs,
                           const attn_selection* select, const attend_sink& sink) = 0;
};

// A cache of spec's format on `be`. Every format runs on every backend: on those without the
// exact accumulator (cuda) through attend_partial / attend_exported_partial.
std::unique_ptr<kv_cache> make_cache(const cache_spec& spec, const cache_geometry& g, backend& be);

// Rank boundaries of a shard plan must fall on multiples of this many positions for the format
// to compress the same tokens the same way on any number of ranks (kivi: its group size).
int64_t cache_alignment(const cache_spec& spec);

// The quantized caches (cache/quant_cache.cpp), for tests and tools that look inside.
std::unique_ptr<kv_cache> make_quant_cache(const cache_spec& spec, const cache_geometry& g, backend& be);
kvq_layer_view quant_cache_view(const kv_cache& c, int layer);  // throws for non-quantized caches
int64_t quant_cache_key_outliers(const kv_cache& c);            // sparse key entries, all layers

}  // namespace xctx
