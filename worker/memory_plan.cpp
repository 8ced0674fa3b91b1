#include "worker/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "cache/x_factors.h"
#include "common/error.h"
#include "common/sys.h"
#include "kernels/softmax_acc.h"
#include "registry/registry.h"

namespace xctx {
namespace {

cache_geometry geometry_of(const model_hparams& hp, int64_t capacity) {
  return make_cache_geometry(hp, rope_config{}, std::max<int64_t>(1, capacity));
}

// Bytes per token of the largest layer's ring block (its positions included).
double ring_block_bytes_per_token(const cache_spec& spec, const model_hparams& hp) {
  const cache_geometry g = geometry_of(hp, 1);
  const cache_format_traits t = format_traits(spec.format);
  // Key outliers at the caches' reserve (kKeyOutlierReserve x nominal; cache_bytes_per_token
  // counts them once): 300-token blocks of real text measured ~2.5x.
  // (cache_bytes_per_token counts the shared positions once; every block carries its own, below.)
  double most = (cache_bytes_per_token(spec, g) - 4.0) / g.n_layer +
                (kKeyOutlierReserve - 1.0) * t.outlier_fraction * hp.kv_dim() * 4;
  if (t.family == cache_family::family_xquant_cl) {
    const double G = spec.options.group_size;
    for (int l = 0; l < g.n_layer; ++l) {
      const double ch = xquant_cl_channels(g, spec.options, l);
      most = std::max(most, ch * xquant_cl_bits(spec.format, spec.options, g.n_layer, l) / 8.0 +
                                std::ceil(ch / G) * 4.0);
    }
    if (spec.options.cl_ring == cl_ring_mode::cl_ring_latent) most = std::max(most, 2.0 * xquant_cl_rank(g));
  }
  return most + 4.0;
}

// Bytes a ring block carries whatever its length: header, the nuq tables (datatypes, channel
// scales, outlier thresholds) and the fp16 residual window of the grouped formats.
constexpr double kBlockHeader = 512;  // token count, array offsets, padding of each array to 8 bytes

double ring_block_fixed_bytes(const cache_spec& spec, const model_hparams& hp) {
  const cache_geometry g = geometry_of(hp, 1);
  const cache_format_traits t = format_traits(spec.format);
  const double C = hp.kv_dim(), G = spec.options.group_size;
  switch (t.family) {
    case cache_family::family_nuq:
      return kBlockHeader + 2.0 * (1 << t.bits_per_element) * 4 + 2 * C * 4 + (t.outlier_fraction > 0 ? 2 * C * 4 : 0) +
             2 * C * 2;  // + the sink row
    case cache_family::family_kivi:
    case cache_family::family_clkv:
      return kBlockHeader + 2 * G * C * 2;
    case cache_family::family_xquant:
      return kBlockHeader + (xquant_uses_latents(g) ? 2 : 1) * G * xquant_rank(g) * 2;
    default:
      return kBlockHeader;
  }
}

size_t parse_bytes(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit((unsigned char)text[i])) ++i;
  XCTX_CHECK(i > 0 && i <= 18, "XCTX_MEMORY_LIMIT: '", text, "' is not a byte count (examples: 8G, 512M)");
  size_t n = std::stoull(text.substr(0, i));
  const std::string unit = text.substr(i);
  static const std::pair<const char*, int> units[] = {{"", 0}, {"K", 10}, {"M", 20}, {"G", 30}, {"T", 40}};
  for (const auto& [u, shift] : units)
    if (unit == u) return n << shift;
  fail("XCTX_MEMORY_LIMIT: unknown unit '", unit, "' (K, M, G, T)");
}

size_t read_number(const char* path) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s == "max") return std::numeric_limits<size_t>::max();
  return std::strtoull(s.c_str(), nullptr, 10);
}

}  // namespace

std::string rank_memory::describe() const {
  std::ostringstream o;
  const std::pair<const char*, size_t> parts[] = {{"cache", cache},           {"residual stream", residual},
                                                  {"scratch", scratch},       {"accumulators", accumulators},
                                                  {"ring blocks", ring_blocks}, {"foreign accumulators", foreign_acc},
                                                  {"anchor/block caches", star_caches}, {"xquant-cl accumulators", x_accumulator},
                                                  {"kernel workspace", workspace}, {"rebuild factors", factors}};
  bool first = true;
  for (const auto& [name, bytes] : parts) {
    if (bytes == 0) continue;
    o << (first ? "" : " + ") << name << " " << format_bytes((double)bytes);
    first = false;
  }
  o << " = " << format_bytes((double)total());
  return o.str();
}

