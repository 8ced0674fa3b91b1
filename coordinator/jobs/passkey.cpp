// `xctx passkey`: builds the prompts, runs every (depth, trial) as one sequence of the driver
// (rank 0 decides, the other ranks follow) and scores greedy answers.
#include "coordinator/jobs/passkey.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>

#include "common/error.h"
#include "common/sys.h"
#include "model/corpus.h"
#include "coordinator/jobs/distributed.h"
#include "coordinator/jobs/sampler.h"
#include "coordinator/jobs/sequence_driver.h"
#include "coordinator/jobs/session.h"
#include "worker/llama_engine.h"
#include "worker/sequence_plan.h"

namespace xctx {
namespace {

// The wording of the landmark-attention / LongLoRA passkey prompt.
constexpr const char* kIntro =
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you "
    "about the important information there.";
constexpr const char* kQuestion = " What is the pass key? The pass key is";
const std::vector<std::string> kClassicSentences = {" The grass is green.", " The sky is blue.", " The sun is yellow.",
                                                    " Here we go.", " There and back again."};

std::string needle_lead() { return " The pass key is "; }
std::string needle_text(int key) {
  const std::string k = std::to_string(key);
  return needle_lead() + k + ". Remember it. " + k + " is the pass key.";
}

bool is_abbreviation(const std::string& text, size_t dot) {
  // Titles before a name end in '.' without ending the sentence.
  static const char* const kTitles[] = {"Mr", "Mrs", "Dr", "St", "Messrs", "Esq"};
  size_t b = dot;
  while (b > 0 && std::isalpha((unsigned char)text[b - 1])) --b;
  const std::string word = text.substr(b, dot - b);
  for (const char* t : kTitles)
    if (word == t) return true;
  return false;
}

// All six novels as one run of sentences, whitespace collapsed, each with a leading space.
const std::vector<std::string>& austen_sentences() {
  static const std::vector<std::string> sentences = [] {
    std::string flat;
    for (const auto& [name, text] : read_austen_novels()) {
      for (char c : text) {
        const bool space = std::isspace((unsigned char)c);
        if (space && (flat.empty() || flat.back() == ' ')) continue;
        flat += space ? ' ' : c;
      }
      if (!flat.empty() && flat.back() != ' ') flat += ' ';
    }
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t i = 0; i < flat.size(); ++i) {
      const char c = flat[i];
      if (c != '.' && c != '!' && c != '?') continue;
      size_t end = i + 1;  // closing quotes, brackets and emphasis marks stay with the sentence
      while (end < flat.size() && (flat[end] == '"' || flat[end] == '\'' || flat[end] == ')' || flat[end] == '_'))
        ++end;
      if (end < flat.size() && flat[end] != ' ') continue;
      if (c == '.' && is_abbreviation(flat, i)) continue;
      std::string s = flat.substr(start, end - start);
      if (!s.empty() && s.front() == ' ') s.erase(0, 1);
      if (!s.empty()) out.push_back(" " + s);
      start = end;
      i = end;
    }
    XCTX_CHECK(!out.empty(), "the Austen corpus has no sentences");
    return out;
  }();
  return sentences;
}

// Consecutive filler sentences from a seeded start, endlessly.
class filler_source {
 public:
  filler_source(const std::string& kind, uint64_t seed) {
    if (kind == "classic") {
      sentences_ = &kClassicSentences;
    } else if (kind == "austen") {
      sentences_ = &austen_sentences();
      std::mt19937_64 rng(seed ^ 0x9E3779B97F4A7C15ull);  // decorrelated from the key's stream
      next_ = rng() % sentences_->size();
    } else {
      fail("--filler: unknown '", kind, "' (classic, austen)");
    }
  }
  const std::string& next() {
    const std::string& s = (*sentences_)[next_];
    next_ = (next_ + 1) % sentences_->size();
    return s;
  }

