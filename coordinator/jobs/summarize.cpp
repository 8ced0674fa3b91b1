#include "coordinator/jobs/summarize.h"

#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs/distributed.h"
#include "coordinator/service/generate_text.h"
#include "coordinator/jobs/session.h"
#include "worker/llama_engine.h"
#include "worker/sequence_plan.h"

namespace xctx {

sampler_params summary_sampling_defaults() {
  sampler_params p;
  p.repetition_penalty = 1.2f;
  p.no_repeat_ngram = 3;
  return p;
}
namespace {

// Summaries a document may ask for beyond the batch default: the tail rank reserves this much.
constexpr int kMaxSummaryTokens = 1024;
// Prompt tokens kept free of the text: the pieces are tokenized apart, and joining them can
// merge or split a token or two at the seams.
constexpr int64_t kPromptSlack = 16;
// A marker no document holds, to cut the rendered chat template around the user's text.
constexpr const char* kTextSlot = "\x01xctx-text\x01";

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); });
}

std::string dump(const nlohmann::json& j) {
  // A summary from a broken cache can hold invalid UTF-8: replace it rather than lose the line.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Paragraphs: runs of text between blank lines.
std::vector<std::string> paragraphs_of(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find("\n\n", start);
    if (end == std::string::npos) end = text.size();
    std::string piece = text.substr(start, end - start);
    if (!blank(piece)) out.push_back(std::move(piece));
    start = end;
    while (start < text.size() && (text[start] == '\n' || text[start] == '\r')) ++start;
  }
  return out;
}

// Sentences: cut after . ! ? ; followed by white space.
std::vector<std::string> sentences_of(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if ((c == '.' || c == '!' || c == '?' || c == ';') && i + 1 < text.size() &&
        std::isspace((unsigned char)text[i + 1])) {
      out.push_back(text.substr(start, i + 1 - start));
      start = i + 1;
      while (start < text.size() && std::isspace((unsigned char)text[start])) ++start;
      i = start > 0 ? start - 1 : 0;
    }
  }
  if (start < text.size() && !blank(text.substr(start))) out.push_back(text.substr(start));
  return out;
}

}  // namespace

// ---- input and output files ------------------------------------------------------------------

std::vector<summary_document> parse_summary_jsonl(const std::string& jsonl, const std::string& source,
                                                  bool allow_paths) {
  std::vector<summary_document> docs;
  std::set<std::string> ids;
  std::istringstream in(jsonl);
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (blank(line)) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail(source, " line ", n, ": not valid JSON (", e.what(), ")");
    }
    XCTX_CHECK(j.is_object(), source, " line ", n, ": expected a JSON object, got ", j.type_name());
    XCTX_CHECK(j.contains("id") && j["id"].is_string() && !j["id"].get<std::string>().empty(), source, " line ", n,
               ": needs a non-empty string \"id\"");
    summary_document d;
    d.id = j["id"].get<std::string>();
    d.line = n;
    XCTX_CHECK(ids.insert(d.id).second, source, " line ", n, ": id \"", d.id, "\" appears twice");
    XCTX_CHECK(allow_paths || !j.contains("path"), source, " line ", n, " (id \"", d.id,
               "\"): \"path\" is not accepted here; send the document's \"text\"");
    const bool has_text = j.contains("text"), has_path = j.contains("path");
    if (has_text == has_path) {
      d.error = "needs exactly one of \"text\" and \"path\"";
    } else if (has_text && !j["text"].is_string()) {
      d.error = "\"text\" must be a string";
    } else if (has_path && (!j["path"].is_string() || j["path"].get<std::string>().empty())) {
      d.error = "\"path\" must be a non-empty string";
    } else if (j.contains("instruction") && !j["instruction"].is_string()) {
      d.error = "\"instruction\" must be a string";
    } else if (j.contains("max_tokens") &&
               (!j["max_tokens"].is_number_integer() || j["max_tokens"].get<int64_t>() < 1 ||
                j["max_tokens"].get<int64_t>() > kMaxSummaryTokens)) {
      d.error = "\"max_tokens\" must be an integer in [1, " + std::to_string(kMaxSummaryTokens) + "]";
    } else {
      if (has_text) d.text = j["text"].get<std::string>();
      if (has_path) d.path = j["path"].get<std::string>();
      if (j.contains("instruction")) d.instruction = j["instruction"].get<std::string>();
      if (j.contains("max_tokens")) d.max_tokens = (int)j["max_tokens"].get<int64_t>();
    }
    docs.push_back(std::move(d));
  }
  return docs;
}

