#include "coordinator/service/service.h"

#include <glog/logging.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/server/TThreadedServer.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TServerSocket.h>
#include <thrift/transport/TSocket.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "Xctx.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/service/generate_text.h"
#include "coordinator/service/http_front.h"
#include "coordinator/service/job_journal.h"
#include "coordinator/jobs/passkey.h"
#include "coordinator/service/secret.h"
#include "coordinator/jobs/sequence_driver.h"
#include "coordinator/service/service_metrics.h"
#include "coordinator/jobs/session.h"
#include "coordinator/jobs/summarize.h"
#include "worker/llama_engine.h"
#include "worker/sequence_plan.h"

namespace xctx {
namespace {

namespace th = apache::thrift;

std::atomic<bool> g_stop_signal{false};
extern "C" void on_stop_signal(int) { g_stop_signal = true; }

// What the handler threads share with the job loop.
struct service_state {
  job_table table;
  service_limits limits;
  std::string secret;  // empty: none required
  rpc::ServiceInfo info;
  service_metrics metrics;
};

// One per connection, so every log line names the peer.
class handler final : public rpc::XctxIf {
 public:
  handler(service_state& st, std::string peer) : st_(st), peer_(std::move(peer)) {}

  int64_t submit(const std::string& auth, const rpc::Job& job) override {
    return answer("submit", auth, [&] {
      check_job_request(job, st_.limits);
      const int64_t id = st_.table.submit(job);
      LOG(INFO) << peer_ << " submit " << rpc::to_string(job.kind) << ": job " << id << " queued";
      return id;
    });
  }
  void status(rpc::JobStatus& out, const std::string& auth, const int64_t id) override {
    out = answer("status", auth, [&] { return st_.table.status(id); });
    VLOG(1) << peer_ << " status " << id << ": " << rpc::to_string(out.phase);
  }
  void result(rpc::JobResult& out, const std::string& auth, const int64_t id) override {
    out = answer("result", auth, [&] { return st_.table.result(id); });
    LOG(INFO) << peer_ << " result " << id << ": " << rpc::to_string(out.phase);
  }
  bool cancel(const std::string& auth, const int64_t id) override {
    const bool r = answer("cancel", auth, [&] { return st_.table.cancel(id); });
    LOG(INFO) << peer_ << " cancel " << id << ": " << (r ? "cancelling" : "had ended");
    return r;
  }
  void info(rpc::ServiceInfo& out, const std::string& auth) override {
    out = answer("info", auth, [&] { return st_.info; });
    VLOG(1) << peer_ << " info";
  }
  void metrics(rpc::Metrics& out, const std::string& auth) override {
    out = answer("metrics", auth, [&] { return st_.table.metrics(); });
    VLOG(1) << peer_ << " metrics";
  }

 private:
  // Auth first, then the call; a refusal is logged with the peer and counted, then thrown to
  // the client. Nothing a request holds can stop the server: unexpected errors become
  // BAD_REQUEST with their message.
  template <class F>
  auto answer(const char* method, const std::string& auth, F&& f) -> decltype(f()) {
    try {
      if (!st_.secret.empty() && !same_secret(auth, st_.secret))
        throw request_error(rpc::ErrorCode::UNAUTHORIZED, "wrong or missing token (the service's --token-file)");
      return f();
    } catch (const rpc::RequestError& e) {
      st_.table.count_rejected();
      st_.metrics.refused(refusal_reason(e.code));
      LOG(WARNING) << peer_ << " " << method << " rejected: " << rpc::to_string(e.code) << ": " << e.message;
      throw;
    } catch (const std::exception& e) {
      st_.table.count_rejected();
      st_.metrics.refused("bad_request");
      LOG(WARNING) << peer_ << " " << method << " rejected: " << e.what();
      throw request_error(rpc::ErrorCode::BAD_REQUEST, e.what());
    }
  }

