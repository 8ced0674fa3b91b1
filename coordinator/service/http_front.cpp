#include "coordinator/service/http_front.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <glog/logging.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "coordinator/service/generate_text.h"
#include "coordinator/service/openai_api.h"
#include "coordinator/service/secret.h"

namespace xctx {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

std::string peer_of(const httplib::Request& req) { return req.remote_addr + ":" + std::to_string(req.remote_port); }

// httplib 0.11 gives a handler no handle on its connection, so a non-streaming request finds its
// socket once (the descriptor whose peer is the request's remote address and port) and polls it
// for the peer's hang-up while the job runs. -1 when not found (then only a stream notices).
int connection_fd(const httplib::Request& req) {
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  int found = -1;
  while (dirent* e = readdir(d)) {
    const int fd = std::atoi(e->d_name);
    struct stat st{};
    if (fd <= 2 || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) continue;
    char host[INET6_ADDRSTRLEN] = {};
    int port = -1;
    if (a.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<sockaddr_in*>(&a);
      inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
      port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<sockaddr_in6*>(&a);
      inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
      port = ntohs(v6->sin6_port);
    }
    if (port == req.remote_port && req.remote_addr == host) {
      found = fd;
      break;
    }
  }
  closedir(d);
  return found;
}

bool peer_hung_up(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

void send_json(httplib::Response& res, int status, const json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

}  // namespace

http_front::http_front(http_front_options opt, job_table& table, service_metrics& metrics)
    : opt_(std::move(opt)), table_(table), metrics_(metrics), server_(std::make_unique<httplib::Server>()) {
  XCTX_CHECK(opt_.port >= 0 && opt_.port <= 65535, "--http-port must be in [0, 65535], got ", opt_.port);
  XCTX_CHECK(opt_.threads >= 1 && opt_.threads <= 4096, "--http-threads must be in [1, 4096], got ", opt_.threads);
}

http_front::~http_front() { stop(); }

void http_front::start() {
  httplib::Server& s = *server_;
  const int threads = opt_.threads;
  s.new_task_queue = [threads] { return new httplib::ThreadPool((size_t)threads); };
  const auto io = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::duration<double>(opt_.io_timeout_s));
  s.set_read_timeout(io);   // a slow-loris client is dropped after this long without bytes
  s.set_write_timeout(io);  // and so is one that stops reading its stream
  s.set_keep_alive_timeout(5);
  s.set_payload_max_length((size_t)opt_.max_request_bytes);
  routes();
  // httplib's listen backlog is 5 (compiled into the Debian library): a burst of clients then
  // overflows the accept queue and some see their connections reset. The listening socket is
  // captured here and listen() called again with a real backlog once it is bound.
  int listen_fd = -1;
  s.set_socket_options([&listen_fd](socket_t fd) {
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);  // httplib's default, kept
    listen_fd = fd;
  });
  port_ = opt_.port == 0 ? s.bind_to_any_port(opt_.bind) : (s.bind_to_port(opt_.bind, opt_.port) ? opt_.port : -1);
  XCTX_CHECK(port_ > 0, "cannot listen for HTTP on ", opt_.bind, ":", opt_.port,
             " (in use, or not an address of this host; --http-port / --bind)");
  if (listen_fd >= 0 && ::listen(listen_fd, 1024) != 0) LOG(WARNING) << "HTTP: cannot raise the listen backlog";
  if (!opt_.port_file.empty()) {  // written whole, then renamed: a reader never sees half a number
    const std::string tmp = opt_.port_file + ".tmp";
    std::ofstream(tmp) << port_ << "\n";
    std::filesystem::rename(tmp, opt_.port_file);
  }
  std::fprintf(stderr, "[xctx] HTTP (OpenAI-compatible) on http://%s:%d/v1\n", opt_.bind.c_str(), port_);
  LOG(INFO) << "HTTP on " << opt_.bind << ":" << port_;
  thread_ = std::thread([this] { server_->listen_after_bind(); });
}

