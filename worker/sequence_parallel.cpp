#include "registry/registry.h"
#include "worker/sequence_parallel.h"

#include <glog/logging.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "cache/x_factors.h"
#include "common/error.h"
#include "common/sys.h"
#include "worker/cache_snapshot.h"
#include "worker/memory_plan.h"

namespace xctx {

prefill_mode parse_prefill_mode(const std::string& name) {
  if (name == "exact") return prefill_mode::prefill_exact;
  if (name == "star") return prefill_mode::prefill_star;
  if (name == "auto") return prefill_mode::prefill_auto;
  fail("unknown prefill mode '", name, "' (exact, star, auto)");
}

namespace {
// Prompts from this length prefill star under auto. With retrieval on, the exact ring would put
// every key beyond the local window at the far distance without selecting any: star (whose
// blocks see [anchor ‖ themselves]) takes over as soon as the prompt leaves the window.
int64_t star_threshold(const sequence_options& opt) {
  if (opt.attention == attention_mode::attention_retrieval)
    return std::min<int64_t>(opt.star_from_tokens, opt.retrieval.local + 1);
  return opt.star_from_tokens;
}
}  // namespace

prefill_mode effective_prefill_mode(const sequence_options& opt, int64_t n_prompt) {
  if (opt.mode != prefill_mode::prefill_auto) return opt.mode;
  return n_prompt >= star_threshold(opt) ? prefill_mode::prefill_star : prefill_mode::prefill_exact;
}

attention_mode apply_attention_mode(sequence_options& seq, run_params& rp, cache_spec& spec, int64_t n_total,
                                    int64_t n_ctx_train) {
  // auto: the user's own position handling (--rope-scaling, SelfExtend) keeps full attention.
  const bool own_positions = rp.se_group != 1 || rp.rope_scale != rope_scaling::rope_scaling_none;
  seq.attention = resolve_attention_mode(seq.attention, n_total, n_ctx_train, own_positions);
  if (seq.attention == attention_mode::attention_full) return seq.attention;
  check_retrieval_options(seq.retrieval, n_ctx_train);
  XCTX_CHECK(rp.se_group == 1 && rp.rope_scale == rope_scaling::rope_scaling_none,
             "--attention retrieval places far keys at one distance inside the trained window; it does not combine "
             "with --rope-scaling (drop it, or use --attention full)");
  rp.se_group = kFixedDistanceGroup;
  rp.se_window = (int)seq.retrieval.local;
  rp.se_period = seq.retrieval.period();
  spec.options.summary_block = seq.retrieval.block;
  return seq.attention;
}

std::string describe_attention(const sequence_options& seq) {
  switch (seq.attention) {
    case attention_mode::attention_full: return "full";
    case attention_mode::attention_retrieval: return describe_retrieval(seq.retrieval);
    case attention_mode::attention_auto: return "auto (unresolved)";
  }
  return "?";
}

sequence_options with_mode_resolved(const sequence_options& opt, int64_t n_prompt) {
  sequence_options out = opt;
  out.mode = effective_prefill_mode(opt, n_prompt);
  return out;
}

const char* prefill_mode_name(prefill_mode m) {
  switch (m) {
    case prefill_mode::prefill_exact: return "exact";
    case prefill_mode::prefill_star: return "star";
    case prefill_mode::prefill_auto: return "auto";
  }
  return "?";
}

std::string describe_prefill(const sequence_options& opt, int64_t n_prompt) {
  const prefill_mode m = effective_prefill_mode(opt, n_prompt);
  std::string out;
  if (m == prefill_mode::prefill_exact) {
    out = std::string("exact ring (") + shard_layout_name(opt.layout) + ")";
  } else {
    out = opt.block_tokens > 0 ? "star: blocks of " + std::to_string(opt.block_tokens) + " tokens"
                               : std::string("star: one block per rank");
    out += opt.anchor_tokens > 0 ? ", anchor " + std::to_string(opt.anchor_tokens) : ", anchor one block";
  }
  if (opt.mode == prefill_mode::prefill_auto)
    out += m == prefill_mode::prefill_star ? " (auto: prompt >= " + std::to_string(star_threshold(opt)) + ")"
                                           : " (auto: star from " + std::to_string(star_threshold(opt)) + ")";
  return out;
}

size_t partial_bytes_per_token_layer(const model_hparams& hp) {
  return (size_t)hp.n_head * (sizeof(int32_t) + (size_t)kAccBins * (hp.head_dim + 1) * sizeof(double));
}

// ---- ring (exact prefill) ----------------------------------------------------------------

ring_attention::ring_attention(kv_cache& own, communicator& comm, backend& be, sequence_comm_stats& stats,
                               communicator* device_comm)
    : own_(own), comm_(comm), be_(be), stats_(stats), device_comm_(device_comm), sum_(be) {
  XCTX_CHECK(device_comm_ == nullptr || !sum_.exact(), "ring_attention: a device communicator on the ", be_.name(),
             " backend, which attends through host memory");
  XCTX_CHECK(device_comm_ == nullptr || device_comm_->size() == comm_.size(), "ring_attention: device communicator of ",
             device_comm_ ? device_comm_->size() : 0, " ranks beside ", comm_.size());
}

void ring_attention::store(int layer, const layer_input& in) { own_.append(layer, in); }

void ring_attention::layer_stored(int layer) {
  const int p = comm_.size();
  held_.resize(p > 1 ? p - 1 : 0);
  held_bytes_ = 0;
  if (p == 1) return;
  const int next = (comm_.rank() + 1) % p, prev = (comm_.rank() + p - 1) % p;
  std::vector<uint8_t> own(own_.exported_bytes(layer));
  own_.export_layer(layer, own.data());
  // Partials mode keeps every held block in backend memory too, uploaded once per layer for all
  // of its query chunks. With a device communicator (NCCL) the blocks travel there: the own block
  // goes up once and each received one comes down once (the caches parse a block's header and
  // positions on the host), instead of host transfers plus an upload per received block.
  const bool exact = sum_.exact();
  if (!exact)
    while (held_on_backend_.size() < held_.size() + 1) held_on_backend_.emplace_back(be_);
  const void* out_dev = nullptr;
  if (device_comm_ != nullptr) {
    void* d = held_on_backend_.back().reserve(std::max<size_t>(own.size(), 1));  // the last slot: the own block
    be_.upload(d, own.data(), own.size());
    out_dev = d;
  }
  // P-1 steps: pass on the block received last, so every block visits every rank once. Each is
  // kept until the layer's last query chunk has attended to it: the layer's foreign blocks in
  // the format's own bytes (a compressed format holds compressed bytes), instead of exact
  // accumulators for every query of the shard (docs/sequence_parallel.md, "Prefill memory").
  const std::vector<uint8_t>* out = &own;
  for (int step = 1; step < p; ++step) {
    const stopwatch clock;
    uint64_t out_bytes = out->size(), in_bytes = 0;
    comm_.sendrecv(&out_bytes, sizeof out_bytes, next, &in_bytes, sizeof in_bytes, prev, 2 * step);
    std::vector<uint8_t>& in = held_[step - 1];
    in.resize(in_bytes);
    if (device_comm_ != nullptr) {
      void* in_dev = held_on_backend_[step - 1].reserve(std::max<size_t>(in_bytes, 1));
      device_comm_->sendrecv(out_dev, out_bytes, next, in_dev, in_bytes, prev, 2 * step + 1);
      be_.download(in.data(), in_dev, in_bytes);
      out_dev = in_dev;
    } else {
      comm_.sendrecv(out->data(), out->size(), next, in.data(), in.size(), prev, 2 * step + 1);
    }
    stats_.ring_bytes_sent += out_bytes;
    stats_.ring_seconds += clock.seconds();
    held_bytes_ += in_bytes;
    out = &in;
  }
  stats_.ring_held_bytes_peak = std::max<uint64_t>(stats_.ring_held_bytes_peak, own.size() + held_bytes_);
  if (!exact && device_comm_ == nullptr)  // each block goes up once, however many query chunks attend to it
    for (size_t i = 0; i < held_.size(); ++i)
      be_.upload(held_on_backend_[i].reserve(std::max<size_t>(held_[i].size(), 1)), held_[i].data(), held_[i].size());
}

void ring_attention::attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) {
  if (n_q == 0) return;
  const cache_geometry& g = own_.geometry();
  sum_.begin(n_q, g.n_head, g.head_dim);
  sum_.add(own_, layer, q, q_pos, n_q, attend_path::attend_prefill);
  // The exact accumulator makes the arrival order (and so the rank count) invisible in o.
  for (size_t i = 0; i < held_.size(); ++i)
    sum_.add_exported(own_, layer, held_[i].data(), held_[i].size(), q, q_pos, n_q, attend_path::attend_prefill,
                      sum_.exact() ? nullptr : held_on_backend_[i].as<void>());
  sum_.finish(o);
}