  service_state& st_;
  std::string peer_;
};

class handler_factory final : public rpc::XctxIfFactory {
 public:
  explicit handler_factory(service_state& st) : st_(st) {}
  rpc::XctxIf* getHandler(const th::TConnectionInfo& conn) override {
    std::string peer = "?";
    if (auto sock = std::dynamic_pointer_cast<th::transport::TSocket>(conn.transport))
      peer = sock->getPeerAddress() + ":" + std::to_string(sock->getPeerPort());
    return new handler(st_, peer);
  }
  void releaseHandler(rpc::XctxIf* h) override { delete h; }

 private:
  service_state& st_;
};

// Frames are read whole before the handler sees them, so the transport caps them (at a margin
// above --max-request-bytes, which the handler enforces with a named error).
class framed_factory final : public th::transport::TTransportFactory {
 public:
  explicit framed_factory(int max_frame) : config_(std::make_shared<th::TConfiguration>(max_frame, max_frame)) {}
  std::shared_ptr<th::transport::TTransport> getTransport(std::shared_ptr<th::transport::TTransport> t) override {
    return std::make_shared<th::transport::TFramedTransport>(t, config_);
  }

 private:
  std::shared_ptr<th::TConfiguration> config_;
};

// Announces the port once the server listens (preServe runs after listen()).
class ready_announcer final : public th::server::TServerEventHandler {
 public:
  ready_announcer(std::string bind, std::string port_file, const int& port) : bind_(std::move(bind)), file_(std::move(port_file)), port_(port) {}
  void preServe() override {
    std::fprintf(stderr, "[xctx] serving on %s:%d\n", bind_.c_str(), port_);
    LOG(INFO) << "serving on " << bind_ << ":" << port_;
    if (!file_.empty()) {  // written whole, then renamed: a reader never sees half a number
      const std::string tmp = file_ + ".tmp";
      std::ofstream(tmp) << port_ << "\n";
      std::filesystem::rename(tmp, file_);
    }
  }

 private:
  std::string bind_, file_;
  const int& port_;
};

// Rank 0's job loop: each kind is a series of driver sequences.
class job_runner {
 public:
  job_runner(model_session& s, sequence_driver& driver, service_state& st, const serve_options& opt, int ranks)
      : s_(s), driver_(driver), st_(st), opt_(opt), ranks_(ranks), summarizer_(*s.tok, s.chat_template, driver, [&] {
          summarize_settings ss;
          ss.n_ctx = st.limits.max_context;
          ss.max_tokens = std::min(ss.max_tokens, st.limits.max_output_tokens);
          ss.map_tokens = std::min(ss.map_tokens, st.limits.max_output_tokens);
          return ss;
        }()) {}

  rpc::JobResult run(int64_t id, const rpc::Job& job) {
    rpc::JobResult r;
    const auto stop = [this, id] { return g_stop_signal.load() || st_.table.cancel_requested(id); };
    try {
      switch (job.kind) {
        case rpc::JobKind::GENERATE: generate(id, job.generate, stop, r); break;
        case rpc::JobKind::PASSKEY: passkey(id, job.passkey, stop, r); break;
        case rpc::JobKind::SUMMARIZE: summarize(id, job.summarize.document, stop, r); break;
        case rpc::JobKind::BATCH: batch(id, job.batch, stop, r); break;
      }
      if (r.phase != rpc::JobPhase::CANCELLED) r.phase = rpc::JobPhase::DONE;
    } catch (const std::exception& e) {
      r.phase = rpc::JobPhase::FAILED;
      r.error = e.what();
    }
    if (r.phase == rpc::JobPhase::CANCELLED && r.error.empty())
      r.error = g_stop_signal ? "the service is shutting down" : "cancelled";
    return r;
  }

 private:
  using stop_fn = std::function<bool()>;

  std::function<void(bool)> phase_setter(int64_t id) {
    return [this, id](bool decoding) {
      st_.table.set_phase(id, decoding ? rpc::JobPhase::DECODE : rpc::JobPhase::PREFILL);
    };
  }

