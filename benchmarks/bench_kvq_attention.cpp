// Decode attention over one layer of each KV cache format (issue 4, "Measured"): does reading
// fewer, compressed bytes make decode attention faster than streaming fp16?
//
// One layer of SmolLM2 geometry (9 heads / 3 kv heads, head_dim 64, RoPE base 1e5) is filled
// with seeded synthetic keys and values shaped like real ones (pre-RoPE keys with a few
// large-magnitude outlier channels, roughly Gaussian values). The nuq formats get a synthetic
// calibration fitted the way `xctx calibrate` fits one (unweighted), from a separate sample of
// the same distribution, so no model is needed. Then, per shard length and thread count, one
// decode query (the position after the last key) is timed through kv_cache::attend on the CPU
// backend. Every timed call starts from cold caches (a flush buffer larger than the LLC is read
// first): in a real model the other layers evict a layer's cache between two decode steps.
//
// Timed per format, round-robin:
//   attend  the decode step (attend_path::attend_decode): the fused one-query kernel
//           (kernels/cpu/kvq/kvq_fused_avx2.cpp) for the quantized formats
//   tiled   the same query through the tiled kernel the prefill path uses (each unit decoded to
//           f32, outliers patched, keys rotated, then the f32 attention core): the kernel decode
//           steps ran before the fused one
// and, as the tiled kernel's two halves, built from its own pieces (kvq_impl.h,
// elementwise_attention_impl.h):
//   decode  codes -> f32 tiles with sparse outliers patched (no RoPE, no attention)
//   math    the attention core on f32 tiles already in cache (decode_block + tile merges),
//           format-independent
// The ceilings, measured in the same run per (length, threads): a memcpy of 512 MiB (reported
// as GB/s read, i.e. bytes copied / time) and a read-only stream of the same buffer.
//
// Output: CSV on stdout (benchmarks/kvq_attention.py turns it into results/), progress on stderr.
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/calibration.h"
#include "common/error.h"
#include "common/half.h"
#include "common/sys.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/kvq/kvq_impl.h"
#include "kernels/kv_quant.h"
#include "registry/registry.h"

namespace xctx {
namespace {

constexpr int kHead = 9, kHeadKv = 3, kHeadDim = 64, kChannels = kHeadKv * kHeadDim;
constexpr float kRopeBase = 1e5f;
constexpr uint64_t kSeed = 20240604;
constexpr int64_t kFillChunk = 8192;   // tokens generated and appended at a time
constexpr int64_t kCalibTokens = 16384;  // calibration sample (a different seed than the shard)
// The decode/math variants: tiles of 64 slots (the tiled kernel's decode tiles), chunks of at
// least 1024 slots, ~4 chunks per thread.
constexpr int kTile = 64;
constexpr int64_t kMinChunk = 1024;
constexpr size_t kFlushBytes = size_t{128} << 20;    // 4x the 32 MiB LLC
constexpr size_t kCeilingBytes = size_t{512} << 20;  // memcpy / read stream buffer

// ---- synthetic keys and values -----------------------------------------------------------

// Per-channel distribution of one layer. Pre-RoPE keys of Llama-family models carry a few
// channels per head with a large, consistently signed magnitude (the reason KIVI quantizes keys
// per channel and KVQuant normalizes them per channel); values are close to Gaussian per token.
struct synth_layer {
  std::vector<float> k_mean, k_std, v_std;  // [C]
  explicit synth_layer(uint64_t seed) : k_mean(kChannels), k_std(kChannels), v_std(kChannels) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> n01(0.0f, 1.0f);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int c = 0; c < kChannels; ++c) {
      k_mean[c] = 0.5f * n01(rng), k_std[c] = 0.5f + u(rng);
      v_std[c] = 0.5f + u(rng);
    }
    constexpr int kOutlierChannelsPerHead = 4;
    for (int h = 0; h < kHeadKv; ++h)
      for (int i = 0; i < kOutlierChannelsPerHead; ++i) {
        const int c = h * kHeadDim + (int)(u(rng) * kHeadDim) % kHeadDim;
        k_mean[c] = (u(rng) < 0.5f ? -1.0f : 1.0f) * (4.0f + 4.0f * u(rng));
        k_std[c] = 1.5f + 1.5f * u(rng);
      }
  }
  // Tokens [t0, t0 + n) of the stream `seed`: the same tokens whatever the chunking.
  void generate(uint64_t seed, int64_t t0, int64_t n, float* k /*[n, C]*/, float* v /*[n, C]*/) const {
    for (int64_t t = 0; t < n; ++t) {
      std::mt19937_64 rng(seed ^ ((uint64_t)(t0 + t) * 0x9E3779B97F4A7C15ull));
      std::normal_distribution<float> n01(0.0f, 1.0f);
      std::student_t_distribution<float> heavy(4.0f);  // occasional large keys beyond the channel's bulk
      for (int c = 0; c < kChannels; ++c) {
        k[t * kChannels + c] = k_mean[c] + k_std[c] * (c % 8 == 0 ? heavy(rng) : n01(rng));
        v[t * kChannels + c] = v_std[c] * n01(rng);
      }
    }
  }
};

