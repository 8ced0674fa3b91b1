// `xctx submit | status | result | cancel`: the command-line client of `xctx serve`.
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>
#include <thrift/transport/TSocket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "Xctx.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs/passkey.h"
#include "coordinator/service/service.h"

namespace xctx {
namespace {

namespace th = apache::thrift;

std::string trimmed(std::string s) {
  const auto first = s.find_first_not_of(" \t\r\n"), last = s.find_last_not_of(" \t\r\n");
  return first == std::string::npos ? std::string() : s.substr(first, last - first + 1);
}

struct connection {
  std::shared_ptr<th::transport::TTransport> transport;
  std::unique_ptr<rpc::XctxClient> client;
  std::string auth;
};

connection connect(const client_options& opt) {
  const size_t colon = opt.server.rfind(':');
  XCTX_CHECK(colon != std::string::npos && colon > 0, "--server: expected HOST:PORT, got '", opt.server, "'");
  const std::string host = opt.server.substr(0, colon);
  const int port = (int)parse_count(opt.server.substr(colon + 1), "--server port");
  auto socket = std::make_shared<th::transport::TSocket>(host, port);
  socket->setConnTimeout(10000);
  connection c;
  c.transport = std::make_shared<th::transport::TFramedTransport>(socket);
  c.client = std::make_unique<rpc::XctxClient>(std::make_shared<th::protocol::TBinaryProtocol>(c.transport));
  if (!opt.token_file.empty()) c.auth = trimmed(read_file_bytes(opt.token_file, "--token-file"));
  try {
    c.transport->open();
  } catch (const th::TException& e) {
    fail("cannot reach the xctx service at ", opt.server, ": ", e.what());
  }
  return c;
}

rpc::Job make_job(const client_options& opt) {
  rpc::Job job;
  if (opt.kind == "generate") {
    job.kind = rpc::JobKind::GENERATE;
    rpc::GenerateJob g;
    XCTX_CHECK(opt.prompt.empty() != opt.prompt_file.empty(), "submit generate: give --prompt or --prompt-file");
    g.prompt = opt.prompt_file.empty() ? opt.prompt : read_file_bytes(opt.prompt_file, "--prompt-file");
    g.chat = opt.chat, g.system = opt.system, g.max_tokens = opt.max_tokens;
    const sampler_params& sp = opt.sampling;
    g.temperature = sp.temperature, g.top_p = sp.top_p, g.seed = opt.seed;
    g.top_k = sp.top_k, g.min_p = sp.min_p, g.repetition_penalty = sp.repetition_penalty;
    g.repeat_last_n = sp.repeat_last_n, g.frequency_penalty = sp.frequency_penalty;
    g.presence_penalty = sp.presence_penalty, g.no_repeat_ngram = sp.no_repeat_ngram;
    g.stop = opt.stop;
    job.__set_generate(g);
  } else if (opt.kind == "passkey") {
    job.kind = rpc::JobKind::PASSKEY;
    rpc::PasskeyJob p;
    p.context = opt.context, p.trials = opt.trials, p.depths = parse_depths(opt.depths), p.seed = opt.seed;
    p.filler = opt.filler;
    job.__set_passkey(p);
  } else if (opt.kind == "summarize") {
    job.kind = rpc::JobKind::SUMMARIZE;
    XCTX_CHECK(!opt.in.empty(), "submit summarize: --in FILE (the document's text)");
    rpc::SummarizeJob s;
    s.document.id = opt.doc_id.empty() ? opt.in : opt.doc_id;
    s.document.text = read_file_bytes(opt.in, "--in");
    s.document.instruction = opt.instruction;
    s.document.max_tokens = opt.max_tokens;
    job.__set_summarize(s);
  } else if (opt.kind == "batch") {
    job.kind = rpc::JobKind::BATCH;
    XCTX_CHECK(!opt.in.empty(), "submit batch: --in FILE.jsonl");
    rpc::BatchJob b;
    b.jsonl = read_file_bytes(opt.in, "--in");
    b.max_tokens = opt.max_tokens;
    job.__set_batch(b);
  } else {
    fail("--kind: unknown '", opt.kind, "' (generate, passkey, summarize, batch)");
  }
  return job;
}

std::string describe(const rpc::JobStatus& s) {
  char buf[320];
  int n = std::snprintf(buf, sizeof buf, "job %lld (%s): %s", (long long)s.id, rpc::to_string(s.kind).c_str(),
                        rpc::to_string(s.phase).c_str());
  if (s.phase == rpc::JobPhase::QUEUED) {
    std::snprintf(buf + n, sizeof buf - n, ", position %d in the queue", s.queue_position);
  } else {
    n += std::snprintf(buf + n, sizeof buf - n, ", %lld/%lld tokens, %.1f tokens/s, %.1f s", (long long)s.tokens_done,
                       (long long)s.tokens_total, s.tokens_per_s, s.elapsed_s);
    if (s.items_total > 0) n += std::snprintf(buf + n, sizeof buf - n, ", %d/%d items", s.items_done, s.items_total);
    if (s.eta_s > 0 && s.phase != rpc::JobPhase::DONE)
      std::snprintf(buf + n, sizeof buf - n, ", ETA %.0f s", s.eta_s);
  }
  std::string out = buf;
  if (!s.error.empty()) out += ": " + s.error;
  return out;
}

// Polls until the job ends; a bar on a terminal, a line per quarter in a log.
rpc::JobResult wait_for(connection& c, int64_t id, double timeout_s) {
  const bool tty = isatty(STDERR_FILENO) != 0;
  const auto start = std::chrono::steady_clock::now();
  int last_quarter = -1;
  for (;;) {
    rpc::JobStatus s;
    c.client->status(s, c.auth, id);
    const bool ended = s.phase == rpc::JobPhase::DONE || s.phase == rpc::JobPhase::FAILED ||
                       s.phase == rpc::JobPhase::CANCELLED;
    const double frac = s.tokens_total > 0 ? (double)s.tokens_done / (double)s.tokens_total : 0.0;
    if (tty) {
      const int width = 30, filled = (int)(frac * width + 0.5);
      std::fprintf(stderr, "\r[%s%s] %3.0f%% %s\x1b[K", std::string(filled, '#').c_str(),
                   std::string(width - filled, ' ').c_str(), 100 * frac, describe(s).c_str());
      if (ended) std::fputc('\n', stderr);
    } else if ((int)(frac * 4) != last_quarter || ended) {
      last_quarter = (int)(frac * 4);
      std::fprintf(stderr, "%s\n", describe(s).c_str());
    }
    if (ended) break;
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    XCTX_CHECK(timeout_s <= 0 || waited < timeout_s, "job ", id, " has not ended after ", timeout_s,
               " s (--timeout); it keeps running: `xctx cancel ", id, "` stops it");
    std::this_thread::sleep_for(std::chrono::milliseconds(tty ? 200 : 500));
  }
  rpc::JobResult r;
  c.client->result(r, c.auth, id);
  return r;
}

int print_result(const rpc::JobResult& r, bool json) {
  const std::string& out = json ? r.json : r.text;
  std::fwrite(out.data(), 1, out.size(), stdout);
  if (!out.empty() && out.back() != '\n') std::fputc('\n', stdout);
  std::fflush(stdout);
  if (r.phase == rpc::JobPhase::DONE) return 0;
  std::fprintf(stderr, "xctx: job %lld %s%s%s\n", (long long)r.id, rpc::to_string(r.phase).c_str(),
               r.error.empty() ? "" : ": ", r.error.c_str());
  return r.phase == rpc::JobPhase::CANCELLED ? 3 : 1;
}

}  // namespace

int run_client(const client_options& opt) {
  try {
    connection c = connect(opt);
    if (opt.command == "submit") {
      const int64_t id = c.client->submit(c.auth, make_job(opt));
      if (!opt.wait) {
        std::printf("%lld\n", (long long)id);
        return 0;
      }
      std::fprintf(stderr, "[xctx] job %lld submitted\n", (long long)id);
      return print_result(wait_for(c, id, opt.timeout_s), opt.json);
    }
    if (opt.command == "result") {
      if (opt.wait) return print_result(wait_for(c, opt.id, opt.timeout_s), opt.json);
      rpc::JobResult r;
      c.client->result(r, c.auth, opt.id);
      return print_result(r, opt.json);
    }
    if (opt.command == "cancel") {
      const bool r = c.client->cancel(c.auth, opt.id);
      std::printf("job %lld: %s\n", (long long)opt.id, r ? "cancelled" : "had already ended");
      return 0;
    }
    XCTX_ASSERT(opt.command == "status");
    if (opt.id > 0) {
      rpc::JobStatus s;
      c.client->status(s, c.auth, opt.id);
      std::printf("%s\n", describe(s).c_str());
      return 0;
    }
    rpc::ServiceInfo i;
    rpc::Metrics m;
    c.client->info(i, c.auth);
    c.client->metrics(m, c.auth);
    std::printf("service %s: model %s | cache %s | %d rank(s), prefill %s, backend %s | context %lld tokens, output "
                "%d tokens | cache %s per rank\n",
                opt.server.c_str(), i.model.c_str(), i.cache.c_str(), i.ranks, i.prefill.c_str(), i.backend.c_str(),
                (long long)i.max_context_tokens, i.max_output_tokens,
                format_bytes((double)i.cache_bytes_per_rank).c_str());
    std::printf("up %.0f s, %s | jobs: %lld submitted, %lld done, %lld failed, %lld cancelled, %d queued | %lld "
                "requests rejected | %lld prompt + %lld generated tokens in %.1f s busy\n",
                m.uptime_s, m.busy ? "busy" : "idle", (long long)m.submitted, (long long)m.completed,
                (long long)m.failed, (long long)m.cancelled, m.queued, (long long)m.rejected,
                (long long)m.prompt_tokens, (long long)m.generated_tokens, m.busy_s);
    return 0;
  } catch (const rpc::RequestError& e) {
    fail("the service refused: ", rpc::to_string(e.code), ": ", e.message);
  } catch (const th::TException& e) {
    fail("talking to the service at ", opt.server, ": ", e.what());
  }
}

}  // namespace xctx