 private:
  const std::vector<std::string>* sentences_ = nullptr;
  size_t next_ = 0;
};

struct filler_piece {
  std::string text;
  int64_t tokens = 0;
  bool ends_sentence = true;
};

// Filler of about `budget` tokens, counted piece by piece (each piece starts with a space, so the
// byte-level pre-tokenizer never merges across pieces). Whole sentences while they fit; when the
// remainder is more than `slack`, the next sentence is cut at a word boundary.
std::vector<filler_piece> build_filler(const tokenizer& tok, const std::string& kind, uint64_t seed, int64_t budget,
                                       int64_t slack) {
  std::vector<filler_piece> out;
  if (budget <= 0) return out;
  filler_source src(kind, seed);
  int64_t total = 0;
  while (total < budget) {
    const std::string& s = src.next();
    const int64_t t = (int64_t)tok.encode(s, false, false).size();
    if (total + t <= budget) {
      out.push_back({s, t, true});
      total += t;
      continue;
    }
    if (budget - total <= slack) break;
    size_t b = 0;
    while (b < s.size()) {
      size_t e = s.find(' ', b + 1);
      if (e == std::string::npos) e = s.size();
      std::string word = s.substr(b, e - b);
      const int64_t tw = (int64_t)tok.encode(word, false, false).size();
      if (total + tw > budget) break;
      out.push_back({std::move(word), tw, false});
      total += tw;
      b = e;
    }
    break;
  }
  return out;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

std::string one_line(const std::string& s) {
  std::string out;
  for (char c : s) out += (c == '\n') ? ' ' : c;
  return out;
}

}  // namespace

int64_t passkey_token_tolerance(int64_t context_tokens) {
  return std::max<int64_t>(32, (context_tokens + 99) / 100);
}

int passkey_for_seed(uint64_t seed) {
  std::mt19937_64 rng(seed);
  return 10000 + (int)(rng() % 90000);
}

namespace {
// [begin, end) of the first maximal run of exactly five digits in `answer`, or {npos, npos}.
std::pair<size_t, size_t> first_five_digit_run(const std::string& answer) {
  for (size_t i = 0; i < answer.size();) {
    if (!is_digit(answer[i])) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < answer.size() && is_digit(answer[j])) ++j;
    if (j - i == 5) return {i, j};
    i = j;
  }
  return {std::string::npos, std::string::npos};
}
}  // namespace

int extract_passkey(const std::string& answer) {
  const auto [b, e] = first_five_digit_run(answer);
  return b == std::string::npos ? -1 : std::stoi(answer.substr(b, 5));
}

bool passkey_answer_complete(const std::string& answer) {
  // A run that ends the text may still grow into six digits.
  const auto [b, e] = first_five_digit_run(answer);
  return b != std::string::npos && e < answer.size();
}

std::pair<double, double> wilson_interval(int correct, int n, double z) {
  if (n <= 0) return {0.0, 1.0};
  const double p = (double)correct / n, z2 = z * z;
  const double centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
  const double half = z / (1.0 + z2 / n) * std::sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n));
  return {std::max(0.0, centre - half), std::min(1.0, centre + half)};
}

