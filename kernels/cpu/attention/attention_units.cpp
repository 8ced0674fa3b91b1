#include "kernels/cpu/attention/attention_units.h"

#include <omp.h>

#include <algorithm>
#include <limits>

#include "common/error.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/omp_errors.h"
#include "kernels/cpu/attention/rope_tile.h"
#include "kernels/cpu/workspace.h"

namespace xctx::cpu {
namespace {

// Queries per decode-kernel call on the many-query path: the unit's tiles stay in L1 across
// their rows instead of streaming from L2 once per query.
constexpr int kQueryBlock = 16;

// The per-query work shared by both paths: the decode kernel over one unit, then the deposit.
struct query_runner {
  const unit_queries& qs;
  const std::vector<float>& q_scaled;     // [n_q, n_head, head_dim]
  const query_ranges& qr;
  impl::isa isa;
  // Per-thread scratch, kept between calls (a decode step calls this 30 times per token; fresh
  // zeroed buffers per call cost more than the attention over a short cache).
  struct scratch_space {
    std::vector<float> o, lse, scratch, q_block, q_block_far;  // [R, hd], [R], decode scratch, [R, hd] x2
    std::vector<int64_t> row_end, row_of;                      // [R]
  };
  scratch_space& sp;
  std::vector<float>& o;
  std::vector<float>& lse;
  std::vector<float>& scratch;
  std::vector<int64_t>& row_end;
  std::vector<float>& q_block;      // rows by kv head
  std::vector<float>& q_block_far;  // the same rows of the grouped-side queries (SelfExtend)
  std::vector<int64_t>& row_of;     // -> (query, head) row of acc

