// Offline SVD of the key/value projections for the X caches (see x_factors.h).
#include "cache/x_factors.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <map>
#include <mutex>

#include "common/error.h"
#include "common/hash.h"
#include "kernels/host_cpu.h"

// LAPACK from OpenBLAS. The Debian OpenBLAS ships the Fortran symbols but not lapacke.h, so the
// routine is declared here with the gfortran calling convention (trailing hidden length of the
// character argument).
extern "C" void dgesdd_(const char* jobz, const int* m, const int* n, double* a, const int* lda, double* s, double* u,
                        const int* ldu, double* vt, const int* ldvt, double* work, const int* lwork, int* iwork,
                        int* info, size_t jobz_len);

namespace xctx {
namespace {

// Rows of a weight matrix, dequantized to double: [n_rows, n_cols] row-major, which read as
// column-major is the paper's [n_cols = d, n_rows = kv] matrix W.
std::vector<double> weight_rows(const weight_view& w, const char* what, int layer) {
  XCTX_CHECK(w.data != nullptr && w.n_rows > 0 && w.n_cols > 0, "x factors: layer ", layer, " has no ", what,
             " weights");
  std::vector<float> row((size_t)w.n_cols);
  std::vector<double> out((size_t)w.n_rows * w.n_cols);
  const auto* base = static_cast<const uint8_t*>(w.data);
  for (int64_t r = 0; r < w.n_rows; ++r) {
    host_dequantize_row(w.type, base + (size_t)r * w.row_bytes(), row.data(), w.n_cols);
    std::copy(row.begin(), row.end(), out.begin() + (size_t)r * w.n_cols);
  }
  return out;
}

// OpenBLAS on one thread for the life of the object. dgesdd's last bits follow OpenBLAS's thread
// count (its blocked updates split differently): factors built on 2 threads differed from those
// built on 1, so one rank (2 threads on 2 cores) and two ranks (1 each) rebuilt different keys.
class blas_single_thread {
 public:
  blas_single_thread() : saved_(openblas_get_num_threads()) { openblas_set_num_threads(1); }
  ~blas_single_thread() { openblas_set_num_threads(saved_); }
  blas_single_thread(const blas_single_thread&) = delete;
  blas_single_thread& operator=(const blas_single_thread&) = delete;

 private:
  int saved_;
};

// Thin SVD of the column-major [m, n] matrix a (destroyed): u [m, k] and vt [k, n]
// column-major, s [k], k = min(m, n).
void svd(std::vector<double>& a, int m, int n, std::vector<double>& s, std::vector<double>& u,
         std::vector<double>& vt, int layer) {
  const int k = std::min(m, n);
  s.assign(k, 0.0), u.assign((size_t)m * k, 0.0), vt.assign((size_t)k * n, 0.0);
  std::vector<int> iwork((size_t)8 * k);
  int lwork = -1, info = 0;
  double query = 0.0;
  const char jobz = 'S';
  dgesdd_(&jobz, &m, &n, a.data(), &m, s.data(), u.data(), &m, vt.data(), &k, &query, &lwork, iwork.data(), &info, 1);
  XCTX_CHECK(info == 0, "x factors: dgesdd workspace query failed for layer ", layer, " (info ", info, ")");
  lwork = (int)query;
  std::vector<double> work((size_t)std::max(1, lwork));
  dgesdd_(&jobz, &m, &n, a.data(), &m, s.data(), u.data(), &m, vt.data(), &k, work.data(), &lwork, iwork.data(),
          &info, 1);
  XCTX_CHECK(info == 0, "x factors: SVD of layer ", layer, " did not converge (dgesdd info ", info, ")");
}

// u [m, k] column-major -> row-major f32; Σ·Vᵀ [k, n] row-major f32.
void store_factors(const std::vector<double>& s, const std::vector<double>& u, const std::vector<double>& vt, int m,
                   int n, std::vector<float>& u_out, std::vector<float>& m_out) {
  const int k = (int)s.size();
  u_out.resize((size_t)m * k);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < k; ++j) u_out[(size_t)i * k + j] = (float)u[(size_t)j * m + i];
  m_out.resize((size_t)k * n);
  for (int j = 0; j < k; ++j)
    for (int c = 0; c < n; ++c) m_out[(size_t)j * n + c] = (float)(s[j] * vt[(size_t)c * k + j]);
}

// W (column-major [d, cols]) as row-major f32 [d, ld] starting at column offset off.
void store_transposed(const std::vector<double>& wcm, int d, int cols, int ld, int off, std::vector<float>& out) {
  for (int c = 0; c < cols; ++c)
    for (int i = 0; i < d; ++i) out[(size_t)i * ld + off + c] = (float)wcm[(size_t)c * d + i];
}

}  // namespace