size_t cache_allocation_bytes(const cache_spec& spec, const model_hparams& hp, int64_t capacity) {
  const cache_geometry g = geometry_of(hp, capacity);
  const cache_format_traits t = format_traits(spec.format);
  const int64_t C = (int64_t)hp.kv_dim();
  // quant_cache reserves reserved_key_outliers per layer.
  const int64_t key_out = g.n_layer * (int64_t)reserved_key_outliers(t.outlier_fraction, C, capacity);
  const bool sink = t.family == cache_family::family_nuq && spec.options.sink;
  size_t window = 0;  // the fp16 residual window is allocated whole, whatever it holds
  const size_t L = (size_t)g.n_layer, G = (size_t)spec.options.group_size;
  if (t.family == cache_family::family_kivi || t.family == cache_family::family_clkv)
    window = 2 * L * G * (size_t)C * 2;
  else if (t.family == cache_family::family_xquant)
    window = (xquant_uses_latents(g) ? 2 : 1) * L * G * (size_t)xquant_rank(g) * 2;
  const cache_bytes b = cache_bytes_for(spec, g, capacity, sink ? 1 : 0, key_out);
  return b.total() - b.fp16_rows * (window > 0) + window;
}

rank_memory estimate_rank_memory(const model_hparams& hp, const cache_spec& spec, const sequence_options& opt,
                                 int n_batch, int n_threads, int64_t n_context, int64_t extra_on_tail, int n_rank,
                                 backend_kind kind) {
  rank_memory m;
  const int64_t n_suffix = 1, n_new = std::max<int64_t>(0, extra_on_tail - n_suffix);
  const int64_t held = opt.capacity_per_rank > 0
                           ? opt.capacity_per_rank
                           : sequence_tokens_needed_per_rank(n_context, n_suffix, n_new, n_rank, spec, opt);
  m.cache = cache_allocation_bytes(spec, hp, held);
  const prefill_mode mode = effective_prefill_mode(opt, n_context + n_suffix);
  // The largest shard a rank prefills (the tail's extra tokens go through the decode path).
  const int64_t shard = sequence_tokens_needed_per_rank(n_context, n_suffix, 0, n_rank, spec, opt) - n_suffix;
  const int64_t b = std::max<int64_t>(1, std::min<int64_t>(n_batch, std::max<int64_t>(shard, 1)));
  const size_t d = hp.n_embd, q = (size_t)hp.n_head * hp.head_dim, kv = hp.kv_dim(), f = hp.n_ff;
  m.scratch = (size_t)b * (2 * d + 2 * q + 2 * kv + 2 * f) * 4;
  m.accumulators = (size_t)b * hp.n_head * (sizeof(int32_t) + (size_t)kAccBins * (hp.head_dim + 1) * sizeof(double));
  workspace_shape ws{std::max(1, n_threads), b, (int64_t)kv, (int64_t)q};
  ws.n_head = hp.n_head, ws.n_head_kv = hp.n_head_kv, ws.head_dim = hp.head_dim, ws.n_embd = hp.n_embd;
  ws.max_weight_cols = std::max<int64_t>(hp.n_embd, hp.n_ff);
  ws.capacity = held;
  m.workspace = kernel_workspace_bytes(kind, ws);
  const bool ring = mode == prefill_mode::prefill_exact && n_rank > 1;
  m.residual = (size_t)(ring ? std::max<int64_t>(shard, 0) : b) * d * 4;
  if (ring) {
    m.ring_blocks = (size_t)(ring_block_bytes_per_token(spec, hp) * (double)n_context +
                             ring_block_fixed_bytes(spec, hp) * n_rank);
    if (format_traits(spec.format).family == cache_family::family_xquant_cl &&
        spec.options.cl_ring == cl_ring_mode::cl_ring_deltas)
      m.foreign_acc = (size_t)std::max<int64_t>(0, n_context) * (d + 1) * 4;
  }
  // Star's extra caches: the anchor, and a view of the block being prefilled (none while a rank
  // holds one block: its first block is attended in the own cache).
  int64_t star_rows = 0, n_caches = 1;
  if (mode == prefill_mode::prefill_star && n_context > 0) {
    const int64_t block = opt.block_tokens > 0 ? opt.block_tokens : shard;
    const int64_t anchor = std::min(n_context, opt.anchor_tokens > 0 ? opt.anchor_tokens : block);
    const int64_t view = opt.block_tokens > 0 && shard > block ? block : 0;
    m.star_caches = cache_allocation_bytes(spec, hp, anchor) + (view > 0 ? cache_allocation_bytes(spec, hp, view) : 0);
    star_rows = anchor + view;
    n_caches += 1 + (view > 0);
  }
  // nuq -1%: each cache appended to keeps a chunk's per-row outlier lists before compacting them
  // (index and value, 2 bytes each per channel).
  if (format_traits(spec.format).outlier_fraction > 0) m.workspace += (size_t)n_caches * b * kv * 4;
  // xquant-cl attends its own tokens from the cross-layer accumulator X̂ ([rows, n_embd] f32 and
  // a layer tag per row), grown with the rows attended up to the cache's capacity; star's anchor
  // and block caches keep their own.
  if (format_traits(spec.format).family == cache_family::family_xquant_cl)
    m.x_accumulator = (size_t)(held + star_rows) * (d * 4 + 2);
  return m;
}