void ring_attention::release() {
  std::vector<std::vector<uint8_t>>().swap(held_);
  held_on_backend_.clear();
  held_bytes_ = 0;
}

// ---- merged partials (decode / suffix) -----------------------------------------------------

merged_attention::merged_attention(kv_cache& own, bool is_tail, communicator& comm, backend& be,
                                   sequence_comm_stats& stats, communicator* device_comm,
                                   retrieval_selector* selector)
    : own_(own),
      is_tail_(is_tail),
      comm_(comm),
      be_(be),
      stats_(stats),
      device_comm_(device_comm),
      selector_(selector),
      sum_(be) {}

void merged_attention::store(int layer, const layer_input& in) {
  if (is_tail_) own_.append(layer, in);
}

void merged_attention::attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) {
  const cache_geometry& g = own_.geometry();
  const attn_selection* select = nullptr;
  if (selector_ != nullptr) {
    const uint64_t sent = selector_->gather_bytes_sent(), read = selector_->summary_bytes_read(),
                   units = selector_->own_units_selected();
    select = &selector_->select(own_, layer, q, q_pos, n_q);  // collective: every rank, every layer
    stats_.retrieval_bytes_sent += selector_->gather_bytes_sent() - sent;
    stats_.retrieval_summary_bytes_read += selector_->summary_bytes_read() - read;
    stats_.retrieval_units_attended += selector_->own_units_selected() - units;
  }
  sum_.begin(n_q, g.n_head, g.head_dim);
  sum_.add(own_, layer, q, q_pos, n_q, attend_path::attend_decode, select);
  if (comm_.size() > 1) {
    const stopwatch clock;
    const size_t bytes = sum_.all_reduce(comm_, device_comm_);
    stats_.gather_seconds += clock.seconds();
    stats_.gather_bytes_sent += bytes;
    stats_.gather_bytes_recv += bytes * comm_.size();
  }
  sum_.finish(o);
}

