// `mpirun -np P xctx serve`: the coordinator as a Thrift service (IDL: coordinator/service/xctx.thrift,
// docs/service.md). Rank 0 answers calls on a server thread and runs the queued jobs one at a
// time on its main thread through the sequence driver; the other ranks follow. The model, the
// engine and one cache per rank -- sized for --max-context at start -- serve every job.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "coordinator/service/job_table.h"
#include "worker/run_params.h"
#include "worker/sequence_parallel.h"

namespace xctx {

struct serve_options {
  std::string model, tokenizer;
  std::string bind = "127.0.0.1";  // listen address; loopback unless the operator says otherwise
  int port = 9090;                 // 0: any free port (see port_file)
  std::string port_file;           // written with the bound port once the service listens
  std::string token_file;          // shared secret every call must carry; empty: no secret
  int http_port = -1;              // the OpenAI-compatible HTTP front (-1: off; 0: any free port)
  std::string http_port_file;      // written with its bound port once it listens
  int http_threads = 64;           // HTTP connections served at once
  double http_io_timeout_s = 30;   // an HTTP client that sends or reads nothing this long is dropped
  service_limits limits;           // max_context 0: the run's context (--ctx, else trained)
  int max_queue = 16;
  int keep_ended = 1000;           // ended jobs whose status/result stay answerable
  std::string journal_dir;         // --journal: accepted jobs survive a restart (coordinator/service/job_journal.h)
  interrupted_policy on_interrupt = interrupted_policy::retry_once;
  std::string log_dir;             // glog files there instead of stderr
  int verbose = 0;                 // glog -v
  run_params run;
  sequence_options seq;
};
int run_serve(const serve_options& opt, communicator& comm);

// `xctx submit | status | result | cancel`: a client of a running service.
struct client_options {
  std::string server = "127.0.0.1:9090";
  std::string token_file;
  std::string command;           // submit | status | result | cancel
  int64_t id = 0;                // status/result/cancel (status without one: info + metrics)
  bool wait = false;             // submit/result: wait for the end, with progress on stderr
  bool json = false;             // result: print the details JSON instead of the text
  double timeout_s = 0;          // --wait: give up after this long (0: never)
  std::string kind = "generate"; // submit: generate | passkey | summarize | batch
  std::string prompt, prompt_file, system;
  bool chat = false;
  int max_tokens = 128;
  sampler_params sampling;       // generate (its seed is --seed below)
  std::vector<std::string> stop; // generate: stop strings
  int64_t seed = 0;
  int64_t context = 4096;        // passkey
  int trials = 1;
  std::string depths = "0,0.5,1", filler = "classic";
  std::string in, doc_id, instruction;  // summarize: a text file; batch: a JSONL file
};
int run_client(const client_options& opt);

}  // namespace xctx