// ---- synthetic calibration (as worker/calibrate.cpp fits it, unweighted) -------------------

std::shared_ptr<calibration> make_calibration(const synth_layer& syn) {
  const int64_t rows = kCalibTokens, C = kChannels;
  std::vector<float> k((size_t)(rows * C)), v((size_t)(rows * C));
  syn.generate(kSeed + 1, 0, rows, k.data(), v.data());
  auto cal = std::make_shared<calibration>();
  cal->model_name = "synthetic SmolLM2-135M layer";
  cal->n_layer = 1, cal->n_head_kv = kHeadKv, cal->head_dim = kHeadDim;
  cal->text_source = "synthetic", cal->weighting = "none";
  cal->n_samples = 1, cal->seq_len = (int)rows, cal->seed = kSeed + 1;
  std::vector<float> col((size_t)rows);
  for (int s = 0; s < kCalibSettings; ++s) {
    calib_layer_setting ls;
    ls.k_lo.resize(C), ls.k_hi.resize(C);
    const double f = kCalibOutlierFraction[s] / 2.0;  // per side: 0.5%/99.5% quantiles, or min/max
    for (int c = 0; c < C; ++c) {
      for (int64_t t = 0; t < rows; ++t) col[t] = k[t * C + c];
      std::sort(col.begin(), col.end());
      ls.k_lo[c] = col[(size_t)std::floor(f * (double)(rows - 1))];
      ls.k_hi[c] = col[(size_t)std::ceil((1.0 - f) * (double)(rows - 1))];
    }
    nuq_histogram hk, hv;
    for (int64_t t = 0; t < rows; ++t)
      for (int c = 0; c < C; ++c) {
        const float x = k[t * C + c], lo = ls.k_lo[c], hi = ls.k_hi[c];
        if (f > 0.0 && (x < lo || x > hi)) continue;  // kept sparse by the cache
        hk.add(kvq_normalize(x, 0.5f * (hi - lo), 0.5f * (hi + lo)), 1.0);
      }
    const int side = value_outliers_per_side(kCalibOutlierFraction[s], (int)C);
    std::vector<int> order((size_t)C);
    for (int64_t t = 1; t < rows; ++t) {  // t = 0 plays the attention sink
      const float* x = v.data() + t * C;
      for (int c = 0; c < C; ++c) order[c] = c;
      std::sort(order.begin(), order.end(), [&](int a, int b) { return x[a] < x[b] || (x[a] == x[b] && a < b); });
      const kvq_affine p = kvq_midrange_params(x[order[side]], x[order[C - 1 - side]]);
      for (int r = side; r < C - side; ++r)
        hv.add(kvq_normalize(x[order[r]], fp16_to_fp32(p.scale), fp16_to_fp32(p.zero)), 1.0);
    }
    for (int b = 0; b < 3; ++b) ls.k[b] = fit_nuq_datatype(hk, kCalibBits[b]), ls.v[b] = fit_nuq_datatype(hv, kCalibBits[b]);
    cal->layers[s].push_back(std::move(ls));
  }
  return cal;
}

// ---- the timed variants ----------------------------------------------------------------------

struct chunk_plan {
  int64_t n_chunk = 1, chunk = 0;
};
chunk_plan plan_chunks(int64_t kv_len) {
  const int64_t threads = omp_get_max_threads();
  chunk_plan p;
  p.n_chunk = std::clamp<int64_t>(threads == 1 ? 1 : 4 * threads, 1, std::max<int64_t>(1, kv_len / kMinChunk));
  p.chunk = ((kv_len + p.n_chunk - 1) / p.n_chunk + kTile - 1) / kTile * kTile;
  p.n_chunk = (kv_len + p.chunk - 1) / p.chunk;
  return p;
}

