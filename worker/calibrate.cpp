#include "worker/calibrate.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "common/error.h"
#include "kernels/kv_quant.h"

namespace xctx {
namespace {

// An fp32 cache that also keeps what the calibration needs: each layer's pre-RoPE keys and
// values as appended, and the (post-RoPE) queries that attend.
class recording_cache final : public kv_cache {
 public:
  recording_cache(const cache_geometry& g, backend& be) : inner_(make_cache(cache_format::cache_fp32, g, be)) {
    k_.resize(g.n_layer), v_.resize(g.n_layer), q_.resize(g.n_layer);
  }
  cache_format format() const override { return inner_->format(); }
  const cache_geometry& geometry() const override { return inner_->geometry(); }
  void append(int layer, const layer_input& in) override {
    const size_t C = (size_t)geometry().n_head_kv * geometry().head_dim;
    k_[layer].insert(k_[layer].end(), in.k, in.k + in.n * C);
    v_[layer].insert(v_[layer].end(), in.v, in.v + in.n * C);
    inner_->append(layer, in);
  }
  int64_t n_tokens(int layer) const override { return inner_->n_tokens(layer); }
  // Records the queries the layer's own tokens are attended with (what calibration weights by).
  void attend_impl(int layer, const attend_source& src, const attend_queries& qs, const attn_selection* select,
                   const attend_sink& sink) override {
    if (src.own()) {
      const size_t row = (size_t)geometry().n_head * geometry().head_dim;
      q_[layer].insert(q_[layer].end(), qs.q, qs.q + qs.n * row);
    }
    inner_->attend(layer, src, qs, select, sink);
  }
  size_t exported_bytes(int layer) const override { return inner_->exported_bytes(layer); }
  void export_layer(int layer, void* dst) const override { inner_->export_layer(layer, dst); }
  void restore_layer(int, const void*, size_t) override {
    fail("the calibration's recording cache is filled by the forward pass, not restored");
  }
  void release_ring_state() override { inner_->release_ring_state(); }
  void clear() override {
    inner_->clear();
    for (auto* vv : {&k_, &v_, &q_})
      for (auto& x : *vv) x.clear();
  }
  size_t bytes_allocated() const override { return inner_->bytes_allocated(); }
  size_t bytes_used() const override { return inner_->bytes_used(); }

  std::vector<std::vector<float>> k_, v_, q_;  // [layer][n, C], [layer][n, C], [layer][n, n_head, hd]