std::vector<double> parse_depths(const std::string& text) {
  std::vector<double> out;
  size_t b = 0;
  while (b <= text.size()) {
    size_t e = text.find(',', b);
    if (e == std::string::npos) e = text.size();
    const std::string item = text.substr(b, e - b);
    size_t used = 0;
    double d = 0;
    try {
      d = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    XCTX_CHECK(!item.empty() && used == item.size(), "--depths: '", item, "' is not a number (e.g. 0,0.5,1)");
    XCTX_CHECK(d >= 0.0 && d <= 1.0, "--depths: ", d, " is outside [0, 1]");
    out.push_back(d);
    b = e + 1;
  }
  return out;
}

passkey_prompt make_passkey_prompt(const tokenizer& tok, int64_t context_tokens, double depth, int key,
                                   const std::string& filler_kind, uint64_t seed, bool chat,
                                   const std::string& chat_template) {
  XCTX_CHECK(depth >= 0.0 && depth <= 1.0, "passkey depth ", depth, " is outside [0, 1]");
  XCTX_CHECK(key >= 10000 && key <= 99999, "passkey ", key, " is not a 5-digit number");
  XCTX_CHECK(context_tokens > 0, "passkey context must be > 0 tokens, got ", context_tokens);
  const bool add_bos = tok.vocab().add_bos;
  const int64_t tol = passkey_token_tolerance(context_tokens);

  // (context text, suffix text) for given filler halves; the suffix starts at the question.
  auto render = [&](const std::string& before, const std::string& after) {
    const std::string head = kIntro + before + needle_text(key) + after;
    if (!chat) return std::pair<std::string, std::string>(head, kQuestion);
    const std::string full =
        apply_chat_template(detect_chat_style(chat_template), std::vector<chat_message>{chat_message{"user", head + kQuestion}},
                            /*add_generation_prompt=*/true);
    const size_t q = full.rfind(kQuestion);
    XCTX_ASSERT(q != std::string::npos, "chat template dropped the question");
    return std::pair<std::string, std::string>(full.substr(0, q), full.substr(q));
  };
  auto encode = [&](const std::string& s) { return tok.encode(s, add_bos, /*parse_special=*/chat); };

  const auto [bare_ctx, bare_suffix] = render("", "");
  const int64_t n_fixed = (int64_t)encode(bare_ctx + bare_suffix).size();
  XCTX_CHECK(n_fixed < context_tokens, "passkey --context ", context_tokens,
             " is too small: the prompt without filler already takes ", n_fixed, " tokens");

  passkey_prompt p;
  p.key = key;
  int64_t budget = context_tokens - n_fixed;
  // Piece counts are exact for a byte-level BPE; the loop only corrects tokenizers whose pieces
  // interact at the joins.
  for (int attempt = 0;; ++attempt) {
    const std::vector<filler_piece> pieces = build_filler(tok, filler_kind, seed, budget, tol / 2);
    int64_t filler_total = 0;
    for (const auto& pc : pieces) filler_total += pc.tokens;
    // The key goes at the sentence boundary nearest to depth × filler.
    const double target = depth * (double)filler_total;
    size_t split = 0;
    double best = target;  // distance at boundary 0
    int64_t run = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      run += pieces[i].tokens;
      const bool boundary = pieces[i].ends_sentence || i + 1 == pieces.size();
      if (boundary && std::abs((double)run - target) < best) {
        best = std::abs((double)run - target);
        split = i + 1;
      }
    }
    std::string before, after;
    for (size_t i = 0; i < pieces.size(); ++i) (i < split ? before : after) += pieces[i].text;
    const auto [ctx_text, suffix_text] = render(before, after);
    p.text = ctx_text + suffix_text;
    p.ids = encode(p.text);
    p.filler_tokens = filler_total;
    const int64_t diff = (int64_t)p.ids.size() - context_tokens;
    if (std::abs(diff) <= tol) {
      const size_t n_ctx = encode(ctx_text).size();
      XCTX_CHECK(n_ctx <= p.ids.size() && std::equal(p.ids.begin(), p.ids.begin() + n_ctx, encode(ctx_text).begin()),
                 "the tokenizer merges across the start of the question; cannot split context and suffix");
      p.context_ids.assign(p.ids.begin(), p.ids.begin() + n_ctx);
      p.suffix_ids.assign(p.ids.begin() + n_ctx, p.ids.end());
      const std::string key_lead = ctx_text.substr(0, ctx_text.find(needle_text(key))) + needle_lead();
      // The lead ends in a space that joins the first digit's token, so count without it.
      p.key_token = (int64_t)encode(key_lead.substr(0, key_lead.size() - 1)).size();
      return p;
    }
    XCTX_CHECK(attempt < 4, "could not build a passkey prompt of ", context_tokens, " tokens (±", tol, "): got ",
               p.ids.size());
    budget -= diff;
  }
}

namespace {
rope_config with_group(rope_config r, int group) {
  r.se_group = group;
  return r;
}
}  // namespace

void check_passkey_options(const passkey_options& opt, const model_hparams& hp) {
  XCTX_CHECK(opt.trials >= 1, "--trials must be >= 1, got ", opt.trials);
  XCTX_CHECK(!opt.depths.empty(), "--depths is empty");
  for (double d : opt.depths) XCTX_CHECK(d >= 0.0 && d <= 1.0, "--depths: ", d, " is outside [0, 1]");
  XCTX_CHECK(opt.filler == "classic" || opt.filler == "austen", "--filler: unknown '", opt.filler,
             "' (classic, austen)");
  XCTX_CHECK(opt.max_answer_tokens >= 1, "--max-answer-tokens must be >= 1");
  XCTX_CHECK(opt.context >= 64, "passkey --context must be >= 64 tokens, got ", opt.context);
  // The prompt may overshoot --context by the tolerance; the answer follows it.
  const int64_t need = passkey_tokens_needed(opt);
  const int64_t suggest_ctx = (need + 1023) / 1024 * 1024;
  if (opt.run.rope_scale == rope_scaling::rope_scaling_none && opt.run.se_group == 1) {
    // The smallest factor in steps of 0.25 that stretches the trained context over `need`.
    const double factor = std::ceil(4.0 * (double)need / hp.n_ctx_train) / 4.0;
    XCTX_CHECK(need <= hp.n_ctx_train, "passkey --context ", opt.context, " needs up to ", need,
               " tokens (prompt within its tolerance + answer), beyond the model's trained context of ",
               hp.n_ctx_train, "; use a smaller --context or pass --rope-scaling linear --rope-factor ", factor,
               " --ctx ", suggest_ctx, " (or --rope-scaling selfextend)");
  }
  if (opt.run.se_group > 1) {
    const rope_config r = make_rope_config(hp, opt.run);
    const int64_t reach = rope_reach(r, hp.n_ctx_train);
    int suggest = r.se_group;
    while (suggest < 4096 && rope_reach(with_group(r, suggest), hp.n_ctx_train) < need) suggest *= 2;
    XCTX_CHECK(need <= reach, "passkey --context ", opt.context, " needs up to ", need,
               " tokens, beyond what SelfExtend with --group ", r.se_group, " --window ", r.se_window,
               " reaches from the trained context of ", hp.n_ctx_train, " (", reach, " tokens); pass --group ",
               suggest);
  }
  const int64_t capacity = opt.run.n_ctx > 0 ? opt.run.n_ctx : hp.n_ctx_train;
  XCTX_CHECK(need <= capacity, "passkey --context ", opt.context, " needs up to ", need, " tokens but the context is ",
             capacity, " (pass --ctx ", suggest_ctx, ")");
}