// ---- star (anchor + one block) --------------------------------------------------------------

star_attention::star_attention(kv_cache& own, kv_cache* anchor, kv_cache* block, backend& be,
                               int64_t summary_skip_below, retrieval_selector* probe)
    : own_(own), anchor_(anchor), block_(block), summary_skip_below_(summary_skip_below), probe_(probe), sum_(be) {}

void star_attention::store(int layer, const layer_input& in) {
  layer_input kept = in;  // positions ascend: the rows below the mark lead
  while (kept.summary_skip < kept.n && kept.pos[kept.summary_skip] < summary_skip_below_) ++kept.summary_skip;
  own_.append(layer, kept);
  if (block_ != nullptr) block_->append(layer, in);
  if (probe_ != nullptr) probe_->probe_keys(layer, own_.geometry(), kept);
}

void star_attention::attend(int layer, const float* q, const int32_t* q_pos, int64_t n_q, float* o) {
  const cache_geometry& g = own_.geometry();
  sum_.begin(n_q, g.n_head, g.head_dim);
  sum_.add(block_ != nullptr ? *block_ : own_, layer, q, q_pos, n_q, attend_path::attend_prefill);
  if (anchor_ != nullptr) sum_.add(*anchor_, layer, q, q_pos, n_q, attend_path::attend_prefill);
  sum_.finish(o);
  if (probe_ != nullptr) probe_->probe_queries(layer, q, q_pos, n_q);
}

// ---- the runner ------------------------------------------------------------------------------

namespace {

// The X formats' rebuild factors of the run are rank 0's. Every rank builds its own from the
// same weights, but an SVD's last bits follow the LAPACK build and the CPU kernels it picks,
// which may differ between nodes; a rank with other factors would encode and rebuild other
// keys. Compared by digest; sent only when some rank differs.
std::shared_ptr<const x_factors> rank0_factors(communicator& comm, std::shared_ptr<const x_factors> mine) {
  const uint64_t digest = x_factors_digest(*mine);
  std::vector<uint64_t> all(comm.size());
  comm.all_gather(&digest, all.data(), sizeof digest);
  if (std::all_of(all.begin(), all.end(), [&](uint64_t d) { return d == all[0]; })) return mine;
  if (comm.rank() == 0)
    std::fprintf(stderr, "note: ranks built different X rebuild factors from the same weights (another LAPACK or "
                         "CPU kernel); every rank uses rank 0's\n");
  auto shared = std::make_shared<x_factors>(*mine);
  for (std::vector<float>* a : x_factor_arrays(*shared)) comm.broadcast(a->data(), a->size() * sizeof(float), 0);
  return shared;
}

}  // namespace