std::set<std::string> completed_summary_ids(const std::string& out_path) {
  std::set<std::string> done;
  if (!std::filesystem::exists(out_path)) return done;
  std::string text = read_file_bytes(out_path);
  const size_t last_newline = text.rfind('\n');
  const size_t keep = last_newline == std::string::npos ? 0 : last_newline + 1;
  if (keep < text.size()) {  // a line cut short by a kill: drop it, its document runs again
    std::fprintf(stderr, "[summarize] %s: dropping an incomplete last line (%zu bytes)\n", out_path.c_str(),
                 text.size() - keep);
    std::filesystem::resize_file(out_path, keep);
    text.resize(keep);
  }
  std::istringstream in(text);
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (blank(line)) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("--resume: ", out_path, " line ", n, " is not valid JSON (", e.what(), "); not an output of this command?");
    }
    XCTX_CHECK(j.is_object() && j.contains("id") && j["id"].is_string(), "--resume: ", out_path, " line ", n,
               " has no string \"id\"");
    done.insert(j["id"].get<std::string>());
  }
  return done;
}

durable_jsonl_writer::durable_jsonl_writer(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  XCTX_CHECK(fd_ >= 0, "cannot open ", path, " for appending: ", std::strerror(errno));
}

durable_jsonl_writer::~durable_jsonl_writer() {
  if (fd_ >= 0) ::close(fd_);
}

void durable_jsonl_writer::append(const std::string& line) {
  const std::string data = line + "\n";
  write_all_bytes(fd_, data.data(), data.size(), path_);
  XCTX_CHECK(::fsync(fd_) == 0, "fsync of ", path_, " failed: ", std::strerror(errno));
}

std::string summary_line(const std::string& id, const summary_result& r, const std::string& cache, int ranks) {
  return dump({{"id", id},
               {"summary", r.summary},
               {"prompt_tokens", r.prompt_tokens},
               {"generated_tokens", r.generated_tokens},
               {"prefill_s", r.prefill_s},
               {"decode_s", r.decode_s},
               {"cache", cache},
               {"ranks", ranks},
               {"method", r.method},
               {"chunks", r.chunks}});
}

std::string summary_error_line(const std::string& id, const std::string& error) {
  return dump({{"id", id}, {"error", error}});
}

// ---- the summarizer ----------------------------------------------------------------------------

summarizer::summarizer(const tokenizer& tok, const std::string& chat_template, sequence_driver& driver,
                       const summarize_settings& settings)
    : tok_(tok), style_(detect_chat_style(chat_template)), driver_(driver), s_(settings) {
  XCTX_CHECK(s_.max_tokens >= 1 && s_.max_tokens <= kMaxSummaryTokens, "--max-tokens must be in [1, ",
             kMaxSummaryTokens, "], got ", s_.max_tokens);
  XCTX_CHECK(s_.map_tokens >= 1, "map summary tokens must be >= 1");
  XCTX_CHECK(s_.chunk_tokens >= 0, "--chunk-tokens must be >= 0");
}

int64_t summarizer::count(const std::string& text) const {
  return (int64_t)tok_.encode(text, false, false).size();
}

std::vector<int32_t> summarizer::prompt_ids(const std::string& instruction, const std::string& text) const {
  // The template's own markup is parsed for special tokens; the document is not, so a text
  // holding "<|im_end|>" stays text.
  const std::string rendered = apply_chat_template(style_, {{"user", kTextSlot}}, true);
  const size_t at = rendered.find(kTextSlot);
  XCTX_ASSERT(at != std::string::npos);
  std::vector<int32_t> ids = tok_.encode(rendered.substr(0, at), tok_.vocab().add_bos, true);
  const std::vector<int32_t> body = tok_.encode(instruction + "\n\n" + text, false, false);
  const std::vector<int32_t> tail = tok_.encode(rendered.substr(at + std::strlen(kTextSlot)), false, true);
  ids.insert(ids.end(), body.begin(), body.end());
  ids.insert(ids.end(), tail.begin(), tail.end());
  return ids;
}