 private:
  std::unique_ptr<kv_cache> inner_;
};

// Per-layer accumulation across samples.
struct layer_accum {
  std::vector<float> k, wk;  // [rows, C] keys (sink excluded) and their sensitivities
  std::array<nuq_histogram, kCalibSettings> hv;
};

// Sensitivities of one layer of one sample (see calibrate.h). k_rot: post-RoPE keys.
void layer_sensitivities(const cache_geometry& g, const std::vector<float>& k_rot, const std::vector<float>& v,
                         const std::vector<float>& q, const std::vector<int64_t>& sel, int64_t L,
                         std::vector<float>& wk /*[L, C]*/, std::vector<float>& wv /*[L, C]*/) {
  const int hd = g.head_dim, C = g.n_head_kv * hd, grp = g.n_head / g.n_head_kv;
  const int R = (int)sel.size() * grp;
  const float scale = 1.0f / std::sqrt((float)hd);
  std::fill(wk.begin(), wk.end(), 0.0f), std::fill(wv.begin(), wv.end(), 0.0f);
  std::vector<float> qs((size_t)R * hd), qe((size_t)R * hd), P((size_t)R * L), O((size_t)R * hd), VO((size_t)L * R);
  std::vector<float> A((size_t)R * L), WK((size_t)L * hd), vv((size_t)L), oo((size_t)R);
  for (int kvh = 0; kvh < g.n_head_kv; ++kvh) {
    for (size_t i = 0; i < sel.size(); ++i)
      for (int u = 0; u < grp; ++u) {
        const int r = (int)i * grp + u;
        const float* qr = q.data() + ((size_t)sel[i] * g.n_head + (size_t)kvh * grp + u) * hd;
        for (int d = 0; d < hd; ++d) qs[(size_t)r * hd + d] = qr[d] * scale;
        for (int d = 0; d < hd; d += 2) {  // pair energy: what RoPE leaves invariant
          const float e = d + 1 < g.rope.n_rot ? 0.5f * (qr[d] * qr[d] + qr[d + 1] * qr[d + 1]) : qr[d] * qr[d];
          qe[(size_t)r * hd + d] = e / (float)hd;
          qe[(size_t)r * hd + d + 1] = d + 1 < g.rope.n_rot ? e / (float)hd : qr[d + 1] * qr[d + 1] / (float)hd;
        }
      }
    const float* kb = k_rot.data() + (size_t)kvh * hd;
    const float* vb = v.data() + (size_t)kvh * hd;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, (int)L, hd, 1.0f, qs.data(), hd, kb, C, 0.0f, P.data(),
                (int)L);
    for (int r = 0; r < R; ++r) {  // causal softmax of each sampled row
      const int64_t end = sel[r / grp] + 1;
      float* p = P.data() + (size_t)r * L;
      const float m = *std::max_element(p, p + end);
      double s = 0.0;
      for (int64_t t = 0; t < end; ++t) s += (p[t] = std::exp(p[t] - m));
      for (int64_t t = 0; t < end; ++t) p[t] = (float)(p[t] / s);
      std::fill(p + end, p + L, 0.0f);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, hd, (int)L, 1.0f, P.data(), (int)L, vb, C, 0.0f,
                O.data(), hd);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)L, R, hd, 1.0f, vb, C, O.data(), hd, 0.0f, VO.data(), R);
    for (int64_t t = 0; t < L; ++t) vv[t] = cblas_sdot(hd, vb + t * C, 1, vb + t * C, 1);
    for (int r = 0; r < R; ++r) oo[r] = cblas_sdot(hd, O.data() + (size_t)r * hd, 1, O.data() + (size_t)r * hd, 1);
    for (int r = 0; r < R; ++r)
      for (int64_t t = 0; t < L; ++t) {
        const float p = P[(size_t)r * L + t];
        const float dist = std::max(0.0f, vv[t] - 2.0f * VO[(size_t)t * R + r] + oo[r]);
        A[(size_t)r * L + t] = p * p * dist;
        wv[(size_t)t * C + (size_t)kvh * hd] += p * p;  // channel 0 of the head holds the row sum
      }
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)L, hd, R, 1.0f, A.data(), (int)L, qe.data(), hd, 0.0f,
                WK.data(), hd);
    for (int64_t t = 0; t < L; ++t) {
      for (int d = 0; d < hd; ++d) wk[(size_t)t * C + (size_t)kvh * hd + d] = WK[(size_t)t * hd + d];
      const float w = wv[(size_t)t * C + (size_t)kvh * hd];
      for (int d = 1; d < hd; ++d) wv[(size_t)t * C + (size_t)kvh * hd + d] = w;
    }
  }
}

// Values are normalized online per token (as the cache does), so their histograms fill per sample.
void add_values(const std::vector<float>& v, const std::vector<float>& wv, int64_t L, int C, bool weighted,
                std::array<nuq_histogram, kCalibSettings>& hv) {
  std::vector<int> order((size_t)C);
  for (int64_t t = 1; t < L; ++t) {  // t = 0 is the attention sink, kept in fp16
    const float* x = v.data() + (size_t)t * C;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return x[a] < x[b] || (x[a] == x[b] && a < b); });
    for (int s = 0; s < kCalibSettings; ++s) {
      const int side = value_outliers_per_side(kCalibOutlierFraction[s], C);
      const kvq_affine p = kvq_midrange_params(x[order[side]], x[order[C - 1 - side]]);
      const float scale = fp16_to_fp32(p.scale), zero = fp16_to_fp32(p.zero);
      for (int rank = side; rank < C - side; ++rank) {
        const int c = order[rank];
        hv[s].add(kvq_normalize(x[c], scale, zero), weighted ? wv[(size_t)t * C + c] : 1.0);
      }
    }
  }
}

