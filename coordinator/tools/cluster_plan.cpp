#include "coordinator/tools/cluster_plan.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cache/block_summary.h"
#include "common/error.h"
#include "model/gguf.h"
#include "model/weights.h"
#include "worker/llama_engine.h"
#include "worker/sequence_parallel.h"

namespace xctx {
namespace {

constexpr double kGB = 1e9;  // vendors' GB and GB/s are decimal

model_hparams llama_shape(const char* name, int n_layer, int n_embd, int n_ff, int n_head, int n_head_kv, int n_vocab,
                          int n_ctx_train, float rope_base, bool tied) {
  model_hparams hp;
  hp.name = name;
  hp.n_layer = n_layer, hp.n_embd = n_embd, hp.n_ff = n_ff;
  hp.n_head = n_head, hp.n_head_kv = n_head_kv, hp.head_dim = n_embd / n_head, hp.n_rot = n_embd / n_head;
  hp.n_vocab = n_vocab, hp.n_ctx_train = n_ctx_train, hp.rope_freq_base = rope_base, hp.tied_output = tied;
  return hp;
}

template <class T>
const T& find_named(const std::vector<T>& table, const std::string& name, const char* what) {
  for (const T& e : table)
    if (e.name == name) return e;
  std::string known;
  for (const T& e : table) known += (known.empty() ? "" : ", ") + e.name;
  fail("unknown ", what, " '", name, "' (known: ", known, ")");
}

// Ranks' share of the sequence: the most tokens one rank holds.
int64_t tokens_per_rank(int64_t context, int ranks) { return (context + ranks - 1) / ranks; }

cache_geometry plan_geometry(const model_hparams& hp, int64_t capacity) {
  return make_cache_geometry(hp, make_rope_config(hp, run_params{}), capacity);
}

// The bytes a rank's cache allocates for n tokens: the exact layout, with the key-outlier
// reserve the nuq -1% caches make (cache/format.h) -- what xctx's own fit check counts.
double cache_bytes_at(const model_hparams& hp, cache_format f, int64_t n) {
  const cache_geometry g = plan_geometry(hp, n);
  const cache_format_traits t = format_traits(f);
  const int64_t n_sink = t.family == cache_family::family_nuq && n > 0 ? 1 : 0;
  const int64_t key_out =
      (int64_t)reserved_key_outliers(t.outlier_fraction, (int64_t)g.n_head_kv * g.head_dim, n - n_sink) * g.n_layer;
  return (double)cache_bytes_for(cache_spec(f), g, n, n_sink, key_out).total();
}

// FLOPs to rebuild one token's K and V in one layer from what an X format caches (XQuant §3.4,
// with xctx's shapes: kv_dim = n_head_kv·head_dim in place of d/g).
double rebuild_flops_per_token_layer(const model_hparams& hp, cache_format f) {
  const double d = hp.n_embd, kv = hp.kv_dim();
  const bool mha = hp.n_head_kv == hp.n_head;
  switch (format_traits(f).family) {
    case cache_family::family_xquant: return mha ? 2.0 * d * 2.0 * d : 2.0 * 2.0 * kv * kv;  // X·[W_k|W_v] or latents·ΣBᵀ
    case cache_family::family_xquant_cl:
      return mha ? 2.0 * 2.0 * d * (d + 0.5) : 2.0 * 4.0 * kv * d;  // + delta up-projection and accumulate
    case cache_family::family_fp:
    case cache_family::family_kivi:
    case cache_family::family_nuq:
    case cache_family::family_clkv: return 0.0;
  }
  return 0.0;
}

// Linear-layer FLOPs per token of the transformer blocks (the logits of the last token aside).
double block_flops_per_token(const model_hparams& hp) {
  const double d = hp.n_embd, q = (double)hp.n_head * hp.head_dim, kv = hp.kv_dim(), ff = hp.n_ff;
  return 2.0 * hp.n_layer * (d * q + 2.0 * d * kv + q * d + 3.0 * d * ff);
}

// Attention FLOPs (QKᵀ and PV) of one query against n keys, every layer.
double attention_flops(const model_hparams& hp, double n_keys) {
  return 4.0 * hp.n_layer * hp.n_head * (double)hp.head_dim * n_keys;
}

}  // namespace

const std::vector<device_spec>& device_table() {
  static const std::vector<device_spec> t = {
      {"h100", 80 * kGB, 3.35e12, 989e12, "NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense BF16"},
      {"h100-pcie", 80 * kGB, 2.0e12, 756e12,
       "NVIDIA H100 PCIe datasheet: 80 GB HBM2e, 2.0 TB/s, 756 TFLOPS dense BF16 (XQuant §3.4's H100)"},
      {"h200", 141 * kGB, 4.8e12, 989e12, "NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16"},
      {"a100-80gb", 80 * kGB, 2.039e12, 312e12,
       "NVIDIA A100 80GB SXM datasheet: 80 GB HBM2e, 2.039 TB/s, 312 TFLOPS dense BF16"},
  };
  return t;
}

const std::vector<network_spec>& network_table() {
  // Bandwidths are the vendors' per-GPU link rates, one direction; latencies are assumed
  // per-step costs of a ring collective on small messages (NCCL-like), not measurements.
  static const std::vector<network_spec> t = {
      {"nvlink4", 450 * kGB, 3e-6, "H100 SXM NVLink 4: 900 GB/s total per GPU = 450 GB/s each way; 3 us/step assumed"},
      {"nvlink3", 300 * kGB, 3e-6, "A100 SXM NVLink 3: 600 GB/s total per GPU = 300 GB/s each way; 3 us/step assumed"},
      {"ib-ndr", 50 * kGB, 5e-6, "InfiniBand NDR 400 Gb/s, one HCA per GPU; 5 us/step assumed"},
      {"ib-hdr", 25 * kGB, 5e-6, "InfiniBand HDR 200 Gb/s, one HCA per GPU; 5 us/step assumed"},
      {"eth-100g", 12.5 * kGB, 15e-6, "100 Gb Ethernet (TCP); 15 us/step assumed"},
      {"eth-10g", 1.25 * kGB, 30e-6, "10 Gb Ethernet (TCP); 30 us/step assumed"},
  };
  return t;
}

device_spec find_device(const std::string& name) { return find_named(device_table(), name, "--gpu kind"); }
network_spec find_network(const std::string& name) { return find_named(network_table(), name, "--network"); }

const std::vector<model_preset>& model_presets() {
  static const std::vector<model_preset> t = {
      {"llama-2-7b", llama_shape("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, 4096, 10000.0f, false),
       "Touvron et al. 2023 (Llama 2), the LLaMA-7B shape of the KVQuant paper"},
      {"llama-3-8b", llama_shape("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, 8192, 500000.0f, false),
       "Meta Llama 3 8B config.json"},
      {"llama-3.1-8b", llama_shape("llama-3.1-8b", 32, 4096, 14336, 32, 8, 128256, 131072, 500000.0f, false),
       "Meta Llama 3.1 8B config.json (the XQuant paper's GQA example)"},
      {"llama-3-70b", llama_shape("llama-3-70b", 80, 8192, 28672, 64, 8, 128256, 8192, 500000.0f, false),
       "Meta Llama 3 70B config.json"},
      {"smollm2-135m", llama_shape("smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, 100000.0f, true),
       "SmolLM2-135M-Instruct, xctx's embedded default"},
  };
  return t;
}

model_hparams plan_model_hparams(const std::string& model) {
  for (const model_preset& p : model_presets())
    if (p.name == model) return p.hp;
  namespace fs = std::filesystem;
  if (fs::is_directory(model) || fs::path(model).filename() == "config.json")
    return read_hf_config(fs::is_directory(model) ? model : fs::path(model).parent_path().string());
  if (fs::is_regular_file(model)) {
    const auto f = gguf_file::open(model);
    model_hparams hp = read_gguf_hparams(*f);
    hp.validate(model);
    return hp;
  }
  std::string known;
  for (const model_preset& p : model_presets()) known += (known.empty() ? "" : ", ") + p.name;
  fail("--model '", model, "' is neither a preset (", known, "), a .gguf file nor a checkpoint directory");
}

double model_parameters(const model_hparams& hp) {
  const double embed = (double)hp.n_vocab * hp.n_embd;
  return block_flops_per_token(hp) / 2.0 + embed * (hp.tied_output ? 1.0 : 2.0);
}

double merge_bytes_exact(const model_hparams& hp) { return (double)partial_bytes_per_token_layer(hp); }
double merge_bytes_o_lse(const model_hparams& hp) { return (double)hp.n_head * (hp.head_dim + 1) * sizeof(float); }

const cpu_format_costs& cpu_format_profile::at(int threads) const {
  XCTX_ASSERT(!by_threads.empty());
  const auto* best = &by_threads.front();
  for (const auto& e : by_threads)
    if (e.first <= threads) best = &e;
  return best->second;
}

cpu_profile::turns_factors cpu_profile::turns_at(double ranks_per_core) const {
  turns_factors out;
  out.ranks_per_core = ranks_per_core;
  if (ranks_per_core <= 1 || oversubscribed.empty()) return out;
  // The segment holding ranks_per_core (the last one past the end), from the point (1, 1, 1).
  turns_factors lo, hi = oversubscribed.front();
  for (size_t i = 1; i < oversubscribed.size() && hi.ranks_per_core < ranks_per_core; ++i)
    lo = hi, hi = oversubscribed[i];
  const double w = (ranks_per_core - lo.ranks_per_core) / (hi.ranks_per_core - lo.ranks_per_core);
  out.decode = std::max(1.0, lo.decode + w * (hi.decode - lo.decode));
  out.prefill = std::max(1.0, lo.prefill + w * (hi.prefill - lo.prefill));
  return out;
}

double cpu_profile::collective_price(int ranks, int hosts) const {
  if (ranks <= 1) return 0.0;
  if (hosts <= 1) return collective_s;
  XCTX_CHECK(has_across_hosts, "the CPU profile (", source, ") has no across-hosts calibration for ", hosts,
             " hosts: run benchmarks/scaling.py with --nodes 2 or more");
  return across_collective_s + across_turns_collective_s * std::max(0.0, (double)ranks / cores - 1.0);
}

const cpu_format_profile& cpu_profile::costs(cache_format f) const {
  for (const auto& [fmt, c] : formats)
    if (fmt == f) return c;
  std::string have;
  for (const auto& e : formats) have += (have.empty() ? "" : ", ") + std::string(format_traits(e.first).name);
  fail("the CPU profile (", source, ") has no measurements for ", format_traits(f).name, " (it has: ", have, ")");
}

cpu_profile read_cpu_profile(const std::string& path) {
  std::ifstream in(path);
  XCTX_CHECK(in.good(), path, ": cannot open the CPU profile (benchmarks/scaling.py writes one)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
  const auto num = [&](const nlohmann::json& o, const char* key, const std::string& where) {
    XCTX_CHECK(o.is_object() && o.contains(key) && o[key].is_number() && o[key].get<double>() >= 0, path, ": ",
               where, key, " must be a non-negative number");
    return o[key].get<double>();
  };
  cpu_profile p;
  p.source = path;
  p.machine = j.value("machine", "CPU");
  p.cores = (int)num(j, "cores", "");
  p.memory_bytes = num(j, "memory_bytes", "");
  p.n_layer = (int)num(j, "n_layer", ""), p.n_embd = (int)num(j, "n_embd", "");
  XCTX_CHECK(p.cores >= 1 && p.memory_bytes > 0, path, ": cores and memory_bytes must be positive");
  if (j.contains("collective_s")) p.collective_s = num(j, "collective_s", "");
  if (j.contains("oversubscribed")) {
    const nlohmann::json& o = j["oversubscribed"];
    XCTX_CHECK(o.is_object(), path, ": 'oversubscribed' must map ranks per core (\"2\", \"4\", ...) to factors");
    for (const auto& [key, f] : o.items()) {
      const std::string where = "oversubscribed." + key + ".";
      double r = 0;
      const auto [end, err] = std::from_chars(key.data(), key.data() + key.size(), r);
      XCTX_CHECK(err == std::errc() && end == key.data() + key.size() && r > 1, path, ": oversubscribed: '", key,
                 "' is not a count of ranks per core above 1");
      cpu_profile::turns_factors t{r, num(f, "decode_factor", where), num(f, "prefill_factor", where)};
      XCTX_CHECK(t.decode >= 1 && t.prefill >= 1, path, ": ", where,
                 "*: the factors are measured time over conserved work (>= 1)");
      p.oversubscribed.push_back(t);
    }
    std::sort(p.oversubscribed.begin(), p.oversubscribed.end(),
              [](const auto& a, const auto& b) { return a.ranks_per_core < b.ranks_per_core; });
  }
  if (j.contains("across_hosts")) {
    p.has_across_hosts = true;
    p.across_collective_s = num(j["across_hosts"], "collective_s", "across_hosts.");
    p.across_turns_collective_s = num(j["across_hosts"], "turns_collective_s", "across_hosts.");
  }
  XCTX_CHECK(j.contains("formats") && j["formats"].is_object() && !j["formats"].empty(), path,
             ": 'formats' must map cache formats to their costs by thread count");
  for (const auto& [name, by_threads] : j["formats"].items()) {
    XCTX_CHECK(by_threads.is_object() && !by_threads.empty(), path, ": formats.", name,
               " must map thread counts (\"1\", \"2\", ...) to costs");
    cpu_format_profile fp;
    for (const auto& [threads, o] : by_threads.items()) {
      const std::string where = "formats." + name + "." + threads + ".";
      int t = 0;
      const auto [end, err] = std::from_chars(threads.data(), threads.data() + threads.size(), t);
      XCTX_CHECK(err == std::errc() && end == threads.data() + threads.size() && t >= 1, path, ": formats.", name, ": '", threads, "' is not a thread count");
      cpu_format_costs c;
      c.decode_fixed_core_s = num(o, "decode_fixed_core_s", where);
      c.decode_core_s_per_token = num(o, "decode_core_s_per_token", where);
      c.prefill_core_s_per_token = num(o, "prefill_core_s_per_token", where);
      c.prefill_core_s_per_token2 = num(o, "prefill_core_s_per_token2", where);
      fp.by_threads.emplace_back(t, c);
    }
    std::sort(fp.by_threads.begin(), fp.by_threads.end(),
              [](const auto& x, const auto& y) { return x.first < y.first; });
    p.formats.emplace_back(parse_cache_format(name), fp);
  }
  return p;
}

format_plan plan_format(const plan_inputs& in, cache_format f) {
  const model_hparams& hp = in.hp;
  XCTX_CHECK(in.context > 0 && in.ranks > 0, "plan: context and ranks must be positive");
  XCTX_CHECK(in.cpu != nullptr || (in.device.bandwidth > 0 && in.device.peak_flops > 0 && in.device.memory_bytes > 0),
             "plan: the device needs memory, bandwidth and FLOP/s");
  format_plan p;
  p.format = f;
  p.bytes_per_token = cache_bytes_per_token(cache_spec(f), plan_geometry(hp, in.context));
  p.tokens_per_rank = tokens_per_rank(in.context, in.ranks);
  p.cache_bytes_per_rank = cache_bytes_at(hp, f, p.tokens_per_rank);
  p.weight_bytes = model_parameters(hp) * in.weight_bits / 8.0;
  // A device holds the weights and one rank's cache. A CPU machine holds every rank's cache and
  // the weights once (the ranks map the same file).
  const int caches_per_memory = in.cpu != nullptr ? in.ranks : 1;
  const double usable = (in.cpu != nullptr ? in.cpu->memory_bytes : in.device.memory_bytes) * in.usable_fraction;
  const auto fits_at = [&](int64_t n_rank) {
    return p.weight_bytes + caches_per_memory * cache_bytes_at(hp, f, n_rank) <= usable;
  };
  p.fits = fits_at(p.tokens_per_rank);

  // Longest context: the largest per-rank count that fits (bytes grow with n), times ranks.
  if (p.weight_bytes < usable) {
    int64_t lo = 0, hi = 1;
    while (hi < ((int64_t)1 << 40) && fits_at(hi)) lo = hi, hi *= 2;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (fits_at(mid) ? lo : hi) = mid;
    }
    p.max_context = lo * in.ranks;
  }
  if (in.cpu != nullptr) {
    // Measured costs (cpu_profile): work conserved across ranks at the core seconds measured
    // with the rank's thread count. Each rank runs max(1, C / P) threads (default_threads), so
    // min(C, P x that) cores work at once: all C of them for a single rank too. Collectives
    // cost their measured price each: n_layer merges per decode step, P-1 ring steps per layer.
    // Ranks taking turns on the cores (P > C) lose the measured share of their time to it, by
    // how many take turns on each core.
    const cpu_profile& cpu = *in.cpu;
    const int threads_per_rank = std::max(1, cpu.cores / in.ranks);
    const cpu_format_costs& c = cpu.costs(f).at(threads_per_rank);
    const double par = std::min(cpu.cores, in.ranks * threads_per_rank), n = (double)in.context;
    const cpu_profile::turns_factors turns = cpu.turns_at((double)in.ranks / cpu.cores);
    XCTX_CHECK(in.hosts >= 1 && in.hosts <= in.ranks, "--hosts must be in 1..", in.ranks, " (the ranks)");
    const double collective = cpu.collective_price(in.ranks, in.hosts);
    p.decode_rebuild_s = (in.ranks * c.decode_fixed_core_s + n * c.decode_core_s_per_token) / par *
                         turns.decode;
    p.decode_merge_s = hp.n_layer * collective;
    p.decode_s = p.decode_rebuild_s + p.decode_merge_s;
    p.prefill_ring_s = (n * c.prefill_core_s_per_token + n * n * c.prefill_core_s_per_token2) / par *
                           turns.prefill +
                       hp.n_layer * (in.ranks - 1) * collective;
    // Star: the anchor's tokens again on every rank past the first; the attention square shrinks
    // to the blocks' [anchor | block] rectangles.
    const double b = (double)std::min<int64_t>(in.star_block, p.tokens_per_rank);
    const double rect = in.ranks * ((double)p.tokens_per_rank / b * (b * b + b * b / 2.0) + b * b / 2.0);
    p.prefill_star_s = ((n + (in.ranks - 1) * b) * c.prefill_core_s_per_token +
                        std::min(rect, n * n / 2.0) * 2.0 * c.prefill_core_s_per_token2) / par;
    return p;
  }

  // Decode step on the slowest (fullest) rank.
  const double bw = in.device.bandwidth * in.bandwidth_efficiency;
  const double flops = in.device.peak_flops * in.flops_efficiency;
  if (in.retrieval != nullptr) {
    const retrieval_options& r = *in.retrieval;
    const cache_geometry geo = plan_geometry(hp, in.context);
    const double blocks = (double)p.tokens_per_rank / (double)r.block;
    const double C = (double)hp.n_head_kv * hp.head_dim;
    p.summary_bytes_per_token = (double)summary_bytes_per_block(geo) * hp.n_layer / (double)r.block;
    // Per KV head: one list of k (score, id) records per KV head, and up to that many times the
    // blocks read (the lists' union; the bound, as lists may share blocks).
    const double lists = r.scope == selection_scope::select_per_kv_head ? hp.n_head_kv : 1.0;
    p.selection_bytes_per_token_layer = (double)r.top_k * 16.0 * lists;
    const double tokens_read =
        std::min<double>((double)p.tokens_per_rank, (double)(r.sink + r.local) + lists * r.top_k * r.block);
    const double summaries_read = blocks * hp.n_layer * (2.0 * C * sizeof(uint16_t) + 12.0);  // bf16 min, max
    p.retrieval_bytes_read = p.weight_bytes + summaries_read + tokens_read * p.bytes_per_token;
    const double score_flops = blocks * hp.n_layer * hp.n_head * hp.head_dim * 4.0;  // two products per channel
    const double compute = (rebuild_flops_per_token_layer(hp, f) * hp.n_layer * tokens_read +
                            attention_flops(hp, tokens_read) + block_flops_per_token(hp) + score_flops) / flops;
    const double gathers = in.ranks > 1 ? hp.n_layer * (in.ranks - 1) *
                                              (2.0 * in.network.latency_s +
                                               (merge_bytes_o_lse(hp) + p.selection_bytes_per_token_layer) /
                                                   in.network.bandwidth)
                                        : 0.0;
    p.retrieval_decode_s = std::max(p.retrieval_bytes_read / bw, compute) + gathers;
  }
  const double n_s = (double)p.tokens_per_rank;
  const double rebuild = rebuild_flops_per_token_layer(hp, f) * hp.n_layer;
  p.decode_memory_s = (p.weight_bytes + p.cache_bytes_per_rank) / bw;
  p.decode_rebuild_s = (rebuild * n_s + attention_flops(hp, n_s) + block_flops_per_token(hp)) / flops;
  const int P = in.ranks;
  // GPU ranks gather (o, lse) partials (worker/attention_sum.h: the CUDA backend has no exact
  // accumulator), not the CPU backend's exact accumulator images.
  p.decode_merge_s = P > 1 ? hp.n_layer * (P - 1) * (in.network.latency_s + merge_bytes_o_lse(hp) / in.network.bandwidth)
                           : 0.0;
  p.decode_s = std::max(p.decode_memory_s, p.decode_rebuild_s) + p.decode_merge_s;

  // Prefill. Ring: every rank runs its shard through the blocks, attends 1/P of the causal
  // square, rebuilds every block it sees (X formats), and passes P-1 blocks per layer.
  const double n = (double)in.context;
  const double causal = attention_flops(hp, n * n / 2.0) / P;
  const double layer_block_bytes = p.cache_bytes_per_rank / hp.n_layer;
  const double ring_comm =
      P > 1 ? hp.n_layer * (P - 1) * (in.network.latency_s + layer_block_bytes / in.network.bandwidth) : 0.0;
  p.prefill_ring_s = (n_s * block_flops_per_token(hp) + causal + rebuild * n) / flops + ring_comm;
  // Star: blocks of b tokens see [anchor a | themselves]; a rank past the first also recomputes
  // the anchor (its blocks and causal square).
  const double b = (double)std::min<int64_t>(in.star_block, p.tokens_per_rank), a = b;
  const double blocks = n_s / b;
  const double star_attn = attention_flops(hp, blocks * (b * a + b * b / 2.0) + a * a / 2.0);
  const double star_rebuild = rebuild * (n_s + a);
  p.prefill_star_s = ((n_s + (P > 1 ? a : 0.0)) * block_flops_per_token(hp) + star_attn + star_rebuild) / flops;
  return p;
}

double kvquant_table_gib(const model_hparams& hp, int bits, double outlier_fraction, int64_t n) {
  const double d = hp.n_embd;
  const double bits_per_element = bits + (outlier_fraction > 0 ? outlier_fraction * 32.0 + 16.0 / d : 0.0);
  return (double)n * hp.n_layer * d * bits_per_element / 8.0 / (1024.0 * 1024.0 * 1024.0);
}

double xquant_ridge_length_mha(double ridge, double d, double e) {
  // P·(e/8·l·d + 24·d²) = 4·l·d²  =>  l = 24·P·d / (4·d − P·e/8)
  const double den = 4.0 * d - ridge * e / 8.0;
  return den > 0 ? 24.0 * ridge * d / den : INFINITY;
}

double xquant_ridge_length_gqa(double ridge, double d, double g, double e) {
  // P·(e/8·l·d/g + 26·d² + 4·(d/g)²) = 4·l·(d/g)²
  const double k = d / g;
  const double den = 4.0 * k * k - ridge * e / 8.0 * k;
  return den > 0 ? ridge * (26.0 * d * d + 4.0 * k * k) / den : INFINITY;
}

}  // namespace xctx