bool format_needs_x_factors(cache_format f) {
  const cache_family fam = format_traits(f).family;
  return fam == cache_family::family_xquant || fam == cache_family::family_xquant_cl;
}

x_factor_kind x_factor_kind_for(cache_format f) {
  XCTX_CHECK(format_needs_x_factors(f), "cache ", format_traits(f).name, " uses no rebuild factors");
  return format_traits(f).family == cache_family::family_xquant ? x_factor_kind::xf_latent
                                                                : x_factor_kind::xf_cross_layer;
}

std::shared_ptr<const x_factors> build_x_factors(const model_weights& w, x_factor_kind kind) {
  const model_hparams& hp = w.hp;
  auto f = std::make_shared<x_factors>();
  f->kind = kind;
  f->n_layer = hp.n_layer, f->n_embd = hp.n_embd, f->kv_dim = hp.kv_dim();
  f->identity = hp.n_head_kv == hp.n_head;  // MHA caches X itself (§3.1)
  const int d = hp.n_embd, C = hp.kv_dim();
  XCTX_CHECK((int)w.layers.size() == hp.n_layer, "x factors: model has ", w.layers.size(), " layers, hparams say ",
             hp.n_layer);
  f->rank = kind == x_factor_kind::xf_latent ? (f->identity ? d : std::min(d, C))
                                             : (f->identity ? d : std::min(d, 2 * C));
  f->layers.resize(hp.n_layer);
  const blas_single_thread one_thread;  // factors a function of the weights, not of the threads
  for (int l = 0; l < hp.n_layer; ++l) {
    const layer_weights& L = w.layers[l];
    XCTX_CHECK(L.wk.n_cols == d && L.wk.n_rows == C && L.wv.n_cols == d && L.wv.n_rows == C, "x factors: layer ", l,
               " W_k/W_v are ", L.wk.n_rows, "x", L.wk.n_cols, " / ", L.wv.n_rows, "x", L.wv.n_cols, ", expected ", C,
               "x", d);
    x_layer_factors& F = f->layers[l];
    F.b_k = L.bk, F.b_v = L.bv;
    std::vector<double> wk = weight_rows(L.wk, "key", l), wv = weight_rows(L.wv, "value", l);
    std::vector<double> s, u, vt;
    if (kind == x_factor_kind::xf_latent) {
      if (f->identity) {
        F.m_k.resize((size_t)d * C), F.m_v.resize((size_t)d * C);
        store_transposed(wk, d, C, C, 0, F.m_k);
        store_transposed(wv, d, C, C, 0, F.m_v);
        continue;
      }
      svd(wk, d, C, s, u, vt, l);
      store_factors(s, u, vt, d, C, F.u_k, F.m_k);
      svd(wv, d, C, s, u, vt, l);
      store_factors(s, u, vt, d, C, F.u_v, F.m_v);
      continue;
    }
    std::vector<double> wkv(wk);  // column-major [d, 2C]: the columns of W_k, then of W_v
    wkv.insert(wkv.end(), wv.begin(), wv.end());
    F.w_kv.resize((size_t)d * 2 * C);
    store_transposed(wkv, d, 2 * C, 2 * C, 0, F.w_kv);
    if (f->identity) {
      F.m_kv = F.w_kv;
      continue;
    }
    svd(wkv, d, 2 * C, s, u, vt, l);
    store_factors(s, u, vt, d, 2 * C, F.u_kv, F.m_kv);
  }
  return f;
}

size_t x_factor_bytes(const model_hparams& hp, x_factor_kind kind) {
  const size_t d = hp.n_embd, C = hp.kv_dim();
  const bool identity = hp.n_head_kv == hp.n_head;
  size_t per_layer = 0;  // floats, as build_x_factors fills them
  if (kind == x_factor_kind::xf_latent) {
    const size_t r = std::min(d, C);
    per_layer = identity ? 2 * d * C : 2 * (d * r + r * C);  // m_k, m_v (+ u_k, u_v)
  } else {
    const size_t r2 = std::min(d, 2 * C);
    per_layer = identity ? 4 * d * C : 2 * d * C + d * r2 + r2 * 2 * C;  // w_kv, m_kv (+ u_kv)
  }
  if (hp.qkv_bias) per_layer += 2 * C;  // b_k, b_v
  return (size_t)hp.n_layer * per_layer * sizeof(float);
}

std::vector<std::vector<float>*> x_factor_arrays(x_factors& f) {
  std::vector<std::vector<float>*> out;
  for (x_layer_factors& L : f.layers)
    for (std::vector<float>* a : {&L.u_k, &L.u_v, &L.m_k, &L.m_v, &L.u_kv, &L.m_kv, &L.w_kv, &L.b_k, &L.b_v})
      out.push_back(a);
  return out;
}

