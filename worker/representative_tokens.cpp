#include "worker/representative_tokens.h"

#include <cblas.h>

#include <algorithm>
#include <numeric>

#include "common/error.h"

namespace xctx {

representative_tokens::representative_tokens(int n_head, int n_head_kv, int head_dim, int64_t block, int64_t window,
                                             const rope_config& rope, backend& be)
    : n_head_(n_head), n_head_kv_(n_head_kv), head_dim_(head_dim), block_(block), window_(window), rope_(rope), be_(be) {
  XCTX_CHECK(be.host_memory(), "representative tokens: host-memory backends only");
  XCTX_CHECK(n_head_kv > 0 && n_head % n_head_kv == 0 && block > 0 && window > 0, "representative tokens: bad shape");
  rope_.se_group = 1, rope_.se_window = 0;  // the keys' true positions: within W of a query
}

void representative_tokens::clear() {
  open_.clear();
  chosen_.clear();
}

void representative_tokens::begin_star_block() {
  for (auto& [layer, b] : open_) choose(layer, b);
  open_.clear();
}

void representative_tokens::keys(int layer, const layer_input& in) {
  if (in.n <= 0) return;
  open_block& b = open_[layer];
  const size_t C = (size_t)n_head_kv_ * head_dim_, n0 = b.pos.size(), n = (size_t)in.n;
  XCTX_CHECK(n0 == 0 || in.pos[0] > b.pos.back(), "representative tokens: positions must ascend within a star block");
  b.pos.insert(b.pos.end(), in.pos, in.pos + n);
  b.k.insert(b.k.end(), in.k, in.k + n * C);
  b.k_rot.insert(b.k_rot.end(), in.k, in.k + n * C);
  be_.rope(b.k_rot.data() + n0 * C, in.pos, in.n, n_head_kv_, rope_);
  b.score.resize((n0 + n) * n_head_kv_, 0.0);
  b.seen.resize(n0 + n, 0);
  for (size_t i = 0; i < n; ++i) b.eligible.push_back((int64_t)i >= in.summary_skip ? 1 : 0);
}

void representative_tokens::queries(int layer, const float* q, const int32_t* q_pos, int64_t n_q) {
  const auto it = open_.find(layer);
  if (it == open_.end() || n_q <= 0) return;
  open_block& b = it->second;
  const int H = n_head_, hd = head_dim_, g = n_head_ / n_head_kv_;
  const int C = n_head_kv_ * hd;
  constexpr int64_t kTile = 256;
  for (int64_t i0 = 0; i0 < n_q; i0 += kTile) {
    const int64_t m = std::min(kTile, n_q - i0);
    const int32_t p_lo = *std::min_element(q_pos + i0, q_pos + i0 + m);
    const int32_t p_hi = *std::max_element(q_pos + i0, q_pos + i0 + m);
    // The keys some query of the tile sees: strictly earlier, at most W back.
    const int64_t k0 = std::lower_bound(b.pos.begin(), b.pos.end(), (int64_t)p_lo - window_) - b.pos.begin();
    const int64_t k1 = std::lower_bound(b.pos.begin(), b.pos.end(), p_hi) - b.pos.begin();
    const int64_t nk = k1 - k0;
    if (nk <= 0) continue;
    tile_.resize((size_t)(m * nk));
    for (int h = 0; h < H; ++h) {
      const int kvh = h / g;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)nk, hd, 1.0f, q + ((size_t)i0 * H + h) * hd,
                  H * hd, b.k_rot.data() + (size_t)k0 * C + (size_t)kvh * hd, C, 0.0f, tile_.data(), (int)nk);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t p = q_pos[i0 + i];
        const float* row = tile_.data() + (size_t)(i * nk);
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t pm = b.pos[(size_t)(k0 + j)];
          if (pm < p && p - pm <= window_) b.score[(size_t)(k0 + j) * n_head_kv_ + kvh] += row[j];
        }
      }
    }
    for (int64_t i = 0; i < m; ++i) {
      const int64_t p = q_pos[i0 + i];
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t pm = b.pos[(size_t)(k0 + j)];
        if (pm < p && p - pm <= window_) ++b.seen[(size_t)(k0 + j)];
      }
    }
  }
}

void representative_tokens::choose(int layer, open_block& b) {
  const size_t n = b.pos.size(), hd = (size_t)head_dim_, C = (size_t)n_head_kv_ * hd;
  std::map<int64_t, block_keys>& out = chosen_[layer];
  std::vector<size_t> rows;
  for (size_t r0 = 0; r0 < n;) {
    const int64_t id = floor_div(b.pos[r0], block_);
    size_t r1 = r0;
    while (r1 < n && floor_div(b.pos[r1], block_) == id) ++r1;
    XCTX_CHECK(out.find(id) == out.end(), "representative tokens: block ", id, " spans two star blocks");
    block_keys& bk = out[id];
    bk.k.assign((size_t)n_head_kv_ * kPerBlock * hd, 0.0f);
    bk.count.assign((size_t)n_head_kv_, 0);
    for (int kvh = 0; kvh < n_head_kv_; ++kvh) {
      rows.clear();
      for (size_t r = r0; r < r1; ++r)
        if (b.eligible[r] && b.seen[r] > 0) rows.push_back(r);
      const auto mean = [&](size_t r) { return b.score[r * n_head_kv_ + kvh] / b.seen[r]; };
      const size_t top = std::min<size_t>(rows.size(), kPerBlock);
      std::partial_sort(rows.begin(), rows.begin() + (std::ptrdiff_t)top, rows.end(), [&](size_t x, size_t y) {
        const double mx = mean(x), my = mean(y);
        return mx > my || (mx == my && x < y);
      });
      for (size_t j = 0; j < top; ++j)
        std::copy_n(b.k.data() + rows[j] * C + kvh * hd, hd, bk.k.data() + ((size_t)kvh * kPerBlock + j) * hd);
      bk.count[(size_t)kvh] = (int)top;
    }
    r0 = r1;
  }
}

const representative_tokens::block_keys* representative_tokens::of(int layer, int64_t block_id) {
  if (!open_.empty()) begin_star_block();  // the prefill is over: choose the last block's
  const auto l = chosen_.find(layer);
  if (l == chosen_.end()) return nullptr;
  const auto it = l->second.find(block_id);
  return it == l->second.end() ? nullptr : &it->second;
}

}  // namespace xctx
