// Reference attention: per (query, head) a plain two-pass softmax in double. Slow on purpose.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/softmax_acc.h"

namespace xctx::ref {

namespace {

void check_args(const attn_args& a) {
  XCTX_CHECK(a.n_q >= 0 && a.n_kv >= 0, "attention: negative sizes n_q=", a.n_q, " n_kv=", a.n_kv);
  XCTX_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0,
             "attention: n_head=", a.n_head, " must be a positive multiple of n_head_kv=", a.n_head_kv);
  XCTX_CHECK(a.head_dim > 0, "attention: head_dim must be positive, got ", a.head_dim);
  for (int64_t j = 1; j < a.n_kv; ++j)
    XCTX_CHECK(a.kv_pos[j - 1] <= a.kv_pos[j], "attention: kv_pos must be non-decreasing, kv_pos[", j - 1,
               "]=", a.kv_pos[j - 1], " > kv_pos[", j, "]=", a.kv_pos[j]);
}

// The whole cache as double, converted once: [n_kv, n_head_kv, head_dim].
std::vector<double> kv_as_double(const void* base, kv_dtype type, int64_t n) {
  std::vector<double> out((size_t)n);
  for (int64_t e = 0; e < n; ++e) {
    switch (type) {
      case kv_dtype::kv_f32: out[e] = ((const float*)base)[e]; break;
      case kv_dtype::kv_f16: out[e] = fp16_to_fp32(((const uint16_t*)base)[e]); break;
    }
  }
  return out;
}

}  // namespace

double rope_score(const float* q, const double* k, const rope_config& cfg, int32_t q_pos, int32_t k_pos) {
  double s = 0.0;
  if (!self_extend_on(cfg) || (int64_t)q_pos - k_pos < cfg.se_window) {
    for (int d = 0; d < cfg.head_dim; ++d) s += (double)q[d] * k[d];
    return s;
  }
  // (R(a) q)·(R(b) k) = q·(R(b - a) k): the key turned by the difference of the two turns.
  const int64_t turn = (self_extend_key_pos(cfg, k_pos) - k_pos) - (self_extend_query_pos(cfg, q_pos) - q_pos);
  for (int i = 0; i < cfg.n_rot / 2; ++i) {
    const double th = rope_theta(cfg, (int32_t)turn, i), c = std::cos(th), sn = std::sin(th);
    const double k0 = k[2 * i] * c - k[2 * i + 1] * sn, k1 = k[2 * i] * sn + k[2 * i + 1] * c;
    s += (double)q[2 * i] * k0 + (double)q[2 * i + 1] * k1;
  }
  for (int d = cfg.n_rot; d < cfg.head_dim; ++d) s += (double)q[d] * k[d];
  return s;
}

void attention_partial(const attn_args& a) {
  if (a.acc != nullptr) {  // the oracle deposits its whole partial at once
    with_accumulator(a, a.n_q * a.n_head, a.head_dim, [](const attn_args& b) { attention_partial(b); });
    return;
  }
  check_args(a);
  const int group = a.n_head / a.n_head_kv;
  const int hd = a.head_dim;
  const int64_t n_elem = a.n_kv * a.n_head_kv * hd;
  const std::vector<double> k = kv_as_double(a.k, a.kv_type, n_elem);  // [n_kv, n_head_kv, head_dim]
  const std::vector<double> v = kv_as_double(a.v, a.kv_type, n_elem);  // [n_kv, n_head_kv, head_dim]
  rope_config rope = a.rope;  // only SelfExtend's fields matter; the head size is the call's
  rope.head_dim = hd;
  if (self_extend_on(rope))
    XCTX_CHECK(rope.n_rot <= hd && rope.n_rot % 2 == 0, "attention: SelfExtend rope n_rot=", rope.n_rot,
               " does not fit head_dim=", hd);
  std::vector<double> score((size_t)a.n_kv);  // [n_kv]
  std::vector<double> acc((size_t)hd);        // [head_dim]
  if (a.select != nullptr) check_selection(*a.select, a.n_q, a.n_head_kv, "attention");
  for (int64_t i = 0; i < a.n_q; ++i) {
    for (int h = 0; h < a.n_head; ++h) {
      const float* q = a.q + (i * a.n_head + h) * hd;
      const int kvh = h / group;
      // Causal, and inside the units query i's list for this head holds when there is a
      // selection (retrieval).
      const auto visible = [&](int64_t j) {
        return a.kv_pos[j] <= a.q_pos[i] && (a.select == nullptr || a.select->sees(i, kvh, attn_unit_of(a.kv_pos[j])));
      };
      float* o = a.o + (i * a.n_head + h) * hd;
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < a.n_kv; ++j) {
        if (!visible(j)) continue;
        const double* kr = k.data() + (j * a.n_head_kv + kvh) * hd;
        score[j] = rope_score(q, kr, rope, a.q_pos[i], a.kv_pos[j]) * (double)a.scale;
        m = std::max(m, score[j]);
      }
      if (m == -std::numeric_limits<double>::infinity()) {
        std::fill(o, o + hd, 0.0f);
        a.lse[i * a.n_head + h] = -std::numeric_limits<float>::infinity();
        continue;
      }
      double sum = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < a.n_kv; ++j) {
        if (!visible(j)) continue;
        const double p = std::exp(score[j] - m);
        sum += p;
        const double* vr = v.data() + (j * a.n_head_kv + kvh) * hd;
        for (int d = 0; d < hd; ++d) acc[d] += p * vr[d];
      }
      for (int d = 0; d < hd; ++d) o[d] = (float)(acc[d] / sum);
      a.lse[i * a.n_head + h] = (float)(m + std::log(sum));
    }
  }
}

void merge_partials(const float* o_parts /*[n_part, n_row, head_dim]*/, const float* lse_parts /*[n_part, n_row]*/,
                    int n_part, int64_t n_row, int head_dim, float* o /*[n_row, head_dim]*/, float* lse /*[n_row]*/) {
  XCTX_CHECK(n_part > 0, "merge_partials: need at least one part, got ", n_part);
  XCTX_CHECK(head_dim > 0 && n_row >= 0, "merge_partials: bad shape n_row=", n_row, " head_dim=", head_dim);
  std::vector<double> acc((size_t)head_dim);  // [head_dim]; o may alias part 0, so build the row first
  for (int64_t r = 0; r < n_row; ++r) {
    double m = -std::numeric_limits<double>::infinity();
    for (int p = 0; p < n_part; ++p) m = std::max(m, (double)lse_parts[p * n_row + r]);
    if (m == -std::numeric_limits<double>::infinity()) {
      std::fill(o + r * head_dim, o + (r + 1) * head_dim, 0.0f);
      lse[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    double sum = 0.0;
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int p = 0; p < n_part; ++p) {
      const double w = std::exp((double)lse_parts[p * n_row + r] - m);  // 0 for an empty (-inf) part
      if (w == 0.0) continue;
      sum += w;
      const float* op = o_parts + ((int64_t)p * n_row + r) * head_dim;
      for (int d = 0; d < head_dim; ++d) acc[d] += w * op[d];
    }
    for (int d = 0; d < head_dim; ++d) o[r * head_dim + d] = (float)(acc[d] / sum);
    lse[r] = (float)(m + std::log(sum));
  }
}

}  // namespace xctx::ref