size_t available_memory_bytes() {
  if (const char* env = std::getenv("XCTX_MEMORY_LIMIT")) return parse_bytes(env);
  size_t avail = std::numeric_limits<size_t>::max();
  std::ifstream in("/proc/meminfo");
  std::string key;
  size_t kib = 0;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") avail = kib * 1024;
  }
  // cgroup v2, then v1: a container's limit is what the kernel enforces.
  size_t limit = read_number("/sys/fs/cgroup/memory.max"), used = read_number("/sys/fs/cgroup/memory.current");
  if (limit == std::numeric_limits<size_t>::max()) {
    limit = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    used = read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  }
  if (limit != std::numeric_limits<size_t>::max() && used != std::numeric_limits<size_t>::max() && limit > used)
    avail = std::min(avail, limit - used);
  return avail;
}

cache_spec resolve_ring_mode(const cache_spec& spec, const model_hparams& hp, const sequence_options& opt,
                             int64_t n_context, int n_rank) {
  if (format_traits(spec.format).family != cache_family::family_xquant_cl ||
      spec.options.cl_ring != cl_ring_mode::cl_ring_auto)
    return spec;
  cache_spec out = spec;
  const bool ring = effective_prefill_mode(opt, n_context + 1) == prefill_mode::prefill_exact && n_rank > 1;  // + the suffix
  const size_t deltas_bytes = (size_t)std::max<int64_t>(0, n_context) * ((size_t)hp.n_embd + 1) * 4;
  out.options.cl_ring = ring && deltas_bytes > kClDeltasBudget ? cl_ring_mode::cl_ring_latent : cl_ring_mode::cl_ring_deltas;
  return out;
}

size_t factor_upload_bytes(const model_hparams& hp, const cache_spec& spec, const backend* be) {
  if (be == nullptr || be->memory_share_bytes() == 0 || !format_needs_x_factors(spec.format)) return 0;
  const x_factors* f = spec.options.factors.get();
  if (f != nullptr && f->kind == x_factor_kind_for(spec.format) && x_factors_on_backend::resident(*be, *f)) return 0;
  return x_factor_bytes(hp, x_factor_kind_for(spec.format));
}

void check_sequence_fits(communicator& comm, const model_hparams& hp, const cache_spec& spec,
                         const sequence_options& opt, int n_batch, int n_threads, int64_t n_context,
                         int64_t extra_on_tail, backend_kind kind, const backend* be) {
  const int P = comm.size();
  // On a device, everything counts against the rank's share, the factors' upload included.
  const auto needs = [&](const cache_spec& s, int n_rank) {
    rank_memory m = estimate_rank_memory(hp, s, opt, n_batch, n_threads, n_context, extra_on_tail, n_rank, kind);
    m.factors = factor_upload_bytes(hp, s, be);
    return m;
  };
  const rank_memory need = needs(spec, P);
  const uint64_t device_share = be != nullptr ? be->memory_share_bytes() : 0;
  const uint64_t available = device_share > 0 ? device_share : available_memory_bytes();
  const int local_ranks = device_share > 0 ? 1 : node_local_ranks();  // a device's share is per rank already
  struct verdict {
    uint64_t need, share, available;
    int32_t local_ranks, on_device;
  } mine{need.total(), available / (uint64_t)local_ranks, available, local_ranks, device_share > 0 ? 1 : 0};
  std::vector<verdict> all(P);
  comm.all_gather(&mine, all.data(), sizeof mine);
  int worst = 0;
  for (int r = 1; r < P; ++r)
    if (all[r].share < all[worst].share) worst = r;
  const uint64_t share = all[worst].share;
  if (need.total() <= share) return;

  // Every rank builds the same message from the gathered figures.
  std::ostringstream msg;
  msg << "the sequence does not fit in memory: " << n_context << " context tokens over " << P << " rank(s) with cache "
      << format_traits(spec.format).name << " and " << prefill_mode_name(effective_prefill_mode(opt, n_context))
      << " prefill need up to " << need.describe() << " per rank, but rank " << worst << " may use "
      << format_bytes((double)share);
  if (all[worst].on_device != 0)
    msg << " (its share of its GPU's free memory, the " << (be != nullptr ? be->name() : std::string("device"))
        << " backend).";
  else
    msg << " (" << format_bytes((double)all[worst].available) << " available on its node / " << all[worst].local_ranks
        << " rank(s) there).";
  std::string fitting;
  for (cache_format f : all_cache_formats()) {
    cache_spec other(f, spec.options);
    other.options.cl_ring = cl_ring_mode::cl_ring_latent;
    const size_t b = needs(other, P).total();
    if (b <= share) fitting += (fitting.empty() ? "" : ", ") + std::string(format_traits(f).name) + " (" + format_bytes((double)b) + ")";
  }
  msg << " Formats that fit at " << P << " rank(s): " << (fitting.empty() ? "none" : fitting) << ".";
  int fits_from = 0;
  for (int p = P + 1; p <= 4096 && fits_from == 0; p = p < 64 ? p + 1 : p * 2)
    if (needs(spec, p).total() <= share) fits_from = p;
  if (fits_from > 0)
    msg << " " << format_traits(spec.format).name << " fits from " << fits_from << " ranks with "
        << format_bytes((double)share) << " each";
  else
    msg << " " << format_traits(spec.format).name << " does not fit on up to 4096 ranks with "
        << format_bytes((double)share) << " each";
  fail(msg.str());
}

}  // namespace xctx
