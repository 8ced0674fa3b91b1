// Attention kernels, cpu vs ref. Decode: one query against n_kv cached tokens (9/3 heads,
// head_dim 64, SmolLM2's layout), reported as GB/s of K/V bytes read — decode attention is a
// stream over the cache, so bandwidth is the number that matters. Prefill: causal
// self-attention over n tokens, reported as GFLOP/s (4 flops per visible (query, key, dim):
// QK^T and PV, multiply-add each). The ref baseline is timed in the same run and reported as
// the speedup counter.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/half.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/ref/ref_ops.h"

namespace xctx {
namespace {

constexpr int kHead = 9, kHeadKv = 3, kHeadDim = 64;

struct bench_data {
  std::vector<float> q, kf, vf, o, lse;
  std::vector<uint16_t> kh, vh;
  std::vector<int32_t> q_pos, kv_pos;
  attn_args args(kv_dtype t) {
    attn_args a;
    a.q = q.data(), a.q_pos = q_pos.data(), a.n_q = (int64_t)q_pos.size();
    a.k = t == kv_dtype::kv_f16 ? (const void*)kh.data() : (const void*)kf.data();
    a.v = t == kv_dtype::kv_f16 ? (const void*)vh.data() : (const void*)vf.data();
    a.kv_pos = kv_pos.data(), a.n_kv = (int64_t)kv_pos.size(), a.kv_type = t;
    a.n_head = kHead, a.n_head_kv = kHeadKv, a.head_dim = kHeadDim, a.scale = 1.0f / std::sqrt((float)kHeadDim);
    a.o = o.data(), a.lse = lse.data();
    return a;
  }
};

bench_data make_data(int64_t n_q, int64_t n_kv, bool causal_self) {
  bench_data d;
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  d.q.resize((size_t)(n_q * kHead * kHeadDim));
  for (auto& x : d.q) x = 3.0f * u(rng);
  const size_t n_elem = (size_t)(n_kv * kHeadKv * kHeadDim);
  d.kf.resize(n_elem), d.vf.resize(n_elem), d.kh.resize(n_elem), d.vh.resize(n_elem);
  for (size_t e = 0; e < n_elem; ++e) {
    d.kf[e] = u(rng), d.vf[e] = u(rng);
    d.kh[e] = fp32_to_fp16(d.kf[e]), d.vh[e] = fp32_to_fp16(d.vf[e]);
  }
  d.kv_pos.resize((size_t)n_kv);
  for (int64_t j = 0; j < n_kv; ++j) d.kv_pos[j] = (int32_t)j;
  d.q_pos.resize((size_t)n_q);
  for (int64_t i = 0; i < n_q; ++i) d.q_pos[i] = (int32_t)(causal_self ? i : n_kv + i);
  d.o.resize(d.q.size()), d.lse.resize((size_t)(n_q * kHead));
  return d;
}

// One attention call (cpu::attention_partial's overload with the default switches, or ref's).
using attention_fn = void (*)(const attn_args&);

double seconds_of(attention_fn fn, const attn_args& a, int reps) {
  fn(a);  // warm
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) fn(a);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

// args: n_kv, f16 (0/1), backend (0 = ref, 1 = cpu)
void BM_decode(benchmark::State& state) {
  const int64_t n_kv = state.range(0);
  const kv_dtype t = state.range(1) ? kv_dtype::kv_f16 : kv_dtype::kv_f32;
  const bool cpu_backend = state.range(2) != 0;
  auto d = make_data(1, n_kv, false);
  const attn_args a = d.args(t);
  const attention_fn fn = cpu_backend ? attention_fn(&cpu::attention_partial) : &ref::attention_partial;
  for (auto _ : state) {
    fn(a);
    benchmark::DoNotOptimize(d.o.data());
  }
  const double kv_bytes = 2.0 * (double)n_kv * kHeadKv * kHeadDim * (t == kv_dtype::kv_f16 ? 2 : 4);
  state.SetBytesProcessed((int64_t)(kv_bytes * (double)state.iterations()));
  state.counters["kv_GBps"] = benchmark::Counter(kv_bytes * (double)state.iterations() / 1e9, benchmark::Counter::kIsRate);
  if (cpu_backend) {
    const double t_cpu = seconds_of(&cpu::attention_partial, a, 20);
    const double t_ref = seconds_of(&ref::attention_partial, a, 1);
    state.counters["speedup_vs_ref"] = t_ref / t_cpu;
  }
}
BENCHMARK(BM_decode)
    ->ArgNames({"n_kv", "f16", "cpu"})
    ->ArgsProduct({{1024, 8192, 65536}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// args: n (queries = keys, causal self-attention), f16, backend
void BM_prefill(benchmark::State& state) {
  const int64_t n = state.range(0);
  const kv_dtype t = state.range(1) ? kv_dtype::kv_f16 : kv_dtype::kv_f32;
  const bool cpu_backend = state.range(2) != 0;
  auto d = make_data(n, n, true);
  const attn_args a = d.args(t);
  const attention_fn fn = cpu_backend ? attention_fn(&cpu::attention_partial) : &ref::attention_partial;
  for (auto _ : state) {
    fn(a);
    benchmark::DoNotOptimize(d.o.data());
  }
  const double flops = 4.0 * (double)n * (double)(n + 1) / 2.0 * kHead * kHeadDim;
  state.counters["GFLOPs"] = benchmark::Counter(flops * (double)state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_prefill)
    ->ArgNames({"n", "f16", "cpu"})
    ->Args({512, 0, 0})
    ->Args({512, 0, 1})
    ->Args({512, 1, 1})
    ->Args({2048, 0, 1})
    ->Args({2048, 1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// One unit (kAttnUnit = 256 f16 keys, 3 kv heads, hd 64) against rows_per_head query rows per
// kv head, single-threaded: the unit path's decode-kernel call (prefill blocks 16 queries: 48
// rows per head; a decode step 3). kernel 0 = AVX2, 1 = AVX-512 many-row (same bits); the
// counter is rows x keys per second, and the AVX2 kernel's time on the same job is measured in
// the same run as the baseline (speedup_vs_avx2).
void BM_units_rows(benchmark::State& state) {
  const int rph = (int)state.range(0);
  const bool avx512 = state.range(1) != 0;
  if (avx512 && !cpu::has_avx512()) {
    state.SkipWithError("no AVX-512 on this CPU");
    return;
  }
  constexpr int64_t n_keys = 256;
  auto d = make_data(1, n_keys, false);
  const int R = rph * kHeadKv;
  std::vector<float> q((size_t)R * kHeadDim), o((size_t)R * kHeadDim), lse((size_t)R);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : q) x = u(rng);
  std::vector<int64_t> row_end((size_t)R, n_keys);
  std::vector<float> scratch((size_t)cpu::impl::decode_scratch_floats(R, kHeadDim));
  cpu::impl::decode_job jb;
  jb.q = q.data(), jb.row_end = row_end.data(), jb.R = R, jb.n_kvh = kHeadKv, jb.hd = kHeadDim;
  jb.k = d.kh.data(), jb.v = d.vh.data(), jb.type = kv_dtype::kv_f16, jb.ld = kHeadKv * kHeadDim;
  jb.j0 = 0, jb.j1 = n_keys, jb.o = o.data(), jb.lse = lse.data(), jb.scratch = scratch.data();
  const auto run = [&](bool wide) { wide ? cpu::impl::avx512::decode_block(jb) : cpu::impl::avx2::decode_block(jb); };
  for (auto _ : state) {
    run(avx512);
    benchmark::DoNotOptimize(o.data());
  }
  state.counters["row_keys_per_s"] =
      benchmark::Counter((double)R * n_keys * (double)state.iterations(), benchmark::Counter::kIsRate);
  const auto time_of = [&](bool wide) {
    run(wide);
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < 200; ++r) run(wide);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  state.counters["speedup_vs_avx2"] = time_of(false) / time_of(avx512);
}
BENCHMARK(BM_units_rows)
    ->ArgNames({"rows_per_head", "avx512"})
    ->ArgsProduct({{3, 6, 12, 48}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
}  // namespace xctx

BENCHMARK_MAIN();
