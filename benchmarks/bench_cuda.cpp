// The CUDA backend's speed on one device, for the device check (launch/device-check): decode
// attention per cache format over 1M and 10M keys of one layer (SmolLM2's 9/3 heads of 64), as
// GB/s of the cache's bytes against the device's measured copy bandwidth; the matrix-vector
// product and a 512-token GEMM; and a whole decode step of a SmolLM2-shaped synthetic model with
// CUDA graphs on and off, interleaved A/B. Writes cuda_bench.csv and cuda_bench.md to --out.
//
// Usage: bench_cuda [--out DIR] [--keys 1048576,10485760] [--quick]
// Every timing is the median of --reps calls after two warm-ups, each call ended by a device
// synchronize (the backend's stream), so launch latency is included as a user would see it.
// Caches are filled with four distinct random chunks of 64K tokens repeated (their positions
// increase): attention reads every byte whatever the values.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cache/cache.h"
#include "cache/format.h"
#include "cache/quant_test_util.h"  // make_synthetic_calibration (tests/cache)
#include "cache/x_factors.h"
#include "common/error.h"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"
#include "model/gguf_writer.h"
#include "model/weights.h"
#include "registry/registry.h"
#include "worker/llama_engine.h"

namespace xctx {
namespace {

using clock_type = std::chrono::steady_clock;

struct row {
  std::string what, format;
  int64_t keys = 0;
  double ms = 0, bytes = 0, flops = 0;
  std::string note;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Milliseconds of one call, median of reps after two warm-ups.
double time_ms(backend& be, int reps, const std::function<void()>& f) {
  for (int i = 0; i < 2; ++i) f();
  be.synchronize();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = clock_type::now();
    f();
    be.synchronize();
    t.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
  }
  return median(t);
}

std::vector<float> random_floats(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

struct device_buffer {
  backend& be;
  void* p;
  device_buffer(backend& b, size_t bytes) : be(b), p(b.alloc(bytes)) {}
  template <typename T>
  device_buffer(backend& b, const std::vector<T>& host) : device_buffer(b, host.size() * sizeof(T)) {
    b.upload(p, host.data(), host.size() * sizeof(T));
  }
  ~device_buffer() { be.free(p); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

model_hparams smollm2_shape(int n_layer) {
  model_hparams hp;
  hp.arch = "llama";
  hp.name = "smollm2-shaped synthetic";
  hp.n_layer = n_layer;
  hp.n_embd = 576;
  hp.n_ff = 1536;
  hp.n_head = 9;
  hp.n_head_kv = 3;
  hp.head_dim = 64;
  hp.n_rot = 64;
  hp.n_vocab = 49152;
  hp.n_ctx_train = 8192;
  hp.rms_eps = 1e-5f;
  hp.rope_freq_base = 100000.0f;
  hp.tied_output = true;
  return hp;
}

model_weights synthetic_model(const model_hparams& hp, const std::filesystem::path& dir) {
  const auto path = dir / ("bench_cuda_" + std::to_string(hp.n_layer) + "l.gguf");
  make_tiny_model_writer(hp, ggml_type::ggml_q4_1, 7).write(path.string());
  return load_model(path.string());
}

// Device read bandwidth as a device-to-device copy of 2 GiB measures it (bytes read + written).
double copy_gbps(backend& be) {
  const size_t bytes = size_t(2) << 30;
  device_buffer a(be, bytes), b(be, bytes);
  const double ms = time_ms(be, 5, [&] { be.copy(b.p, a.p, bytes); });
  return 2.0 * (double)bytes / (ms * 1e6);
}

// Decode attention of one query over n_keys cached tokens of one layer in `fmt`.
row attention_row(backend& be, cache_format fmt, int64_t n_keys, const model_weights& w1, int reps) {
  const model_hparams& hp = w1.hp;
  cache_geometry g;
  g.n_layer = 1, g.n_head = hp.n_head, g.n_head_kv = hp.n_head_kv, g.head_dim = hp.head_dim, g.n_embd = hp.n_embd;
  g.rope.head_dim = hp.head_dim, g.rope.n_rot = hp.n_rot, g.rope.freq_base = hp.rope_freq_base;
  g.capacity = n_keys;
  cache_options o;
  if (format_traits(fmt).needs_calibration) o.calib = test::make_synthetic_calibration(g, 3);
  if (format_needs_x_factors(fmt)) o.factors = build_x_factors(w1, x_factor_kind_for(fmt));
  auto cache = make_cache(cache_spec(fmt, o), g, be);
  const int64_t chunk = std::min<int64_t>(n_keys, 65536);
  const int C = g.n_head_kv * g.head_dim;
  std::vector<std::unique_ptr<device_buffer>> xs, ks, vs;
  for (int c = 0; c < 4; ++c) {
    xs.push_back(std::make_unique<device_buffer>(be, random_floats((size_t)(chunk * g.n_embd), 10 + c, -1, 1)));
    ks.push_back(std::make_unique<device_buffer>(be, random_floats((size_t)(chunk * C), 20 + c, -2, 2)));
    vs.push_back(std::make_unique<device_buffer>(be, random_floats((size_t)(chunk * C), 30 + c, -1, 1)));
  }
  std::vector<int32_t> pos((size_t)chunk);
  const auto t_fill = clock_type::now();
  for (int64_t at = 0, c = 0; at < n_keys; at += chunk, ++c) {
    const int64_t m = std::min(chunk, n_keys - at);
    for (int64_t i = 0; i < m; ++i) pos[(size_t)i] = (int32_t)(at + i);
    cache->append(0, layer_input{xs[c % 4]->as<float>(), ks[c % 4]->as<float>(), vs[c % 4]->as<float>(), pos.data(), m});
  }
  be.synchronize();
  const double fill_s = std::chrono::duration<double>(clock_type::now() - t_fill).count();
  device_buffer q(be, random_floats((size_t)(g.n_head * g.head_dim), 40, -1, 1));
  device_buffer out(be, (size_t)(g.n_head * g.head_dim + g.n_head) * sizeof(float));
  const int32_t q_pos = (int32_t)n_keys;
  row r;
  r.what = "decode attention";
  r.format = format_traits(fmt).name;
  r.keys = n_keys;
  r.ms = time_ms(be, reps, [&] {
    cache->attend_partial(0, q.as<float>(), &q_pos, 1, attend_path::attend_decode, out.as<float>(),
                          out.as<float>() + g.n_head * g.head_dim);
  });
  r.bytes = (double)cache->bytes_used();
  char note[96];
  std::snprintf(note, sizeof note, "fill %.1f s (%.0f Mtok/s)", fill_s, (double)n_keys / fill_s / 1e6);
  r.note = note;
  return r;
}

row matmul_row(backend& be, ggml_type type, int64_t n_rows, int64_t n_cols, int64_t n_tok, int reps) {
  const size_t row_bytes = ggml_row_bytes(type, n_cols), wbytes = row_bytes * (size_t)n_rows;
  // Real blocks (finite scales): random rows through the reference quantizer.
  std::vector<uint8_t> wh(wbytes);
  const std::vector<float> rows = random_floats((size_t)(n_rows * n_cols), 5, -0.1f, 0.1f);
  for (int64_t r = 0; r < n_rows; ++r)
    ref::quantize_row(type, rows.data() + (size_t)(r * n_cols), wh.data() + (size_t)r * row_bytes, n_cols);
  const ggml_type_traits tr = ggml_traits(type);
  device_buffer wd(be, wh);
  device_buffer x(be, random_floats((size_t)(n_tok * n_cols), 6, -1, 1));
  device_buffer y(be, (size_t)(n_tok * n_rows) * sizeof(float));
  weight_view w{type, n_rows, n_cols, wd.p};
  row r;
  r.what = n_tok == 1 ? "matvec" : "gemm " + std::to_string(n_tok) + " tokens";
  r.format = tr.name;
  r.keys = 0;
  r.ms = time_ms(be, reps, [&] { be.matmul(w, x.as<float>(), n_tok, y.as<float>()); });
  r.bytes = (double)wbytes;
  r.flops = 2.0 * (double)n_rows * (double)n_cols * (double)n_tok;
  r.note = std::to_string(n_rows) + "x" + std::to_string(n_cols) + (be.arithmetic().empty() ? "" : ", " + be.arithmetic());
  return r;
}

// One decode step (one token, 30 layers, fp16 cache holding `context` tokens), graphs on and off
// interleaved: returns {eager ms, graphs ms}.
std::pair<double, double> decode_step_ms(const model_weights& w, int64_t context, int reps) {
  setenv("XCTX_CUDA_GRAPHS", "0", 1);
  auto eager = make_backend(backend_kind::backend_cuda);
  unsetenv("XCTX_CUDA_GRAPHS");
  auto graphs = make_backend(backend_kind::backend_cuda);
  struct side {
    backend* be;
    std::unique_ptr<llama_engine> engine;
    std::unique_ptr<kv_cache> cache;
    std::vector<double> ms;
  } sides[2];
  sides[0].be = eager.get(), sides[1].be = graphs.get();
  std::vector<int32_t> prompt((size_t)context), pos((size_t)context);
  for (int64_t i = 0; i < context; ++i) prompt[(size_t)i] = (int32_t)((i * 37 + 11) % w.hp.n_vocab), pos[(size_t)i] = (int32_t)i;
  std::vector<float> logits((size_t)w.hp.n_vocab);
  const int steps = 2 + reps;
  for (auto& s : sides) {
    run_params rp;
    rp.cache = cache_format::cache_fp16;
    rp.n_batch = 512;
    s.engine = std::make_unique<llama_engine>(w, *s.be, rp);
    s.cache = make_cache(cache_spec(cache_format::cache_fp16), s.engine->cache_geometry_for(context + steps * 2), *s.be);
    s.engine->forward(prompt.data(), pos.data(), context, *s.cache, llama_engine::logits_for::logits_last, logits.data());
  }
  int32_t p = (int32_t)context;
  for (int step = 0; step < steps; ++step, ++p) {
    for (auto& s : sides) {  // A/B interleaved: the same token at the same position on both
      const int32_t tok = (int32_t)((7 + 13 * step) % w.hp.n_vocab);
      const auto t0 = clock_type::now();
      s.engine->forward(&tok, &p, 1, *s.cache, llama_engine::logits_for::logits_last, logits.data());
      const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
      if (step >= 2) s.ms.push_back(ms);  // the first two: graph capture at the second use
    }
  }
  return {median(sides[0].ms), median(sides[1].ms)};
}

std::vector<int64_t> parse_keys(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

int run(int argc, char** argv) {
  std::filesystem::path out = ".";
  std::vector<int64_t> keys = {int64_t(1) << 20, int64_t(10) << 20};
  int reps = 10;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) out = argv[++i];
    else if (a == "--keys" && i + 1 < argc) keys = parse_keys(argv[++i]);
    else if (a == "--quick") quick = true, reps = 3;
    else {
      std::fprintf(stderr, "usage: bench_cuda [--out DIR] [--keys N,N] [--quick]\n");
      return 2;
    }
  }
  const cuda_probe probe = probe_cuda();
  if (!probe.error.empty() || probe.bound < 0) {
    std::fprintf(stderr, "bench_cuda: no usable CUDA device: %s\n", probe.error.c_str());
    return 1;
  }
  const auto& dev = probe.devices[(size_t)probe.bound];
  std::filesystem::create_directories(out);
  auto be = make_backend(backend_kind::backend_cuda);
  const double copy = copy_gbps(*be);
  std::printf("device %s (sm_%d%d, %d SMs, %.1f GiB); copy bandwidth %.0f GB/s (read + write)\n", dev.name.c_str(),
              dev.cc_major, dev.cc_minor, dev.sm_count, (double)dev.total_bytes / (1 << 30), copy);
  std::vector<row> rows;
  const model_weights w1 = synthetic_model(smollm2_shape(1), out);
  const cache_format formats[] = {cache_format::cache_fp16,    cache_format::cache_fp32,  cache_format::cache_kivi2,
                                  cache_format::cache_kivi4,   cache_format::cache_nuq3,  cache_format::cache_nuq3_1pct,
                                  cache_format::cache_xquant2, cache_format::cache_xquant4};
  for (int64_t n : keys)
    for (cache_format f : formats) {
      if (quick && f != cache_format::cache_fp16 && f != cache_format::cache_nuq3_1pct) continue;
      try {
        rows.push_back(attention_row(*be, f, n, w1, reps));
      } catch (const std::exception& e) {
        rows.push_back(row{"decode attention", format_traits(f).name, n, 0, 0, 0, std::string("error: ") + e.what()});
      }
      const row& r = rows.back();
      std::printf("%-18s %-10s %9lld keys  %8.3f ms  %7.1f GB/s  %s\n", r.what.c_str(), r.format.c_str(),
                  (long long)r.keys, r.ms, r.ms > 0 ? r.bytes / (r.ms * 1e6) : 0.0, r.note.c_str());
      std::fflush(stdout);
    }
  for (ggml_type t : {ggml_type::ggml_q4_1, ggml_type::ggml_q8_0, ggml_type::ggml_f16}) {
    rows.push_back(matmul_row(*be, t, 4096, 4096, 1, reps));
    rows.push_back(matmul_row(*be, t, 4096, 4096, 512, reps));
  }
  for (const row& r : rows)
    if (r.what != "decode attention")
      std::printf("%-18s %-10s %8.3f ms  %7.1f GB/s  %7.2f TFLOP/s  %s\n", r.what.c_str(), r.format.c_str(), r.ms,
                  r.bytes / (r.ms * 1e6), r.flops / (r.ms * 1e9), r.note.c_str());
  const model_weights w30 = synthetic_model(smollm2_shape(30), out);
  const int64_t context = quick ? 1024 : 4096;
  const auto [eager_ms, graphs_ms] = decode_step_ms(w30, context, quick ? 8 : 32);
  std::printf("decode step (30 layers, %lld-token fp16 cache): eager %.3f ms, graphs %.3f ms (%.2fx)\n",
              (long long)context, eager_ms, graphs_ms, eager_ms / graphs_ms);
  rows.push_back(row{"decode step eager", "fp16", context, eager_ms, 0, 0, "XCTX_CUDA_GRAPHS=0"});
  rows.push_back(row{"decode step graphs", "fp16", context, graphs_ms, 0, 0, "A/B interleaved with eager"});

  std::ofstream csv(out / "cuda_bench.csv"), md(out / "cuda_bench.md");
  csv << "what,format,keys,ms,bytes,gbps,fraction_of_copy_bw,tflops,note\n";
  md << "# CUDA backend on " << dev.name << " (sm_" << dev.cc_major << dev.cc_minor << ", " << dev.sm_count
     << " SMs)\n\nWritten by benchmarks/bench_cuda.cpp. Copy bandwidth (device-to-device, read + write): "
     << (int)copy << " GB/s. GB/s counts the bytes each call must read (the cache's bytes, the weight's bytes).\n\n"
     << "| what | format | keys | ms | GB/s | of copy bandwidth | TFLOP/s | note |\n|---|---|---:|---:|---:|---:|---:|---|\n";
  for (const row& r : rows) {
    const double gbps = r.ms > 0 && r.bytes > 0 ? r.bytes / (r.ms * 1e6) : 0.0;
    const double tflops = r.ms > 0 && r.flops > 0 ? r.flops / (r.ms * 1e9) : 0.0;
    char buf[512];
    std::snprintf(buf, sizeof buf, "%s,%s,%lld,%.4f,%.0f,%.1f,%.3f,%.3f,\"%s\"\n", r.what.c_str(), r.format.c_str(),
                  (long long)r.keys, r.ms, r.bytes, gbps, gbps / copy, tflops, r.note.c_str());
    csv << buf;
    std::snprintf(buf, sizeof buf, "| %s | %s | %lld | %.3f | %.0f | %.2f | %.2f | %s |\n", r.what.c_str(),
                  r.format.c_str(), (long long)r.keys, r.ms, gbps, gbps / copy, tflops, r.note.c_str());
    md << buf;
  }
  std::printf("wrote %s and %s\n", (out / "cuda_bench.csv").c_str(), (out / "cuda_bench.md").c_str());
  return 0;
}

}  // namespace
}  // namespace xctx

int main(int argc, char** argv) {
  try {
    return xctx::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
}
