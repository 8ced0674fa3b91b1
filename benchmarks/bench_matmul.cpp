// Matmul throughput on the SmolLM2-135M shapes (Q4_1 layer matrices, the Q8_0 tied output
// projection), decode (n_tok = 1) and prefill (n_tok = 512), 1 and 2 threads.
//
// Counters: weight_GBps = weight bytes read / time (the roofline for decode is memory bandwidth),
// GFLOPs = 2·n_rows·n_cols·n_tok / time, and ratios against baselines timed in the same run on
// the same data and thread count:
//   vs_dequant_blas = time(dequantize the whole matrix, then cblas_sgemv / sgemm) / time(this)
//   vs_ref          = time(ref::matmul) / time(this)     (n_tok = 1 only; ref is double-precision)
// Run: build/benchmarks/bench_matmul [--benchmark_filter=...]
#include <benchmark/benchmark.h>
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/sys.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/ref/ref_ops.h"

namespace xctx {
namespace {

struct bench_shape {
  const char* name;
  ggml_type type;
  int64_t n_rows, n_cols;
};

// wq/wo are 576x576, wk/wv 192x576, gate/up 1536x576, down 576x1536; token_embd doubles as
// the output projection.
const bench_shape k_shapes[] = {
    {"wq_wo", ggml_type::ggml_q4_1, 576, 576},         {"wk_wv", ggml_type::ggml_q4_1, 192, 576},
    {"gate_up", ggml_type::ggml_q4_1, 1536, 576},      {"down", ggml_type::ggml_q4_1, 576, 1536},
    {"output", ggml_type::ggml_q8_0, 49152, 576},
};

struct bench_data {
  std::vector<uint8_t> w;  // [n_rows, row_bytes]
  std::vector<float> x;    // [n_tok, n_cols]
  std::vector<float> y;    // [n_tok, n_rows]
  weight_view view;
};

// Quantized by the reference quantizer from seeded normal data; cached per shape and n_tok.
bench_data& data_for(int shape, int64_t n_tok) {
  static std::map<std::pair<int, int64_t>, bench_data> cache;
  auto it = cache.find({shape, n_tok});
  if (it != cache.end()) return it->second;
  const bench_shape& s = k_shapes[shape];
  bench_data d;
  std::mt19937 rng(42 + (uint32_t)shape);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  const size_t row_bytes = ggml_row_bytes(s.type, s.n_cols);
  d.w.resize(row_bytes * (size_t)s.n_rows);
  std::vector<float> row((size_t)s.n_cols);
  for (int64_t r = 0; r < s.n_rows; ++r) {
    for (auto& v : row) v = nd(rng);
    ref::quantize_row(s.type, row.data(), d.w.data() + (size_t)r * row_bytes, s.n_cols);
  }
  d.x.resize((size_t)(n_tok * s.n_cols));
  for (auto& v : d.x) v = nd(rng) * 20.0f;
  d.y.resize((size_t)(n_tok * s.n_rows));
  d.view = weight_view{s.type, s.n_rows, s.n_cols, d.w.data()};
  return cache.emplace(std::make_pair(shape, n_tok), std::move(d)).first->second;
}

// The plain way to use BLAS on quantized weights: dequantize the whole matrix to f32, then
// BLAS. Both steps split rows over the OpenMP threads with single-threaded BLAS calls, as the
// prefill path does, so the ratio measures fusing (no f32 copy of the weights), not a clash
// between OpenMP and OpenBLAS thread pools.
void dequant_blas(bench_data& d, int64_t n_tok, std::vector<float>& scratch) {
  const weight_view& w = d.view;
  scratch.resize((size_t)(w.n_rows * w.n_cols));
  float* dst = scratch.data();
  const size_t row_bytes = w.row_bytes();
  openblas_set_num_threads(1);
#pragma omp parallel
  {
    int64_t r0, r1;
    cpu::detail::thread_rows(w.n_rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
      cpu::dequantize_row(w.type, d.w.data() + (size_t)r * row_bytes, dst + r * w.n_cols, w.n_cols);
    }
#pragma omp barrier
    if (r0 < r1 && n_tok == 1) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)(r1 - r0), (int)w.n_cols, 1.0f, dst + r0 * w.n_cols,
                  (int)w.n_cols, d.x.data(), 1, 0.0f, d.y.data() + r0, 1);
    } else if (r0 < r1) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n_tok, (int)(r1 - r0), (int)w.n_cols, 1.0f,
                  d.x.data(), (int)w.n_cols, dst + r0 * w.n_cols, (int)w.n_cols, 0.0f, d.y.data() + r0,
                  (int)w.n_rows);
    }
  }
}

