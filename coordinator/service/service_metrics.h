// The service's Prometheus metrics (GET /metrics on the HTTP front): counters and latency
// histograms that the job loop feeds as jobs run, gauges read from the job table at scrape time.
// Names follow Prometheus conventions (base units, _total counters, _seconds histograms).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "coordinator/service/job_table.h"

namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace xctx {

class service_metrics {
 public:
  service_metrics();
  ~service_metrics();

  // The job loop, as a job runs.
  void first_token(double seconds_since_submit);
  void token_interval(double seconds);  // between two generated tokens of one job
  void job_ended(const rpc::JobResult& r);
  // Any surface (Thrift or HTTP) that refuses a request, by reason ("queue_full", "unauthorized", ...).
  void refused(const std::string& reason);
  void set_cache_bytes(int rank, int64_t bytes);

  // The exposition text, with the job table's queue and running gauges read now.
  std::string scrape(const job_table& table);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>* refusals_;
  prometheus::Family<prometheus::Counter>* jobs_;
  prometheus::Family<prometheus::Gauge>* cache_bytes_;
  prometheus::Counter *prompt_tokens_, *generated_tokens_;
  prometheus::Gauge *queue_depth_, *running_, *prefill_rate_, *decode_rate_;
  prometheus::Histogram *ttft_, *per_token_;
};

// The metrics' reason label for a Thrift error code ("bad_request", "queue_full", ...).
std::string refusal_reason(rpc::ErrorCode::type code);

}  // namespace xctx