// Slots [s0, s0 + nt) decoded to f32 as the tiled kernel's decode_tile does it, minus RoPE.
void decode_tile_no_rope(bool avx2, const kvq_layer_view& L, int64_t s0, int nt, float* kt /*[nt, C]*/,
                         float* vt /*[nt, C]*/, std::vector<float>& sc, std::vector<float>& zc, int64_t& group) {
  const int C = L.channels();
  int r = 0;
  while (r < nt) {
    const int64_t s = s0 + r;
    if (s < L.n_sink || s >= L.q_end) {
      const uint16_t* ks = s < L.n_sink ? L.k_sink + s * C : L.k_tail + (s - L.q_end) * C;
      const uint16_t* vs = s < L.n_sink ? L.v_sink + s * C : L.v_tail + (s - L.q_end) * C;
      for (int c = 0; c < C; ++c) kt[(size_t)r * C + c] = fp16_to_fp32(ks[c]), vt[(size_t)r * C + c] = fp16_to_fp32(vs[c]);
      ++r;
      continue;
    }
    const int64_t i = s - L.n_sink;
    int64_t run = std::min<int64_t>(nt - r, L.q_end - s);
    const float *scp = L.k_ch_scale, *zcp = L.k_ch_zero;
    if (L.scheme == kvq_scheme::kvq_uniform) {
      const int64_t g = i / L.group;
      run = std::min<int64_t>(run, (g + 1) * L.group - i);
      if (group != g) {
        for (int c = 0; c < C; ++c) {
          const kvq_affine p = L.k_group[(size_t)g * C + c];
          sc[c] = fp16_to_fp32(p.scale), zc[c] = fp16_to_fp32(p.zero);
        }
        group = g;
      }
      scp = sc.data(), zcp = zc.data();
    }
    if (avx2) {
      cpu::impl::avx2::kvq_decode_keys(L, i, (int)run, scp, zcp, kt + (size_t)r * C);
      cpu::impl::avx2::kvq_decode_values(L, i, (int)run, vt + (size_t)r * C);
    } else {
      cpu::impl::kvq_decode_keys_scalar(L, i, (int)run, scp, zcp, kt + (size_t)r * C);
      cpu::impl::kvq_decode_values_scalar(L, i, (int)run, vt + (size_t)r * C);
    }
    for (int64_t q = 0; q < run; ++q) {
      float* kr = kt + (size_t)(r + q) * C;
      float* vr = vt + (size_t)(r + q) * C;
      if (L.k_out_off != nullptr)
        for (uint32_t e = L.k_out_off[i + q]; e < L.k_out_off[i + q + 1]; ++e)
          kr[L.k_out_idx[e]] += fp16_to_fp32(L.k_out_val[e]);
      const size_t vo = (size_t)(i + q) * L.v_out_per_tok;
      for (int e = 0; e < L.v_out_per_tok; ++e) vr[L.v_out_idx[vo + e]] += fp16_to_fp32(L.v_out_val[vo + e]);
    }
    r += (int)run;
  }
}

// The decode part alone over the whole layer; returns a checksum so nothing is optimized away.
double run_decode_only(const kvq_layer_view& L) {
  const bool avx2 = cpu::impl::best_isa() == cpu::impl::isa::isa_avx2;
  const int C = L.channels();
  const chunk_plan p = plan_chunks(L.n);
  double sum = 0.0;
#pragma omp parallel if (p.n_chunk > 1) reduction(+ : sum)
  {
    std::vector<float> kt((size_t)kTile * C), vt((size_t)kTile * C), sc(C), zc(C);
    int64_t group = -1;
#pragma omp for schedule(dynamic, 1)
    for (int64_t ch = 0; ch < p.n_chunk; ++ch) {
      const int64_t end = std::min(L.n, (ch + 1) * p.chunk);
      for (int64_t s0 = ch * p.chunk; s0 < end; s0 += kTile) {
        const int nt = (int)std::min<int64_t>(kTile, end - s0);
        decode_tile_no_rope(avx2, L, s0, nt, kt.data(), vt.data(), sc, zc, group);
        sum += kt[0] + vt[(size_t)(nt - 1) * C + C - 1];
      }
    }
  }
  return sum;
}