// Median wall time of a baseline, measured once per (baseline, shape, n_tok, threads).
template <typename Fn>
double baseline_seconds(const std::string& key, Fn&& fn) {
  static std::map<std::string, double> cache;
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  fn();  // warm-up: page faults, caches, thread start
  std::vector<double> t;
  stopwatch total;
  while (t.size() < 5 || (t.size() < 200 && total.seconds() < 0.3)) {
    stopwatch sw;
    fn();
    t.push_back(sw.seconds());
  }
  std::nth_element(t.begin(), t.begin() + (long)t.size() / 2, t.end());
  return cache[key] = t[t.size() / 2];
}

// decode_f32 / decode_q16 / decode_q8: the decode path with float activations / activations
// rounded to 16-bit blocks / to 8-bit blocks (llama.cpp's arithmetic), on the best kernels this
// CPU has (AVX-512 VNNI for the integer paths where present); *_avx2: the same with AVX-512 off,
// the baseline of the VNNI kernels in the same run. "cpu" is cpu::matmul with the process's
// setting. prefill_q8 / prefill_q16: the integer prefill GEMM (8- / 16-bit activation blocks,
// AVX-512 VNNI), against
// prefill_split_rows (the f32 GEMM cpu::matmul runs by default) in the same run; on AMX hosts
// prefill_q8/q16 take the tiles and prefill_q8/q16_vnni are the same products with AMX off.
enum variant : int {
  v_cpu, v_decode_f32, v_decode_q8, v_prefill_split, v_prefill_whole, v_dequant_blas, v_ref, v_decode_q16,
  v_decode_q16_avx2, v_decode_q8_avx2, v_decode_q16_avxvnni, v_decode_q8_avxvnni, v_prefill_q8, v_prefill_q8_vnni,
  v_prefill_q16, v_prefill_q16_vnni
};
const char* const k_variant_names[] = {"cpu", "decode_f32", "decode_q8", "prefill_split_rows", "prefill_whole_matrix",
                                       "dequant_blas", "ref", "decode_q16", "decode_q16_avx2", "decode_q8_avx2",
                                       "decode_q16_avxvnni", "decode_q8_avxvnni", "prefill_q8", "prefill_q8_vnni",
                                       "prefill_q16", "prefill_q16_vnni"};