  void generate(int64_t id, const rpc::GenerateJob& g, const stop_fn& stop, rpc::JobResult& r) {
    const std::vector<int32_t> ids = generate_prompt_ids(*s_.tok, s_.chat_template, g);
    const int64_t n = (int64_t)ids.size(), total = n + g.max_tokens;
    XCTX_CHECK(total <= st_.limits.max_context, "the prompt has ", n, " tokens; with max_tokens ", g.max_tokens,
               " that exceeds the service's context of ", st_.limits.max_context, " tokens");
    st_.table.set_tokens(id, 0, total);
    // The output as final text pieces (whole UTF-8 characters, no part of a stop string), for
    // the HTTP front's streams; a stop string ends the sequence like a cancel, but as DONE.
    text_stream text(*s_.tok, g.stop);
    bool hit_stop = false;
    sequence_hooks h;
    h.should_stop = [&] { return hit_stop || stop(); };
    h.on_phase = phase_setter(id);
    h.prefill_progress = [&](int64_t d, int64_t) { st_.table.set_tokens(id, d, total); };
    int64_t made = 0;
    auto last = std::chrono::steady_clock::now();
    h.on_token = [&](int32_t t) {
      const auto now = std::chrono::steady_clock::now();
      if (made == 0) st_.metrics.first_token(st_.table.seconds_since_submitted(id));
      else st_.metrics.token_interval(std::chrono::duration<double>(now - last).count());
      last = now;
      st_.table.set_tokens(id, n + ++made, total);
      hit_stop = text.push(t);
      st_.table.append_text(id, text.take_ready());
    };
    const sequence_outcome out = driver_.run({ids, {}, g.max_tokens, sampling_of(g)}, h);
    text.finish();
    st_.table.append_text(id, text.take_ready());
    r.text = text.text();
    r.prompt_tokens = out.prompt_tokens, r.generated_tokens = (int64_t)out.ids.size();
    r.prefill_s = out.prefill_s, r.decode_s = out.decode_s;
    r.finish_reason = hit_stop || (int64_t)out.ids.size() < g.max_tokens ? "stop" : "length";
    if (out.stopped && !hit_stop) r.phase = rpc::JobPhase::CANCELLED;
  }

  void passkey(int64_t id, const rpc::PasskeyJob& p, const stop_fn& stop, rpc::JobResult& r) {
    passkey_options o;
    o.context = p.context, o.trials = p.trials, o.depths = p.depths, o.seed = (uint64_t)p.seed, o.filler = p.filler;
    o.run = opt_.run;
    o.run.n_ctx = st_.limits.max_context;
    check_passkey_options(o, s_.weights.hp);
    const int items = o.trials * (int)o.depths.size();
    const int64_t per_trial = passkey_tokens_needed(o);
    int done = 0;
    st_.table.set_items(id, 0, items);
    st_.table.set_tokens(id, 0, items * per_trial);
    passkey_hooks h;
    h.should_stop = stop;
    h.prefill_progress = [&](size_t, int, int64_t d, int64_t) {
      st_.table.set_tokens(id, done * per_trial + d, items * per_trial);
    };
    h.on_phase = phase_setter(id);
    h.on_trial = [&](const nlohmann::json& t) {
      st_.table.set_items(id, ++done, items);
      r.prompt_tokens += t["prompt_tokens"].get<int64_t>();
      r.generated_tokens += t["answer_tokens"].get<int64_t>();
      r.prefill_s += t["prefill_s"].get<double>(), r.decode_s += t["decode_s"].get<double>();
    };
    const nlohmann::json trials = passkey_trials(o, *s_.tok, s_.chat_template, driver_, h);
    const nlohmann::json summary = passkey_summary(o, trials);
    std::ostringstream table;
    for (const auto& d : summary["per_depth"])
      table << "depth " << d["depth"].get<double>() << ": " << d["correct"].get<int>() << "/"
            << d["trials"].get<int>() << "\n";
    table << "all: " << summary["correct"].get<int>() << "/" << summary["total"].get<int>() << "\n";
    r.text = table.str();
    r.json = nlohmann::json{{"trials", trials}, {"summary", summary}}.dump(
        -1, ' ', false, nlohmann::json::error_handler_t::replace);
    if ((int)trials.size() < items) r.phase = rpc::JobPhase::CANCELLED;
  }