// The attention core the tiled kernel runs per tile, on an f32 tile already in cache, for as
// many tiles as a layer of kv_len slots has (merging tile partials like the kernel does).
double run_math_only(int64_t kv_len, const float* tile_k /*[kTile, C]*/, const float* tile_v /*[kTile, C]*/,
                     const float* qs /*[R, hd] scaled, kv-head order*/) {
  const cpu::impl::isa v = cpu::impl::best_isa();
  constexpr int R = kHead, hd = kHeadDim;
  const chunk_plan p = plan_chunks(kv_len);
  std::vector<float> o_parts((size_t)p.n_chunk * R * hd), lse_parts((size_t)p.n_chunk * R);
#pragma omp parallel if (p.n_chunk > 1)
  {
    std::vector<float> o_t((size_t)R * hd), lse_t(R), scratch((size_t)cpu::impl::decode_scratch_floats(R, hd));
    std::vector<int64_t> rel(R);
#pragma omp for schedule(dynamic, 1)
    for (int64_t ch = 0; ch < p.n_chunk; ++ch) {
      float* acc_o = o_parts.data() + (size_t)ch * R * hd;
      float* acc_lse = lse_parts.data() + (size_t)ch * R;
      std::fill(acc_o, acc_o + R * hd, 0.0f);
      std::fill(acc_lse, acc_lse + R, -INFINITY);
      const int64_t end = std::min(kv_len, (ch + 1) * p.chunk);
      for (int64_t s0 = ch * p.chunk; s0 < end; s0 += kTile) {
        const int nt = (int)std::min<int64_t>(kTile, end - s0);
        std::fill(rel.begin(), rel.end(), (int64_t)nt);
        cpu::impl::decode_job jb;
        jb.q = qs, jb.row_end = rel.data(), jb.R = R, jb.n_kvh = kHeadKv, jb.hd = hd;
        jb.k = tile_k, jb.v = tile_v, jb.type = kv_dtype::kv_f32, jb.ld = kChannels;
        jb.j0 = 0, jb.j1 = nt;
        jb.o = o_t.data(), jb.lse = lse_t.data(), jb.scratch = scratch.data();
        cpu::impl::decode_block(v, jb);
        for (int r = 0; r < R; ++r) {  // log-sum-exp merge of the tile into the chunk partial
          if (acc_lse[r] == -INFINITY) {
            std::copy(o_t.begin() + r * hd, o_t.begin() + (r + 1) * hd, acc_o + r * hd);
            acc_lse[r] = lse_t[r];
            continue;
          }
          const float m = std::max(acc_lse[r], lse_t[r]);
          const float wa = std::exp(acc_lse[r] - m), wb = std::exp(lse_t[r] - m), inv = 1.0f / (wa + wb);
          for (int d = 0; d < hd; ++d) acc_o[r * hd + d] = (acc_o[r * hd + d] * wa + o_t[r * hd + d] * wb) * inv;
          acc_lse[r] = m + std::log(wa + wb);
        }
      }
    }
  }
  std::vector<float> o((size_t)R * hd), lse(R);
  cpu::impl::merge_partials(v, o_parts.data(), lse_parts.data(), (int)p.n_chunk, R, hd, o.data(), lse.data());
  return o[0] + lse[0];
}

// Sanity check that the synthetic calibration and the data fit each other: the decoded
// (pre-RoPE) keys and values of the first tokens against the originals, as the RMS error over
// the RMS deviation from the channel mean (the spread a format has to resolve). fp16: 0.
void recon_error(const kvq_layer_view& L, const synth_layer& syn, int64_t n_check, double* k_err, double* v_err) {
  const bool avx2 = cpu::impl::best_isa() == cpu::impl::isa::isa_avx2;
  const int C = kChannels;
  std::vector<float> k((size_t)(n_check * C)), v(k.size()), kd(k.size()), vd(k.size()), sc(C), zc(C);
  syn.generate(kSeed, 0, n_check, k.data(), v.data());
  int64_t group = -1;
  for (int64_t s0 = 0; s0 < n_check; s0 += kTile) {
    const int nt = (int)std::min<int64_t>(kTile, n_check - s0);
    decode_tile_no_rope(avx2, L, s0, nt, kd.data() + s0 * C, vd.data() + s0 * C, sc, zc, group);
  }
  double ek = 0, sk = 0, ev = 0, sv = 0;
  for (int64_t t = 0; t < n_check; ++t)
    for (int c = 0; c < C; ++c) {
      const size_t i = (size_t)(t * C + c);
      ek += (kd[i] - k[i]) * (double)(kd[i] - k[i]), sk += (k[i] - syn.k_mean[c]) * (double)(k[i] - syn.k_mean[c]);
      ev += (vd[i] - v[i]) * (double)(vd[i] - v[i]), sv += v[i] * (double)v[i];
    }
  *k_err = std::sqrt(ek / sk), *v_err = std::sqrt(ev / sv);
}

