#include "coordinator/jobs/sequence_driver.h"

#include <algorithm>
#include <optional>

#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs/distributed.h"

namespace xctx {
namespace {

enum driver_op : int32_t { op_end = 0, op_run = 1, op_idle = 2 };
constexpr int32_t kSequenceOver = -1;  // in place of a token id: no further decode step

}  // namespace

sequence_driver::sequence_driver(sequence_parallel_runner& runner, communicator& comm, const tokenizer& tok,
                                 int32_t n_vocab)
    : runner_(runner), comm_(comm), tok_(tok), logits_((size_t)n_vocab) {}

sequence_outcome sequence_driver::run(const sequence_request& req, const sequence_hooks& hooks) {
  XCTX_ASSERT(comm_.rank() == 0 && !finished_);
  XCTX_CHECK(req.max_tokens >= 0, "max_tokens must be >= 0, got ", req.max_tokens);
  XCTX_CHECK(!req.context.empty() || !req.suffix.empty(), "a sequence needs at least one prompt token");
  XCTX_CHECK(req.load_cache_dir.empty() || (req.context.empty() && !req.suffix.empty()),
             "a sequence resumed from a snapshot continues with its suffix alone (no context to prefill)");
  // Refused here, on rank 0 alone and before any broadcast, so the followers never start it.
  const sequence_options& so = runner_.options();
  XCTX_CHECK(req.max_tokens <= so.max_new_tokens, "a sequence asks for ", req.max_tokens,
             " new tokens; this runner reserves room for ", so.max_new_tokens);
  if (so.capacity_per_rank > 0) {
    const int64_t need =
        runner_.tokens_needed_per_rank((int64_t)req.context.size(), (int64_t)req.suffix.size(), req.max_tokens);
    XCTX_CHECK(need <= so.capacity_per_rank, "a prompt of ", req.context.size() + req.suffix.size(),
               " tokens needs ", need, " tokens on one rank; the caches hold ", so.capacity_per_rank,
               " tokens per rank");
  }
  check_sampler_params(req.sampling);  // before the followers are told: a bad value fails here alone
  int32_t head[2] = {op_run, req.max_tokens};
  comm_.broadcast(head, sizeof head, 0);
  std::vector<int32_t> context = req.context, suffix = req.suffix;
  std::string save = req.save_cache_dir, load = req.load_cache_dir;
  broadcast_tokens(comm_, context);
  broadcast_tokens(comm_, suffix);
  broadcast_string(comm_, save);
  broadcast_string(comm_, load);
  sequence_outcome out;
  run_sequence(context, suffix, req.max_tokens, save, load, &req, &hooks, out);
  return out;
}

void sequence_driver::idle() {
  XCTX_ASSERT(comm_.rank() == 0 && !finished_);
  int32_t head[2] = {op_idle, 0};
  comm_.broadcast(head, sizeof head, 0);
}

void sequence_driver::finish() {
  XCTX_ASSERT(comm_.rank() == 0);
  if (finished_) return;
  finished_ = true;
  int32_t head[2] = {op_end, 0};
  comm_.broadcast(head, sizeof head, 0);
}

void sequence_driver::follow() {
  XCTX_ASSERT(comm_.rank() != 0);
  for (;;) {
    int32_t head[2] = {op_end, 0};  // op, max_tokens of a run
    comm_.broadcast(head, sizeof head, 0);
    const int32_t op = head[0];
    if (op == op_end) return;
    if (op == op_idle) continue;
    XCTX_ASSERT(op == op_run);
    std::vector<int32_t> context, suffix;
    std::string save, load;
    broadcast_tokens(comm_, context);
    broadcast_tokens(comm_, suffix);
    broadcast_string(comm_, save);
    broadcast_string(comm_, load);
    sequence_outcome ignored;
    try {
      run_sequence(context, suffix, head[1], save, load, nullptr, nullptr, ignored);
    } catch (const Error&) {
      // Refused alike on rank 0, which reports it; wait for the next command.
    }
  }
}

// Collective. Rank 0 (req != nullptr) samples and broadcasts each token it wants stepped;
// every rank steps exactly those, so all runners stay in lockstep.
void sequence_driver::run_sequence(const std::vector<int32_t>& context, const std::vector<int32_t>& suffix,
                                   int max_tokens, const std::string& save_dir, const std::string& load_dir,
                                   const sequence_request* req, const sequence_hooks* hooks, sequence_outcome& out) {
  const bool lead = req != nullptr;
  runner_.reset();
  out.prompt_tokens = (int64_t)(context.size() + suffix.size());
  stopwatch prefill_clock;
  // The runner counts prefill progress in tokens or, layer-major, in layers: report tokens.
  llama_engine::progress_fn progress;
  if (lead && hooks->prefill_progress)
    progress = [&](int64_t done, int64_t total) {
      hooks->prefill_progress(total > 0 ? out.prompt_tokens * done / total : 0, out.prompt_tokens);
    };
  if (lead && hooks->on_phase) hooks->on_phase(false);
  if (progress) progress(0, 1);  // starts the hook's clock before any work
  if (!load_dir.empty()) {  // resume: restore the snapshot, then the suffix continues it
    runner_.load_cache(load_dir, (int64_t)suffix.size() + max_tokens);
    out.restored_tokens = runner_.next_position();
    out.prompt_tokens += out.restored_tokens;
    runner_.step(suffix.data(), (int64_t)suffix.size(), logits_.data());
    if (progress) progress(1, 1);
  } else {
    runner_.prefill(context, suffix, logits_.data(), progress, max_tokens);
  }
  if (!save_dir.empty()) {
    std::vector<int32_t> tokens(context);
    tokens.insert(tokens.end(), suffix.begin(), suffix.end());
    out.snapshot_bytes = runner_.save_cache(save_dir, tokens);
  }
  out.prefill_s = prefill_clock.seconds();
  out.prefill = runner_.mode();
  if (lead && hooks->on_phase) hooks->on_phase(true);

  stopwatch decode_clock;
  std::optional<sampler> smp;
  if (lead) {  // the repetition penalty's window reaches back into the prompt: its last tokens
    const size_t want = (size_t)std::max(0, req->sampling.repeat_last_n);
    const size_t from_suffix = std::min(want, suffix.size()), from_context = std::min(want - from_suffix, context.size());
    std::vector<int32_t> tail(context.end() - (std::ptrdiff_t)from_context, context.end());
    tail.insert(tail.end(), suffix.end() - (std::ptrdiff_t)from_suffix, suffix.end());
    smp.emplace(req->sampling, tail);
  }
  for (;;) {
    int32_t id = kSequenceOver;
    if (lead) {
      if (hooks->should_stop && hooks->should_stop()) {
        out.stopped = true;
      } else if ((int)out.ids.size() < req->max_tokens) {
        const int32_t next = smp->sample(logits_.data(), (int32_t)logits_.size());
        if (!tok_.is_end_of_generation(next)) {
          out.ids.push_back(next);
          if (hooks->on_token) hooks->on_token(next);
          // The last token the budget allows is not run through the model: nothing follows it.
          if ((int)out.ids.size() < req->max_tokens) id = next;
        }
      }
    }
    comm_.broadcast(&id, sizeof id, 0);
    if (id == kSequenceOver) break;
    runner_.step(&id, 1, logits_.data());
    ++out.decode_steps;
  }
  out.decode_s = decode_clock.seconds();
}

}  // namespace xctx