// Args: shape index, n_tok, threads, variant.
void BM_matmul(benchmark::State& state) {
  const int shape = (int)state.range(0);
  const int64_t n_tok = state.range(1);
  const int threads = (int)state.range(2);
  const auto v = (variant)state.range(3);
  const bench_shape& s = k_shapes[shape];
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(threads);
  bench_data& d = data_for(shape, n_tok);
  std::vector<float> scratch;
  using pre = cpu::prefill_activations;
  auto run = [&](variant which) {
    switch (which) {
      case v_cpu: cpu::matmul(d.view, d.x.data(), n_tok, d.y.data()); break;
      case v_decode_f32:
        cpu::detail::matmul_decode(d.view, d.x.data(), n_tok, d.y.data(), cpu::decode_activations::act_f32);
        break;
      case v_decode_q8:
        cpu::detail::matmul_decode(d.view, d.x.data(), n_tok, d.y.data(), cpu::decode_activations::act_q8);
        break;
      case v_decode_q16:
        cpu::detail::matmul_decode(d.view, d.x.data(), n_tok, d.y.data(), cpu::decode_activations::act_q16);
        break;
      case v_decode_q16_avx2:
      case v_decode_q8_avx2:
        cpu::set_force_avx2(true);
        cpu::detail::matmul_decode(d.view, d.x.data(), n_tok, d.y.data(),
                                   which == v_decode_q8_avx2 ? cpu::decode_activations::act_q8
                                                             : cpu::decode_activations::act_q16);
        cpu::set_force_avx2(false);
        break;
      case v_decode_q16_avxvnni:
      case v_decode_q8_avxvnni:
        cpu::set_force_avx_vnni(true);
        cpu::detail::matmul_decode(d.view, d.x.data(), n_tok, d.y.data(),
                                   which == v_decode_q8_avxvnni ? cpu::decode_activations::act_q8
                                                                : cpu::decode_activations::act_q16);
        cpu::set_force_avx_vnni(false);
        break;
      case v_prefill_split:
        cpu::detail::matmul_prefill(d.view, d.x.data(), n_tok, d.y.data(),
                                    cpu::detail::prefill_mode::prefill_split_rows);
        break;
      case v_prefill_whole:
        cpu::detail::matmul_prefill(d.view, d.x.data(), n_tok, d.y.data(),
                                    cpu::detail::prefill_mode::prefill_whole_matrix);
        break;
      case v_prefill_q8:
      case v_prefill_q16:
        cpu::detail::matmul_prefill_int(d.view, d.x.data(), n_tok, d.y.data(),
                                        which == v_prefill_q8 ? pre::pre_q8 : pre::pre_q16, true);
        break;
      case v_prefill_q8_vnni:
      case v_prefill_q16_vnni:
        cpu::set_force_no_amx(true);
        cpu::detail::matmul_prefill_int(d.view, d.x.data(), n_tok, d.y.data(),
                                        which == v_prefill_q8_vnni ? pre::pre_q8 : pre::pre_q16, true);
        cpu::set_force_no_amx(false);
        break;
      case v_dequant_blas: dequant_blas(d, n_tok, scratch); break;
      case v_ref: ref::matmul(d.view, d.x.data(), n_tok, d.y.data()); break;
    }
  };
  const std::string key = std::string(s.name) + "/" + std::to_string(n_tok) + "/" + std::to_string(threads);
  const double t_blas = baseline_seconds("blas/" + key, [&] { run(v_dequant_blas); });
  const double t_ref = n_tok == 1 ? baseline_seconds("ref/" + key, [&] { run(v_ref); }) : 0.0;
  run(v);  // warm-up
  stopwatch sw;
  for (auto _ : state) {
    run(v);
    benchmark::DoNotOptimize(d.y.data());
    benchmark::ClobberMemory();
  }
  const double t = sw.seconds() / (double)state.iterations();
  omp_set_num_threads(saved_threads);
  const double bytes = (double)d.view.bytes();
  const double flops = 2.0 * (double)s.n_rows * (double)s.n_cols * (double)n_tok;
  state.counters["weight_GBps"] = bytes / t / 1e9;
  state.counters["GFLOPs"] = flops / t / 1e9;
  state.counters["vs_dequant_blas"] = t_blas / t;
  if (n_tok == 1) state.counters["vs_ref"] = t_ref / t;
  state.SetLabel(std::string(ggml_traits(s.type).name) + " " + std::to_string(s.n_rows) + "x" +
                 std::to_string(s.n_cols) + " " + k_variant_names[v]);
}

void matmul_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "n_tok", "threads", "variant"});
  for (int shape = 0; shape < (int)std::size(k_shapes); ++shape) {
    for (int threads : {1, 2}) {
      for (int v : {v_decode_f32, v_decode_q16, v_decode_q8, v_dequant_blas}) b->Args({shape, 1, threads, v});
      if (cpu::has_avx512()) {
        for (int v : {v_decode_q16_avx2, v_decode_q8_avx2}) b->Args({shape, 1, threads, v});
      }
      if (cpu::has_avx_vnni()) {
        for (int v : {v_decode_q16_avxvnni, v_decode_q8_avxvnni}) b->Args({shape, 1, threads, v});
      }
      for (int v : {v_cpu, v_prefill_split, v_prefill_whole}) b->Args({shape, 512, threads, v});
      const ggml_type type = k_shapes[shape].type;
      using pre = cpu::prefill_activations;
      if (cpu::prefill_q8_supported()) b->Args({shape, 512, threads, v_prefill_q8});
      if (cpu::has_amx()) b->Args({shape, 512, threads, v_prefill_q8_vnni});
      if (cpu::detail::prefill_int_applies(type, pre::pre_q16)) b->Args({shape, 512, threads, v_prefill_q16});
      if (cpu::has_amx() && type != ggml_type::ggml_q8_0) b->Args({shape, 512, threads, v_prefill_q16_vnni});
    }
  }
}
BENCHMARK(BM_matmul)->Apply(matmul_args)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The decode/prefill crossover (prefill_min_tokens): the three paths at small n_tok on the two
// most common shapes, single thread (every path splits rows over threads the same way).
void crossover_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"shape", "n_tok", "threads", "variant"});
  for (int shape : {2, 4}) {
    for (int64_t n_tok : {2, 4, 8, 12, 16, 24, 32, 40, 64, 96}) {
      for (int v : {v_decode_f32, v_decode_q16, v_decode_q8, v_prefill_split}) b->Args({shape, n_tok, 1, v});
    }
  }
}
BENCHMARK(BM_matmul)->Name("BM_crossover")->Apply(crossover_args)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace
}  // namespace xctx

BENCHMARK_MAIN();