int64_t passkey_tokens_needed(const passkey_options& opt) {
  return opt.context + passkey_token_tolerance(opt.context) + opt.max_answer_tokens;
}

nlohmann::json passkey_summary(const passkey_options& opt, const nlohmann::json& trials) {
  nlohmann::json per_depth = nlohmann::json::array();
  int all = 0, n_total = 0;
  double prefill_total_s = 0;
  for (double depth : opt.depths) {
    int correct = 0, n = 0;
    for (const auto& t : trials)
      if (t["depth"].get<double>() == depth) correct += t["ok"].get<bool>(), ++n;
    const auto [lo, hi] = wilson_interval(correct, n);
    per_depth.push_back({{"depth", depth}, {"correct", correct}, {"trials", n},
                         {"accuracy", n > 0 ? (double)correct / n : 0.0}, {"ci95", {lo, hi}}});
    all += correct, n_total += n;
  }
  for (const auto& t : trials) prefill_total_s += t["prefill_s"].get<double>();
  const auto [lo, hi] = wilson_interval(all, n_total);
  return {{"per_depth", per_depth}, {"correct", all}, {"total", n_total},
          {"accuracy", n_total > 0 ? (double)all / n_total : 0.0}, {"ci95", {lo, hi}},
          {"prefill_s_total", prefill_total_s}};
}

nlohmann::json passkey_trials(const passkey_options& opt, const tokenizer& tok, const std::string& chat_template,
                              sequence_driver& driver, const passkey_hooks& hooks) {
  nlohmann::json trials = nlohmann::json::array();
  for (size_t di = 0; di < opt.depths.size(); ++di) {
    for (int t = 0; t < opt.trials; ++t) {
      if (hooks.should_stop && hooks.should_stop()) return trials;
      const uint64_t trial_seed = opt.seed + (uint64_t)t;
      const int key = passkey_for_seed(trial_seed);
      stopwatch build_clock;
      const passkey_prompt prompt =
          make_passkey_prompt(tok, opt.context, opt.depths[di], key, opt.filler, trial_seed, opt.chat, chat_template);
      const double build_s = build_clock.seconds();
      const int64_t n_prompt = (int64_t)(prompt.context_ids.size() + prompt.suffix_ids.size());

      if (hooks.before_trial) hooks.before_trial(prompt.key_token);
      sequence_hooks seq_hooks;
      // Decoding ends as soon as the key (or a wrong 5-digit number) is complete: at 1M tokens
      // every step costs a pass over the whole sharded cache.
      std::vector<int32_t> so_far;
      bool answered = false;
      seq_hooks.on_token = [&](int32_t id) {
        so_far.push_back(id);
        answered = passkey_answer_complete(tok.decode(so_far));
      };
      seq_hooks.should_stop = [&] { return answered || (hooks.should_stop && hooks.should_stop()); };
      seq_hooks.on_phase = hooks.on_phase;
      if (hooks.prefill_progress)
        seq_hooks.prefill_progress = [&](int64_t done, int64_t total) { hooks.prefill_progress(di, t, done, total); };
      const sequence_outcome out =
          driver.run({prompt.context_ids, prompt.suffix_ids, opt.max_answer_tokens, sampler_params{}}, seq_hooks);
      if (out.stopped && !answered) return trials;  // cancelled

      const std::string answer = tok.decode(out.ids);
      const int got = extract_passkey(answer);
      trials.push_back({{"depth", opt.depths[di]},
                        {"trial", t},
                        {"seed", trial_seed},
                        {"key", key},
                        {"answer", answer},
                        {"answer_tokens", out.ids.size()},
                        {"extracted", got},
                        {"ok", got == key},
                        {"prompt_tokens", n_prompt},
                        {"suffix_tokens", prompt.suffix_ids.size()},
                        {"key_token", prompt.key_token},
                        {"build_s", build_s},
                        {"prefill_mode", prefill_mode_name(out.prefill)},
                        {"prefill_s", out.prefill_s},
                        {"decode_s", out.decode_s},
                        {"decode_steps", out.decode_steps}});
      if (hooks.annotate_trial) hooks.annotate_trial(trials.back());
      if (hooks.on_trial) hooks.on_trial(trials.back());
    }
  }
  return trials;
}