  summary_result summarize_text(int64_t id, const std::string& text, const std::string& instruction, int max_tokens,
                                const stop_fn& stop, int64_t base_done) {
    summary_hooks h;
    h.should_stop = stop;
    h.on_phase = phase_setter(id);
    h.progress = [&](int64_t d, int64_t t) { st_.table.set_tokens(id, base_done + d, base_done + t); };
    return summarizer_.summarize(text, instruction, max_tokens, h);
  }

  void summarize(int64_t id, const rpc::Document& d, const stop_fn& stop, rpc::JobResult& r) {
    st_.table.set_items(id, 0, 1);
    const summary_result s = summarize_text(id, d.text, d.instruction, d.max_tokens, stop, 0);
    r.text = s.summary;
    r.json = summary_line(d.id, s, st_.info.cache, ranks_);
    r.prompt_tokens = s.prompt_tokens, r.generated_tokens = s.generated_tokens;
    r.prefill_s = s.prefill_s, r.decode_s = s.decode_s;
    if (s.stopped) r.phase = rpc::JobPhase::CANCELLED;
    else st_.table.set_items(id, 1, 1);
  }

  void batch(int64_t id, const rpc::BatchJob& b, const stop_fn& stop, rpc::JobResult& r) {
    const std::vector<summary_document> docs = parse_summary_jsonl(b.jsonl, "batch.jsonl", false);
    st_.table.set_items(id, 0, (int)docs.size());
    int done = 0, errors = 0;
    int64_t tokens = 0;
    for (const summary_document& d : docs) {
      if (stop()) {
        r.phase = rpc::JobPhase::CANCELLED;
        break;
      }
      std::string line;
      try {
        XCTX_CHECK(d.error.empty(), d.error);
        const summary_result s =
            summarize_text(id, d.text, d.instruction, d.max_tokens > 0 ? d.max_tokens : b.max_tokens, stop, tokens);
        if (s.stopped) {
          r.phase = rpc::JobPhase::CANCELLED;
          break;
        }
        tokens += s.prompt_tokens + s.generated_tokens;
        r.prompt_tokens += s.prompt_tokens, r.generated_tokens += s.generated_tokens;
        r.prefill_s += s.prefill_s, r.decode_s += s.decode_s;
        line = summary_line(d.id, s, st_.info.cache, ranks_);
      } catch (const Error& e) {
        ++errors;
        line = summary_error_line(d.id, e.what());
      }
      r.text += line + "\n";
      st_.table.set_items(id, ++done, (int)docs.size());
    }
    r.json = nlohmann::json{{"documents", docs.size()}, {"done", done}, {"errors", errors}}.dump();
  }