void http_front::set_ready(http_model_view view) {
  std::lock_guard<std::mutex> lock(view_mu_);
  view_ = std::make_shared<const http_model_view>(std::move(view));
}

void http_front::stop() {
  stopping_ = true;
  if (thread_.joinable()) {
    server_->stop();
    thread_.join();
  }
}

void http_front::refuse(httplib::Response& res, const api_error& e, const httplib::Request& req) {
  metrics_.refused(e.code.empty() ? (e.status == 400 ? "bad_request" : std::to_string(e.status)) : e.code);
  table_.count_rejected();
  LOG(WARNING) << peer_of(req) << " " << req.method << " " << req.path << " refused: " << e.status << " " << e.what();
  send_json(res, e.status, error_body(e));
}

bool http_front::authorized(const httplib::Request& req, httplib::Response& res) {
  if (opt_.secret.empty()) return true;
  const std::string h = req.get_header_value("Authorization");
  const std::string given = h.rfind("Bearer ", 0) == 0 ? h.substr(7) : std::string();
  if (same_secret(given, opt_.secret)) return true;
  refuse(res, api_error(401, "authentication_error", "wrong or missing token: send Authorization: Bearer <the service's --token-file secret>", "", "invalid_api_key"), req);
  return false;
}

void http_front::routes() {
  httplib::Server& s = *server_;
  const auto ready_view = [this] {
    std::lock_guard<std::mutex> lock(view_mu_);
    return view_;
  };
  s.Get("/health", [this, ready_view](const httplib::Request&, httplib::Response& res) {
    if (stopping_) return send_json(res, 503, {{"status", "stopping"}});
    if (!ready_view()) return send_json(res, 503, {{"status", "loading"}});
    send_json(res, 200, {{"status", "ok"}});
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.scrape(table_), "text/plain; version=0.0.4");
  });
  s.Get("/v1/models", [this, ready_view](const httplib::Request& req, httplib::Response& res) {
    const auto v = ready_view();
    if (!v) return refuse(res, api_error(503, "service_unavailable", "the model is loading", "", "loading"), req);
    if (!authorized(req, res)) return;
    json model = {{"id", v->info.model}, {"object", "model"}, {"created", 0}, {"owned_by", "xctx"},
                  {"xctx", {{"cache", v->info.cache}, {"ranks", v->info.ranks}, {"backend", v->info.backend},
                            {"attention", v->attention}, {"max_context_tokens", v->info.max_context_tokens},
                            {"max_output_tokens", v->info.max_output_tokens}}}};
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model})}});
  });
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completion(req, res, api_endpoint::completions);
  });
  s.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    completion(req, res, api_endpoint::chat_completions);
  });
  // xctx's extension: the status of any job (Thrift's too) and cancelling it.
  const auto job_route = [this, ready_view](bool cancel) {
    return [this, ready_view, cancel](const httplib::Request& req, httplib::Response& res) {
      if (!ready_view()) return refuse(res, api_error(503, "service_unavailable", "the model is loading", "", "loading"), req);
      if (!authorized(req, res)) return;
      try {
        const int64_t id = std::stoll(req.matches[1]);
        if (cancel) {
          const bool r = table_.cancel(id);
          LOG(INFO) << peer_of(req) << " DELETE job " << id << ": " << (r ? "cancelling" : "had ended");
          return send_json(res, 200, {{"id", id}, {"cancelled", r}});
        }
        const rpc::JobStatus st = table_.status(id);
        send_json(res, 200, {{"id", id}, {"kind", rpc::to_string(st.kind)}, {"phase", rpc::to_string(st.phase)},
                             {"tokens_done", st.tokens_done}, {"tokens_total", st.tokens_total},
                             {"tokens_per_s", st.tokens_per_s}, {"eta_s", st.eta_s},
                             {"queue_position", st.queue_position}, {"elapsed_s", st.elapsed_s}, {"error", st.error}});
      } catch (const rpc::RequestError& e) {
        refuse(res, api_error_of(e), req);
      } catch (const std::out_of_range&) {
        refuse(res, api_error(400, "invalid_request_error", "job id out of range"), req);
      }
    };
  };
  s.Get(R"(/v1/jobs/(\d+))", job_route(false));
  s.Delete(R"(/v1/jobs/(\d+))", job_route(true));
  // Errors httplib answers itself (404 route, 413 body over --max-request-bytes, 400 framing)
  // get OpenAI's error shape too.
  s.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const int st = res.status;
    const std::string msg = st == 404   ? "no route " + req.method + " " + req.path
                            : st == 413 ? "the body is over the service's limit of " +
                                              std::to_string(opt_.max_request_bytes) + " bytes (--max-request-bytes)"
                                        : st == 400 ? std::string("the request is not well-formed HTTP")
                                        : "HTTP status " + std::to_string(st);
    const api_error e(st, st == 404 ? "not_found_error" : "invalid_request_error", msg, "",
                      st == 413 ? "request_too_large" : "");
    metrics_.refused(st == 413 ? "request_too_large" : std::to_string(st));
    LOG(WARNING) << peer_of(req) << " " << req.method << " " << req.path << " refused: " << st << " " << msg;
    res.set_content(error_body(e).dump(), "application/json");
  });
  s.set_exception_handler([this](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    LOG(ERROR) << peer_of(req) << " " << req.path << ": " << what;
    send_json(res, 500, error_body(api_error(500, "server_error", what)));
  });
}

