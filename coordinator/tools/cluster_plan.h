// `xctx plan`: what a model, a context and a cluster add up to before anything runs -- per cache
// format the bytes per token, the cache and weights per GPU, whether it fits, the longest
// context that would, and a roofline projection of the decode step and the prefill
// (docs/scaling.md, "Planning"). Pure arithmetic on tables; nothing here touches a device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cache/format.h"
#include "model/hparams.h"
#include "worker/retrieval.h"

namespace xctx {

// One accelerator (or CPU) kind: memory, bandwidth and dense 16-bit peak, with where the
// figures come from.
struct device_spec {
  std::string name;
  double memory_bytes = 0;   // per device
  double bandwidth = 0;      // memory read bandwidth, bytes/s
  double peak_flops = 0;     // dense fp16/bf16 tensor FLOP/s (no sparsity)
  std::string source;
};
// One interconnect between the ranks: bandwidth per rank and direction, and the latency of one
// small collective step (assumed, see network_table's sources).
struct network_spec {
  std::string name;
  double bandwidth = 0;  // bytes/s
  double latency_s = 0;
  std::string source;
};
const std::vector<device_spec>& device_table();
const std::vector<network_spec>& network_table();
device_spec find_device(const std::string& name);    // throws listing the known names
network_spec find_network(const std::string& name);  // throws listing the known names

// Published model geometries (llama-2-7b = LLaMA-7B's shape; llama-3-8b; llama-3-70b;
// smollm2-135m, the embedded default).
struct model_preset {
  std::string name;
  model_hparams hp;
  std::string source;
};
const std::vector<model_preset>& model_presets();
// A preset name, a .gguf file (metadata only), or a Hugging Face directory / its config.json.
model_hparams plan_model_hparams(const std::string& model);

// Parameters of the dense transformer (embeddings and output included; norms and biases left
// out: < 0.1%).
double model_parameters(const model_hparams& hp);

// A CPU machine measured by benchmarks/scaling.py (one rank, at 1 thread and on all cores;
// docs/scaling.md). All ranks share its C cores. Per format and measured thread count t, as core
// seconds (wall x t): the decode step costs fixed + n·per_token per rank (n: that rank's tokens),
// the exact ring prefill lin·n + att·n² in all. A rank runs max(1, C / P) threads
// (default_threads) at the costs of the largest measured t not above that (ideal scaling past
// it), and min(C, P x threads) cores work at once. Each collective (a decode step's n_layer
// merges, the ring's P-1 steps per layer) adds the measured price of one. More ranks than cores
// take turns on them and lose time to it (waiting ranks polling, every collective step waiting
// for its peers to be scheduled, caches refilled after each switch): their work is multiplied by
// factors measured at some ranks per core (P / C), linear between those points and from 1 at
// P = C, extended past the last point along the last segment's slope.
struct cpu_format_costs {
  double decode_fixed_core_s = 0;      // per rank and step: the weights' matvecs, norms, logits
  double decode_core_s_per_token = 0;  // per cached token and step: attention over the cache
  double prefill_core_s_per_token = 0;
  double prefill_core_s_per_token2 = 0;
};
struct cpu_format_profile {
  std::vector<std::pair<int, cpu_format_costs>> by_threads;  // ascending thread counts
  const cpu_format_costs& at(int threads) const;  // the largest measured count <= threads (else the smallest)
};
struct cpu_profile {
  std::string machine, source;
  int cores = 0;
  double memory_bytes = 0;  // the machine's, shared by all its ranks
  int n_layer = 0, n_embd = 0;  // the model it was measured with
  double collective_s = 0;  // seconds per collective beyond the conserved work (optional)
  // P > C: measured time over conserved work, decode step and prefill (>= 1), at ranks per
  // core > 1, ascending (optional).
  struct turns_factors {
    double ranks_per_core = 1, decode = 1, prefill = 1;
  };
  std::vector<turns_factors> oversubscribed;
  turns_factors turns_at(double ranks_per_core) const;  // interpolated as above; 1s when P <= C
  // Ranks over several hosts that share these cores (benchmarks/scaling.py: network namespaces,
  // TCP between them): a collective's price across hosts, plus what each one adds per rank per
  // core past the first while ranks take turns (a collective step waits for a peer that is not
  // running, and the kernel's TCP work runs on the same cores). Optional.
  bool has_across_hosts = false;
  double across_collective_s = 0, across_turns_collective_s = 0;
  // One collective's price for `ranks` ranks over `hosts` hosts; throws when hosts > 1 and the
  // profile has no across-hosts calibration.
  double collective_price(int ranks, int hosts) const;
  std::vector<std::pair<cache_format, cpu_format_profile>> formats;
  const cpu_format_profile& costs(cache_format f) const;  // throws naming the formats it has
};
cpu_profile read_cpu_profile(const std::string& path);  // throws naming the file and field

struct plan_inputs {
  model_hparams hp;
  int64_t context = 0;  // tokens of the whole sequence
  int ranks = 1;        // one per device
  device_spec device;
  network_spec network;
  double weight_bits = 16;          // per parameter as the devices hold them
  double usable_fraction = 0.9;     // of device memory for weights + cache (the rest: runtime,
                                    // activations, workspaces)
  double bandwidth_efficiency = 0.8;  // achieved / peak memory bandwidth in the decode step
  double flops_efficiency = 0.5;      // achieved / peak FLOP/s in prefill GEMMs and rebuilds
  int64_t star_block = 4096;         // star prefill block (= anchor) tokens
  const cpu_profile* cpu = nullptr;  // set: project for this measured CPU machine instead of `device`
  int hosts = 1;                     // with cpu: hosts the ranks span (collectives cross them when > 1)
  // Set (contexts past the trained window): also project the decode step under retrieval
  // attention (worker/retrieval.h).
  const retrieval_options* retrieval = nullptr;
};

// One cache format's plan. Times are projections (roofline), not measurements.
struct format_plan {
  cache_format format;
  double bytes_per_token = 0;      // cache_bytes_per_token: K and V (or X), every layer
  int64_t tokens_per_rank = 0;
  double cache_bytes_per_rank = 0;
  double weight_bytes = 0;         // every rank holds the whole model
  bool fits = false;
  int64_t max_context = 0;         // longest sequence that fits on `ranks` devices
  // Decode step: weights and the rank's cache streamed once, K/V rebuild FLOPs (X formats)
  // hidden under the stream when smaller, plus one all-gather per layer.
  double decode_memory_s = 0, decode_rebuild_s = 0, decode_merge_s = 0, decode_s = 0;
  // Prefill: ring (exact) = local FLOPs + P-1 cache blocks passed per layer; star = local FLOPs
  // over [anchor | block] + the anchor recomputed on every rank.
  double prefill_ring_s = 0, prefill_star_s = 0;
  // Retrieval (plan_inputs::retrieval): the block summaries' bytes per token (inside
  // bytes_per_token's cache when on), the selection's all-gather per token and layer (each rank's
  // k (score, id) records), and a decode step on the fullest rank that reads the weights, the
  // min/max of its blocks' summaries and at most S + W + k·B tokens of its cache (all of the
  // sink, the local window and the selected blocks on one rank: a bound).
  double summary_bytes_per_token = 0, selection_bytes_per_token_layer = 0;
  double retrieval_bytes_read = 0;  // per decode step on the fullest rank
  double retrieval_decode_s = 0;
};
format_plan plan_format(const plan_inputs& in, cache_format f);

// Bytes one rank contributes per token and layer to the decode merge: xctx's exact accumulator
// (worker/sequence_parallel.h) and a plain (o, lse) merge of fp32.
double merge_bytes_exact(const model_hparams& hp);
double merge_bytes_o_lse(const model_hparams& hp);

// ---- the papers' own arithmetic, reproduced ---------------------------------------------------

// KVQuant (Hooper et al. 2024) Tables 1 and 6, GiB for n tokens: the tables count n_layer x
// n_embd elements per token -- one of K or V, half the K+V cache -- at `bits` each, plus, with
// outliers, 32 bits per sparse element (fp16 value + 16-bit index) and 16 bits per
// n_embd-vector; 1M = 10^6 tokens, GB = 2^30 bytes. Matches every LLaMA-7B entry of Table 6.
double kvquant_table_gib(const model_hparams& hp, int bits, double outlier_fraction, int64_t n);

// XQuant (Tomar et al. 2025) §3.4: the longest sequence whose K/V rematerialization stays under
// the ridge point P = peak FLOP/s / bandwidth, with the weights' memory traffic overlapping it.
// MHA (eq. 3): 4·l·d² / (e/8·l·d + 24·d²) = P. GQA (eq. 4, g query heads per kv head):
// 4·l·(d/g)² / (e/8·l·d/g + 26·d² + 4·(d/g)²) = P.
double xquant_ridge_length_mha(double ridge, double d, double e_bits);
double xquant_ridge_length_gqa(double ridge, double d, double g, double e_bits);

}  // namespace xctx
