// Decode-step cost of the X caches (issue 5): per format and shard length, one layer of SmolLM2
// geometry (n_embd 576, 9 / 3 heads, head_dim 64), the FLOPs and bytes of one decode query, the
// measured time of kv_cache::attend on the CPU backend, and where on this CPU the rebuild turns
// compute-bound.
//
// Weights are random matrices of the model's shapes (the SVD costs and the rebuild FLOPs do not
// depend on their values); the layer inputs are a synthetic residual stream. The ceilings are
// measured in the same run: sgemm GFLOP/s at the rebuild's tile shape (64 x 192 x 192, one
// thread per core, the way the decode kernel calls it) and at a large square shape, and the
// read bandwidth of a 256 MiB stream.
//
// "Compute-bound" follows XQuant §3.4 (Eq. 3/4): a decode step of one layer loads the layer's
// weights (Q4_1 here) and the cache and performs the rebuild; with F FLOPs and B cache bytes per
// token, W weight bytes and the machine's ridge point P = FLOP/s / (byte/s), the step is compute-
// bound from l* = P W / (F - P B) tokens on (never when F / B <= P).
//
// Usage: bench_x_rebuild [--lengths 1024,8192,65536] [--reps N] [--out-dir benchmarks/results]
//                        [--selfextend G --window W]
// With --selfextend the decode query sees its last W tokens at exact positions and the rest at
// SelfExtend's grouped ones (the long runs' setting past the trained window); results go to
// x_rebuild_selfextend.{csv,md}. The FLOP and byte columns stay the plain rebuild's accounting.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/x_cache.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "registry/registry.h"