std::vector<std::string> summarizer::split_text(const std::string& text, int64_t max_tokens) const {
  XCTX_CHECK(max_tokens >= 8, "cannot cut text into chunks of ", max_tokens, " tokens");
  // Units no longer than max_tokens, in order, each with the separator that joins it to the last.
  struct unit {
    std::string text;
    const char* sep;
    int64_t tokens;
  };
  std::vector<unit> units;
  for (const std::string& para : paragraphs_of(text)) {
    const int64_t n = count(para);
    if (n <= max_tokens) {
      units.push_back({para, "\n\n", n});
      continue;
    }
    bool first = true;
    for (const std::string& sent : sentences_of(para)) {
      const std::vector<int32_t> ids = tok_.encode(sent, false, false);
      for (size_t b = 0; b < ids.size(); b += (size_t)max_tokens) {  // a sentence longer than a chunk
        const std::vector<int32_t> slice(ids.begin() + b, ids.begin() + std::min(ids.size(), b + (size_t)max_tokens));
        units.push_back({tok_.decode(slice), first ? "\n\n" : (b == 0 ? " " : ""), (int64_t)slice.size()});
        first = false;
      }
    }
  }
  // Pack units by their summed counts; token counts of pieces do not quite add up (merges at
  // the seams), so each closed chunk is counted once for real and gives back units until it fits.
  std::vector<std::string> chunks;
  size_t begin = 0;
  while (begin < units.size()) {
    size_t end = begin + 1;
    for (int64_t est = units[begin].tokens; end < units.size() && est + units[end].tokens + 1 <= max_tokens; ++end)
      est += units[end].tokens + 1;
    const auto join = [&](size_t e) {
      std::string c = units[begin].text;
      for (size_t i = begin + 1; i < e; ++i) c += units[i].sep + units[i].text;
      return c;
    };
    std::string cur = join(end);
    while (end > begin + 1 && count(cur) > max_tokens) cur = join(--end);
    chunks.push_back(std::move(cur));
    begin = end;
  }
  return chunks;
}

std::string summarizer::run_one(const std::string& instruction, const std::string& text, int max_tokens,
                                summary_result& r, const summary_hooks& hooks, int64_t& done, int64_t& total) {
  sequence_request req;
  req.context = prompt_ids(instruction, text);
  req.max_tokens = max_tokens;
  req.sampling = s_.sampling;
  XCTX_CHECK((int64_t)req.context.size() + max_tokens <= s_.n_ctx, "a summary prompt of ", req.context.size(),
             " tokens + ", max_tokens, " to generate exceeds the context of ", s_.n_ctx, " tokens");
  const int64_t base = done;
  total = std::max(total, base + (int64_t)req.context.size() + max_tokens);
  // Stop strings end a summary like the service's generate jobs (coordinator/service/generate_text.h).
  std::optional<text_stream> out_text;
  if (!s_.stop.empty()) out_text.emplace(tok_, s_.stop);
  bool hit_stop = false;
  sequence_hooks h;
  h.should_stop = [&] { return hit_stop || (hooks.should_stop && hooks.should_stop()); };
  h.on_phase = hooks.on_phase;
  h.on_token = [&](int32_t id) {
    if (out_text) hit_stop = out_text->push(id);
    if (hooks.progress) hooks.progress(++done, total);
  };
  if (hooks.progress) h.prefill_progress = [&](int64_t d, int64_t) { hooks.progress(base + d, total); };
  done = base + (int64_t)req.context.size();
  const sequence_outcome out = driver_.run(req, h);
  done = base + out.prompt_tokens + (int64_t)out.ids.size();
  r.prompt_tokens += out.prompt_tokens;
  r.generated_tokens += (int64_t)out.ids.size();
  r.prefill_s += out.prefill_s;
  r.decode_s += out.decode_s;
  ++r.sequences;
  r.stopped = r.stopped || (out.stopped && !hit_stop);
  std::string summary = out_text ? out_text->text() : tok_.decode(out.ids);
  const size_t first = summary.find_first_not_of(" \n\t");
  return first == std::string::npos ? std::string() : summary.substr(first);
}