  model_session& s_;
  sequence_driver& driver_;
  service_state& st_;
  const serve_options& opt_;
  int ranks_;
  summarizer summarizer_;
};

void setup_logging(const serve_options& opt) {
  FLAGS_v = opt.verbose;
  if (!opt.log_dir.empty()) {
    std::filesystem::create_directories(opt.log_dir);
    FLAGS_log_dir = opt.log_dir;
    FLAGS_logtostderr = false;
    FLAGS_stderrthreshold = google::GLOG_ERROR;
  }
}

}  // namespace

int run_serve(const serve_options& opt, communicator& comm) {
  const bool lead = comm.rank() == 0;
  XCTX_CHECK(opt.port >= 0 && opt.port <= 65535, "--port must be in [0, 65535], got ", opt.port);
  // Every rank ignores the first SIGTERM/SIGINT (mpirun forwards them to all): rank 0 stops
  // taking jobs, ends the running one at its next step and releases the others.
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  if (lead) setup_logging(opt);
  // Rank 0's own inputs are checked before the model loads, so a typo fails at once.
  const std::string secret = lead && !opt.token_file.empty() ? read_secret(opt.token_file) : std::string();
  // The job table and the HTTP front exist before the model loads: /health answers 503 until
  // the ranks are up and the cache is allocated, so a supervisor can tell loading from dead.
  std::unique_ptr<job_journal> journal;
  std::unique_ptr<service_state> state;
  std::unique_ptr<http_front> http;
  if (lead) {
    if (!opt.journal_dir.empty()) {
      journal = std::make_unique<job_journal>(opt.journal_dir, opt.keep_ended);
      const job_journal::replay& r = journal->replayed();
      int interrupted = 0;
      for (const auto& j : r.jobs) interrupted += j.starts > 0;
      std::fprintf(stderr, "[xctx] job journal %s: %zu pending job(s) (%d interrupted: %s), %zu ended, next id %lld\n",
                   journal->path().c_str(), r.jobs.size(), interrupted,
                   opt.on_interrupt == interrupted_policy::retry_once ? "retried once" : "failed", r.ended.size(),
                   (long long)r.next_id);
    }
    state.reset(new service_state{job_table(opt.max_queue, opt.keep_ended, journal.get(), opt.on_interrupt),
                                  opt.limits, secret, {}, {}});
    if (opt.http_port >= 0) {
      http_front_options ho;
      ho.bind = opt.bind, ho.port = opt.http_port, ho.port_file = opt.http_port_file, ho.secret = secret;
      ho.threads = opt.http_threads, ho.max_request_bytes = opt.limits.max_request_bytes;
      ho.io_timeout_s = opt.http_io_timeout_s;
      http = std::make_unique<http_front>(ho, state->table, state->metrics);
      http->start();
    }
  }

  const std::string model_path = opt.model.empty() ? default_model_path() : opt.model;
  model_session s = open_session(model_path, opt.tokenizer, opt.run, comm.rank() == 0);
  const model_hparams& hp = s.weights.hp;
  const int64_t n_ctx = opt.run.n_ctx > 0 ? opt.run.n_ctx : hp.n_ctx_train;
  service_limits limits = opt.limits;
  if (limits.max_context <= 0) limits.max_context = n_ctx;
  XCTX_CHECK(limits.max_context <= n_ctx, "--max-context ", limits.max_context, " is over the context of ", n_ctx,
             " tokens (raise --ctx)");
  XCTX_CHECK(limits.max_output_tokens >= 1 && limits.max_output_tokens < limits.max_context,
             "--max-output-tokens must be in [1, --max-context), got ", limits.max_output_tokens);
  XCTX_CHECK(limits.max_request_bytes >= 1024, "--max-request-bytes must be >= 1024");

  // The one cache is sized for --max-context: retrieval when that is past the trained window.
  const sequence_plan plan =
      plan_sequences(hp, opt.seq, opt.run, s.cache,
                     {limits.max_context - 1, limits.max_context, limits.max_output_tokens, /*one_cache=*/true},
                     comm.size());
  const sequence_options& seq = plan.seq;
  llama_engine engine(s.weights, *s.be, plan.run);
  sequence_parallel_runner runner(engine, comm, *s.be, plan.cache, seq);
  runner.reserve();  // the one cache every job reuses, allocated now so a shortfall shows at start
  sequence_driver driver(runner, comm, *s.tok, hp.n_vocab);
  // Every rank's cache bytes, for /metrics (shards differ by a block at most, but say so).
  const uint64_t own_cache = runner.cache().bytes_allocated();
  std::vector<uint64_t> cache_per_rank((size_t)comm.size());
  comm.all_gather(&own_cache, cache_per_rank.data(), sizeof own_cache);
  if (!lead) {
    driver.follow();
    return 0;
  }

  service_state& st = *state;
  st.limits = limits;
  rpc::ServiceInfo& info = st.info;
  info.model = hp.name;
  info.cache = format_traits(opt.run.cache).name;
  for (cache_format f : all_cache_formats()) info.cache_formats.push_back(format_traits(f).name);
  info.ranks = comm.size();
  info.max_context_tokens = limits.max_context;
  info.max_output_tokens = limits.max_output_tokens;
  info.max_request_bytes = limits.max_request_bytes;
  info.max_queue = opt.max_queue;
  info.cache_bytes_per_rank = (int64_t)runner.cache().bytes_allocated();
  info.backend = s.be->name();
  info.prefill = prefill_mode_name(seq.mode);
  info.auth_required = !st.secret.empty();
  std::fprintf(stderr, "[xctx] serve: %d rank(s) | %s | cache %s per rank, %s planned for the fullest\n", comm.size(),
               plan.header().c_str(), format_bytes((double)runner.cache().bytes_allocated()).c_str(),
               plan.memory.describe().c_str());

  int bound_port = opt.port;
  auto socket = std::make_shared<th::transport::TServerSocket>(opt.bind, opt.port);
  socket->setListenCallback([&bound_port](THRIFT_SOCKET fd) {  // after bind: learn the port of --port 0
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      bound_port = ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&a)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  });
  const int64_t max_frame = std::min<int64_t>(INT32_MAX, std::max<int64_t>(2 * limits.max_request_bytes,
                                                                           limits.max_request_bytes + (1 << 20)));
  auto server = std::make_shared<th::server::TThreadedServer>(
      std::make_shared<rpc::XctxProcessorFactory>(std::make_shared<handler_factory>(st)), socket,
      std::make_shared<framed_factory>((int)max_frame),
      // No string or list of a request is longer than its frame; without the limits Thrift
      // allocates whatever length a string claims (up to 2 GB) before finding the bytes missing.
      std::make_shared<th::protocol::TBinaryProtocolFactory>((int32_t)max_frame, (int32_t)max_frame, false, true));
  server->setServerEventHandler(std::make_shared<ready_announcer>(opt.bind, opt.port_file, bound_port));
  std::string server_error;
  std::thread server_thread([&] {
    try {
      server->serve();
    } catch (const std::exception& e) {
      server_error = e.what();
      g_stop_signal = true;
    }
  });