// ---- memory ----------------------------------------------------------------------------------

// Reads a buffer several times the LLC with both cores so no cache level keeps the layer.
double flush_caches(const std::vector<uint64_t>& buf) {
  uint64_t s = 0;
#pragma omp parallel for num_threads(2) reduction(+ : s) schedule(static)
  for (size_t i = 0; i < buf.size(); ++i) s += buf[i];
  return (double)s;
}

double read_stream(const std::vector<uint64_t>& buf) {
  uint64_t s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
  for (size_t i = 0; i < buf.size(); ++i) s += buf[i];
  return (double)s;
}

void copy_stream(const std::vector<uint64_t>& src, std::vector<uint64_t>& dst) {
  const int nt = omp_get_max_threads();
  const size_t n = src.size();
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const size_t a = n * t / nt, b = n * (t + 1) / nt;
    std::memcpy(dst.data() + a, src.data() + a, (b - a) * sizeof(uint64_t));
  }
}

template <typename F>
double seconds(F&& f) {
  stopwatch sw;
  f();
  return sw.seconds();
}

double median(std::vector<double> x) {  // NaN when nothing was timed (--attend-only)
  if (x.empty()) return std::nan("");
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

long involuntary_switches() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_nivcsw;
}

volatile double g_sink = 0.0;  // keeps results of untimed-by-value work alive

// ---- the sweep -------------------------------------------------------------------------------

struct options {
  std::vector<int64_t> lengths = {8192, 65536, 524288};
  std::vector<std::string> formats = {"fp16", "kivi4", "kivi3", "kivi2", "nuq4", "nuq3", "nuq2",
                                      "nuq4-1%", "nuq3-1%", "nuq2-1%"};
  std::vector<int> threads;
  int rounds = 0;  // 0: by length
  int se_group = 1;  // SelfExtend: keys past the window at floor(pos / G) (1: off)
  int se_window = 1024;
  bool attend_only = false;  // time the decode step alone (the tiled, decode and math columns stay empty)
  bool warm = false;  // no cache flush before the decode step (its compute alone where the shard fits the LLC)
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

options parse_args(int argc, char** argv) {
  options o;
  o.threads = {default_threads(), 1};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      XCTX_CHECK(i + 1 < argc, "bench_kvq_attention: ", a, " needs a value");
      return argv[++i];
    };
    if (a == "--quick") {
      o.lengths = {8192, 65536};
    } else if (a == "--lengths") {
      o.lengths.clear();
      for (const std::string& s : split(value())) o.lengths.push_back(parse_count(s, "--lengths"));
    } else if (a == "--formats") {
      o.formats = split(value());
    } else if (a == "--threads") {
      o.threads.clear();
      for (const std::string& s : split(value())) o.threads.push_back((int)parse_count(s, "--threads"));
    } else if (a == "--rounds") {
      o.rounds = (int)parse_count(value(), "--rounds");
    } else if (a == "--selfextend") {
      o.se_group = (int)parse_count(value(), "--selfextend");
    } else if (a == "--window") {
      o.se_window = (int)parse_count(value(), "--window");
    } else if (a == "--attend-only") {
      o.attend_only = true;
    } else if (a == "--warm") {
      o.warm = true;
    } else {
      fail("bench_kvq_attention: unknown argument '", a,
           "' (known: --quick, --lengths 8K,64K,512K, --formats fp16,kivi3,..., --threads 2,1, --rounds N, "
           "--selfextend G, --window W, --attend-only, --warm)");
    }
  }
  XCTX_CHECK(!o.formats.empty() && o.formats[0] == "fp16", "bench_kvq_attention: --formats must start with fp16 (the baseline)");
  for (const std::string& f : o.formats) parse_cache_format(f);  // throws listing the valid names
  return o;
}