sequence_parallel_runner::sequence_parallel_runner(llama_engine& engine, communicator& comm, backend& be,
                                                   cache_spec spec, const sequence_options& opt)
    : engine_(engine), comm_(comm), be_(be), spec_(std::move(spec)), opt_(opt) {
  XCTX_CHECK(opt.max_new_tokens >= 0, "max_new_tokens must be >= 0");
  XCTX_CHECK(opt.anchor_tokens >= 0, "anchor tokens must be >= 0");
  if (spec_.options.factors && comm_.size() > 1) spec_.options.factors = rank0_factors(comm_, spec_.options.factors);
  XCTX_CHECK(opt_.attention != attention_mode::attention_auto,
             "sequence runner: attention auto must be resolved (apply_attention_mode) before the engine is built");
  if (opt_.attention == attention_mode::attention_retrieval) {
    XCTX_CHECK(fixed_distance_on(engine_.rope()) && engine_.rope().se_window == opt_.retrieval.local &&
                   engine_.rope().se_period == opt_.retrieval.period(),
               "retrieval attention needs the engine's rope at the fixed distance --local (apply_attention_mode)");
    spec_.options.summary_block = opt_.retrieval.block;
    selector_ = std::make_unique<retrieval_selector>(opt_.retrieval, engine_.rope(), engine_.hparams().n_head, be_, comm_);
  }
  if (be_.has_device_collectives() && comm_.size() > 1) {
    // Every rank's device, gathered before NCCL's initialisation, which would fail on a shared one
    // (more local ranks than GPUs: -np 2 on one GPU, per-task CUDA_VISIBLE_DEVICES under Slurm).
    constexpr size_t kIdBytes = 320;
    std::string mine = cuda_device_identity();
    mine.resize(kIdBytes, '\0');
    std::vector<char> all((size_t)comm_.size() * kIdBytes);
    comm_.all_gather(mine.data(), all.data(), kIdBytes);
    std::vector<std::string> ids;
    for (int r = 0; r < comm_.size(); ++r) ids.emplace_back(all.data() + (size_t)r * kIdBytes);  // up to its NUL
    if (const std::string shared = describe_shared_devices(ids); !shared.empty()) {
      if (comm_.rank() == 0)
        LOG(WARNING) << "NCCL cannot run two ranks on one GPU (" << shared << "): ring blocks and decode partials "
                     << "go through host memory over " << comm_.name() << " instead (slower; one rank per GPU avoids it)";
    } else {
      own_device_comm_ = make_nccl_communicator_or_fail(comm_);  // bootstrapped through comm_ (MPI)
      device_comm_ = own_device_comm_.get();
    }
  }
}

std::string describe_shared_devices(const std::vector<std::string>& identities) {
  for (size_t a = 0; a < identities.size(); ++a)
    for (size_t b = a + 1; b < identities.size(); ++b)
      if (!identities[a].empty() && identities[a] == identities[b])
        return "ranks " + std::to_string(a) + " and " + std::to_string(b) + " share " + identities[a];
  return "";
}

sequence_parallel_runner::~sequence_parallel_runner() = default;

namespace {

// The plan of a prefill's context (the prompt less its suffix); an empty context (short prompt)
// puts the suffix on rank 0. opt.mode must be resolved (with_mode_resolved).
shard_plan prefill_plan(int64_t n_context, int n_rank, const sequence_options& opt, int64_t align) {
  XCTX_ASSERT(opt.mode != prefill_mode::prefill_auto, "prefill plan: auto mode not resolved");
  shard_plan plan;
  if (opt.mode == prefill_mode::prefill_exact)
    plan = make_shard_plan(n_context, n_rank, opt.layout, align, kMinPrefillBatch);
  else if (opt.block_tokens > 0)
    plan = make_block_plan(n_context, n_rank, opt.block_tokens, align, kMinPrefillBatch);
  else
    plan = make_shard_plan(n_context, n_rank, shard_layout::shard_contiguous, align, kMinPrefillBatch);
  if (n_context == 0) plan.tail_rank = 0;
  return plan;
}

int64_t max_tokens_of(const shard_plan& plan, int64_t extra_on_tail) {
  int64_t most = 0;
  for (int r = 0; r < plan.n_rank; ++r)
    most = std::max(most, plan.tokens_of(r) + (r == plan.tail_rank ? extra_on_tail : 0));
  return most;
}

}  // namespace

int64_t sequence_tokens_needed_per_rank(int64_t n_context, int64_t n_suffix, int64_t n_new, int n_rank,
                                        const cache_spec& spec, const sequence_options& opt) {
  if (n_suffix == 0 && n_context > 0) --n_context, n_suffix = 1;  // as prefill moves the last token
  const shard_plan plan = prefill_plan(n_context, n_rank, with_mode_resolved(opt, n_context + n_suffix), cache_alignment(spec));
  return max_tokens_of(plan, n_suffix + n_new);
}

int64_t sequence_capacity_per_rank(int64_t n_total, int n_rank, const cache_spec& spec, const sequence_options& opt) {
  XCTX_CHECK(n_total >= 1, "a sequence holds at least one token");
  // A rank's share grows with the prompt about linearly, so the extremes bound it: the longest
  // prompt generating one token (most on every rank) and the shortest generating the most (most
  // on the tail). Shares are not quite monotonic (pieces align to the format's groups and a short
  // last piece joins the one before), so each extreme is swept over one round of pieces.
  const int64_t round = 2 * n_rank * std::max<int64_t>(cache_alignment(spec), kMinPrefillBatch);
  int64_t most = 0;
  for (const int64_t n_new : {int64_t{1}, std::min<int64_t>(opt.max_new_tokens, n_total - 1)}) {
    const int64_t longest = std::max<int64_t>(1, n_total - n_new);
    for (int64_t n = longest; n >= 1 && n > longest - round; --n)
      most = std::max(most, sequence_tokens_needed_per_rank(n, 0, n_new, n_rank, spec, opt));
  }
  return most;
}