summary_result summarizer::summarize(const std::string& text_in, const std::string& instruction_in, int max_tokens,
                                     const summary_hooks& hooks) {
  XCTX_CHECK(!blank(text_in), "the document is empty");
  const std::string instruction = instruction_in.empty() ? s_.instruction : instruction_in;
  if (max_tokens <= 0) max_tokens = s_.max_tokens;
  XCTX_CHECK(max_tokens <= kMaxSummaryTokens, "max_tokens ", max_tokens, " is over the limit of ", kMaxSummaryTokens);
  const auto text_budget = [&](const std::string& instr, int out_tokens) {
    return s_.n_ctx - out_tokens - (int64_t)prompt_ids(instr, "").size() - kPromptSlack;
  };
  summary_result r;
  int64_t done = 0;
  std::string text = text_in;
  int64_t n_text = count(text);
  if (n_text <= text_budget(instruction, max_tokens)) {
    r.method = "single";
    int64_t total = 0;
    r.summary = run_one(instruction, text, max_tokens, r, hooks, done, total);
    return r;
  }

  // Map-reduce, level by level, until the joined summaries fit one sequence.
  r.method = "map-reduce";
  const int map_tokens = std::min(s_.map_tokens, max_tokens);
  const std::string reduce_instruction =
      "The following are summaries of the consecutive parts of one long text. " + instruction;
  for (int level = 0;; ++level) {
    const std::string probe = "This is part 999 of 999 of a longer text. Summarize this part in a few sentences.";
    int64_t chunk = text_budget(probe, map_tokens);
    if (s_.chunk_tokens > 0) chunk = std::min(chunk, s_.chunk_tokens);
    XCTX_CHECK(chunk >= 64, "the context of ", s_.n_ctx, " tokens leaves ", chunk,
               " tokens per chunk: too small to summarize a long document (raise --ctx)");
    const std::vector<std::string> pieces = split_text(text, chunk);
    if (level == 0) r.chunks = (int)pieces.size();
    int64_t total = done + n_text + (int64_t)pieces.size() * (map_tokens + 64) + max_tokens;
    std::string joined;
    for (size_t k = 0; k < pieces.size(); ++k) {
      const std::string map_instruction = "This is part " + std::to_string(k + 1) + " of " +
                                          std::to_string(pieces.size()) +
                                          " of a longer text. Summarize this part in a few sentences.";
      const std::string part = run_one(map_instruction, pieces[k], map_tokens, r, hooks, done, total);
      if (r.stopped) return r;
      joined += (joined.empty() ? "" : "\n\n") + part;
    }
    const int64_t n_joined = count(joined);
    if (n_joined <= text_budget(reduce_instruction, max_tokens)) {
      r.summary = run_one(reduce_instruction, joined, max_tokens, r, hooks, done, total);
      return r;
    }
    XCTX_CHECK(n_joined < n_text && level < 8, "map-reduce does not converge: ", pieces.size(),
               " chunk summaries hold ", n_joined, " tokens, the text held ", n_text);
    text = std::move(joined);
    n_text = n_joined;
  }
}

// ---- the command -------------------------------------------------------------------------------

