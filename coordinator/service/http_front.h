// The service's HTTP front (docs/service.md), beside Thrift on rank 0: OpenAI-compatible
// /v1/completions and /v1/chat/completions (server-sent events with "stream": true), /v1/models,
// /health and Prometheus /metrics, plus xctx's /v1/jobs/{id} (status, DELETE cancels). It queues
// jobs in the same job table as Thrift, under the same limits and shared secret (Authorization:
// Bearer). It listens before the model loads, so /health says 503 while the ranks come up.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "coordinator/service/job_table.h"
#include "coordinator/service/openai_api.h"
#include "coordinator/service/service_metrics.h"
#include "model/tokenizer.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace xctx {

struct http_front_options {
  std::string bind = "127.0.0.1";
  int port = 8080;                // 0: any free port (see port_file)
  std::string port_file;          // written with the bound port once it listens
  std::string secret;             // empty: no Authorization needed
  int threads = 64;               // connections served at once (a stream holds one)
  int64_t max_request_bytes = 8 << 20;
  double io_timeout_s = 30;       // a client that sends or reads nothing for this long is dropped
};

// What the front needs of the loaded model; given once the ranks are up and the cache allocated.
struct http_model_view {
  const tokenizer* tok = nullptr;
  std::string chat_template;
  rpc::ServiceInfo info;
  std::string attention;  // the run header's attention mode
  service_limits limits;
};

class http_front {
 public:
  http_front(http_front_options opt, job_table& table, service_metrics& metrics);
  ~http_front();
  // Binds (throws naming the address when it cannot) and serves on its own threads.
  void start();
  int port() const { return port_; }
  // From now on /health answers 200 and /v1 takes requests.
  void set_ready(http_model_view view);
  // /health answers 503 "stopping"; then the server ends its connections and threads.
  void stop();

 private:
  void routes();
  bool authorized(const httplib::Request& req, httplib::Response& res);
  // Checks and queues a completion request, then answers it whole or as a stream.
  void completion(const httplib::Request& req, httplib::Response& res, api_endpoint ep);
  void answer_whole(const httplib::Request& req, httplib::Response& res, const answer_context& c, api_endpoint ep);
  void answer_stream(httplib::Response& res, const answer_context& c, api_endpoint ep, bool usage,
                     const std::string& peer);
  void refuse(httplib::Response& res, const api_error& e, const httplib::Request& req);

  http_front_options opt_;
  job_table& table_;
  service_metrics& metrics_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
  std::mutex view_mu_;
  std::shared_ptr<const http_model_view> view_;  // null until ready
  std::atomic<bool> stopping_{false};
};

}  // namespace xctx