int64_t sequence_parallel_runner::tokens_needed_per_rank(int64_t n_context, int64_t n_suffix, int64_t n_new) const {
  return sequence_tokens_needed_per_rank(n_context, n_suffix, n_new, comm_.size(), spec_, opt_);
}

void sequence_parallel_runner::prepare_cache(const sequence_options& seq, int64_t own_tokens, int64_t max_tokens,
                                             int64_t n_context, int64_t extra_on_tail) {
  const model_hparams& hp = engine_.hparams();
  const int n_batch = engine_.params().n_batch, n_threads = engine_.params().n_threads;
  const int64_t cap = opt_.capacity_per_rank;
  if (cap <= 0) {
    // Every rank refuses together, before allocating, when some rank lacks the memory.
    cache_spec spec = resolve_ring_mode(spec_, hp, seq, n_context, comm_.size());
    cache_.reset();  // the previous sequence's cache goes before the check and the new allocation
    const backend_kind kind = engine_.params().backend;
    check_sequence_fits(comm_, hp, spec, seq, n_batch, n_threads, n_context, extra_on_tail, kind, &be_);
    planned_bytes_ =
        estimate_rank_memory(hp, spec, seq, n_batch, n_threads, n_context, extra_on_tail, comm_.size(), kind).total();
    cache_ = make_cache(spec, engine_.cache_geometry_for(std::max<int64_t>(1, own_tokens)), be_);
    return;
  }
  // max_tokens is the same on every rank, so every rank refuses together, before any collective.
  XCTX_CHECK(max_tokens <= cap, "the sequence needs ", max_tokens, " tokens on one rank but this runner's caches hold ",
             cap, " tokens per rank (", comm_.size(), " ranks)");
  if (!cache_) reserve();
  cache_->clear();
}

void sequence_parallel_runner::reserve() {
  const int64_t cap = opt_.capacity_per_rank;
  if (cap <= 0 || cache_) return;
  // Sized for the longest sequence the capacity admits: cap tokens on every rank.
  const model_hparams& hp = engine_.hparams();
  const int64_t longest = cap * comm_.size();
  const cache_spec spec = resolve_ring_mode(spec_, hp, opt_, longest, comm_.size());
  const run_params& rp = engine_.params();
  check_sequence_fits(comm_, hp, spec, opt_, rp.n_batch, rp.n_threads, longest, 0, rp.backend, &be_);
  planned_bytes_ =
      estimate_rank_memory(hp, spec, opt_, rp.n_batch, rp.n_threads, longest, 0, comm_.size(), rp.backend).total();
  cache_ = make_cache(spec, engine_.cache_geometry_for(cap), be_);
}

void sequence_parallel_runner::reset() {
  active_ = false;
  next_pos_ = 0;
  if (opt_.capacity_per_rank <= 0) cache_.reset();
}

void sequence_parallel_runner::prefill(const std::vector<int32_t>& context_in, const std::vector<int32_t>& suffix_in,
                                       float* logits, const llama_engine::progress_fn& progress,
                                       int64_t max_new_tokens) {
  XCTX_CHECK(!active_, "prefill called twice on one sequence (reset() starts a new one)");
  std::vector<int32_t> context = context_in, suffix = suffix_in;
  if (suffix.empty()) {
    XCTX_CHECK(!context.empty(), "prefill: no tokens");
    suffix.push_back(context.back());
    context.pop_back();
  }
  const int p = comm_.size(), rank = comm_.rank();
  const int64_t n = (int64_t)context.size();
  // auto decides on the whole prompt, as the run headers do (describe_prefill).
  const sequence_options seq = with_mode_resolved(opt_, n + (int64_t)suffix.size());
  plan_ = prefill_plan(n, p, seq, cache_alignment(spec_));
  const bool tail = rank == plan_.tail_rank;
  XCTX_CHECK(max_new_tokens <= opt_.max_new_tokens, "a sequence asks for ", max_new_tokens,
             " new tokens; this runner allows ", opt_.max_new_tokens);
  const int64_t extra_on_tail = (int64_t)suffix.size() + (max_new_tokens >= 0 ? max_new_tokens : opt_.max_new_tokens);
  const std::vector<int32_t> pos = plan_.positions_of(rank);
  prepare_cache(seq, (int64_t)pos.size() + (tail ? extra_on_tail : 0), max_tokens_of(plan_, extra_on_tail), n,
                extra_on_tail);
  active_ = true;

  std::vector<int32_t> mine(pos.size());
  for (size_t i = 0; i < pos.size(); ++i) mine[i] = context[pos[i]];
  mode_ = seq.mode;
  if (n > 0) {
    switch (mode_) {
      case prefill_mode::prefill_exact: {
        ring_attention ring(*cache_, comm_, be_, stats_, device_comm_);
        if (p == 1) {  // one rank: chunk-major keeps memory bounded for any length
          engine_.forward(mine.data(), pos.data(), (int64_t)mine.size(), ring, llama_engine::logits_for::logits_none,
                          nullptr, progress, cache_alignment(spec_));
        } else if (!mine.empty()) {
          engine_.forward_layer_major(mine.data(), pos.data(), (int64_t)mine.size(), ring, progress);
        } else {  // fewer context tokens than shards: still relay the other ranks' blocks
          for (int l = 0; l < engine_.hparams().n_layer; ++l) ring.layer_stored(l);
        }
        ring.release();
        cache_->release_ring_state();  // foreign tokens' working memory (xquant-cl deltas mode)
        break;
      }
      case prefill_mode::prefill_star:
        prefill_star(context, pos, progress);
        break;
      case prefill_mode::prefill_auto:
        XCTX_ASSERT(false, "auto prefill mode not resolved");
    }
  }
  next_pos_ = n;
  step(suffix.data(), (int64_t)suffix.size(), logits);
}

