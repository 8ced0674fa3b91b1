#include "coordinator/cli/commands.h"

#include <memory>
#include <string>

#include "common/error.h"
#include "common/sys.h"
#include "coordinator/cli/options.h"
#include "coordinator/jobs/jobs.h"
#include "coordinator/jobs/passkey.h"
#include "coordinator/jobs/summarize.h"
#include "coordinator/service/service.h"

namespace xctx::cli {

namespace {

// A collective job: the options struct `o` and the shared flags live as long as the command.
template <class Options>
struct job_state {
  Options o;
  job_flags f;
};

command generate_command(CLI::App& app) {
  auto s = std::make_shared<job_state<generate_options>>();
  auto* g = app.add_subcommand("generate", "continue a prompt, streaming the text");
  generate_options& gen = s->o;
  add_model_options(g, gen.model, &gen.tokenizer);
  g->add_option("--prompt", gen.prompt, "prompt text");
  g->add_option("--prompt-file", gen.prompt_file, "file holding the prompt");
  g->add_flag("--chat", gen.chat, "wrap the prompt in the model's chat template as a user message");
  g->add_option("--system", gen.system, "system message for --chat");
  g->add_option("--max-tokens,-n", gen.max_tokens, "tokens to generate")->default_val(128);
  add_sampling_options(g, gen.sampling);
  g->add_option("--stop", gen.stop, "end before the first of these strings; the output holds none of it (repeatable)")
      ->check(non_empty("--stop"));
  g->add_flag("!--no-stats", gen.show_stats, "do not print speed and memory at the end");
  g->add_option("--save-cache", gen.save_cache,
                "save every rank's cache shard to this directory once the prompt is in (-n 0: only save)");
  g->add_option("--load-cache", gen.load_cache,
                "resume from a saved cache: the prompt continues the saved sequence (same ranks, model, --cache)")
      ->excludes("--save-cache");
  add_job_options(g, gen.run, s->f);
  return {g, true, [s](communicator* comm) {
            apply_job_options(s->o.run, s->o.seq, s->f);
            return run_generate(s->o, *comm);
          }};
}

command plan_command(CLI::App& app) {
  struct state {
    plan_options o;
    std::string context = "1M", block = "4K", select_per = "layer";
  };
  auto s = std::make_shared<state>();
  plan_options& plan = s->o;
  auto* pl = app.add_subcommand("plan", "cache bytes, fit, longest context and projected speed per cache format on a cluster");
  pl->add_option("--model", plan.model, "preset (llama-2-7b, llama-3-8b, llama-3.1-8b, llama-3-70b, smollm2-135m), GGUF or HF directory")
      ->default_val("llama-3-8b");
  pl->add_option("--context", s->context, "tokens of the sequence (e.g. 128K, 10M)")->default_val("1M");
  pl->add_option("--gpus", plan.gpus, "ranks, one per GPU")->default_val(8);
  pl->add_option("--gpu", plan.gpu, "h100 | h100-pcie | h200 | a100-80gb")->default_val("h100");
  pl->add_option("--network", plan.network, "nvlink4 | nvlink3 | ib-ndr | ib-hdr | eth-100g | eth-10g")->default_val("nvlink4");
  pl->add_option("--formats", plan.formats, "comma-separated cache formats");
  pl->add_option("--weight-bits", plan.weight_bits, "bits per weight as the devices hold them")->default_val(16);
  pl->add_option("--block", s->block, "star prefill block (= anchor) tokens")->default_val("4K");
  pl->add_option("--memory-gib", plan.memory_gib, "override the device's memory (GiB)")->check(positive());
  pl->add_option("--bandwidth-gbs", plan.bandwidth_gbs, "override the device's memory bandwidth (GB/s)")->check(positive());
  pl->add_option("--tflops", plan.tflops, "override the device's dense 16-bit TFLOP/s")->check(positive());
  pl->add_option("--cpu-profile", plan.cpu_profile,
                 "project for ranks sharing one CPU machine, from costs benchmarks/scaling.py measured (JSON)");
  pl->add_option("--hosts", plan.hosts, "with --cpu-profile: hosts the ranks span (network namespaces on that machine)")
      ->default_val(1)
      ->needs("--cpu-profile");
  pl->add_flag("--json", plan.json, "one JSON object instead of the table");
  pl->add_option("--top-k", plan.retrieval.top_k, "retrieval (contexts past the trained window): blocks per query")
      ->default_val(32);
  pl->add_option("--local", plan.retrieval.local, "retrieval: local window tokens")->default_val(4096);
  pl->add_option("--block-size", plan.retrieval.block, "retrieval: tokens per block")->default_val(256);
  pl->add_option("--sink", plan.retrieval.sink, "retrieval: sink tokens")->default_val(256);
  pl->add_option("--select-per", s->select_per, "retrieval: layer | kv-head (one top-k per KV head)")
      ->default_val("layer")
      ->check(selection_scope_choice());
  return {pl, false, [s](communicator*) {
            s->o.context = parse_count(s->context, "--context");
            s->o.block = parse_count(s->block, "--block");
            s->o.retrieval.scope = parse_selection_scope(s->select_per);
            return run_plan(s->o);
          }};
}

command doctor_command(CLI::App& app) {
  auto doc = std::make_shared<doctor_options>();
  auto* dr = app.add_subcommand(
      "doctor", "backends, CPU kernels, BLAS/MPI/NCCL/CUDA versions, devices, what each rank binds to, the environment");
  dr->add_option("--json", doc->json_path, "also write the report to this JSON file");
  dr->add_flag("--probe", doc->probe,
               "also measure this host's limits on rank 0: read bandwidth, fp32 FMA and int8 dot-product peaks (~10 s)");
  return {dr, true, [doc](communicator* comm) { return run_doctor(*doc, *comm); }};
}

command info_command(CLI::App& app) {
  struct state {
    info_options o;
    std::string context;
  };
  auto s = std::make_shared<state>();
  auto* i = app.add_subcommand("info", "hyper-parameters, metadata and tensors of a model file");
  i->add_option("model", s->o.model, "GGUF file or HF checkpoint directory (default: the fetched SmolLM2)");
  i->add_option("--cache", s->o.cache, "also print the byte breakdown of this cache format");
  i->add_option("--context", s->context, "tokens for the cache total (default 8K)");
  i->add_flag("--all", s->o.all_metadata, "print metadata arrays in full");
  return {i, false, [s](communicator*) {
            if (!s->context.empty()) s->o.context = parse_count(s->context, "--context");
            return run_info(s->o);
          }};
}

command bench_command(CLI::App& app) {
  struct state : job_state<bench_options> {
    std::string prompt_tokens;
  };
  auto s = std::make_shared<state>();
  auto* b = app.add_subcommand("bench", "timed prefill + decode on real text; prints JSON");
  b->add_option("--model", s->o.model, "model (default: the fetched SmolLM2)");
  b->add_option("--text", s->o.text_file, "text to tokenize for the prompt: a file, austen:NAME[,NAME] or austen:all")
      ->required();
  b->add_option("--prompt-tokens", s->prompt_tokens, "prompt length in tokens (e.g. 512, 8K)")->default_val("512");
  b->add_option("--gen-tokens", s->o.gen_tokens, "greedy decode steps after the prompt")->default_val(0);
  add_job_options(b, s->o.run, s->f);
  return {b, true, [s](communicator* comm) {
            apply_job_options(s->o.run, s->o.seq, s->f);
            s->o.prompt_tokens = parse_count(s->prompt_tokens, "--prompt-tokens");
            return run_bench(s->o, *comm);
          }};
}

command passkey_command(CLI::App& app) {
  struct state : job_state<passkey_options> {
    std::string context = "4K", depths = "0,0.25,0.5,0.75,1";
  };
  auto s = std::make_shared<state>();
  passkey_options& pk = s->o;
  auto* p = app.add_subcommand("passkey", "passkey retrieval: find a 5-digit key hidden at several depths");
  add_model_options(p, pk.model, &pk.tokenizer);
  p->add_option("--context", s->context, "prompt length in tokens (e.g. 4K)")->default_val("4K");
  p->add_option("--trials", pk.trials, "trials per depth (trial t uses seed + t)")->default_val(3);
  p->add_option("--depths", s->depths, "comma-separated key depths in [0, 1]")->default_val("0,0.25,0.5,0.75,1");
  p->add_option("--seed", pk.seed, "seed of the keys and the filler start")->default_val(1)->check(seed_value());
  p->add_option("--filler", pk.filler, "classic (repeated grass/sky/sun lines) | austen (the novels)")
      ->default_val("classic");
  p->add_flag("--chat", pk.chat, "wrap the prompt in the model's chat template");
  p->add_option("--max-answer-tokens", pk.max_answer_tokens,
                "greedy tokens decoded at most per answer (stops at a complete 5-digit number)")
      ->default_val(24);
  p->add_option("--json", pk.json_path, "also write per-trial results and the summary to this JSON file");
  p->add_flag("--needle-rank", pk.needle_rank,
              "retrieval, one rank: report per layer and KV head the rank of the key's block under each scoring "
              "rule (in --json)");
  add_job_options(p, pk.run, s->f);
  return {p, true, [s](communicator* comm) {
            apply_job_options(s->o.run, s->o.seq, s->f);
            s->o.context = parse_count(s->context, "--context");
            s->o.depths = parse_depths(s->depths);
            return run_passkey(s->o, *comm);
          }};
}

command ppl_command(CLI::App& app) {
  struct state : job_state<ppl_options> {
    std::string window = "2048", stride, max_tokens;
  };
  auto s = std::make_shared<state>();
  ppl_options& ppl = s->o;
  auto* pc = app.add_subcommand("ppl", "teacher-forced perplexity with attention reading the compressed cache");
  pc->add_option("--model", ppl.model, "model (default: the fetched SmolLM2)");
  pc->add_option("--tokenizer", ppl.tokenizer, "GGUF to take the vocabulary from (default: the model file)");
  pc->add_option("--text", ppl.text, "evaluation text: a file, austen:NAME[,NAME] or kjv:BOOK[,BOOK]")->required();
  // Declared before the job options: ppl's --window is its own, selfextend's is --se-window here.
  pc->add_option("--window", s->window, "tokens per window (the perplexity context)")->default_val("2048");
  pc->add_option("--stride", s->stride, "tokens between window starts (default: the window; smaller = sliding)");
  pc->add_option("--max-windows", ppl.max_windows, "stop after this many windows (0 = all)")
      ->default_val(0)
      ->check(integer_in(0, int64_t(1) << 40));
  pc->add_option("--max-tokens", s->max_tokens, "use only the first N tokens of the text");
  pc->add_option("--json", ppl.json_path, "also write the result as JSON");
  add_job_options(pc, ppl.run, s->f);
  return {pc, true, [s](communicator* comm) {
            apply_job_options(s->o.run, s->o.seq, s->f);
            XCTX_CHECK(s->o.seq.mode != prefill_mode::prefill_star,
                       "ppl scores with the exact ring prefill only (--prefill exact or auto)");
            s->o.ctx = parse_count(s->window, "--window");
            s->o.stride = s->stride.empty() ? s->o.ctx : parse_count(s->stride, "--stride");
            if (!s->max_tokens.empty()) s->o.max_tokens = parse_count(s->max_tokens, "--max-tokens");
            return run_ppl(s->o, *comm);
          }};
}

command calibrate_command(CLI::App& app) {
  auto cal = std::make_shared<calibrate_cmd_options>();
  auto* cc = app.add_subcommand("calibrate", "derive the nuq datatypes, key scales and outlier thresholds (KVQuant)");
  cc->add_option("--model", cal->model, "model (default: the fetched SmolLM2)");
  cc->add_option("--text", cal->text, "calibration text: a file, or austen:NAME[,NAME] (e.g. austen:sensesensibility)")
      ->required();
  cc->add_option("--samples", cal->calib.n_samples, "calibration windows")->default_val(16)->check(CLI::Range(1, 1 << 20));
  cc->add_option("--seq-len", cal->calib.seq_len, "tokens per window")->default_val(2048)->check(CLI::Range(2, 1 << 24));
  cc->add_option("--seed", cal->calib.seed, "seed of the window offsets and sampled queries")
      ->default_val(1)
      ->check(seed_value());
  cc->add_option("--weighting", cal->weighting, "k-means weights: attention (output sensitivity) | none")
      ->default_val("attention");
  cc->add_option("--queries", cal->calib.queries_per_sample, "query positions sampled per window for the weights")
      ->default_val(64)
      ->check(CLI::Range(1, 1 << 20));
  cc->add_option("--out", cal->out, "calibration file to write")->required();
  cc->add_option("--threads", cal->run.n_threads, "CPU threads")->check(CLI::Range(1, 4096));
  cc->add_option("--batch", cal->run.n_batch, "forward chunk size in tokens")->default_val(512)->check(CLI::Range(1, 1 << 20));
  return {cc, false, [cal](communicator*) { return run_calibrate(*cal); }};
}

command summarize_command(CLI::App& app) {
  struct state : job_state<summarize_options> {
    std::string chunk_tokens;
  };
  auto s = std::make_shared<state>();
  summarize_options& sum = s->o;
  auto* sc = app.add_subcommand("summarize", "summarize the documents of a JSONL file, one result line each");
  add_model_options(sc, sum.model, &sum.tokenizer);
  sc->add_option("--in", sum.in, "input JSONL: {\"id\", \"text\" | \"path\", \"instruction\"?, \"max_tokens\"?} per line")
      ->required();
  sc->add_option("--out", sum.out, "output JSONL, one line per document, appended and fsync'd as each ends")->required();
  sc->add_flag("--resume", sum.resume, "continue an interrupted run: skip the ids --out holds already");
  sc->add_option("--instruction", sum.settings.instruction, "default instruction (a line's \"instruction\" wins)")
      ->default_val(kDefaultSummaryInstruction);
  sc->add_option("--max-tokens,-n", sum.settings.max_tokens, "summary tokens (a line's \"max_tokens\" wins)")
      ->default_val(200);
  sc->add_option("--chunk-tokens", s->chunk_tokens, "map-reduce: text tokens per chunk (default: as many as fit --ctx)");
  sc->add_option("--map-tokens", sum.settings.map_tokens, "map-reduce: tokens of each chunk summary")
      ->default_val(160)
      ->check(CLI::Range(1, 1 << 20));
  add_sampling_options(sc, sum.settings.sampling, true, summary_sampling_defaults());
  sc->add_option("--stop", sum.settings.stop, "end each summary before the first of these strings (repeatable)")
      ->check(non_empty("--stop"));
  add_job_options(sc, sum.run, s->f);
  return {sc, true, [s](communicator* comm) {
            apply_job_options(s->o.run, s->o.seq, s->f);
            if (!s->chunk_tokens.empty()) {
              s->o.settings.chunk_tokens = parse_count(s->chunk_tokens, "--chunk-tokens");
              XCTX_CHECK(s->o.settings.chunk_tokens >= 1, "--chunk-tokens must be at least 1 token, got ",
                         s->chunk_tokens);
            }
            return run_summarize(s->o, *comm);
          }};
}

command serve_command(CLI::App& app) {
  struct state : job_state<serve_options> {
    std::string max_context, max_request_bytes = "8M", on_interrupt = "retry";
  };
  auto s = std::make_shared<state>();
  serve_options& srv = s->o;
  auto* sv = app.add_subcommand("serve",
                                "run the coordinator as a Thrift service and, with --http-port, an OpenAI-compatible "
                                "HTTP one (rank 0 listens; docs/service.md)");
  add_model_options(sv, srv.model, &srv.tokenizer);
  sv->add_option("--bind", srv.bind, "address to listen on")->default_val("127.0.0.1");
  sv->add_option("--port", srv.port, "TCP port (0: any free port; see --port-file)")->default_val(9090);
  sv->add_option("--port-file", srv.port_file, "write the bound port here once listening");
  sv->add_option("--http-port", srv.http_port,
                 "also serve HTTP here: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics "
                 "(0: any free port, see --http-port-file; default: off)")
      ->check(CLI::Range(0, 65535));
  sv->add_option("--http-port-file", srv.http_port_file, "write the bound HTTP port here once listening");
  sv->add_option("--http-threads", srv.http_threads, "HTTP connections served at once (a stream holds one)")
      ->default_val(64)
      ->check(CLI::Range(1, 4096));
  sv->add_option("--http-io-timeout", srv.http_io_timeout_s,
                 "seconds an HTTP client may send or read nothing before it is dropped (slow clients)")
      ->default_val(30)
      ->check(number_in(0.1, 3600));
  sv->add_option("--token-file", srv.token_file,
                 "shared secret every request must carry (>= 8 characters; HTTP: Authorization: Bearer)");
  sv->add_option("--max-request-bytes", s->max_request_bytes, "largest request accepted (e.g. 8M)")->default_val("8M");
  sv->add_option("--max-context", s->max_context, "prompt + output tokens of one sequence (default: --ctx)");
  sv->add_option("--max-output-tokens", srv.limits.max_output_tokens, "largest max_tokens a job may ask")
      ->default_val(1024);
  sv->add_option("--max-queue", srv.max_queue, "jobs waiting at most")->default_val(16);
  sv->add_option("--journal", srv.journal_dir,
                 "directory of the job journal: accepted jobs are fsync'd there before they are acknowledged and "
                 "survive a restart (launch/xctx-serve restarts a service whose rank died)");
  sv->add_option("--on-interrupt", s->on_interrupt,
                 "--journal: a job that was running when the service stopped: retry (once) | fail")
      ->default_val("retry")
      ->check(CLI::IsMember({"retry", "fail"}));
  sv->add_option("--log-dir", srv.log_dir, "write glog files there (default: log to stderr)");
  sv->add_option("--verbose,-v", srv.verbose, "glog verbosity (1: every status/info call too)")
      ->default_val(0)
      ->check(CLI::Range(0, 9));
  add_job_options(sv, srv.run, s->f);
  return {sv, true, [s](communicator* comm) {
            apply_job_options(s->o.run, s->o.seq, s->f);
            s->o.limits.max_request_bytes = parse_count(s->max_request_bytes, "--max-request-bytes");
            s->o.on_interrupt =
                s->on_interrupt == "fail" ? interrupted_policy::fail : interrupted_policy::retry_once;
            s->o.limits.max_context = s->max_context.empty() ? 0 : parse_count(s->max_context, "--max-context");
            XCTX_CHECK(s->max_context.empty() || s->o.limits.max_context >= 2,
                       "--max-context must be at least 2 tokens, got ", s->max_context);
            return run_serve(s->o, *comm);
          }};
}

// submit, status, result and cancel: the service's client, one options struct for the four.
void add_client_commands(CLI::App& app, std::vector<command>& out) {
  auto cl = std::make_shared<client_options>();
  const auto add_server_options = [&cl](CLI::App* cmd) {
    cmd->add_option("--server", cl->server, "HOST:PORT of `xctx serve`")->default_val("127.0.0.1:9090");
    cmd->add_option("--token-file", cl->token_file, "file holding the service's shared secret");
  };
  auto* sub = app.add_subcommand("submit", "queue a job on a running service; prints its id (--wait: its result)");
  add_server_options(sub);
  sub->add_option("--kind", cl->kind, "generate | passkey | summarize | batch")->default_val("generate");
  sub->add_option("--prompt", cl->prompt, "generate: prompt text");
  sub->add_option("--prompt-file", cl->prompt_file, "generate: file holding the prompt");
  sub->add_flag("--chat", cl->chat, "generate: wrap the prompt in the chat template");
  sub->add_option("--system", cl->system, "generate: chat system message");
  sub->add_option("--max-tokens,-n", cl->max_tokens, "tokens to generate (summaries: 0 = the service's default)")
      ->default_val(128)
      ->check(integer_in(0, 1 << 30));
  add_sampling_options(sub, cl->sampling, false);  // generate
  sub->add_option("--stop", cl->stop, "generate: end before the first of these strings (repeatable)");
  sub->add_option("--seed", cl->seed, "sampling / passkey seed")->default_val(0)->check(seed_value());
  sub->add_option("--context", cl->context, "passkey: prompt tokens")
      ->default_val(4096)
      ->check(integer_in(64, int64_t(1) << 40));
  sub->add_option("--trials", cl->trials, "passkey: trials per depth")->default_val(1)->check(integer_in(1, 1 << 20));
  sub->add_option("--depths", cl->depths, "passkey: comma-separated depths")->default_val("0,0.5,1");
  sub->add_option("--filler", cl->filler, "passkey: classic | austen")->default_val("classic");
  sub->add_option("--in", cl->in, "summarize: text file; batch: JSONL file");
  sub->add_option("--id", cl->doc_id, "summarize: the document's id (default: the file name)");
  sub->add_option("--instruction", cl->instruction, "summarize: instruction (default: the service's)");
  sub->add_flag("--wait", cl->wait, "wait for the end with progress on stderr, then print the result");
  sub->add_flag("--json", cl->json, "with --wait: print the result's details JSON");
  sub->add_option("--timeout", cl->timeout_s, "with --wait: give up waiting after this many seconds")->check(positive());
  auto* st = app.add_subcommand("status", "a job's phase and progress; without an id, the service's info and metrics");
  add_server_options(st);
  st->add_option("id", cl->id, "job id");
  auto* res = app.add_subcommand("result", "print a job's result (exit 1: failed, 3: cancelled)");
  add_server_options(res);
  res->add_option("id", cl->id, "job id")->required();
  res->add_flag("--wait", cl->wait, "wait for the end with progress on stderr");
  res->add_flag("--json", cl->json, "print the details JSON instead of the text");
  res->add_option("--timeout", cl->timeout_s, "with --wait: give up waiting after this many seconds")->check(positive());
  auto* can = app.add_subcommand("cancel", "cancel a queued or running job");
  add_server_options(can);
  can->add_option("id", cl->id, "job id")->required();
  for (auto [cmd, name] : {std::pair{sub, "submit"}, {st, "status"}, {res, "result"}, {can, "cancel"}}) {
    const bool is_submit = cmd == sub;
    out.push_back({cmd, false, [cl, name = std::string(name), is_submit](communicator*) {
                     cl->command = name;
                     if (is_submit) parse_depths(cl->depths);  // refused here, not by the service
                     return run_client(*cl);
                   }});
  }
}

}  // namespace

std::vector<command> add_commands(CLI::App& app) {
  std::vector<command> out;
  out.push_back(generate_command(app));
  out.push_back(plan_command(app));
  out.push_back(doctor_command(app));
  out.push_back(info_command(app));
  out.push_back(bench_command(app));
  out.push_back(passkey_command(app));
  out.push_back(ppl_command(app));
  out.push_back(calibrate_command(app));
  out.push_back(summarize_command(app));
  out.push_back(serve_command(app));
  add_client_commands(app, out);
  return out;
}

}  // namespace xctx::cli