void http_front::completion(const httplib::Request& req, httplib::Response& res, api_endpoint ep) {
  std::shared_ptr<const http_model_view> v;
  {
    std::lock_guard<std::mutex> lock(view_mu_);
    v = view_;
  }
  if (stopping_) return refuse(res, api_error(503, "service_unavailable", "the service is shutting down", "", "shutting_down"), req);
  if (!v) return refuse(res, api_error(503, "service_unavailable", "the model is loading; GET /health says when it is ready", "", "loading"), req);
  if (!authorized(req, res)) return;
  int64_t id = 0;
  openai_request r;
  try {
    r = parse_openai_request(req.body, ep, v->limits.max_output_tokens);
    rpc::Job job;
    job.kind = rpc::JobKind::GENERATE;
    job.__set_generate(r.job);
    // The prompt's length is checked here, so a prompt too long is a 413 before anything queues.
    const int64_t n = (int64_t)generate_prompt_ids(*v->tok, v->chat_template, job.generate).size();
    if (ep == api_endpoint::chat_completions && !r.max_tokens_given)  // OpenAI: what is left of the context
      job.generate.max_tokens = (int32_t)std::max<int64_t>(1, std::min<int64_t>(job.generate.max_tokens, v->limits.max_context - n));
    if (n + job.generate.max_tokens > v->limits.max_context)
      throw api_error(413, "invalid_request_error",
                      "the prompt has " + std::to_string(n) + " tokens; with max_tokens " +
                          std::to_string(job.generate.max_tokens) + " that exceeds the service's context of " +
                          std::to_string(v->limits.max_context) + " tokens",
                      "max_tokens", "context_length_exceeded");
    check_job_request(job, v->limits);
    id = table_.submit(job);
    LOG(INFO) << peer_of(req) << " POST " << req.path << (r.stream ? " (stream)" : "") << ": job " << id << " queued, "
              << n << " prompt tokens";
  } catch (const api_error& e) {
    return refuse(res, e, req);
  } catch (const rpc::RequestError& e) {
    return refuse(res, api_error_of(e), req);
  }

  answer_context c;
  c.id = std::string(ep == api_endpoint::completions ? "cmpl-" : "chatcmpl-") + std::to_string(id);
  c.model = v->info.model;
  c.created = (int64_t)std::time(nullptr);
  c.job_id = id;
  c.cache = v->info.cache;
  c.attention = v->attention;
  res.set_header("X-Xctx-Job-Id", std::to_string(id));
  if (r.stream) return answer_stream(res, c, ep, r.include_usage, peer_of(req));
  answer_whole(req, res, c, ep);
}