namespace xctx {
namespace {

constexpr int kLayers = 4;  // xquant-cl needs a base below the timed layer; the last one is timed
constexpr int kD = 576, kHead = 9, kHeadKv = 3, kHd = 64, kKv = kHeadKv * kHd;
constexpr int kFf = 1536;
constexpr uint64_t kSeed = 20250601;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

int g_se_group = 1, g_se_window = 0;  // --selfextend G --window W

cache_geometry geometry(int64_t cap) {
  cache_geometry g;
  g.rope.se_group = g_se_group, g.rope.se_window = g_se_window;
  g.n_layer = kLayers, g.n_head = kHead, g.n_head_kv = kHeadKv, g.head_dim = kHd, g.n_embd = kD;
  g.rope.head_dim = kHd, g.rope.n_rot = kHd, g.rope.freq_base = 1e5f;
  g.capacity = cap;
  return g;
}

struct model {
  model_weights w;
  std::vector<std::vector<float>> mats;
};
model make_model() {
  model m;
  m.w.hp.n_layer = kLayers, m.w.hp.n_embd = kD, m.w.hp.n_head = kHead, m.w.hp.n_head_kv = kHeadKv;
  m.w.hp.head_dim = kHd;
  m.mats.resize(2 * kLayers);
  std::mt19937 rng(kSeed);
  std::normal_distribution<float> nd;
  m.w.layers.resize(kLayers);
  for (int l = 0; l < kLayers; ++l)
    for (int k = 0; k < 2; ++k) {
      auto& a = m.mats[2 * l + k];
      a.resize((size_t)kKv * kD);
      for (float& x : a) x = nd(rng) / std::sqrt((float)kD);
      weight_view& v = k == 0 ? m.w.layers[l].wk : m.w.layers[l].wv;
      v.type = ggml_type::ggml_f32, v.n_rows = kKv, v.n_cols = kD, v.data = a.data();
    }
  return m;
}

// Per-token work of one decode query at one layer (multiply-add = 2 FLOPs).
struct cost {
  double flops = 0;         // what this implementation does
  double flops_paper = 0;   // XQuant §3.4's count (K and V both rebuilt)
  double extra_bytes = 0;   // bytes beyond the stored cache (the cl accumulator's traffic)
};
cost per_token_cost(cache_format f) {
  const double attn = 2.0 * kHead * kHd * 2;  // q·k and p·v
  cost c;
  switch (format_traits(f).family) {
    case cache_family::family_fp:
    case cache_family::family_kivi:
    case cache_family::family_nuq: c.flops = c.flops_paper = attn; return c;
    case cache_family::family_clkv: c.flops = c.flops_paper = 2.0 * kHead * kHd + 2.0 * kHead * kKv; return c;
    case cache_family::family_xquant:  // K = z·ΣBᵀ (r x kv), V absorbed: u += p z (per query head)
      c.flops = 2.0 * kKv * kKv + 2.0 * kHead * kHd + 2.0 * kHead * kKv;
      c.flops_paper = 2 * 2.0 * kKv * kKv + attn;
      return c;
    case cache_family::family_xquant_cl:  // X̂ += δ·U_kvᵀ (2kv x d), K = X̂·W_k (d x kv), V absorbed in X̂
      c.flops = 2.0 * (2 * kKv) * kD + 2.0 * kD * kKv + 2.0 * kHead * kHd + 2.0 * kHead * kD;
      c.flops_paper = 2.0 * 4 * kKv * kD + attn;
      c.extra_bytes = 3.0 * kD * 4;  // accumulator read + written by the update, read by the rebuild
      return c;
  }
  return c;
}

// Stored bytes per token of the timed layer (xquant-cl: a delta layer; the others are uniform).
double layer_bytes_per_token(cache_format f) {
  cache_options o;
  o.cl_hi_layers = 1;
  const cache_geometry g = geometry(1);
  if (format_traits(f).family == cache_family::family_xquant_cl) {
    const int ch = xquant_cl_channels(g, o, kLayers - 1), G = o.group_size;
    return (double)ch * format_traits(f).bits_per_element / 8 + (double)((ch + G - 1) / G) * 4 + 4.0 / kLayers;
  }
  return cache_bytes_per_token(cache_spec(f, o), g) / kLayers;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Read bandwidth (GB/s) of a buffer larger than the LLC, all threads.
double read_bandwidth() {
  const size_t n = (size_t{256} << 20) / sizeof(float);
  std::vector<float> buf(n, 1.0f);
  std::vector<double> t;
  double sink = 0;
  for (int r = 0; r < 5; ++r) {
    const double t0 = now();
    float s = 0;  // float + simd: the sum vectorizes, so the loop is limited by the reads
#pragma omp parallel for simd reduction(+ : s) schedule(static)
    for (int64_t i = 0; i < (int64_t)n; ++i) s += buf[i];
    t.push_back(now() - t0);
    sink += s;
  }
  if (sink == 42) std::printf(" ");
  return n * sizeof(float) / median(t) / 1e9;
}

// sgemm GFLOP/s: the rebuild tile (64 x 192 x 192) run by every thread at once with OpenBLAS
// pinned to one thread (as the decode kernel does), and a large square product.
void gemm_ceilings(double& tile_gflops, double& big_gflops) {
  const int M = 64, N = kKv, K = kKv;
  const int threads = omp_get_max_threads(), reps = 2000;
  const int blas = openblas_get_num_threads();
  openblas_set_num_threads(1);
  std::vector<double> t;
  for (int r = 0; r < 3; ++r) {
    const double t0 = now();
#pragma omp parallel
    {
      std::vector<float> a((size_t)M * K, 0.5f), b((size_t)K * N, 0.25f), c((size_t)M * N);
      for (int i = 0; i < reps; ++i)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N);
    }
    t.push_back(now() - t0);
  }
  openblas_set_num_threads(blas);
  tile_gflops = 2.0 * M * N * K * reps * threads / median(t) / 1e9;
  const int S = 1536;
  std::vector<float> a((size_t)S * S, 0.5f), b((size_t)S * S, 0.25f), c((size_t)S * S);
  t.clear();
  for (int r = 0; r < 3; ++r) {
    const double t0 = now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, S, S, S, 1.0f, a.data(), S, b.data(), S, 0.0f, c.data(), S);
    t.push_back(now() - t0);
  }
  big_gflops = 2.0 * S * S * S / median(t) / 1e9;
}

// Bytes of one layer's weights in SmolLM2's Q4_1 file (20 bytes per 32 weights) plus its norms.
double layer_weight_bytes() {
  const double params = 2.0 * kD * kD + 2.0 * kKv * kD + 3.0 * kFf * kD;
  return params * 20.0 / 32.0 + 2.0 * kD * 4;
}

struct row {
  std::string format;
  int64_t n = 0;
  double flops = 0, flops_paper = 0, bytes = 0, ms = 0;
};

}  // namespace
}  // namespace xctx

