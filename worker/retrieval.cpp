#include "worker/retrieval.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>

#include "cache/block_summary.h"
#include "common/error.h"
#include "common/half.h"
#include "worker/representative_tokens.h"

namespace xctx {

attention_mode parse_attention_mode(const std::string& name) {
  if (name == "full") return attention_mode::attention_full;
  if (name == "retrieval") return attention_mode::attention_retrieval;
  if (name == "auto") return attention_mode::attention_auto;
  fail("--attention: unknown mode '", name, "' (full, retrieval, auto)");
}

attention_mode resolve_attention_mode(attention_mode requested, int64_t n_total, int64_t n_ctx_train,
                                      bool own_positions) {
  if (requested != attention_mode::attention_auto) return requested;
  return n_total <= n_ctx_train || own_positions ? attention_mode::attention_full : attention_mode::attention_retrieval;
}

const char* attention_mode_name(attention_mode m) {
  switch (m) {
    case attention_mode::attention_full: return "full";
    case attention_mode::attention_retrieval: return "retrieval";
    case attention_mode::attention_auto: return "auto";
  }
  return "?";
}

block_score_rule parse_block_score_rule(const std::string& name) {
  if (name == "minmax") return block_score_rule::score_minmax;
  if (name == "mean") return block_score_rule::score_mean;
  fail("--block-score: unknown rule '", name, "' (minmax, mean)");
}

const char* block_score_rule_name(block_score_rule r) {
  switch (r) {
    case block_score_rule::score_minmax: return "minmax";
    case block_score_rule::score_mean: return "mean";
  }
  return "?";
}

selection_scope parse_selection_scope(const std::string& name) {
  if (name == "layer") return selection_scope::select_per_layer;
  if (name == "kv-head") return selection_scope::select_per_kv_head;
  fail("--select-per: unknown scope '", name, "' (layer, kv-head)");
}

const char* selection_scope_name(selection_scope s) {
  switch (s) {
    case selection_scope::select_per_layer: return "layer";
    case selection_scope::select_per_kv_head: return "kv-head";
  }
  return "?";
}

far_positions parse_far_positions(const std::string& name) {
  if (name == "fixed") return far_positions::far_fixed;
  if (name == "ordered") return far_positions::far_ordered;
  fail("--far-positions: unknown placement '", name, "' (fixed, ordered)");
}

const char* far_positions_name(far_positions f) { return f == far_positions::far_ordered ? "ordered" : "fixed"; }

void check_retrieval_options(const retrieval_options& o, int64_t n_ctx_train) {
  XCTX_CHECK(o.block > 0 && o.block % kAttnUnit == 0, "--block-size must be a positive multiple of ", kAttnUnit,
             " (the attention unit), got ", o.block);
  XCTX_CHECK(o.top_k >= 1 && o.top_k <= 4096, "--top-k must be in [1, 4096], got ", o.top_k);
  XCTX_CHECK(o.sink >= 0, "--sink must be >= 0, got ", o.sink);
  XCTX_CHECK(o.local >= 1, "--local must be >= 1, got ", o.local);
  XCTX_CHECK(o.local < n_ctx_train, "--local ", o.local, " must be below the model's trained window of ", n_ctx_train,
             " positions: every retrieved key sits at distance --local from the query");
  XCTX_CHECK(o.sink <= (int64_t)1 << 30, "--sink ", o.sink, " is beyond any context");
  XCTX_CHECK(o.restart_skip >= 0 && o.restart_skip < o.block, "--restart-skip must be in [0, --block-size ", o.block,
             "), got ", o.restart_skip);
  XCTX_CHECK(o.far == far_positions::far_fixed || o.local + o.block < n_ctx_train, "--far-positions ordered places ",
             "retrieved keys up to --local + --block-size = ", o.local + o.block,
             " positions from the query, beyond the model's trained window of ", n_ctx_train,
             " (lower --local or --block-size, or use --far-positions fixed)");
}

std::string describe_retrieval(const retrieval_options& o) {
  return "retrieval: sink " + std::to_string(o.sink) + ", local " + std::to_string(o.local) + ", top-" +
         std::to_string(o.top_k) + " blocks of " + std::to_string(o.block) + " per " + selection_scope_name(o.scope) +
         " (" + block_score_rule_name(o.rule) + "), far keys " +
         (o.far == far_positions::far_ordered
              ? "in block order at distances " + std::to_string(o.local + 1) + "-" + std::to_string(o.local + o.block)
              : "at distance " + std::to_string(o.local)) +
         (o.restart_skip > 0 ? ", star-block restarts unscored: first " + std::to_string(o.restart_skip) : "");
}

retrieval_selector::retrieval_selector(const retrieval_options& o, const rope_config& rope, int n_head, backend& be,
                                       communicator& comm)
    : opt_(o), rope_(rope), n_head_(n_head), be_(be), comm_(comm) {
  XCTX_CHECK(be.host_memory(), "retrieval attention runs on host-memory backends (--backend cpu) so far, not on ",
             be.name());
  XCTX_CHECK(fixed_distance_on(rope) && rope.se_window == o.local && rope.se_period == o.period(),
             "retrieval attention: the keys' rope must place far keys as --local and --far-positions say (internal)");
}

retrieval_selector::~retrieval_selector() = default;

bool retrieval_selector::candidate(int64_t id, int64_t p) const {
  const int64_t first = id * opt_.block, last = first + opt_.block - 1;
  if (first > p) return false;  // not started for this query
  const int64_t u0 = attn_unit_of(first), u1 = attn_unit_of(last);
  const int64_t sink_end = (opt_.sink + kAttnUnit - 1) / kAttnUnit;  // sink units [0, sink_end)
  const int64_t local_first = attn_unit_of(std::max<int64_t>(0, p - opt_.local + 1));
  // Wholly seen anyway: every unit of the block in the sink or the local window.
  for (int64_t u = u0; u <= u1; ++u)
    if (u >= sink_end && u < local_first) return true;
  return false;
}

void retrieval_selector::fixed_units(int64_t p, std::vector<int64_t>& out) const {
  const int64_t up = attn_unit_of(p);
  const int64_t sink_end = std::min((opt_.sink + kAttnUnit - 1) / kAttnUnit, up + 1);
  for (int64_t u = 0; u < sink_end; ++u) out.push_back(u);
  for (int64_t u = std::max(sink_end, attn_unit_of(std::max<int64_t>(0, p - opt_.local + 1))); u <= up; ++u)
    out.push_back(u);
}

namespace {

bool better(const retrieval_selector::scored_block& a, const retrieval_selector::scored_block& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

inline float bf16_value(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

// One query head's score of one block from its bf16 summary: Quest's bound
// Σ_c max(q_c·min_c, q_c·max_c), or q · mean. Float lanes (the loops vectorize; a decode step
// scores every block of the shard in every layer), summed in a fixed order, so every rank
// computes a block's score to the same bits.
double head_score(block_score_rule rule, const float* qh, const uint16_t* mn, const uint16_t* mx,
                  const uint16_t* mean, int hd) {
  constexpr int kLanes = 8;
  float lane[kLanes] = {};
  int c = 0;
  if (rule == block_score_rule::score_minmax) {
    for (; c + kLanes <= hd; c += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float a = qh[c + j] * bf16_value(mn[c + j]), b = qh[c + j] * bf16_value(mx[c + j]);
        lane[j] += a > b ? a : b;
      }
    for (; c < hd; ++c) lane[0] += std::max(qh[c] * bf16_value(mn[c]), qh[c] * bf16_value(mx[c]));
  } else {
    for (; c + kLanes <= hd; c += kLanes)
      for (int j = 0; j < kLanes; ++j) lane[j] += qh[c + j] * bf16_value(mean[c + j]);
    for (; c < hd; ++c) lane[0] += qh[c] * bf16_value(mean[c]);
  }
  double s = 0.0;
  for (int j = 0; j < kLanes; ++j) s += lane[j];
  return s;
}

}  // namespace

int retrieval_selector::lists_per_query(const kv_cache& own, int layer) const {
  (void)layer;  // every layer has the model's KV heads
  return opt_.scope == selection_scope::select_per_kv_head ? own.geometry().n_head_kv : 1;
}

std::vector<std::vector<retrieval_selector::scored_block>> retrieval_selector::score_blocks(
    const kv_cache& own, int layer, const float* q, const int32_t* q_pos, int64_t n_q, int64_t keep) {
  const block_summary_view S = summaries_of(own, layer);
  const int hd = S.head_dim, H = n_head_, g = H / S.n_head_kv, C = S.n_head_kv * hd;
  const int L = lists_per_query(own, layer), heads_per_list = H / L;
  turn_queries(q, q_pos, n_q, H, hd);

  std::vector<std::vector<scored_block>> out((size_t)n_q * L);
  std::vector<scored_block> cand;
  for (int64_t i = 0; i < n_q; ++i) {
    const float* qi = qf_.data() + (size_t)i * H * hd;
    for (int l = 0; l < L; ++l) {
      cand.clear();
      for (int64_t b = 0; b < S.n_blocks; ++b) {
        // A block none of whose keys was summarized has no bound to score (the star prefill
        // leaves at least one key of every block in: sequence_parallel_runner::prefill_star).
        if (S.count[b] == 0 || !candidate(S.ids[b], q_pos[i])) continue;
        const uint16_t* mn = S.kmin + (size_t)b * C;
        const uint16_t* mx = S.kmax + (size_t)b * C;
        const uint16_t* mean = S.kmean + (size_t)b * C;
        double s = 0.0;
        for (int h = l * heads_per_list; h < (l + 1) * heads_per_list; ++h) {
          const int c0 = (h / g) * hd;
          s += head_score(opt_.rule, qi + (size_t)h * hd, mn + c0, mx + c0, mean + c0, hd);
        }
        cand.push_back({s, S.ids[b]});
      }
      const size_t k = std::min<size_t>((size_t)keep, cand.size());
      std::partial_sort(cand.begin(), cand.begin() + (ptrdiff_t)k, cand.end(), better);
      out[(size_t)i * L + l].assign(cand.begin(), cand.begin() + (ptrdiff_t)k);
    }
  }
  const size_t per_block = opt_.rule == block_score_rule::score_minmax ? 2 : 1;
  summary_bytes_read_ += (size_t)S.n_blocks * (per_block * C * sizeof(uint16_t) + 12);
  return out;
}

void retrieval_selector::turn_queries(const float* q, const int32_t* q_pos, int64_t n_q, int H, int hd) {
  // Queries turned from their positions to the fixed distance: R(W - p)·R(p)·q = R(W)·q, the
  // query the kernels use against far keys (which sit unrotated, at position 0).
  qf_.assign(q, q + (size_t)n_q * H * hd);
  turn_.resize((size_t)n_q);
  for (int64_t i = 0; i < n_q; ++i) turn_[(size_t)i] = (int32_t)(opt_.local - q_pos[i]);
  rope_config plain = rope_;
  plain.se_group = 1, plain.se_window = 0;
  be_.rope(qf_.data(), turn_.data(), n_q, H, plain);
}

void retrieval_selector::set_probe(int64_t pos) {
  XCTX_CHECK(pos < 0 || comm_.size() == 1, "the needle-rank probe runs on one rank (got ", comm_.size(), ")");
  probe_pos_ = pos;
  probe_.clear();
  probed_.clear();
  repr_.reset();
}

void retrieval_selector::probe_star_block() {
  if (repr_) repr_->begin_star_block();
}

void retrieval_selector::probe_keys(int layer, const cache_geometry& g, const layer_input& in) {
  if (!probing()) return;
  if (!repr_)
    repr_ = std::make_unique<representative_tokens>(n_head_, g.n_head_kv, g.head_dim, opt_.block, opt_.local, rope_, be_);
  repr_->keys(layer, in);
}

void retrieval_selector::probe_queries(int layer, const float* q, const int32_t* q_pos, int64_t n_q) {
  if (probing() && repr_) repr_->queries(layer, q, q_pos, n_q);
}

namespace {

// InfLLM's block score for one query head: Σ over the block's representative keys of q·k.
double repr_head_score(const float* qh, const representative_tokens::block_keys* bk, int kvh, int hd) {
  if (bk == nullptr) return -std::numeric_limits<double>::infinity();
  double s = 0.0;
  for (int j = 0; j < bk->count[(size_t)kvh]; ++j) {
    const float* k = bk->k.data() + ((size_t)kvh * representative_tokens::kPerBlock + j) * hd;
    float d = 0.0f;
    for (int c = 0; c < hd; ++c) d += qh[c] * k[c];
    s += d;
  }
  return s;
}

}  // namespace

void retrieval_selector::run_probe(const kv_cache& own, int layer, const int32_t* q_pos, int64_t n_q) {
  const block_summary_view S = summaries_of(own, layer);
  const int hd = S.head_dim, H = n_head_, nkv = S.n_head_kv, g = H / nkv, C = nkv * hd;
  const int64_t i = n_q - 1, p = q_pos[i];  // the last query: the one that predicts the answer
  const int64_t needle = floor_div(probe_pos_, opt_.block);
  const float* qi = qf_.data() + (size_t)i * H * hd;
  // The rules: 0 minmax, 1 mean (the summaries), 2 repr (the star prefill's representatives).
  const int n_rules = repr_ && !repr_->empty() ? 3 : 2;
  probe_layer r;
  r.layer = layer;
  // [candidates][rule][nkv + 1]: per KV head's query heads, and their sum (the layer).
  std::vector<std::array<std::vector<double>, 3>> sc;
  std::vector<int64_t> ids;
  int64_t at = -1;
  for (int64_t b = 0; b < S.n_blocks; ++b) {
    if (S.count[b] == 0 || !candidate(S.ids[b], p)) continue;  // as score_blocks
    if (S.ids[b] == needle) at = (int64_t)ids.size();
    ids.push_back(S.ids[b]);
    const representative_tokens::block_keys* bk = n_rules > 2 ? repr_->of(layer, S.ids[b]) : nullptr;
    std::array<std::vector<double>, 3> s;
    for (int rule = 0; rule < n_rules; ++rule) {
      s[rule].assign((size_t)nkv + 1, 0.0);
      for (int h = 0; h < H; ++h) {
        const int c0 = (h / g) * hd;
        const float* qh = qi + (size_t)h * hd;
        const double x =
            rule == 2 ? repr_head_score(qh, bk, h / g, hd)
                      : head_score(rule == 0 ? block_score_rule::score_minmax : block_score_rule::score_mean, qh,
                                   S.kmin + (size_t)b * C + c0, S.kmax + (size_t)b * C + c0,
                                   S.kmean + (size_t)b * C + c0, hd);
        s[rule][(size_t)(h / g)] += x;
        s[rule][(size_t)nkv] += x;
      }
    }
    sc.push_back(std::move(s));
  }
  r.candidates = (int64_t)ids.size();
  std::vector<int64_t>* const tops[3] = {&r.top_minmax, &r.top_mean, &r.top_repr};
  for (int rule = 0; rule < n_rules; ++rule) {  // the same order as rank_of: score, then the lower id
    std::vector<size_t> order(ids.size());
    for (size_t j = 0; j < order.size(); ++j) order[j] = j;
    const size_t top = std::min<size_t>(order.size(), kProbeTop);
    std::partial_sort(order.begin(), order.begin() + (std::ptrdiff_t)top, order.end(), [&](size_t a, size_t b) {
      const double xa = sc[a][rule][(size_t)nkv], xb = sc[b][rule][(size_t)nkv];
      return xa > xb || (xa == xb && ids[a] < ids[b]);
    });
    for (size_t j = 0; j < top; ++j) tops[rule]->push_back(ids[order[j]]);
  }
  r.rank_minmax_kv.assign((size_t)nkv, 0), r.rank_mean_kv.assign((size_t)nkv, 0);
  if (n_rules > 2) r.rank_repr = 0, r.rank_repr_kv.assign((size_t)nkv, 0);
  if (at >= 0) {
    const auto rank_of = [&](int rule, int col) {
      int64_t better_count = 0;
      const double mine = sc[(size_t)at][rule][(size_t)col];
      for (size_t j = 0; j < ids.size(); ++j) {
        const double x = sc[j][rule][(size_t)col];
        if (x > mine || (x == mine && ids[j] < ids[(size_t)at])) ++better_count;
      }
      return better_count + 1;
    };
    int64_t* const ranks[3] = {&r.rank_minmax, &r.rank_mean, &r.rank_repr};
    std::vector<int64_t>* const ranks_kv[3] = {&r.rank_minmax_kv, &r.rank_mean_kv, &r.rank_repr_kv};
    for (int rule = 0; rule < n_rules; ++rule) {
      *ranks[rule] = rank_of(rule, nkv);
      for (int h = 0; h < nkv; ++h) (*ranks_kv[rule])[(size_t)h] = rank_of(rule, h);
    }
  }
  probe_.push_back(std::move(r));
}

const attn_selection& retrieval_selector::select(const kv_cache& own, int layer, const float* q, const int32_t* q_pos,
                                                 int64_t n_q) {
  const int k = opt_.top_k;
  std::vector<std::vector<scored_block>> mine = score_blocks(own, layer, q, q_pos, n_q, k);
  if (probe_pos_ >= 0 && n_q > 0) {  // score_blocks left the turned queries in qf_
    if ((int)probed_.size() <= layer) probed_.resize((size_t)layer + 1, false);
    if (!probed_[(size_t)layer]) probed_[(size_t)layer] = true, run_probe(own, layer, q_pos, n_q);
  }
  const int p = comm_.size();
  const int L = lists_per_query(own, layer);
  const int64_t n_lists = n_q * L;
  std::vector<std::vector<scored_block>> best((size_t)n_lists);
  if (p == 1) {
    best = std::move(mine);
  } else {
    // Fixed-size records: k slots per list, unused ones with id -1.
    std::vector<scored_block> send((size_t)n_lists * k, scored_block{-std::numeric_limits<double>::infinity(), -1});
    for (int64_t l = 0; l < n_lists; ++l)
      std::copy(mine[(size_t)l].begin(), mine[(size_t)l].end(), send.begin() + l * k);
    std::vector<scored_block> recv(send.size() * p);
    const size_t bytes = send.size() * sizeof(scored_block);
    comm_.all_gather(send.data(), recv.data(), bytes);
    gather_bytes_sent_ += bytes;
    for (int64_t l = 0; l < n_lists; ++l) {
      std::vector<scored_block>& b = best[(size_t)l];
      for (int r = 0; r < p; ++r)
        for (int j = 0; j < k; ++j) {
          const scored_block& x = recv[((size_t)r * n_lists + l) * k + j];
          if (x.id >= 0) b.push_back(x);
        }
      const size_t keep = std::min<size_t>((size_t)k, b.size());
      std::partial_sort(b.begin(), b.begin() + (ptrdiff_t)keep, b.end(), better);
      b.resize(keep);
    }
  }
  sel_.lists_per_query = L;
  sel_.offsets.assign(1, 0);
  sel_.units.clear();
  const int64_t units_per_block = opt_.block / kAttnUnit;
  const block_summary_view own_blocks = summaries_of(own, layer);
  const int64_t* own_end = own_blocks.ids + own_blocks.n_blocks;
  std::vector<int64_t> u, read;
  for (int64_t i = 0; i < n_q; ++i) {
    const int64_t up = attn_unit_of(q_pos[i]);
    read.clear();
    for (int l = 0; l < L; ++l) {
      u.clear();
      fixed_units(q_pos[i], u);
      for (const scored_block& b : best[(size_t)(i * L + l)])
        for (int64_t x = 0; x < units_per_block; ++x)
          if (b.id * units_per_block + x <= up) u.push_back(b.id * units_per_block + x);
      std::sort(u.begin(), u.end());
      u.erase(std::unique(u.begin(), u.end()), u.end());
      sel_.units.insert(sel_.units.end(), u.begin(), u.end());
      sel_.offsets.push_back((int64_t)sel_.units.size());
      read.insert(read.end(), u.begin(), u.end());
    }
    // Units read for query i: the union of its lists, counted where this rank holds them.
    std::sort(read.begin(), read.end());
    read.erase(std::unique(read.begin(), read.end()), read.end());
    for (const int64_t x : read)
      if (std::binary_search(own_blocks.ids, own_end, floor_div(x * kAttnUnit, opt_.block))) ++own_units_;
  }
  return sel_;
}

}  // namespace xctx