// Per-channel ranges from all calibration keys, then the key histograms.
void fit_keys(const layer_accum& acc, int C, bool weighted, calib_layer_setting* out /*[kCalibSettings]*/) {
  const int64_t rows = (int64_t)acc.k.size() / C;
  XCTX_CHECK(rows > 0, "calibration: no key rows to fit");
  std::vector<float> col((size_t)rows);
  for (int s = 0; s < kCalibSettings; ++s) out[s].k_lo.resize(C), out[s].k_hi.resize(C);
  for (int c = 0; c < C; ++c) {
    for (int64_t t = 0; t < rows; ++t) col[t] = acc.k[(size_t)t * C + c];
    std::sort(col.begin(), col.end());
    for (int s = 0; s < kCalibSettings; ++s) {
      const double f = kCalibOutlierFraction[s] / 2.0;  // per side
      out[s].k_lo[c] = col[(size_t)std::floor(f * (double)(rows - 1))];
      out[s].k_hi[c] = col[(size_t)std::ceil((1.0 - f) * (double)(rows - 1))];
    }
  }
  for (int s = 0; s < kCalibSettings; ++s) {
    nuq_histogram hk;
    for (int64_t t = 0; t < rows; ++t)
      for (int c = 0; c < C; ++c) {
        const float x = acc.k[(size_t)t * C + c];
        const float lo = out[s].k_lo[c], hi = out[s].k_hi[c];
        if (kCalibOutlierFraction[s] > 0.0 && (x < lo || x > hi)) continue;  // sparse outliers
        // The same expressions the cache normalizes with.
        const float zero = 0.5f * (hi + lo), scale = 0.5f * (hi - lo);
        hk.add(kvq_normalize(x, scale, zero), weighted ? acc.wk[(size_t)t * C + c] : 1.0);
      }
    for (int b = 0; b < 3; ++b) out[s].k[b] = fit_nuq_datatype(hk, kCalibBits[b]);
  }
}

}  // namespace

std::vector<int64_t> calibration_windows(int64_t n_tokens, int n_samples, int seq_len, uint64_t seed) {
  XCTX_CHECK(n_samples > 0 && seq_len > 1, "calibration: need samples > 0 and seq-len > 1, got ", n_samples, " and ",
             seq_len);
  XCTX_CHECK(n_tokens >= seq_len, "calibration text has ", n_tokens, " tokens, fewer than --seq-len ", seq_len);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> starts;
  const int64_t slots = n_tokens / seq_len;
  if (slots >= n_samples) {  // distinct non-overlapping windows, chosen at random
    std::vector<int64_t> idx((size_t)slots);
    std::iota(idx.begin(), idx.end(), 0);
    for (int i = 0; i < n_samples; ++i) {
      std::uniform_int_distribution<int64_t> d(i, slots - 1);
      std::swap(idx[i], idx[d(rng)]);
      starts.push_back(idx[i] * seq_len);
    }
    std::sort(starts.begin(), starts.end());
  } else {  // short text: windows overlap
    std::uniform_int_distribution<int64_t> d(0, n_tokens - seq_len);
    for (int i = 0; i < n_samples; ++i) starts.push_back(d(rng));
  }
  return starts;
}

