// Long-document summarization, one document at a time or as a JSONL batch (`xctx summarize`,
// and the service's summarize/batch jobs).
//
// A document whose prompt and summary fit one sequence (the context, --ctx) is summarized in one
// sequence, however long, with the sequence-parallel cache. A longer one goes through
// map-reduce: the text is cut at paragraph (then sentence, then token) boundaries into chunks
// that fit, each chunk is summarized, and the chunk summaries -- joined in order -- are
// summarized again with the document's instruction; if even they do not fit, the same again one
// level up. docs/service.md describes the prompts.
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "coordinator/jobs/sampler.h"
#include "coordinator/jobs/sequence_driver.h"
#include "model/tokenizer.h"
#include "worker/run_params.h"
#include "worker/sequence_parallel.h"

namespace xctx {

inline constexpr const char* kDefaultSummaryInstruction =
    "Summarize the following text in a few sentences. Name the main people and what happens.";

// One input line: {"id", "text" | "path", optional "instruction", "max_tokens"}.
struct summary_document {
  std::string id;
  std::string text;
  std::string path;         // as written; read relative to the JSONL's folder
  std::string instruction;  // empty: the batch default
  int max_tokens = 0;       // 0: the batch default
  int64_t line = 0;         // 1-based line of the input
  std::string error;        // a bad field: the document gets an error line, the batch goes on
};

// Parses a JSONL batch. Throws xctx::Error naming `source` and the line for what cannot be tied
// to a document -- a line that is not a JSON object, a missing or empty string "id", a repeated
// id -- so nothing runs on a malformed file. Other problems of a document land in its .error.
// allow_paths false (the service): a "path" line is refused as well.
std::vector<summary_document> parse_summary_jsonl(const std::string& jsonl, const std::string& source,
                                                  bool allow_paths);

// For --resume: the ids an earlier run's output holds. A last line that a kill cut short (no
// newline) is removed from the file; a malformed complete line is an error (the output is not
// this command's, or is damaged), never silently redone.
std::set<std::string> completed_summary_ids(const std::string& out_path);

// Appends one line and makes it durable (write, then fsync) before returning.
class durable_jsonl_writer {
 public:
  explicit durable_jsonl_writer(const std::string& path);
  ~durable_jsonl_writer();
  durable_jsonl_writer(const durable_jsonl_writer&) = delete;
  durable_jsonl_writer& operator=(const durable_jsonl_writer&) = delete;
  void append(const std::string& line);  // without the newline

 private:
  std::string path_;
  int fd_ = -1;
};

// Summaries decode with a repetition penalty and a no-repeat-trigram guard by default: on the demo
// set (benchmarks/results/summarize_sampling_*.md, 10 documents, fp16) greedy decoding looped on a
// phrase in 80% of the summaries; --repeat-penalty 1.2 --no-repeat-ngram 3 in none, with the
// named-character signal unchanged (70% / 80%) and decode at 0.86x greedy's rate.
sampler_params summary_sampling_defaults();

struct summarize_settings {
  std::string instruction = kDefaultSummaryInstruction;
  int max_tokens = 200;       // summary tokens when a document says nothing
  int64_t n_ctx = 8192;       // tokens one sequence may hold: prompt + summary
  int64_t chunk_tokens = 0;   // map step: text tokens per chunk; 0: as many as fit
  int map_tokens = 160;       // tokens of each chunk summary
  sampler_params sampling = summary_sampling_defaults();
  std::vector<std::string> stop;  // a summary ends before the first of these strings
};

struct summary_result {
  std::string summary;
  int64_t prompt_tokens = 0;     // over every sequence the document took
  int64_t generated_tokens = 0;
  double prefill_s = 0.0, decode_s = 0.0;
  std::string method;            // single | map-reduce
  int chunks = 1;                // sequences of the first map level (1 for single)
  int sequences = 0;
  bool stopped = false;          // should_stop ended it; the summary is incomplete
};

struct summary_hooks {           // rank 0
  // Tokens done of this document so far (prompt read + generated) and a rough total.
  std::function<void(int64_t done, int64_t total)> progress;
  std::function<bool()> should_stop;
  std::function<void(bool decoding)> on_phase;  // each sequence's prefill and decode (sequence_hooks)
};

// Rank 0's side of summarization; every sequence goes through the driver, so the other ranks
// follow without knowing about documents.
class summarizer {
 public:
  summarizer(const tokenizer& tok, const std::string& chat_template, sequence_driver& driver,
             const summarize_settings& settings);

  // Throws xctx::Error for a document that cannot be summarized (empty text, a context too
  // small for even one chunk).
  summary_result summarize(const std::string& text, const std::string& instruction, int max_tokens,
                           const summary_hooks& hooks = {});

  // The token ids of one summary prompt (chat template around instruction + text).
  std::vector<int32_t> prompt_ids(const std::string& instruction, const std::string& text) const;
  // Cuts text into pieces of at most max_tokens tokens each, at paragraph, sentence or (for
  // a sentence longer than that) token boundaries, in order; joined they give back the text
  // up to the whitespace at the cuts.
  std::vector<std::string> split_text(const std::string& text, int64_t max_tokens) const;
  const summarize_settings& settings() const { return s_; }

 private:
  std::string run_one(const std::string& instruction, const std::string& text, int max_tokens, summary_result& r,
                      const summary_hooks& hooks, int64_t& done, int64_t& total);
  int64_t count(const std::string& text) const;

  const tokenizer& tok_;
  chat_style style_;
  sequence_driver& driver_;
  summarize_settings s_;
};

// The output line of a summarized document (keys: id, summary, prompt_tokens, generated_tokens,
// prefill_s, decode_s, cache, ranks, method, chunks) and of a failed one ({id, error}).
std::string summary_line(const std::string& id, const summary_result& r, const std::string& cache, int ranks);
std::string summary_error_line(const std::string& id, const std::string& error);

// `xctx summarize --in docs.jsonl --out summaries.jsonl [--resume]`. Collective under mpirun.
struct summarize_options {
  std::string model, tokenizer;
  std::string in, out;
  bool resume = false;
  summarize_settings settings;
  run_params run;
  sequence_options seq;
};
int run_summarize(const summarize_options& opt, communicator& comm);

}  // namespace xctx