  static scratch_space& thread_scratch() {
    thread_local scratch_space s;
    return s;
  }
  // max_queries: queries per decode-kernel call (1, or kQueryBlock on the blocked path).
  query_runner(const unit_queries& q, const std::vector<float>& qsc, const query_ranges& r, int max_queries)
      : qs(q), q_scaled(qsc), qr(r), isa(impl::best_isa()), sp(thread_scratch()), o(sp.o), lse(sp.lse),
        scratch(sp.scratch), row_end(sp.row_end), q_block(sp.q_block), q_block_far(sp.q_block_far),
        row_of(sp.row_of) {
    const size_t R = (size_t)max_queries * qs.n_head;
    o.resize(R * qs.head_dim);
    lse.resize(R);
    scratch.resize((size_t)impl::decode_scratch_floats((int)R, qs.head_dim));
    row_end.resize(R);
    q_block.resize(R * qs.head_dim);
    q_block_far.resize(qr.grouped ? R * qs.head_dim : 0);
    row_of.resize(R);
  }
  // Several queries in one decode-kernel call give each row the same arithmetic as a call of
  // its own query alone only if the kernel's 3-row blocks never mix queries: the rows of one kv
  // head are ordered by query, so that holds when a query has a multiple of 3 heads per kv head.
  bool can_block() const { return (qs.n_head / qs.n_head_kv) % 3 == 0; }
  // Rows of queries [i0, i0 + nqb) in the kernel's order r = (kvh * nqb + ii) * g + u.
  void set_block(int64_t i0, int nqb) {
    const int g = qs.n_head / qs.n_head_kv, hd = qs.head_dim;
    for (int kvh = 0; kvh < qs.n_head_kv; ++kvh)
      for (int ii = 0; ii < nqb; ++ii)
        for (int u = 0; u < g; ++u) {
          const int64_t r = ((int64_t)kvh * nqb + ii) * g + u;
          row_of[(size_t)r] = (i0 + ii) * qs.n_head + (int64_t)kvh * g + u;
          std::copy(q_scaled.begin() + row_of[(size_t)r] * hd, q_scaled.begin() + (row_of[(size_t)r] + 1) * hd,
                    q_block.begin() + r * hd);
          if (qr.grouped)
            std::copy(qr.q_far.begin() + row_of[(size_t)r] * hd, qr.q_far.begin() + (row_of[(size_t)r] + 1) * hd,
                      q_block_far.begin() + r * hd);
        }
    block_i0 = i0, block_n = nqb;
  }
  // The block's queries over one unit. Both sides' key ranges are prefixes of the unit [0, e)
  // -- the grouped side always, the near side when no query's window edge falls inside the unit;
  // a query whose does is run alone (the kernel's rows are the same arithmetic either way).
  void run_block_sides(const unit_kv& kv, const unit_kv& kv_far, int64_t s0, int n, softmax_acc& acc) {
    bool prefix = true;
    for (int ii = 0; ii < block_n && prefix; ++ii) prefix = qr.near(block_i0 + ii, s0, n).first == 0;
    if (prefix) {
      run_block(kv, q_block, false, s0, n, acc);
    } else {
      for (int ii = 0; ii < block_n; ++ii) {
        const auto [b, e] = qr.near(block_i0 + ii, s0, n);
        run(block_i0 + ii, false, kv, s0, b, e, n, acc);
      }
    }
    if (qr.grouped) run_block(kv_far, q_block_far, true, s0, n, acc);
  }
  void run_block(const unit_kv& kv, const std::vector<float>& rows, bool far, int64_t s0, int n, softmax_acc& acc) {
    const int g = qs.n_head / qs.n_head_kv;
    const int R = block_n * qs.n_head;
    bool any = false;
    for (int r = 0; r < R; ++r) {
      const int64_t i = block_i0 + (r / g) % block_n;
      // The near side runs here only when every row's range is a prefix [0, e) (run_block_sides).
      row_end[(size_t)r] = far ? qr.far(i, s0, n).second : qr.near(i, s0, n).second;
      row_end[(size_t)r] = std::max<int64_t>(row_end[(size_t)r], 0);
      any = any || row_end[(size_t)r] > 0;
    }
    if (!any) return;
    impl::decode_job jb;
    jb.q = rows.data(), jb.row_end = row_end.data(), jb.R = R;
    jb.n_kvh = qs.n_head_kv, jb.hd = qs.head_dim;
    jb.k = kv.k, jb.v = kv.v, jb.type = kv.type, jb.ld = kv.ld;
    jb.j0 = 0, jb.j1 = n;
    jb.o = o.data(), jb.lse = lse.data(), jb.scratch = scratch.data();
    jb.avx512_rows = qs.avx512_rows;
    impl::decode_block(isa, jb);
    for (int r = 0; r < R; ++r)  // rows ordered (kvh, query, head of the group)
      if (qr.head_sees(block_i0 + (r / g) % block_n, r / (g * block_n), s0))
        acc.add_partial(row_of[(size_t)r], lse[(size_t)r], o.data() + (size_t)r * qs.head_dim);
  }
  int64_t block_i0 = 0;
  int block_n = 0;
  // Query i over the unit's slots [b, e) (relative to s0): the near side with the unit's keys,
  // or the grouped side (far) with its grouped keys and the turned query.
  void run(int64_t i, bool far, const unit_kv& kv, int64_t s0, int64_t b, int64_t e, int n, softmax_acc& acc) {
    if (b >= e) return;
    std::fill(row_end.begin(), row_end.end(), e);
    impl::decode_job jb;
    jb.q = (far ? qr.q_far : q_scaled).data() + (size_t)i * qs.n_head * qs.head_dim;
    jb.row_end = row_end.data();
    jb.R = qs.n_head;  // rows in head order: head h reads kv head h / (n_head / n_head_kv)
    jb.n_kvh = qs.n_head_kv;
    jb.hd = qs.head_dim;
    jb.k = kv.k, jb.v = kv.v, jb.type = kv.type, jb.ld = kv.ld;
    jb.j0 = b, jb.j1 = n;
    jb.o = o.data(), jb.lse = lse.data(), jb.scratch = scratch.data();
    jb.avx512_rows = qs.avx512_rows;
    impl::decode_block(isa, jb);
    const int g = qs.n_head / qs.n_head_kv;
    for (int h = 0; h < qs.n_head; ++h)
      if (qr.head_sees(i, h / g, s0)) acc.add_partial(i * qs.n_head + h, lse[(size_t)h], o.data() + (size_t)h * qs.head_dim);
  }
  // Both sides of query i over one unit (kv_far: the grouped keys, only read when needed).
  void run_both(int64_t i, const unit_kv& kv, const unit_kv& kv_far, int64_t s0, int n, softmax_acc& acc) {
    const auto [nb, ne] = qr.near(i, s0, n);
    run(i, false, kv, s0, nb, ne, n, acc);
    if (qr.grouped) {
      const auto [fb, fe] = qr.far(i, s0, n);
      run(i, true, kv_far, s0, fb, fe, n, acc);
    }
  }
};

// Shared checks of both entries; returns false when there is nothing to attend.
bool check_units_args(const unit_queries& qs, const int32_t* kv_pos, int64_t n_kv, const softmax_acc& acc) {
  XCTX_CHECK(qs.n_head > 0 && qs.n_head_kv > 0 && qs.n_head % qs.n_head_kv == 0 && qs.head_dim > 0,
             "attention: bad heads n_head=", qs.n_head, " n_head_kv=", qs.n_head_kv, " head_dim=", qs.head_dim);
  XCTX_CHECK(acc.rows() == qs.n_q * qs.n_head && acc.width() == qs.head_dim, "attention: accumulator of ",
             acc.rows(), " x ", acc.width(), " for ", qs.n_q, " queries x ", qs.n_head, " heads x ", qs.head_dim);
  if (!std::is_sorted(kv_pos, kv_pos + n_kv)) {  // the cheap scan first: this runs every decode step
    const int64_t j = std::is_sorted_until(kv_pos, kv_pos + n_kv) - kv_pos;
    fail("attention: kv_pos must be non-decreasing, kv_pos[", j - 1, "]=", kv_pos[j - 1], " > kv_pos[", j, "]=",
         kv_pos[j]);
  }
  return qs.n_q > 0 && n_kv > 0;
}

}  // namespace

query_ranges::query_ranges(const unit_queries& qs, const int32_t* kv_pos, int64_t n_kv)
    : end((size_t)qs.n_q),
      split((size_t)qs.n_q, 0),
      grouped(qs.rope != nullptr && self_extend_on(*qs.rope)),
      kv_pos(kv_pos),
      select(qs.select) {
  if (select != nullptr) check_selection(*select, qs.n_q, qs.n_head_kv, "attention");
  for (int64_t i = 0; i < qs.n_q; ++i) {
    end[i] = std::upper_bound(kv_pos, kv_pos + n_kv, qs.q_pos[i]) - kv_pos;
    kv_len = std::max(kv_len, end[i]);
    if (grouped) {
      const int64_t last = self_extend_last_grouped(*qs.rope, qs.q_pos[i]);
      split[i] = std::upper_bound(kv_pos, kv_pos + end[i], last, [](int64_t p, int32_t k) { return p < k; }) - kv_pos;
    }
  }
  if (grouped && kv_len > 0) {
    q_far = impl::self_extend_queries(qs.q, qs.q_pos, qs.n_q, qs.n_head, *qs.rope);
    for (float& x : q_far) x *= qs.scale;
  }
}

std::vector<int64_t> query_ranges::visible_units(const std::vector<int64_t>& ub) const {
  std::vector<int64_t> out;
  const int64_t n_unit = (int64_t)ub.size() - 1;
  out.reserve((size_t)n_unit);
  for (int64_t u = 0; u < n_unit; ++u) {
    bool any = select == nullptr;
    for (size_t i = 0; i < end.size() && !any; ++i) any = selected((int64_t)i, ub[u]);
    if (any) out.push_back(u);
  }
  return out;
}

bool query_ranges::any_near(int64_t s0, int n) const {
  for (size_t i = 0; i < end.size(); ++i) {
    const auto [b, e] = near((int64_t)i, s0, n);
    if (b < e) return true;
  }
  return false;
}

bool query_ranges::any_far(int64_t s0, int n) const {
  if (!grouped) return false;
  for (size_t i = 0; i < end.size(); ++i)
    if (far((int64_t)i, s0, n).second > 0) return true;
  return false;
}

std::vector<int64_t> unit_bounds(const int32_t* pos, int64_t n) {
  // Positions ascend: each unit ends where the first position of a later unit is, found by
  // binary search (O(units · log n), not a pass over every slot of every decode step).
  std::vector<int64_t> b;
  for (int64_t s = 0; s < n;) {
    b.push_back(s);
    const int64_t u = attn_unit_of(pos[s]);
    s = std::partition_point(pos + s, pos + n, [&](int32_t p) { return attn_unit_of(p) == u; }) - pos;
  }
  b.push_back(n);
  return b;
}

void attend_units(const unit_queries& qs, const int32_t* kv_pos, int64_t n_kv,
                  const std::function<std::unique_ptr<unit_loader>()>& make_loader, softmax_acc& acc) {
  if (!check_units_args(qs, kv_pos, n_kv, acc)) return;
  const int hd = qs.head_dim;
  const int C = qs.n_head_kv * hd;
  const query_ranges ranges(qs, kv_pos, n_kv);
  const int64_t kv_len = ranges.kv_len;
  if (kv_len == 0) return;
  std::vector<float> q_scaled((size_t)qs.n_q * qs.n_head * hd);
  for (size_t e = 0; e < q_scaled.size(); ++e) q_scaled[e] = qs.q[e] * qs.scale;
  const std::vector<int64_t> ub = unit_bounds(kv_pos, kv_len);
  const int64_t n_unit = (int64_t)ub.size() - 1;
  const int threads = omp_get_max_threads();
  const int sides = ranges.grouped ? 2 : 1;  // unit buffers: near keys, grouped keys

  if (qs.n_q < 2 * threads) {
    // Few queries (decode): threads split the units, each deposits into its own accumulator;
    // the exact merge makes the split invisible.
    const std::vector<int64_t> vis = ranges.visible_units(ub);
    const int64_t n_vis = (int64_t)vis.size();
    omp_error_carrier errors;
#pragma omp parallel if (n_vis > 1 && threads > 1)
    {
      std::unique_ptr<unit_loader> ld = make_loader();
      query_runner qr(qs, q_scaled, ranges, 1);
      thread_local std::vector<float> kbuf, vbuf;  // [sides, kAttnUnit, C] each, reused across calls
      kbuf.resize((size_t)sides * kAttnUnit * C), vbuf.resize((size_t)sides * kAttnUnit * C);
      float* kfar = kbuf.data() + (size_t)(sides - 1) * kAttnUnit * C;
      float* vfar = vbuf.data() + (size_t)(sides - 1) * kAttnUnit * C;
      thread_local softmax_acc mine;
      mine.reset(acc.rows(), acc.width());
      // Contiguous ranges: each thread streams one run of the cache front to back.
#pragma omp for schedule(static)
      for (int64_t x = 0; x < n_vis; ++x) {
        const int64_t u = vis[(size_t)x];
        const int64_t s0 = ub[u];
        const int n = (int)(ub[u + 1] - s0);
        if (x + 1 < n_vis) {
          const int64_t nx = vis[(size_t)x + 1];
          ld->prefetch(ub[nx], (int)(ub[nx + 1] - ub[nx]));
        }
        errors.run([&] {
          unit_kv kv, kv_far;
          if (ranges.any_near(s0, n)) kv = ld->load(s0, n, kbuf.data(), vbuf.data());
          if (ranges.any_far(s0, n)) kv_far = ld->load_grouped(s0, n, kfar, vfar);
          for (int64_t i = 0; i < qs.n_q; ++i) qr.run_both(i, kv, kv_far, s0, n, mine);
        });
      }
#pragma omp critical(xctx_attend_units_merge)
      errors.run([&] { acc.merge(mine); });
    }
    errors.rethrow();
    return;
  }

  // Many queries (prefill): load a batch of units together, then threads split the queries
  // (each query's rows belong to one thread, so deposits go straight into acc).
  const size_t unit_elems = (size_t)kAttnUnit * C;
  std::vector<float> kbuf((size_t)sides * kUnitBatch * unit_elems), vbuf(kbuf.size());
  std::vector<unit_kv> kvs((size_t)sides * kUnitBatch);  // near of unit b at b, grouped at kUnitBatch + b
  omp_error_carrier errors;
#pragma omp parallel
  {
    std::unique_ptr<unit_loader> ld = make_loader();
    query_runner qr(qs, q_scaled, ranges, kQueryBlock);
    for (int64_t u0 = 0; u0 < n_unit; u0 += kUnitBatch) {
      const int nb = (int)std::min<int64_t>(kUnitBatch, n_unit - u0);
#pragma omp for schedule(static)
      for (int w = 0; w < sides * nb; ++w) {
        const int b = w % nb, side = w / nb;
        const int64_t s0 = ub[u0 + b];
        const int n = (int)(ub[u0 + b + 1] - s0);
        const size_t off = ((size_t)side * kUnitBatch + b) * unit_elems;
        unit_kv& kv = kvs[(size_t)side * kUnitBatch + b];
        kv = unit_kv{};
        errors.run([&] {
          if (side == 0 && ranges.any_near(s0, n)) kv = ld->load(s0, n, kbuf.data() + off, vbuf.data() + off);
          if (side == 1 && ranges.any_far(s0, n)) kv = ld->load_grouped(s0, n, kbuf.data() + off, vbuf.data() + off);
        });
      }
      if (qr.can_block()) {
        const int64_t n_qb = (qs.n_q + kQueryBlock - 1) / kQueryBlock;
#pragma omp for schedule(dynamic, 1)
        for (int64_t qb = 0; qb < n_qb; ++qb) {
          errors.run([&] {
            qr.set_block(qb * kQueryBlock, (int)std::min<int64_t>(kQueryBlock, qs.n_q - qb * kQueryBlock));
            for (int b = 0; b < nb; ++b) {
              const int64_t s0 = ub[u0 + b];
              qr.run_block_sides(kvs[b], kvs[(size_t)(sides - 1) * kUnitBatch + b], s0, (int)(ub[u0 + b + 1] - s0),
                                 acc);
            }
          });
        }
      } else {
#pragma omp for schedule(dynamic, 8)
        for (int64_t i = 0; i < qs.n_q; ++i)
          errors.run([&] {
            for (int b = 0; b < nb; ++b) {
              const int64_t s0 = ub[u0 + b];
              const unit_kv& far = kvs[(size_t)(sides - 1) * kUnitBatch + b];
              qr.run_both(i, kvs[b], far, s0, (int)(ub[u0 + b + 1] - s0), acc);
            }
          });
      }
    }
  }
  errors.rethrow();
}

void attend_units_one_query(const unit_queries& qs, const int32_t* kv_pos, int64_t n_kv,
                            const std::function<std::unique_ptr<unit_kernel>()>& make_kernel, softmax_acc& acc) {
  XCTX_CHECK(qs.n_q <= 1, "attention: the one-query path got ", qs.n_q, " queries");
  if (!check_units_args(qs, kv_pos, n_kv, acc)) return;
  const query_ranges ranges(qs, kv_pos, n_kv);
  if (ranges.kv_len == 0) return;
  const int hd = qs.head_dim;
  std::vector<float> q_scaled((size_t)qs.n_head * hd);
  for (size_t e = 0; e < q_scaled.size(); ++e) q_scaled[e] = qs.q[e] * qs.scale;
  const std::vector<int64_t> ub = unit_bounds(kv_pos, ranges.kv_len);
  const std::vector<int64_t> vis = ranges.visible_units(ub);
  const int64_t n_vis = (int64_t)vis.size();
  const int threads = omp_get_max_threads();
  omp_error_carrier errors;
#pragma omp parallel if (n_vis > 1 && threads > 1)
  {
    std::unique_ptr<unit_kernel> kernel = make_kernel();
    thread_local std::vector<float> o, lse;
    o.resize((size_t)qs.n_head * hd), lse.resize((size_t)qs.n_head);
    thread_local softmax_acc mine;
    mine.reset(acc.rows(), acc.width());
    const int g = qs.n_head / qs.n_head_kv;
    const auto deposit = [&](int64_t s0) {
      for (int h = 0; h < qs.n_head; ++h)
        if (ranges.head_sees(0, h / g, s0)) mine.add_partial(h, lse[(size_t)h], o.data() + (size_t)h * hd);
    };
#pragma omp for schedule(static)
    for (int64_t x = 0; x < n_vis; ++x) {
      const int64_t u = vis[(size_t)x];
      const int64_t s0 = ub[u];
      const int n = (int)(ub[u + 1] - s0);
      errors.run([&] {
        const auto [nb, ne] = ranges.near(0, s0, n);
        if (nb < ne) kernel->attend(q_scaled.data(), s0 + nb, (int)(ne - nb), false, o.data(), lse.data()), deposit(s0);
        if (ranges.grouped) {
          const auto [fb, fe] = ranges.far(0, s0, n);
          if (fb < fe)
            kernel->attend(ranges.q_far.data(), s0 + fb, (int)(fe - fb), true, o.data(), lse.data()), deposit(s0);
        }
      });
    }
#pragma omp critical(xctx_attend_units_merge)
    errors.run([&] { acc.merge(mine); });
  }
  errors.rethrow();
}

}  // namespace xctx::cpu