void sequence_parallel_runner::prefill_star(const std::vector<int32_t>& context, const std::vector<int32_t>& pos,
                                            const llama_engine::progress_fn& progress) {
  if (pos.empty()) return;  // a rank without blocks (more ranks than blocks)
  const int64_t n = (int64_t)context.size(), align = cache_alignment(spec_);
  // This rank's blocks; with block_tokens == 0 its whole chunk is one block.
  std::vector<std::pair<int64_t, int64_t>> blocks = {{pos.front(), (int64_t)pos.back() + 1}};
  if (opt_.block_tokens > 0) blocks = blocks_in(blocks[0].first, blocks[0].second, n, opt_.block_tokens, align, kMinPrefillBatch);
  // The default anchor is the context's first block: with one block per rank, the chunk of the
  // first rank that holds tokens (alignment can leave rank 0 without any).
  int64_t first_chunk = 0;
  for (int r = 0; r < plan_.n_rank && first_chunk == 0; ++r) first_chunk = plan_.tokens_of(r);
  const int64_t block = opt_.block_tokens > 0 ? aligned_block(opt_.block_tokens, align) : first_chunk;
  const int64_t anchor_len = std::min<int64_t>(n, opt_.anchor_tokens > 0 ? opt_.anchor_tokens : block);
  int64_t longest = 0;
  for (const auto& [b, e] : blocks) longest = std::max(longest, e - b);

  std::unique_ptr<kv_cache> anchor, block_view;
  int64_t anchor_built = 0;  // tokens the anchor cache holds
  std::vector<int32_t> ids, at;
  int64_t done = 0;
  for (const auto& [b, e] : blocks) {
    // The anchor is the first anchor_len tokens, cut short where this block starts (an anchor
    // that reaches the block would be the block itself). Its keys/values depend on its tokens
    // only (causal), so one anchor cache serves every block of the rank.
    const int64_t a = std::min(anchor_len, b);
    if (a > 0 && a != anchor_built) {
      anchor = make_cache(spec_, engine_.cache_geometry_for(a), be_);
      ids.assign(context.begin(), context.begin() + a);
      at.resize(a);
      for (int64_t i = 0; i < a; ++i) at[i] = (int32_t)i;
      local_attention own_anchor(*anchor, be_);
      engine_.forward(ids.data(), at.data(), a, own_anchor, llama_engine::logits_for::logits_none, nullptr, {}, align);
      anchor_built = a;
    }
    // The rank's first block sees only itself in the own cache; later ones need a separate view.
    const bool first = b == blocks.front().first;
    if (!first && !block_view) block_view = make_cache(spec_, engine_.cache_geometry_for(longest), be_);
    if (block_view) block_view->clear();
    // A block after the context's first restarts (it sees only the anchor): its first positions
    // stay out of the retrieval summaries, all but one at most, so every summary block it starts
    // (b is on the summary grid: cache_alignment) keeps a summarized key.
    const int64_t skip = b > 0 && spec_.options.summary_block > 0 ? std::min(opt_.retrieval.restart_skip, e - b - 1) : 0;
    retrieval_selector* probe = selector_ != nullptr && selector_->probing() ? selector_.get() : nullptr;
    if (probe != nullptr) probe->probe_star_block();
    star_attention star(*cache_, a > 0 ? anchor.get() : nullptr, first ? nullptr : block_view.get(), be_, b + skip,
                        probe);
    ids.assign(context.begin() + b, context.begin() + e);
    at.resize(e - b);
    for (int64_t i = 0; i < e - b; ++i) at[i] = (int32_t)(b + i);
    const int64_t before = done;
    engine_.forward(ids.data(), at.data(), e - b, star, llama_engine::logits_for::logits_none, nullptr,
                    progress ? llama_engine::progress_fn([&](int64_t d, int64_t) { progress(before + d, (int64_t)pos.size()); })
                             : llama_engine::progress_fn{},
                    align);
    done += e - b;
  }
}