int rounds_for(int64_t n) { return n <= 8192 ? 51 : (n <= 65536 ? 25 : 15); }

struct cache_entry {
  std::string name;
  std::unique_ptr<kv_cache> cache;
  bool quantized = false;
  double k_err = 0.0, v_err = 0.0;  // reconstruction error (see recon_error)
};

void run(const options& opt) {
  auto be = make_backend(backend_kind::backend_cpu);
  const synth_layer syn(kSeed);
  const auto cal = make_calibration(syn);
  cache_geometry g;
  g.n_layer = 1, g.n_head = kHead, g.n_head_kv = kHeadKv, g.head_dim = kHeadDim, g.n_embd = kHead * kHeadDim;
  g.rope.head_dim = kHeadDim, g.rope.n_rot = kHeadDim, g.rope.freq_base = kRopeBase;
  if (opt.se_group > 1) g.rope.se_group = opt.se_group, g.rope.se_window = opt.se_window;

  std::vector<uint64_t> flush_buf(kFlushBytes / 8, 1), src(kCeilingBytes / 8, 3), dst(kCeilingBytes / 8, 0);
  std::mt19937_64 rng(kSeed + 2);
  std::normal_distribution<float> n01(0.0f, 1.0f);
  std::vector<float> q((size_t)kHead * kHeadDim);
  for (float& x : q) x = n01(rng);
  // The math variant's query rows in kv-head order, pre-scaled (as the kernel prepares them),
  // and one tile of decoded-looking keys/values.
  std::vector<float> qs(q.size()), tile_k((size_t)kTile * kChannels), tile_v((size_t)kTile * kChannels);
  for (size_t i = 0; i < q.size(); ++i) qs[i] = q[i] / std::sqrt((float)kHeadDim);
  syn.generate(kSeed + 3, 0, kTile, tile_k.data(), tile_v.data());

  // The fused decode kernel has a 16-lane variant; everything else runs at most AVX2.
  const char* fused_isa = cpu::has_avx512() ? "avx512" : cpu::impl::isa_name(cpu::impl::best_isa());
  std::printf("# isa=%s fused_isa=%s default_threads=%d flush_MiB=%zu ceiling_MiB=%zu seed=%llu selfextend_G=%d W=%d\n",
              cpu::impl::isa_name(cpu::impl::best_isa()), fused_isa, default_threads(), kFlushBytes >> 20,
              kCeilingBytes >> 20, (unsigned long long)kSeed, opt.se_group, opt.se_group > 1 ? opt.se_window : 0);
  std::printf("format,tokens,threads,bytes_used,fp16_bytes,key_outliers,attend_ms,attend_min_ms,tiled_ms,decode_ms,"
              "math_ms,memcpy_read_GBps,read_GBps,k_rel_err,v_rel_err,rounds\n");
  std::fflush(stdout);

  for (const int64_t n : opt.lengths) {
    stopwatch fill_sw;
    g.capacity = n;
    std::vector<cache_entry> caches;
    for (const std::string& name : opt.formats) {
      cache_options co;
      co.calib = cal;
      cache_entry e;
      e.name = name;
      const cache_format f = parse_cache_format(name);
      e.quantized = format_traits(f).family != cache_family::family_fp;
      e.cache = make_cache(cache_spec(f, co), g, *be);
      caches.push_back(std::move(e));
    }
    {
      std::vector<float> k((size_t)(kFillChunk * kChannels)), v(k.size());
      std::vector<int32_t> pos((size_t)kFillChunk);
      for (int64_t t0 = 0; t0 < n; t0 += kFillChunk) {
        const int64_t m = std::min(kFillChunk, n - t0);
        syn.generate(kSeed, t0, m, k.data(), v.data());
        for (int64_t i = 0; i < m; ++i) pos[i] = (int32_t)(t0 + i);
        layer_input in;
        in.k = k.data(), in.v = v.data(), in.pos = pos.data(), in.n = m;
        for (cache_entry& e : caches) e.cache->append(0, in);
      }
    }
    const size_t fp16_bytes = caches[0].cache->bytes_used();
    for (cache_entry& e : caches)
      if (e.quantized) recon_error(quant_cache_view(*e.cache, 0), syn, std::min<int64_t>(n, 8192), &e.k_err, &e.v_err);
    std::fprintf(stderr, "[%lld tokens] filled %zu caches in %.1f s\n", (long long)n, caches.size(), fill_sw.seconds());
    const int32_t q_pos = (int32_t)n;
    std::vector<float> o((size_t)kHead * kHeadDim), lse(kHead);

    for (const int nt : opt.threads) {
      omp_set_num_threads(nt);
      stopwatch block_sw;
      const long ctx_switches0 = involuntary_switches();
      std::vector<double> t_copy, t_read;
      for (int r = 0; r < 5; ++r) {
        t_copy.push_back(seconds([&] { copy_stream(src, dst); }));
        t_read.push_back(seconds([&] { g_sink = read_stream(src); }));
      }
      const double copy_gbps = (double)kCeilingBytes / median(t_copy) / 1e9;
      const double read_gbps = (double)kCeilingBytes / median(t_read) / 1e9;

      const size_t nf = caches.size();
      std::vector<std::vector<double>> t_att(nf), t_tile(nf), t_dec(nf);
      std::vector<double> t_math;
      const int rounds = opt.rounds > 0 ? opt.rounds : rounds_for(n);
      // Round-robin over formats so load changes on the shared machine hit every format alike;
      // round 0 is the warm-up (page faults, RoPE tables, thread pool).
      for (int r = 0; r <= rounds; ++r) {
        for (size_t fi = 0; fi < nf; ++fi) {
          cache_entry& e = caches[fi];
          if (!opt.warm) g_sink = flush_caches(flush_buf);
          const double ta = seconds([&] { e.cache->attend(0, q.data(), &q_pos, 1, o.data(), lse.data(), attend_path::attend_decode); });
          if (r > 0) t_att[fi].push_back(ta);
          if (opt.attend_only) continue;
          g_sink = flush_caches(flush_buf);
          const double tt = seconds([&] { e.cache->attend(0, q.data(), &q_pos, 1, o.data(), lse.data(), attend_path::attend_prefill); });
          if (r > 0) t_tile[fi].push_back(tt);
          if (e.quantized) {
            const kvq_layer_view view = quant_cache_view(*e.cache, 0);
            g_sink = flush_caches(flush_buf);
            double chk = 0.0;
            const double td = seconds([&] { chk = run_decode_only(view); });
            g_sink = chk;
            if (r > 0) t_dec[fi].push_back(td);
          }
        }
        if (opt.attend_only) continue;
        double chk = 0.0;
        const double tm = seconds([&] { chk = run_math_only(n, tile_k.data(), tile_v.data(), qs.data()); });
        g_sink = chk;
        if (r > 0) t_math.push_back(tm);
      }
      const double math_ms = 1e3 * median(t_math);
      for (size_t fi = 0; fi < nf; ++fi) {
        const cache_entry& e = caches[fi];
        const int64_t key_out = e.quantized ? quant_cache_key_outliers(*e.cache) : 0;
        std::printf("%s,%lld,%d,%zu,%zu,%lld,%.4f,%.4f,%.4f,%s,%.4f,%.2f,%.2f,%.4f,%.4f,%d\n", e.name.c_str(),
                    (long long)n, nt, e.cache->bytes_used(), fp16_bytes, (long long)key_out, 1e3 * median(t_att[fi]),
                    1e3 * *std::min_element(t_att[fi].begin(), t_att[fi].end()), 1e3 * median(t_tile[fi]),
                    e.quantized ? std::to_string(1e3 * median(t_dec[fi])).c_str() : "", math_ms, copy_gbps, read_gbps,
                    e.k_err, e.v_err, rounds);
      }
      std::fflush(stdout);
      // Involuntary context switches of this process during the block: other work on the two
      // cores shows up here (an idle machine gives a handful).
      std::printf("# block tokens=%lld threads=%d seconds=%.1f involuntary_switches=%ld\n", (long long)n, nt,
                  block_sw.seconds(), involuntary_switches() - ctx_switches0);
      std::fflush(stdout);
      std::fprintf(stderr, "[%lld tokens, %d threads] %d rounds in %.1f s (memcpy %.1f GB/s read, read %.1f GB/s)\n",
                   (long long)n, nt, rounds, block_sw.seconds(), copy_gbps, read_gbps);
    }
  }
}

}  // namespace
}  // namespace xctx

int main(int argc, char** argv) {
  try {
    xctx::run(xctx::parse_args(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_kvq_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