  LOG(INFO) << "model " << info.model << " | cache " << info.cache << " | " << info.ranks << " ranks | context "
            << limits.max_context << " tokens, " << format_bytes((double)info.cache_bytes_per_rank)
            << " of cache per rank";
  for (int r = 0; r < comm.size(); ++r) st.metrics.set_cache_bytes(r, (int64_t)cache_per_rank[(size_t)r]);
  if (http) http->set_ready({s.tok.get(), s.chat_template, info, describe_attention(seq), limits});
  job_runner jobs(s, driver, st, opt, comm.size());
  while (!g_stop_signal) {
    auto next = st.table.next(std::chrono::milliseconds(500));
    if (!next) {
      driver.idle();
      continue;
    }
    const auto [id, job] = *next;
    LOG(INFO) << "job " << id << " (" << rpc::to_string(job.kind) << ") started";
    rpc::JobResult r = jobs.run(id, job);
    LOG(INFO) << "job " << id << " " << rpc::to_string(r.phase) << (r.error.empty() ? "" : ": " + r.error) << " | "
              << r.prompt_tokens << " prompt + " << r.generated_tokens << " generated tokens, prefill "
              << r.prefill_s << " s, decode " << r.decode_s << " s";
    st.metrics.job_ended(r);
    // A job our own shutdown stopped is not ended in the journal: a restart runs it again.
    const bool durable = !(r.phase == rpc::JobPhase::CANCELLED && g_stop_signal);
    st.table.finish(id, std::move(r), durable);
  }
  LOG(INFO) << "stopping";
  st.table.close();       // queued jobs end CANCELLED; their HTTP clients get a 503
  if (http) http->stop();
  server->stop();
  server_thread.join();
  driver.finish();  // the other ranks return; rank 0 reports why it stopped
  if (!server_error.empty()) {
    LOG(ERROR) << "the server failed: " << server_error;
    std::fprintf(stderr, "xctx: error: the service on %s:%d failed: %s\n", opt.bind.c_str(), opt.port,
                 server_error.c_str());
    return 1;
  }
  std::fprintf(stderr, "[xctx] service stopped\n");
  return 0;
}

}  // namespace xctx