std::pair<double, int64_t> sequence_parallel_runner::score(const std::vector<int32_t>& tokens, int64_t first_scored,
                                                           const llama_engine::progress_fn& progress) {
  XCTX_CHECK(!active_, "score called on a sequence that was already prefilled (reset() starts a new one)");
  const int64_t n = (int64_t)tokens.size();
  XCTX_CHECK(n >= 2, "score: need at least 2 tokens, got ", n);
  plan_ = make_shard_plan(n, comm_.size(), opt_.layout, cache_alignment(spec_), kMinPrefillBatch);
  const std::vector<int32_t> pos = plan_.positions_of(comm_.rank());
  sequence_options exact = opt_;  // scoring always runs the exact ring
  exact.mode = prefill_mode::prefill_exact;
  prepare_cache(exact, (int64_t)pos.size(), max_tokens_of(plan_, 0), n, 0);
  active_ = true;
  std::vector<int32_t> mine(pos.size()), targets(pos.size());
  for (size_t i = 0; i < pos.size(); ++i) {
    mine[i] = tokens[pos[i]];
    const int64_t t = (int64_t)pos[i] + 1;
    targets[i] = t < n && t >= first_scored ? tokens[t] : -1;
  }
  std::vector<float> nll(pos.size());
  ring_attention ring(*cache_, comm_, be_, stats_, device_comm_);
  if (!mine.empty()) {
    engine_.forward_layer_major_scored(mine.data(), pos.data(), (int64_t)mine.size(), ring, targets.data(), nll.data(),
                                       progress);
  } else {  // more ranks than tokens: still relay the other ranks' blocks
    for (int l = 0; l < engine_.hparams().n_layer; ++l) ring.layer_stored(l);
  }
  ring.release();
  cache_->release_ring_state();
  double part[2] = {0.0, 0.0};
  for (size_t i = 0; i < pos.size(); ++i)
    if (targets[i] >= 0) part[0] += nll[i], part[1] += 1.0;
  std::vector<double> all((size_t)2 * comm_.size());
  comm_.all_gather(part, all.data(), sizeof part);
  double sum = 0.0, count = 0.0;
  for (int r = 0; r < comm_.size(); ++r) sum += all[2 * r], count += all[2 * r + 1];  // rank order: deterministic
  next_pos_ = n;
  return {sum, (int64_t)count};
}

namespace {

// Runs f on every rank; when it throws on any, every rank throws the first failing rank's message
// (so no rank goes on into a collective the others will not join).
template <typename F>
void on_every_rank_or_none(communicator& comm, const char* what, F&& f) {
  constexpr size_t kMessage = 1024;
  char mine[kMessage] = {};
  try {
    f();
  } catch (const Error& e) {
    std::snprintf(mine, kMessage, "%s", e.what());
    if (mine[0] == '\0') std::snprintf(mine, kMessage, "%s failed", what);
  }
  std::vector<char> all(kMessage * comm.size());
  comm.all_gather(mine, all.data(), kMessage);
  for (int r = 0; r < comm.size(); ++r) {
    const char* m = all.data() + (size_t)r * kMessage;
    if (m[0] != '\0') fail(comm.size() > 1 ? "rank " + std::to_string(r) + ": " : std::string(), std::string(m, strnlen(m, kMessage)));
  }
}

}  // namespace

uint64_t sequence_parallel_runner::save_cache(const std::string& dir, const std::vector<int32_t>& tokens) {
  XCTX_CHECK(active_ && cache_, "save_cache: no sequence to save (prefill first)");
  stopwatch clock;
  const int P = comm_.size(), rank = comm_.rank();
  snapshot_state st;
  st.rank = rank, st.n_rank = P, st.tail_rank = plan_.tail_rank, st.next_position = next_pos_;
  st.prefill = prefill_mode_name(mode_);
  st.held_per_rank.resize(P);
  const int64_t held = cache_->n_tokens(0);
  comm_.all_gather(&held, st.held_per_rank.data(), sizeof held);
  if (rank == 0) {
    XCTX_CHECK((int64_t)tokens.size() == next_pos_, "save_cache: ", tokens.size(), " token ids for a sequence of ",
               next_pos_);
    st.tokens = tokens;
  }
  const snapshot_identity id = make_snapshot_identity(engine_.weights(), spec_, cache_->geometry());
  uint64_t bytes = 0;
  on_every_rank_or_none(comm_, "saving the cache", [&] {
    write_cache_snapshot(dir, id, st, *cache_);
    bytes = std::filesystem::file_size(snapshot_file(dir, rank, P));
  });
  std::vector<uint64_t> all(P);
  comm_.all_gather(&bytes, all.data(), sizeof bytes);
  uint64_t total = 0;
  for (uint64_t b : all) total += b;
  on_every_rank_or_none(comm_, "writing the manifest", [&] {
    if (rank == 0) write_snapshot_manifest(dir, id, st, clock.seconds(), total);
  });
  return total;
}