calibration calibrate_model(llama_engine& engine, backend& be, const std::vector<int32_t>& tokens,
                            uint64_t fingerprint, const calibrate_options& opt, const calibrate_progress& progress) {
  // The recorder reads the layers' keys and values as host memory.
  XCTX_CHECK(be.host_memory(), "calibrate runs on a host-memory backend (--backend cpu), not ", be.name());
  const model_hparams& hp = engine.hparams();
  const std::vector<int64_t> starts = calibration_windows((int64_t)tokens.size(), opt.n_samples, opt.seq_len, opt.seed);
  const cache_geometry g = engine.cache_geometry_for(opt.seq_len);
  const int C = g.n_head_kv * g.head_dim;
  const int64_t L = opt.seq_len;
  std::vector<layer_accum> acc(hp.n_layer);
  std::vector<int32_t> pos((size_t)L);
  std::iota(pos.begin(), pos.end(), 0);
  std::mt19937_64 rng(opt.seed ^ 0x9e3779b97f4a7c15ull);
  recording_cache rec(g, be);
  for (int smp = 0; smp < opt.n_samples; ++smp) {
    if (progress) progress("forward", smp, opt.n_samples);
    rec.clear();
    engine.forward(tokens.data() + starts[smp], pos.data(), L, rec, llama_engine::logits_for::logits_none, nullptr);
    // Sampled query positions: one per stratum of [1, L).
    const int n_sel = (int)std::min<int64_t>(opt.queries_per_sample, L - 1);
    std::vector<int64_t> sel((size_t)n_sel);
    for (int i = 0; i < n_sel; ++i) {
      const double lo = 1.0 + (double)i * (L - 1) / n_sel, hi = 1.0 + (double)(i + 1) * (L - 1) / n_sel;
      sel[i] = std::min<int64_t>(L - 1, (int64_t)(lo + std::uniform_real_distribution<double>(0.0, 1.0)(rng) * (hi - lo)));
    }
    const int blas_threads = openblas_get_num_threads();
    openblas_set_num_threads(1);
#pragma omp parallel
    {
      std::vector<float> k_rot, wk((size_t)L * C), wv((size_t)L * C);
#pragma omp for schedule(dynamic, 1)
      for (int l = 0; l < hp.n_layer; ++l) {
        const std::vector<float>& k = rec.k_[l];
        if (opt.weighted) {
          k_rot = k;
          be.rope(k_rot.data(), pos.data(), L, g.n_head_kv, g.rope);
          layer_sensitivities(g, k_rot, rec.v_[l], rec.q_[l], sel, L, wk, wv);
        }
        layer_accum& a = acc[l];
        a.k.insert(a.k.end(), k.begin() + C, k.end());  // row 0 is the sink
        if (opt.weighted) a.wk.insert(a.wk.end(), wk.begin() + C, wk.end());
        add_values(rec.v_[l], wv, L, C, opt.weighted, a.hv);
      }
    }
    openblas_set_num_threads(blas_threads);
  }
  calibration c;
  c.model_fingerprint = fingerprint;
  c.model_name = hp.name;
  c.n_layer = hp.n_layer, c.n_head_kv = hp.n_head_kv, c.head_dim = hp.head_dim;
  c.text_source = opt.text_source;
  c.weighting = opt.weighted ? "attention-output" : "none";
  c.n_samples = opt.n_samples, c.seq_len = opt.seq_len, c.seed = opt.seed;
  for (int s = 0; s < kCalibSettings; ++s) c.layers[s].resize(hp.n_layer);
  int64_t fitted = 0;
#pragma omp parallel for schedule(dynamic, 1)
  for (int l = 0; l < hp.n_layer; ++l) {
    calib_layer_setting out[kCalibSettings];
    fit_keys(acc[l], C, opt.weighted, out);
    for (int s = 0; s < kCalibSettings; ++s) {
      for (int b = 0; b < 3; ++b) out[s].v[b] = fit_nuq_datatype(acc[l].hv[s], kCalibBits[b]);
      c.layers[s][l] = std::move(out[s]);
    }
    std::vector<float>().swap(acc[l].k), std::vector<float>().swap(acc[l].wk);
#pragma omp critical
    {
      ++fitted;
      if (progress && omp_get_thread_num() == 0) progress("fit", fitted, hp.n_layer);
    }
  }
  if (progress) progress("fit", hp.n_layer, hp.n_layer);
  return c;
}

}  // namespace xctx