int run_summarize(const summarize_options& opt, communicator& comm) {
  const bool coordinator = comm.rank() == 0;
  XCTX_CHECK(!opt.in.empty() && !opt.out.empty(), "summarize needs --in FILE.jsonl and --out FILE.jsonl");
  stopwatch load_clock;
  const std::string model_path = opt.model.empty() ? default_model_path() : opt.model;
  model_session s = open_session(model_path, opt.tokenizer, opt.run, comm.rank() == 0);
  const model_hparams& hp = s.weights.hp;
  summarize_settings settings = opt.settings;
  settings.n_ctx = opt.run.n_ctx > 0 ? opt.run.n_ctx : hp.n_ctx_train;

  // Sequences up to the context: retrieval when that is past the trained window. One cache,
  // sized for the longest sequence and reused by every document.
  const int64_t new_tokens =
      std::min<int64_t>(std::max({settings.max_tokens, settings.map_tokens, kMaxSummaryTokens}), settings.n_ctx - 1);
  const sequence_plan plan = plan_sequences(
      hp, opt.seq, opt.run, s.cache, {settings.n_ctx - new_tokens, settings.n_ctx, new_tokens, /*one_cache=*/true},
      comm.size());
  const sequence_options& seq = plan.seq;
  llama_engine engine(s.weights, *s.be, plan.run);
  sequence_parallel_runner runner(engine, comm, *s.be, plan.cache, seq);
  sequence_driver driver(runner, comm, *s.tok, hp.n_vocab);
  if (!coordinator) {
    driver.follow();
    return 0;
  }

  // Everything that can be wrong with the files is found before any document runs; then the
  // other ranks are released (not aborted) and rank 0 reports it.
  std::vector<summary_document> docs;
  std::set<std::string> done;
  std::unique_ptr<durable_jsonl_writer> out_file;
  try {
    docs = parse_summary_jsonl(read_file_bytes(opt.in), opt.in, true);
    if (opt.resume) {
      done = completed_summary_ids(opt.out);
    } else {
      XCTX_CHECK(!std::filesystem::exists(opt.out) || std::filesystem::file_size(opt.out) == 0, "--out ", opt.out,
                 " exists and is not empty: pass --resume to continue it, or choose another file");
    }
    out_file = std::make_unique<durable_jsonl_writer>(opt.out);
  } catch (const Error& e) {
    driver.finish();
    std::fprintf(stderr, "xctx: error: %s\n", e.what());
    return 1;
  }
  durable_jsonl_writer& writer = *out_file;
  const std::filesystem::path in_dir = std::filesystem::path(opt.in).parent_path();
  const std::string cache_name = format_traits(opt.run.cache).name;
  summarizer sum(*s.tok, s.chat_template, driver, settings);

  size_t n_todo = 0;
  for (const auto& d : docs) n_todo += !done.count(d.id);
  std::fprintf(stderr,
               "[summarize] %zu documents in %s, %zu to do (%zu done before) | cache %s, %d rank(s) | %s | %s | "
               "load %.2f s\n",
               docs.size(), opt.in.c_str(), n_todo, docs.size() - n_todo, cache_name.c_str(), comm.size(),
               plan.header().c_str(), describe_sampler(settings.sampling).c_str(), load_clock.seconds());
  stopwatch batch_clock;
  size_t n_run = 0, n_failed = 0;
  int64_t prompt_tokens = 0, generated_tokens = 0;
  for (const summary_document& d : docs) {
    if (done.count(d.id)) continue;
    ++n_run;
    std::string line;
    try {
      XCTX_CHECK(d.error.empty(), d.error);
      const std::string text = d.path.empty() ? d.text : read_file_bytes((in_dir / d.path).string());
      // Progress for the documents that take a while (about 2K tokens and up).
      progress_line progress("[summarize] " + d.id, text.size() >= 8192);
      summary_hooks hooks;
      hooks.progress = [&progress](int64_t done_tokens, int64_t total) { progress(done_tokens, total); };
      const summary_result r = sum.summarize(text, d.instruction, d.max_tokens, hooks);
      progress.finish();
      prompt_tokens += r.prompt_tokens, generated_tokens += r.generated_tokens;
      line = summary_line(d.id, r, cache_name, comm.size());
      std::fprintf(stderr, "[summarize] %zu/%zu %s: %s, %lld prompt + %lld generated tokens, %.1f s\n", n_run, n_todo,
                   d.id.c_str(), r.method == "single" ? "one sequence" : ("map-reduce over " + std::to_string(r.chunks) + " chunks").c_str(),
                   (long long)r.prompt_tokens, (long long)r.generated_tokens, r.prefill_s + r.decode_s);
    } catch (const Error& e) {
      ++n_failed;
      line = summary_error_line(d.id, e.what());
      std::fprintf(stderr, "[summarize] %zu/%zu %s: error: %s\n", n_run, n_todo, d.id.c_str(), e.what());
    }
    writer.append(line);
  }
  driver.finish();
  const double wall = batch_clock.seconds();
  std::fprintf(stderr,
               "[summarize] %zu document(s) (%zu with errors) in %.1f s = %.1f documents/hour | %lld prompt tokens, %lld "
               "generated | peak memory (RSS) of rank 0: %s\n",
               n_run, n_failed, wall, wall > 0 ? 3600.0 * (double)n_run / wall : 0.0, (long long)prompt_tokens,
               (long long)generated_tokens, format_bytes((double)peak_rss_bytes()).c_str());
  return 0;
}

}  // namespace xctx