// Waits for the job's end, then answers with its result; a client that hangs up cancels it.
void http_front::answer_whole(const httplib::Request& req, httplib::Response& res, const answer_context& c,
                              api_endpoint ep) {
  const int64_t id = c.job_id;
  const int fd = connection_fd(req);
  for (;;) {
    const job_table::stream_read got = table_.read_stream(id, SIZE_MAX, 250ms);
    if (got.ended) {
      const rpc::JobResult& jr = got.result;
      if (jr.phase == rpc::JobPhase::DONE) return send_json(res, 200, completion_body(ep, c, jr));
      const bool shutting = stopping_ || jr.error.find("shutting down") != std::string::npos;
      return send_json(res, shutting ? 503 : 500,
                       error_body(api_error(shutting ? 503 : 500, shutting ? "service_unavailable" : "server_error",
                                            "job " + std::to_string(id) + " " + rpc::to_string(jr.phase) + ": " +
                                                jr.error)));
    }
    if (peer_hung_up(fd) || stopping_) {
      table_.cancel(id);
      LOG(INFO) << peer_of(req) << " went away: job " << id << " cancelled";
      // The answer goes nowhere; the job ends at its next step boundary.
      return send_json(res, 503, error_body(api_error(503, "client_closed", "the client closed the connection")));
    }
  }
}

// Server-sent events: the job's text as it becomes final, progress comments while nothing comes,
// then the finish chunk, the usage chunk if asked, [DONE]. A failed write cancels the job.
void http_front::answer_stream(httplib::Response& res, const answer_context& c, api_endpoint ep, bool usage,
                               const std::string& peer) {
  const int64_t id = c.job_id;
  struct stream_state {
    size_t offset = 0;
    bool first = true;
    std::chrono::steady_clock::time_point last_write = std::chrono::steady_clock::now();
  };
  auto state = std::make_shared<stream_state>();
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, id, ep, c, usage, state, peer](size_t, httplib::DataSink& sink) {
        const auto write = [&](const std::string& s) {
          if (sink.write(s.data(), s.size())) {
            state->last_write = std::chrono::steady_clock::now();
            return true;
          }
          table_.cancel(id);  // the client went away: the job ends at its next step boundary
          LOG(INFO) << peer << " stream closed: job " << id << " cancelled";
          return false;
        };
        if (stopping_) table_.cancel(id);
        const job_table::stream_read got = table_.read_stream(id, state->offset, 500ms);
        if (!got.text.empty() || (state->first && got.ended && got.result.phase == rpc::JobPhase::DONE)) {
          state->offset += got.text.size();
          if (!write(sse_event(stream_chunk(ep, c, got.text, "", state->first)))) return false;
          state->first = false;
        }
        if (got.ended) {
          const rpc::JobResult& jr = got.result;
          if (jr.phase == rpc::JobPhase::DONE) {
            if (!write(sse_event(stream_chunk(ep, c, "", jr.finish_reason, false)))) return false;
            if (usage && !write(sse_event(usage_chunk(ep, c, jr)))) return false;
          } else {  // OpenAI's shape for an error inside a stream, as llama.cpp and vLLM send it
            if (!write(sse_event(error_body(api_error(500, "server_error", "job " + std::to_string(id) + " " +
                                                                   rpc::to_string(jr.phase) + ": " + jr.error)))))
              return false;
          }
          if (!write("data: [DONE]\n\n")) return false;
          sink.done();
          return true;
        }
        // A comment line while nothing comes (a long prefill): clients ignore it, a vanished
        // client shows up as a failed write, and it carries the job's progress.
        if (std::chrono::steady_clock::now() - state->last_write > 2s) {
          try {
            const rpc::JobStatus st = table_.status(id);
            return write(": " + rpc::to_string(st.phase) + " " + std::to_string(st.tokens_done) + "/" +
                         std::to_string(st.tokens_total) + " tokens, ETA " + std::to_string((int64_t)st.eta_s) + " s\n\n");
          } catch (const rpc::RequestError&) {
            return write(": waiting\n\n");
          }
        }
        return true;
      });
}

}  // namespace xctx