int main(int argc, char** argv) {
  using namespace xctx;
  std::vector<int64_t> lengths = {1024, 8192, 65536};
  int reps = 5;
  std::string out_dir = "benchmarks/results";
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (i + 1 == argc || a.rfind("--", 0) != 0) {
      std::fprintf(stderr, "usage: %s [--lengths N,N,...] [--reps R] [--out-dir DIR] [--selfextend G --window W]\n",
                   argv[0]);
      return 2;
    }
    if (a == "--lengths") {
      lengths.clear();
      std::stringstream ss(argv[i + 1]);
      std::string tok;
      while (std::getline(ss, tok, ',')) lengths.push_back(std::stoll(tok));
    } else if (a == "--reps") {
      reps = std::stoi(argv[i + 1]);
    } else if (a == "--out-dir") {
      out_dir = argv[i + 1];
    } else if (a == "--selfextend") {
      g_se_group = std::stoi(argv[i + 1]);
    } else if (a == "--window") {
      g_se_window = std::stoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (g_se_group < 1 || g_se_window < 0) {
    std::fprintf(stderr, "--selfextend needs G >= 1 and --window W >= 0\n");
    return 2;
  }
  const model m = make_model();
  std::shared_ptr<const x_factors> fl = build_x_factors(m.w, x_factor_kind::xf_latent);
  std::shared_ptr<const x_factors> fc = build_x_factors(m.w, x_factor_kind::xf_cross_layer);
  double bw = read_bandwidth(), tile_gf = 0, big_gf = 0;
  gemm_ceilings(tile_gf, big_gf);
  const double ridge = tile_gf / bw;
  std::fprintf(stderr, "threads %d: read %.1f GB/s, sgemm tile %.1f GFLOP/s, large %.1f GFLOP/s, ridge %.1f FLOP/B\n",
               omp_get_max_threads(), bw, tile_gf, big_gf, ridge);
  auto be = make_backend(backend_kind::backend_cpu);
  const std::vector<cache_format> formats = {cache_format::cache_fp16,       cache_format::cache_kivi2,
                                             cache_format::cache_xquant4,    cache_format::cache_xquant2,
                                             cache_format::cache_xquant_cl2, cache_format::cache_clkv};
  std::vector<row> rows;
  std::mt19937 rng(kSeed + 1);
  std::normal_distribution<float> nd;
  for (int64_t n : lengths) {
    // The residual stream: X_{l+1} = X_l + 0.15 N(0,1), generated in chunks (K/V = X·Wᵀ, unused by
    // the X formats but needed by the KV ones; random is as good here).
    const int64_t chunk = 4096;
    std::vector<float> x0((size_t)chunk * kD), xl((size_t)chunk * kD), kv((size_t)chunk * kKv);
    std::vector<int32_t> pos((size_t)n + 1);
    for (int64_t i = 0; i <= n; ++i) pos[i] = (int32_t)i;
    for (cache_format f : formats) {
      cache_options o;
      o.cl_hi_layers = 1;  // the timed layer (3) is a delta layer over base 0
      if (format_traits(f).family == cache_family::family_xquant) o.factors = fl;
      if (format_traits(f).family == cache_family::family_xquant_cl) o.factors = fc;
      const cache_spec spec(f, o);
      auto c = make_cache(spec, geometry(n + 1), *be);
      std::mt19937 gen(kSeed + 7);
      for (int64_t at = 0; at < n; at += chunk) {
        const int64_t mm = std::min(chunk, n - at);
        for (int64_t e = 0; e < mm * kD; ++e) x0[e] = nd(gen);
        for (int64_t e = 0; e < mm * kKv; ++e) kv[e] = nd(gen);
        xl = x0;
        for (int l = 0; l < kLayers; ++l) {
          if (l > 0)
            for (int64_t e = 0; e < mm * kD; ++e) xl[e] += 0.15f * nd(gen);
          c->append(l, layer_input{xl.data(), kv.data(), kv.data(), pos.data() + at, mm});
        }
      }
      const int layer = kLayers - 1;
      std::vector<float> q((size_t)kHead * kHd), o_((size_t)kHead * kHd), lse(kHead);
      for (float& v : q) v = 0.3f * nd(rng);
      const int32_t qp = (int32_t)n;
      std::vector<double> t;
      for (int r = 0; r < reps + 1; ++r) {
        c->attend(layer - 1, q.data(), &qp, 1, o_.data(), lse.data(), attend_path::attend_decode);  // cl: accumulator at layer - 1
        const double t0 = now();
        c->attend(layer, q.data(), &qp, 1, o_.data(), lse.data(), attend_path::attend_decode);
        if (r > 0) t.push_back(now() - t0);  // first call warms tables and buffers
      }
      const cost k = per_token_cost(f);
      const double cache_bytes = layer_bytes_per_token(f) * n;
      row rw;
      rw.format = format_traits(f).name, rw.n = n;
      rw.flops = k.flops * n, rw.flops_paper = k.flops_paper * n;
      rw.bytes = cache_bytes + k.extra_bytes * n;
      rw.ms = median(t) * 1e3;
      std::fprintf(stderr, "%-10s n=%6lld  %8.3f ms  %7.2f GFLOP/s  %7.2f GB/s\n", rw.format.c_str(), (long long)n, rw.ms,
                   rw.flops / rw.ms / 1e6, rw.bytes / rw.ms / 1e6);
      rows.push_back(rw);
    }
  }
  const double wbytes = layer_weight_bytes();
  const std::string stem = out_dir + (g_se_group > 1 ? "/x_rebuild_selfextend" : "/x_rebuild");
  const std::string csv_path = stem + ".csv", md_path = stem + ".md";
  std::ofstream csv(csv_path), md(md_path);
  XCTX_CHECK(csv && md, "cannot write ", csv_path, " / ", md_path);
  csv << "format,tokens,flops,flops_paper,bytes,ms,gflops,gbps,intensity,threads,read_gbps,tile_gflops,big_gflops\n";
  md << "# Decode-step rebuild cost of the X caches (one layer, SmolLM2 geometry)\n\n";
  md << "Command: `build/benchmarks/bench_x_rebuild"
     << (g_se_group > 1 ? " --selfextend " + std::to_string(g_se_group) + " --window " + std::to_string(g_se_window)
                        : std::string())
     << "` (" << omp_get_max_threads()
     << " threads). Ceilings measured in the same run: read bandwidth " << bw << " GB/s, sgemm " << tile_gf
     << " GFLOP/s at the rebuild tile (64x192x192, one per thread), " << big_gf
     << " GFLOP/s at 1536^3; ridge point P = " << ridge << " FLOP/byte.\n\n";
  md << "FLOPs = this implementation (K rebuilt, V absorbed); paper = XQuant §3.4's count (K and V rebuilt). "
        "Bytes = the layer's stored cache (+ the xquant-cl accumulator traffic, 3 x n_embd x 4 bytes per token).\n\n";
  if (g_se_group > 1)
    md << "With SelfExtend (G " << g_se_group << ", W " << g_se_window
       << ") the xquant formats absorb the grouped keys into turned queries (docs/x_formats.md): the MFLOP, "
          "GFLOP/s and FLOP/byte columns still count the plain rebuild, not what ran; compare the ms column "
          "with x_rebuild.md or a run of an older binary.\n\n";
  md << "| format | tokens | MFLOP | MFLOP (paper) | MB read | ms | GFLOP/s | GB/s | FLOP/byte |\n";
  md << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  char buf[512];
  for (const row& r : rows) {
    const double inten = r.flops / r.bytes;
    csv << r.format << "," << r.n << "," << r.flops << "," << r.flops_paper << "," << r.bytes << "," << r.ms << ","
        << r.flops / r.ms / 1e6 << "," << r.bytes / r.ms / 1e6 << "," << inten << "," << omp_get_max_threads() << ","
        << bw << "," << tile_gf << "," << big_gf << "\n";
    std::snprintf(buf, sizeof buf, "| %s | %lld | %.1f | %.1f | %.2f | %.3f | %.2f | %.2f | %.1f |\n", r.format.c_str(),
                  (long long)r.n, r.flops / 1e6, r.flops_paper / 1e6, r.bytes / 1e6, r.ms, r.flops / r.ms / 1e6,
                  r.bytes / r.ms / 1e6, inten);
    md << buf;
  }
  md << "\n## Where the rebuild turns compute-bound (XQuant Eq. 3/4 with this CPU's ridge point)\n\n";
  md << "Per token: F FLOPs, B cache bytes; per layer step: W = " << wbytes / 1e6
     << " MB of Q4_1 weights. Compute-bound from l* = P W / (F - P B) tokens (never if F/B <= P).\n\n";
  md << "| format | F (FLOP/token) | B (byte/token) | F/B | l* (tokens) |\n|---|---:|---:|---:|---:|\n";
  for (cache_format f : formats) {
    const double B = layer_bytes_per_token(f) + per_token_cost(f).extra_bytes;
    const double F = per_token_cost(f).flops;
    const double denom = F - ridge * B;
    std::snprintf(buf, sizeof buf, "| %s | %.0f | %.1f | %.1f | %s |\n", format_traits(f).name, F, B, F / B,
                  denom > 0 ? std::to_string((long long)std::llround(ridge * wbytes / denom)).c_str() : "never");
    md << buf;
  }
  std::fprintf(stderr, "wrote %s and %s\n", csv_path.c_str(), md_path.c_str());
  return 0;
}