int run_passkey(const passkey_options& opt_in, communicator& comm) {
  const bool coordinator = comm.rank() == 0;
  stopwatch load_clock;
  passkey_options opt = opt_in;
  const std::string model_path = opt.model.empty() ? default_model_path() : opt.model;
  model_session s = open_session(model_path, opt.tokenizer, opt.run, comm.rank() == 0);
  const model_hparams& hp = s.weights.hp;
  // Retrieval past the trained window (auto): its positions and summaries, and a capacity that
  // holds the prompt and the answer, derived here rather than asked of the user.
  const int64_t needed = passkey_tokens_needed(opt);
  const sequence_plan plan = plan_sequences(
      hp, opt.seq, opt.run, s.cache, {std::min(opt.context, needed), needed, (int64_t)opt.max_answer_tokens + 1, false},
      comm.size());
  opt.seq = plan.seq, opt.run = plan.run, s.cache = plan.cache;
  // Every rank checks the same numbers, so a bad setting fails everywhere before a collective.
  check_passkey_options(opt, hp);
  if (coordinator && opt.run.rope_scale != rope_scaling::rope_scaling_none &&
      opt.context > (int64_t)(hp.n_ctx_train * opt.run.rope_factor))
    std::fprintf(stderr, "[passkey] warning: --context %lld exceeds the trained context %d x --rope-factor %.2f\n",
                 (long long)opt.context, hp.n_ctx_train, opt.run.rope_factor);

  llama_engine engine(s.weights, *s.be, opt.run);
  const size_t base_rss = current_rss_bytes();  // weights and code: what the memory plan leaves out
  const rss_parts base_parts = current_rss_parts();
  // auto is decided once from --context, not per prompt: the prompts vary within the tolerance,
  // and a sweep's trials must all run the prefill its header names.
  sequence_options seq = with_mode_resolved(opt.seq, opt.context);
  sequence_parallel_runner runner(engine, comm, *s.be, s.cache, seq);
  sequence_driver driver(runner, comm, *s.tok, hp.n_vocab);
  if (!coordinator) {
    driver.follow();
    report_shards(comm, runner, opt.run.cache, base_rss, base_parts);
    return 0;
  }

  std::fprintf(stderr, "[passkey] load %.2f s\n", load_clock.seconds());
  std::printf("passkey: model %s | %d rank(s) x %d thread(s), %s | cache %s | filler %s%s | haystack %lld tokens (±%lld)\n",
              hp.name.c_str(), comm.size(), engine.params().n_threads, plan.header().c_str(),
              format_traits(opt.run.cache).name, opt.filler.c_str(), opt.chat ? " | chat" : "", (long long)opt.context,
              (long long)passkey_token_tolerance(opt.context));
  std::unique_ptr<progress_line> progress;
  passkey_hooks hooks;
  hooks.prefill_progress = [&](size_t di, int t, int64_t done, int64_t total) {
    if (done == 0 || !progress) {
      char label[96];
      std::snprintf(label, sizeof label, "[passkey] depth %.2f trial %d: prefill", opt.depths[di], t);
      progress = std::make_unique<progress_line>(label, total >= 4 * opt.run.n_batch);
    }
    (*progress)(done, total);
    if (done == total) progress->finish(), progress.reset();
  };
  hooks.on_trial = [](const nlohmann::json& tr) {
    std::printf("depth %.2f trial %d key %d | %lld tokens, key at %lld | answer \"%s\" | %s | prompt %.2f s, "
                "prefill (%s) %.2f s, decode %.2f s\n",
                tr["depth"].get<double>(), tr["trial"].get<int>(), tr["key"].get<int>(),
                (long long)tr["prompt_tokens"].get<int64_t>(), (long long)tr["key_token"].get<int64_t>(),
                one_line(tr["answer"].get<std::string>()).c_str(), tr["ok"].get<bool>() ? "ok" : "WRONG",
                tr["build_s"].get<double>(), tr["prefill_mode"].get<std::string>().c_str(), tr["prefill_s"].get<double>(),
                tr["decode_s"].get<double>());
    std::fflush(stdout);
  };
  if (opt.needle_rank) {
    XCTX_CHECK(runner.selector() != nullptr, "--needle-rank measures retrieval attention's block selection: it needs "
                                             "--attention retrieval (or auto past the trained window)");
    hooks.before_trial = [&](int64_t key_pos) { runner.selector()->set_probe(key_pos); };
    hooks.annotate_trial = [&](nlohmann::json& tr) {
      nlohmann::json layers = nlohmann::json::array();
      for (const auto& r : runner.selector()->probe_results()) {
        nlohmann::json L = {{"layer", r.layer},          {"candidates", r.candidates},   {"minmax", r.rank_minmax},
                            {"mean", r.rank_mean},       {"minmax_kv", r.rank_minmax_kv}, {"mean_kv", r.rank_mean_kv},
                            {"top_minmax", r.top_minmax}, {"top_mean", r.top_mean}};
        if (r.rank_repr >= 0) L["repr"] = r.rank_repr, L["repr_kv"] = r.rank_repr_kv, L["top_repr"] = r.top_repr;
        layers.push_back(std::move(L));
      }
      tr["needle_rank"] = layers;
    };
  }
  const nlohmann::json trials = passkey_trials(opt, *s.tok, s.chat_template, driver, hooks);
  driver.finish();

  const nlohmann::json summary = passkey_summary(opt, trials);
  std::printf("\n%-8s %9s %9s  %s\n", "depth", "correct", "accuracy", "95% interval (Wilson)");
  const auto row = [](const std::string& label, const nlohmann::json& d, const char* n_key) {
    std::printf("%-8s %6d/%-3d %7.0f%%  [%.0f%%, %.0f%%]\n", label.c_str(), d["correct"].get<int>(),
                d[n_key].get<int>(), 100.0 * d["accuracy"].get<double>(), 100.0 * d["ci95"][0].get<double>(),
                100.0 * d["ci95"][1].get<double>());
  };
  for (const auto& d : summary["per_depth"]) {
    char label[16];
    std::snprintf(label, sizeof label, "%.2f", d["depth"].get<double>());
    row(label, d, "trials");
  }
  const int n_total = summary["total"];
  const double prefill_total_s = summary["prefill_s_total"];
  row("all", summary, "total");
  std::fflush(stdout);  // the table before the memory and shard lines on stderr
  std::fprintf(stderr, "[passkey] prefill %.2f s in all, %.2f s per trial | peak memory (RSS) of rank 0: %s\n",
               prefill_total_s, prefill_total_s / n_total, format_bytes((double)peak_rss_bytes()).c_str());
  const nlohmann::json shards = report_shards(comm, runner, opt.run.cache, base_rss, base_parts);
  if (!opt.json_path.empty()) {
    const nlohmann::json out = {{"model", hp.name},
                                {"context", opt.context},
                                {"filler", opt.filler},
                                {"chat", opt.chat},
                                {"prefill", describe_prefill(opt.seq, opt.context)},
                                {"attention", describe_attention(opt.seq)},
                                {"retrieval_bytes_sent_rank0", runner.stats().retrieval_bytes_sent},
                                {"merge_bytes_sent_rank0", runner.stats().gather_bytes_sent},
                                {"summary_bytes_read_rank0", runner.stats().retrieval_summary_bytes_read},
                                {"decode_tokens_rank0", runner.stats().decode_tokens},
                                {"rope", describe_rope(engine.rope(), hp.n_ctx_train)},
                                {"cache", format_traits(opt.run.cache).name},
                                {"ranks", comm.size()},
                                {"seed", opt.seed},
                                {"trials", trials},
                                {"summary", summary},
                                {"shards", shards}};
    std::ofstream f(opt.json_path);
    XCTX_CHECK(f.good(), "--json: cannot write ", opt.json_path);
    // Answers of a broken cache can hold invalid UTF-8: replace it rather than fail the run.
    f << out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    XCTX_CHECK(f.good(), "--json: write failed on ", opt.json_path);
  }
  return 0;
}

}  // namespace xctx
