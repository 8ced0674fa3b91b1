// The cache formats users name with --cache: one enum and one traits table. Every switch over
// the enum has no default, so the build breaks wherever a new format is not handled.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "kernels/ops.h"

namespace xctx {

struct calibration;  // cache/calibration.h
struct x_factors;    // cache/x_factors.h

// The shape of what one shard caches.
struct cache_geometry {
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;
  int n_embd = 0;
  rope_config rope;
  int64_t capacity = 0;  // tokens this shard may hold
};

enum class cache_format : uint8_t {
  cache_fp32,
  cache_fp16,
  cache_kivi4,  // KIVI* (XQuant §4): uniform, keys per channel pre-RoPE, values per token
  cache_kivi3,
  cache_kivi2,
  cache_nuq4,  // KVQuant: non-uniform per-layer datatypes, offline key scaling, attention sink
  cache_nuq3,
  cache_nuq2,
  cache_nuq4_1pct,  // ... plus 1% per-vector dense-and-sparse outliers
  cache_nuq3_1pct,
  cache_nuq2_1pct,
  // X caches (docs/x_formats.md): the post-norm layer input (or its SVD latents) instead of K/V.
  cache_xquant4,  // XQuant §3.1/3.3: X (MHA) or X·U_k per channel + X·U_v per token (GQA)
  cache_xquant3,
  cache_xquant2,
  cache_xquant_cl4,  // XQuant-CL §3.2: cross-layer deltas against a per-token accumulator
  cache_xquant_cl3,
  cache_xquant_cl2,
  cache_clkv,  // the ACL "XQuant": K/V codes shared by layer pairs, data-free calibration eta
};

enum class cache_family : uint8_t { family_fp, family_kivi, family_nuq, family_xquant, family_xquant_cl, family_clkv };

struct cache_format_traits {
  const char* name;
  cache_family family;
  int bits_per_element;    // of a stored K or V code (16/32 for the baselines)
  double outlier_fraction;  // of each vector kept sparse in fp16 (nuq-1%)
  bool pre_rope_keys;       // keys stored before RoPE (applied at attention time)
  bool needs_calibration;   // nuq: datatypes and key scales come from `xctx calibrate`
};

// Key outliers a nuq -1% cache reserves per layer, as a multiple of the nominal fraction (+16),
// and what the memory plan counts: the thresholds are calibrated offline, and real text runs
// over them -- measured 1.2x (Austen prose) to 2.9x (passkey filler) of 1% on SmolLM2. A cache
// that outgrows this grows its lists by a quarter of it at a time (docs/sequence_parallel.md).
inline constexpr double kKeyOutlierReserve = 3.0;
inline size_t reserved_key_outliers(double outlier_fraction, int64_t channels, int64_t capacity) {
  return outlier_fraction > 0 ? (size_t)std::llround(outlier_fraction * (double)channels * (double)capacity * kKeyOutlierReserve) + 16
                              : 0;
}

cache_format_traits format_traits(cache_format f);
cache_format parse_cache_format(const std::string& name);  // throws listing the valid names
std::vector<cache_format> all_cache_formats();
// The formats of the given families, in all_cache_formats() order.
std::vector<cache_format> formats_of(std::initializer_list<cache_family> families);
// The X formats (xquant*, xquant-cl*, clkv): they need the model's rebuild factors.
std::vector<cache_format> x_cache_formats();

// xquant-cl under the exact ring prefill (docs/x_formats.md "Sequence parallelism"): what a
// ring block of a layer >= the base layer carries, and what the own shard is attended from.
enum class cl_ring_mode : uint8_t {
  // The layer's stored codes (base X or quantized delta) + fp16 params. The receiver keeps an
  // f32 accumulator per foreign token, n_foreign * n_embd * 4 bytes per rank while the prefill
  // ring runs; every shard is attended from the f32 accumulator (the paper's rebuild).
  cl_ring_deltas,
  // The fp16 latent X̂_i·U_kv (GQA: the bytes of fp16 K|V), receiver memory O(block); the own
  // shard is attended through the same fp16 latent so results do not depend on the rank count.
  cl_ring_latent,
  // Chosen per sequence by the sequence runner (worker/memory_plan.h, resolve_ring_mode):
  // deltas while its foreign accumulators stay within a per-rank budget, latent beyond. A cache
  // given auto unresolved runs deltas.
  cl_ring_auto,
};
cl_ring_mode parse_cl_ring_mode(const std::string& name);  // deltas | latent | auto; throws otherwise
const char* cl_ring_mode_name(cl_ring_mode m);

// How a quantized format is run (defaults follow the papers).
struct cache_options {
  int group_size = 128;  // kivi: tokens per key group = channels per value group (XQuant §4)
  int qnorm = -1;        // nuq: Q-Norm of the centroids; -1 = the paper's choice (on at 2 bits)
  bool sink = true;      // nuq: the sequence's first token (position 0) kept in fp16
  std::shared_ptr<const calibration> calib;  // nuq: required
  // xquant*, xquant-cl*: the offline SVD / rebuild matrices of the model (required; built by
  // build_x_factors in cache/x_factors.h).
  std::shared_ptr<const x_factors> factors;
  bool x_fp16_first_channel = false;  // xquant (GQA): first latent channel of X·U_k kept fp16 (App. B)
  int cl_hi_layers = 3;  // xquant-cl: leading layers cached as X at 4 bits (Table 4); the last is the base
  // xquant-cl: ring blocks of layers >= the base. deltas (default): fewest bytes, the paper's
  // f32 rebuild, O(n·n_embd) receiver memory during the prefill; latent: O(block) memory, the
  // bytes of fp16 K|V (GQA). Both give the same tokens on any number of ranks.
  cl_ring_mode cl_ring = cl_ring_mode::cl_ring_deltas;
  // clkv (ACL paper Table 9 / App. A, scaled to the model's depth; -1 = the paper's choice):
  int clkv_key_2bit_layers = -1;    // kq: key layers [0, kq) at 2 bits, the rest 1 bit; -1 = L - 2
  int clkv_value_2bit_layers = 2;   // vq: value layers [0, vq) at 2 bits
  int clkv_value_share_from = -1;   // vm: odd value layers >= vm reuse layer l-1's codes; -1 = L / 2
  int clkv_key_share_from = -1;     // km: same for keys; -1 = L (keys never shared)
  int clkv_group = 32;  // KIVI's group size: tokens per key scale group = channels per value group
                        // (group_size is the residual window: groups close 128 tokens at a time)
  float clkv_eta1 = 1.0f / 6.0f;    // calibration eta of the 1-bit layers
  float clkv_eta2 = 0.045f;         // ... and of the 2-bit layers
  // Retrieval attention (worker/retrieval.h): positions per block summary, a multiple of
  // kAttnUnit; 0 = no summaries. Any format keeps them (cache/block_summary.h).
  int64_t summary_block = 0;
};
bool qnorm_enabled(cache_format f, const cache_options& o);

// The per-layer shape of the X formats, shared by the caches and cache_bytes_for.
// xquant: GQA models (n_head_kv < n_head) cache the latents X·U_k, X·U_v of rank
// min(n_embd, kv_dim); MHA models cache X (n_embd channels) once.
bool xquant_uses_latents(const cache_geometry& g);
int xquant_rank(const cache_geometry& g);
// xquant-cl: layers below cl_hi_layers cache X at 4 bits (the last one is the accumulator's
// base); later layers cache deltas of xquant_cl_rank channels (the [W_k|W_v] latent for GQA).
int xquant_cl_hi_layers(const cache_options& o, int n_layer);
int xquant_cl_rank(const cache_geometry& g);
int xquant_cl_bits(cache_format f, const cache_options& o, int n_layer, int layer);
int xquant_cl_channels(const cache_geometry& g, const cache_options& o, int layer);
struct clkv_layer {
  int key_bits = 2, value_bits = 2;
  bool key_shared = false, value_shared = false;  // codes are layer - 1's (own scale and zero)
  float key_eta = 0.0f, value_eta = 0.0f;
};
clkv_layer clkv_layer_config(const cache_options& o, int n_layer, int layer);

// A format with its options: what make_cache needs. Converts from a bare format.
struct cache_spec {
  cache_format format = cache_format::cache_fp16;
  cache_options options;
  cache_spec() = default;
  cache_spec(cache_format f) : format(f) {}  // NOLINT: implicit on purpose
  cache_spec(cache_format f, cache_options o) : format(f), options(std::move(o)) {}
};

// Throws xctx::Error naming the option (as the CLI spells it) for values no format can run with:
// a group size below 1 (kivi/xquant/clkv groups, xquant-cl's per-token groups) or above 2^20.
// make_cache and cache_alignment call it, so every entry point (CLI, service, batch) refuses alike.
void check_cache_options(const cache_spec& spec);

// Outliers per side of a value vector of `channels` elements for a fraction (at least one per
// side when the fraction is positive).
int value_outliers_per_side(double fraction, int channels);

// Exact bytes a cache holds, by component, summed over layers.
struct cache_bytes {
  size_t positions = 0;    // int32 per token, shared by the layers
  size_t codes = 0;        // packed K and V codes (or the fp16/fp32 elements of the baselines)
  size_t fp16_rows = 0;    // attention sink and residual window, K and V in fp16
  size_t scales = 0;       // per-group / per-token fp16 scales and zero points
  size_t tables = 0;       // per-layer LUTs, key channel scales/zeros, outlier thresholds
  size_t outliers = 0;     // sparse values + indices (+ key column offsets)
  // X formats: codes are the latent / X / delta codes, fp16_rows the residual window (and the
  // fp16 first latent channel), scales the per-group fp16 scale + zero.
  size_t summaries = 0;    // retrieval: per-block key minima, maxima and sums (cache/block_summary.h)
  size_t total() const { return positions + codes + fp16_rows + scales + tables + outliers + summaries; }
};

// The bytes a cache of this spec uses while every layer holds n tokens, of which n_sink are
// the sink (0 or 1) and n_key_outliers (summed over layers) are sparse key entries.
cache_bytes cache_bytes_for(const cache_spec& spec, const cache_geometry& g, int64_t n, int64_t n_sink,
                            int64_t n_key_outliers);
// Bytes per token for long contexts (per-layer tables and windows amortized away; key
// outliers at their nominal fraction): the figure to compare formats by.
double cache_bytes_per_token(const cache_spec& spec, const cache_geometry& g);

}  // namespace xctx