uint64_t x_factors_digest(const x_factors& f) {
  hash64 h;
  const int32_t shape[5] = {(int32_t)f.kind, f.n_layer, f.n_embd, f.kv_dim, f.rank};
  h.update(shape, sizeof shape);
  for (const std::vector<float>* a : x_factor_arrays(const_cast<x_factors&>(f))) {
    const uint64_t n = a->size();
    h.update(&n, sizeof n);
    h.update(a->data(), n * sizeof(float));
  }
  return h.digest();
}

void check_x_factors(const x_factors* f, cache_format fmt, const cache_geometry& g) {
  const char* name = format_traits(fmt).name;
  XCTX_CHECK(f != nullptr, "cache ", name,
             " needs the model's rebuild factors (cache_options.factors, made by build_x_factors; the CLI builds "
             "them from the loaded model)");
  const x_factor_kind want = x_factor_kind_for(fmt);
  XCTX_CHECK(f->kind == want, "cache ", name, ": rebuild factors are of the wrong kind (",
             f->kind == x_factor_kind::xf_latent ? "xquant" : "xquant-cl", ")");
  const int C = g.n_head_kv * g.head_dim;
  XCTX_CHECK(f->n_layer == g.n_layer && f->n_embd == g.n_embd && f->kv_dim == C, "cache ", name,
             ": rebuild factors are for ", f->n_layer, " layers, n_embd ", f->n_embd, ", kv_dim ", f->kv_dim,
             "; the cache has ", g.n_layer, ", ", g.n_embd, ", ", C);
  XCTX_CHECK(f->identity == !xquant_uses_latents(g), "cache ", name,
             ": rebuild factors and geometry disagree on MHA vs GQA (n_head ", g.n_head, ", n_head_kv ", g.n_head_kv,
             ")");
  const int want_rank = want == x_factor_kind::xf_latent ? xquant_rank(g) : xquant_cl_rank(g);
  XCTX_CHECK(f->rank == want_rank, "cache ", name, ": factor rank ", f->rank, " != ", want_rank);
}

namespace {
// The arrays of a layer, in x_layer_factor_ptrs' order.
std::array<const std::vector<float>*, 9> layer_arrays(const x_layer_factors& F) {
  return {&F.u_k, &F.u_v, &F.m_k, &F.m_v, &F.u_kv, &F.m_kv, &F.w_kv, &F.b_k, &F.b_v};
}
std::array<const float**, 9> layer_slots(x_layer_factor_ptrs& P) {
  return {&P.u_k, &P.u_v, &P.m_k, &P.m_v, &P.u_kv, &P.m_kv, &P.w_kv, &P.b_k, &P.b_v};
}
}  // namespace

x_factors_on_backend::x_factors_on_backend(backend& be, const x_factors& f) : copy_(be) {
  size_t total = 0;
  for (const x_layer_factors& F : f.layers)
    for (const std::vector<float>* v : layer_arrays(F)) total += v->size();
  float* dev = be.host_memory() ? nullptr : copy_.reserve_as<float>((int64_t)std::max<size_t>(total, 1));
  size_t at = 0;
  layers_.resize(f.layers.size());
  for (size_t l = 0; l < f.layers.size(); ++l) {
    const auto src = layer_arrays(f.layers[l]);
    const auto dst = layer_slots(layers_[l]);
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i]->empty()) continue;
      if (dev == nullptr) {
        *dst[i] = src[i]->data();
        continue;
      }
      *dst[i] = dev + at;
      be.upload(dev + at, src[i]->data(), src[i]->size() * sizeof(float));
      at += src[i]->size();
    }
  }
}

namespace {
// The live uploads by (backend, factors), under their mutex.
std::mutex& uploads_mutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::pair<const backend*, const x_factors*>, std::weak_ptr<const x_factors_on_backend>>& live_uploads() {
  static std::map<std::pair<const backend*, const x_factors*>, std::weak_ptr<const x_factors_on_backend>> live;
  return live;
}
}  // namespace

bool x_factors_on_backend::resident(const backend& be, const x_factors& f) {
  std::lock_guard<std::mutex> lock(uploads_mutex());
  const auto it = live_uploads().find({&be, &f});
  return it != live_uploads().end() && !it->second.expired();
}

std::shared_ptr<const x_factors_on_backend> x_factors_on_backend::get(backend& be, const x_factors& f) {
  std::lock_guard<std::mutex> lock(uploads_mutex());
  auto& live = live_uploads();
  for (auto it = live.begin(); it != live.end();) it = it->second.expired() ? live.erase(it) : std::next(it);
  std::weak_ptr<const x_factors_on_backend>& slot = live[{&be, &f}];
  std::shared_ptr<const x_factors_on_backend> p = slot.lock();
  if (p == nullptr) slot = p = std::make_shared<const x_factors_on_backend>(be, f);
  return p;
}

}  // namespace xctx
