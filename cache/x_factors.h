// Offline rebuild factors of the X caches (XQuant §3.3): per layer, the SVD of the key/value
// projections of the model, in f32. The paper writes K = X·W_k with W_k of shape [d, kv_dim];
// the engine's weight_view holds the transpose (rows = outputs), so W_k here is wkᵀ.
//
//  latent (xquant, GQA):  W_k = U_k Σ_k B_kᵀ. Cached: X·U_k [n, r] and X·U_v [n, r], r = kv_dim.
//                         Rebuild: K = (X·U_k)·(Σ_k B_kᵀ) + b_k; V via (Σ_v B_vᵀ).
//  x (xquant, MHA):       no SVD; K = X·W_k + b_k directly (u_k is empty = identity).
//  cross_layer (xquant-cl): [W_k | W_v] = U_kv Σ_kv B_kvᵀ with U_kv [d, r2], r2 = min(d, 2 kv_dim)
//                         (GQA) or the identity (MHA). Deltas are cached as ΔX·U_kv and added
//                         back to the accumulator as (ΔX·U_kv)·U_kvᵀ; K|V = X̂·[W_k|W_v] + b.
//                         Σ_kv B_kvᵀ rebuilds K|V from a latent X̂·U_kv (the ring's blocks).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/format.h"
#include "kernels/ops.h"
#include "model/weights.h"

namespace xctx {

enum class x_factor_kind : uint8_t { xf_latent, xf_cross_layer };

struct x_layer_factors {
  // latent / x
  std::vector<float> u_k, u_v;  // [d, r] row-major; empty = identity (MHA: the latent is X)
  std::vector<float> m_k, m_v;  // [r, kv]: Σ Bᵀ (latent) or W_k, W_v (identity u)
  // cross_layer
  std::vector<float> u_kv;   // [d, r2]; empty = identity (MHA)
  std::vector<float> m_kv;   // [r2, 2 kv]: Σ_kv B_kvᵀ (or [W_k | W_v] for MHA)
  std::vector<float> w_kv;   // [d, 2 kv]: [W_k | W_v], rebuilds K|V from the accumulator
  std::vector<float> b_k, b_v;  // [kv] or empty
};

struct x_factors {
  x_factor_kind kind = x_factor_kind::xf_latent;
  int n_layer = 0;
  int n_embd = 0;  // d
  int kv_dim = 0;  // n_head_kv * head_dim
  int rank = 0;    // r (latent/x) or r2 (cross_layer)
  bool identity = false;  // MHA: no SVD, the latent is X itself
  std::vector<x_layer_factors> layers;
};

// The factor kind a format needs (throws for formats that need none).
x_factor_kind x_factor_kind_for(cache_format f);
bool format_needs_x_factors(cache_format f);

// Dequantizes W_k, W_v row by row and runs the SVD in double (LAPACK dgesdd from OpenBLAS, on one
// thread: the factors are then a function of the weights and the OpenBLAS build alone).
// latent is used for GQA geometries (n_head_kv < n_head), identity factors for MHA.
std::shared_ptr<const x_factors> build_x_factors(const model_weights& w, x_factor_kind kind);

// The bytes build_x_factors(w, kind) holds for a model of these hyperparameters: what a device
// backend's upload of them (x_factors_on_backend) allocates.
size_t x_factor_bytes(const model_hparams& hp, x_factor_kind kind);

// Every array of the factors (layer by layer, a fixed order; empty ones included): what a rank
// receives when it takes another rank's factors.
std::vector<std::vector<float>*> x_factor_arrays(x_factors& f);
// A digest of the shape and every array's bits.
uint64_t x_factors_digest(const x_factors& f);

// Throws unless the factors exist and fit the geometry (names the format and the mismatch).
void check_x_factors(const x_factors* f, cache_format fmt, const cache_geometry& g);

// One layer's factors where a backend's kernels read them (null for an empty array).
struct x_layer_factor_ptrs {
  const float *u_k = nullptr, *u_v = nullptr, *m_k = nullptr, *m_v = nullptr;
  const float *u_kv = nullptr, *m_kv = nullptr, *w_kv = nullptr;
  const float *b_k = nullptr, *b_v = nullptr;
};

// Every layer's factors in a backend's memory: the host arrays themselves on host-memory
// backends; on the others one upload, shared by all the caches made on that backend from the
// same factors (a rank's own cache and its star anchor / block caches) and freed with the last.
// They are model data, like the weights: not in a cache's bytes_allocated.
class x_factors_on_backend {
 public:
  x_factors_on_backend(backend& be, const x_factors& f);
  const x_layer_factor_ptrs& layer(int l) const { return layers_.at(l); }
  size_t backend_bytes() const { return copy_.bytes(); }
  // The instance for (be, f), made on first use; callers keep it alive while they use it.
  static std::shared_ptr<const x_factors_on_backend> get(backend& be, const x_factors& f);
  // Whether such an instance is alive now (its memory is already taken on be).
  static bool resident(const backend& be, const x_factors& f);

 private:
  backend_buffer copy_;
  std::vector<x_layer_factor_ptrs> layers_;
};

}  // namespace xctx