std::vector<int32_t> sequence_parallel_runner::load_cache(const std::string& dir, int64_t max_new) {
  XCTX_CHECK(!active_, "load_cache on a sequence already started (reset() ends it)");
  XCTX_CHECK(max_new >= 0, "load_cache: max_new must be >= 0");
  const int P = comm_.size(), rank = comm_.rank();
  const snapshot_identity expect = make_snapshot_identity(engine_.weights(), spec_, engine_.cache_geometry_for(1));
  snapshot_state st;
  on_every_rank_or_none(comm_, "reading the cache snapshot", [&] { st = read_snapshot_state(dir, rank, P, expect); });
  // Sized as a prefill of the saved length would be: the fit check counts that prefill's
  // temporaries too, so it errs on the safe side.
  sequence_options seq = opt_;
  seq.mode = st.prefill == "star" ? prefill_mode::prefill_star : prefill_mode::prefill_exact;
  plan_ = shard_plan{};
  plan_.n_rank = P, plan_.n_tokens = st.next_position, plan_.tail_rank = st.tail_rank;
  int64_t most = 0;
  for (int r = 0; r < P; ++r) most = std::max(most, st.held_per_rank[r] + (r == st.tail_rank ? max_new : 0));
  const bool tail = rank == st.tail_rank;
  prepare_cache(seq, st.held_per_rank[rank] + (tail ? max_new : 0), most, st.next_position, max_new);
  on_every_rank_or_none(comm_, "restoring the cache", [&] {
    restore_cache_snapshot(dir, rank, P, *cache_);
    XCTX_CHECK(cache_->n_tokens(0) == st.held_per_rank[rank], snapshot_file(dir, rank, P), ": restored ",
               cache_->n_tokens(0), " tokens where its header says ", st.held_per_rank[rank]);
  });
  mode_ = seq.mode;
  next_pos_ = st.next_position;
  active_ = true;
  return st.tokens;
}

std::pair<double, int64_t> sequence_parallel_runner::score_stepwise(const std::vector<int32_t>& tokens,
                                                                    int64_t first_scored, int64_t chunk,
                                                                    const llama_engine::progress_fn& progress) {
  const int64_t n = (int64_t)tokens.size(), prefix = 1;
  XCTX_CHECK(n >= 2, "score: need at least 2 tokens, got ", n);
  XCTX_CHECK(chunk >= 1, "score: chunk must be >= 1, got ", chunk);
  const int V = engine_.hparams().n_vocab;
  std::vector<float> logits((size_t)std::min<int64_t>(chunk, n - prefix) * V);
  double sum = 0.0;
  int64_t count = 0;
  // nll = logsumexp(row) - row[target], in double and in vocabulary order: every rank holds the
  // same logits, so every rank adds the same bits.
  const auto add = [&](const float* row, int64_t target_pos) {
    if (target_pos < first_scored || target_pos >= n) return;
    float m = row[0];
    for (int v = 1; v < V; ++v) m = std::max(m, row[v]);
    double z = 0.0;
    for (int v = 0; v < V; ++v) z += std::exp((double)row[v] - (double)m);
    sum += (double)m + std::log(z) - (double)row[tokens[(size_t)target_pos]];
    ++count;
  };
  const std::vector<int32_t> head(tokens.begin(), tokens.begin() + prefix);
  prefill(head, {}, logits.data(), {}, n - 1 - prefix);
  add(logits.data(), prefix);  // the prefill's row predicts token 1
  for (int64_t p = prefix; p < n - 1; p += chunk) {
    const int64_t m = std::min(chunk, n - 1 - p);
    step(tokens.data() + p, m, logits.data(), llama_engine::logits_for::logits_all);
    for (int64_t i = 0; i < m; ++i) add(logits.data() + (size_t)i * V, p + i + 1);
    if (progress) progress(p + m, n - 1);
  }
  return {sum, count};
}

void sequence_parallel_runner::step(const int32_t* tokens, int64_t n, float* logits, llama_engine::logits_for which) {
  XCTX_CHECK(active_, "step before prefill");
  XCTX_CHECK(n > 0, "step: no tokens");
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)(next_pos_ + i);
  merged_attention merged(*cache_, comm_.rank() == plan_.tail_rank, comm_, be_, stats_, device_comm_, selector_.get());
  engine_.forward(tokens, pos.data(), n, merged, which, logits);
  next_pos_ += n;
  stats_.decode_tokens += n;
}

}  // namespace xctx
