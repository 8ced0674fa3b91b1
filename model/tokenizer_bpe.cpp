// Byte-level BPE (GGUF tokenizer.ggml.model = "gpt2"), matching llama.cpp token for token.
//
// encode: split out special tokens -> pre-tokenize the text into pieces with the regex passes
// llama.cpp runs for tokenizer.ggml.pre (hand-written matchers over code points) -> map each
// piece's bytes to GPT-2's byte alphabet -> merge adjacent symbols, lowest merge rank first
// (ties: leftmost) -> one token per final symbol.
//
// The regex passes run in sequence; each splits every piece of the previous pass. A pass that
// llama.cpp runs through std::regex keeps both the matches and the text between them as pieces;
// the GPT-2 and Llama-3 passes mirror llama.cpp's hand-written matchers, which behave as the
// regexes do with `\s+` as a last alternative.
#include <algorithm>
#include <array>

#include "common/error.h"
#include "model/tokenizer_impl.h"
#include "model/unicode.h"

namespace xctx::tokenizer_detail {

namespace {

enum class split_pass : uint8_t {
  pass_each_number,   // \p{N}
  pass_gpt2,          // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  pass_llama3,        // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}
                      //   | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  pass_qwen2,         // as pass_llama3 with \p{N} in place of \p{N}{1,3}
  pass_punct_runs,    // [\p{P}\$\+<=>\^~\|]+
  pass_number_runs,   // \p{N}+
  pass_ascii_digit3,  // [0-9][0-9][0-9]
};

struct pre_tokenizer {
  std::vector<split_pass> passes;
  bool ignore_merges = false;  // a piece that is itself a token is taken whole (Llama 3)
};

bool name_in(const std::string& s, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (s == n) return true;
  return false;
}

// The tokenizer.ggml.pre names and pass lists of llama.cpp's llama-vocab.cpp.
pre_tokenizer pre_tokenizer_for(const std::string& pre) {
  using sp = split_pass;
  if (pre == "default")
    return {{sp::pass_punct_runs, sp::pass_gpt2, sp::pass_number_runs, sp::pass_ascii_digit3}, false};
  if (name_in(pre, {"gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"})) return {{sp::pass_gpt2}, false};
  if (name_in(pre, {"llama3", "llama-v3", "llama-bpe", "falcon3"})) return {{sp::pass_llama3}, true};
  if (name_in(pre, {"dbrx", "smaug-bpe"})) return {{sp::pass_llama3}, false};
  if (name_in(pre, {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}))
    return {{sp::pass_each_number, sp::pass_gpt2}, false};
  if (name_in(pre, {"qwen2", "stablelm2", "deepseek-r1-qwen", "megrez"})) return {{sp::pass_qwen2}, false};
  fail("unknown BPE pre-tokenizer '", pre,
       "' (tokenizer.ggml.pre); supported: default, gpt2/gpt-2 (and phi-2, mpt, olmo, jais), "
       "llama3/llama-v3/llama-bpe/falcon3, dbrx, smaug-bpe, smollm (and starcoder, refact, command-r, codeshell, "
       "exaone, minerva-7b), qwen2 (and stablelm2, deepseek-r1-qwen, megrez)");
}

// The input decoded once: code points, their flags, and where each starts in the bytes.
struct decoded_text {
  std::vector<uint32_t> cpts;      // [n_cpt]
  std::vector<uint8_t> flags;      // [n_cpt] unicode_flags()
  std::vector<uint32_t> byte_off;  // [n_cpt + 1]
};

void decode_text(std::string_view s, decoded_text& t) {
  t.cpts.clear();
  t.flags.clear();
  t.byte_off.clear();
  for (size_t pos = 0; pos < s.size();) {
    t.byte_off.push_back((uint32_t)pos);
    const uint32_t c = utf8_decode(s, pos);
    t.cpts.push_back(c);
    t.flags.push_back(unicode_flags(c));
  }
  t.byte_off.push_back((uint32_t)s.size());
}

constexpr uint8_t k_lnw = uflag_letter | uflag_number | uflag_whitespace;

// Splits the piece [b, e) of `t`, appending the end of every sub-piece to `ends`.
class piece_splitter {
 public:
  piece_splitter(const decoded_text& t, uint32_t b, uint32_t e, std::vector<uint32_t>& ends)
      : cp_(t.cpts), fl_(t.flags), b_(b), e_(e), last_(b), ends_(ends) {}

  void run(split_pass p) {
    switch (p) {
      case split_pass::pass_each_number: return each_number();
      case split_pass::pass_gpt2: return gpt2();
      case split_pass::pass_llama3: return llama3(3);
      case split_pass::pass_qwen2: return llama3(1);
      case split_pass::pass_punct_runs: return runs([](uint32_t c, uint8_t f) {
          return (f & uflag_punctuation) || c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' ||
                 c == '~' || c == '|';
        });
      case split_pass::pass_number_runs: return runs([](uint32_t, uint8_t f) { return (f & uflag_number) != 0; });
      case split_pass::pass_ascii_digit3: return ascii_digit3();
    }
  }

 private:
  void emit(uint32_t end) {
    if (end > last_) {
      ends_.push_back(end);
      last_ = end;
    }
  }
  bool in(uint32_t p) const { return p < e_; }
  uint32_t cpt(uint32_t p) const { return in(p) ? cp_[p] : 0xFFFFFFFFu; }
  uint8_t flags(uint32_t p) const { return in(p) ? fl_[p] : 0; }
  bool is(uint32_t p, uint8_t mask) const { return (flags(p) & mask) != 0; }
  // [^\s\p{L}\p{N}]: any code point in the piece that is none of the three.
  bool is_other(uint32_t p) const { return in(p) && !(fl_[p] & k_lnw); }
  static uint32_t lower_ascii(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

  // 's 't 're 've 'm 'll 'd at `p`; returns the match length or 0.
  uint32_t contraction(uint32_t p, bool any_case) const {
    if (cpt(p) != '\'' || !in(p + 1)) return 0;
    const uint32_t c1 = any_case ? lower_ascii(cpt(p + 1)) : cpt(p + 1);
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
    if (!in(p + 2)) return 0;
    const uint32_t c2 = any_case ? lower_ascii(cpt(p + 2)) : cpt(p + 2);
    if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
    return 0;
  }

  // \s+(?!\S) then \s+: a whitespace run followed by text leaves its last space to that text.
  void whitespace_run(uint32_t p) {
    uint32_t n = 0;
    while (is(p + n, uflag_whitespace)) ++n;
    if (n > 1 && in(p + n)) emit(p + n - 1);
    else if (n > 0) emit(p + n);
    else emit(p + 1);
  }

  void gpt2() {
    for (uint32_t p = b_; p < e_; p = last_) {
      if (uint32_t n = contraction(p, false)) {
        emit(p + n);
        continue;
      }
      const bool space = cpt(p) == ' ';
      const uint32_t q = p + (space ? 1 : 0);  // where the class after an optional space starts
      if (is(q, uflag_letter) || is(q, uflag_number)) {
        const uint8_t cls = is(q, uflag_letter) ? uflag_letter : uflag_number;
        uint32_t r = q;
        while (is(r, cls)) ++r;
        emit(r);
      } else if (is_other(q)) {
        uint32_t r = q;
        while (is_other(r)) ++r;
        emit(r);
      } else {
        whitespace_run(p);
      }
    }
  }

  void llama3(uint32_t max_digits) {
    for (uint32_t p = b_; p < e_; p = last_) {
      if (uint32_t n = contraction(p, true)) {
        emit(p + n);
        continue;
      }
      const uint32_t c = cpt(p);
      // [^\r\n\p{L}\p{N}]?\p{L}+
      if (c != '\r' && c != '\n' && !is(p, uflag_number) && (is(p, uflag_letter) || is(p + 1, uflag_letter))) {
        uint32_t r = p + 1;
        while (is(r, uflag_letter)) ++r;
        emit(r);
        continue;
      }
      // \p{N}{1,max_digits}: a long number becomes groups of max_digits from the left.
      if (is(p, uflag_number)) {
        uint32_t r = p;
        while (is(r, uflag_number)) {
          ++r;
          if (r - last_ >= max_digits) emit(r);
        }
        emit(r);
        continue;
      }
      //  ?[^\s\p{L}\p{N}]+[\r\n]*
      const uint32_t q = p + (c == ' ' ? 1 : 0);
      if (is_other(q)) {
        uint32_t r = q;
        while (is_other(r)) ++r;
        while (cpt(r) == '\r' || cpt(r) == '\n') ++r;
        emit(r);
        continue;
      }
      // \s*[\r\n]+: whitespace up to and including its last line break.
      uint32_t n = 0, end_of_break = 0;
      for (; is(p + n, uflag_whitespace); ++n)
        if (cpt(p + n) == '\r' || cpt(p + n) == '\n') end_of_break = p + n + 1;
      if (end_of_break > 0) emit(end_of_break);
      else whitespace_run(p);
    }
  }

  // The std::regex-style passes: matches and the stretches between them are both pieces.
  void each_number() {
    for (uint32_t p = b_; p < e_; ++p) {
      if (fl_[p] & uflag_number) {
        emit(p);
        emit(p + 1);
      }
    }
    emit(e_);
  }

  template <typename Pred>
  void runs(Pred pred) {
    for (uint32_t p = b_ + 1; p < e_; ++p)
      if (pred(cp_[p], fl_[p]) != pred(cp_[p - 1], fl_[p - 1])) emit(p);
    emit(e_);
  }

  void ascii_digit3() {
    auto digit = [&](uint32_t p) { return in(p) && cp_[p] >= '0' && cp_[p] <= '9'; };
    for (uint32_t p = b_; p < e_;) {
      if (digit(p) && digit(p + 1) && digit(p + 2)) {
        emit(p);
        emit(p + 3);
        p += 3;
      } else {
        ++p;
      }
    }
    emit(e_);
  }

  const std::vector<uint32_t>& cp_;
  const std::vector<uint8_t>& fl_;
  const uint32_t b_, e_;
  uint32_t last_;
  std::vector<uint32_t>& ends_;
};

class bpe_tokenizer final : public tokenizer_base {
 public:
  explicit bpe_tokenizer(const tokenizer_vocab& v) : tokenizer_base(v), pre_(pre_tokenizer_for(v.pre)) {
    const int32_t n = n_vocab();
    // Symbols are token ids, plus ids >= n_vocab for strings that only appear inside merges.
    token_map extra;
    auto symbol_for = [&](const std::string& s) -> int32_t {
      if (int32_t id = lookup(s); id >= 0) return id;
      return extra.try_emplace(s, n + (int32_t)extra.size()).first->second;
    };
    for (int b = 0; b < 256; ++b) {
      const std::string s = utf8_encode(gpt2_byte_to_cpt((uint8_t)b));
      byte_token_[b] = lookup(s);
      byte_symbol_[b] = symbol_for(s);
    }
    merges_.reserve(vocab_.merges.size());
    for (size_t rank = 0; rank < vocab_.merges.size(); ++rank) {
      const std::string& m = vocab_.merges[rank];
      // Split at the first space after the first character: a part may itself start with one.
      const size_t sp = m.find(' ', 1);
      XCTX_CHECK(sp != std::string::npos && sp + 1 < m.size(), "BPE merge ", rank, " '", m,
                 "' is not two space-separated parts");
      const std::string left = m.substr(0, sp), right = m.substr(sp + 1);
      const int32_t l = symbol_for(left), r = symbol_for(right), result = symbol_for(left + right);
      // A repeated pair keeps its first (lowest) rank.
      merges_.try_emplace(pair_key(l, r), merge_rule{(int32_t)rank, result});
    }
    pieces_.resize((size_t)n);
    for (int32_t id = 0; id < n; ++id) {
      const std::string& text = vocab_.tokens[(size_t)id];
      std::string& out = pieces_[(size_t)id];
      for (size_t pos = 0; pos < text.size();) {
        const size_t start = pos;
        const int byte = gpt2_cpt_to_byte(utf8_decode(text, pos));
        if (byte >= 0) out.push_back((char)byte);
        else out.append(text, start, pos - start);  // outside the byte alphabet: keep as written
      }
    }
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const override {
    std::vector<int32_t> out;
    if (add_bos) {
      XCTX_CHECK(vocab_.bos_id >= 0, "encode: add_bos requested but the vocabulary has no BOS token");
      out.push_back(vocab_.bos_id);
    }
    workspace w;
    for (const text_fragment& f : split_special(text, parse_special)) {
      if (f.special_id >= 0) out.push_back(f.special_id);
      else encode_text(f.text, w, out);
    }
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids, bool render_special) const override {
    std::string s;
    for (int32_t id : ids) s += token_piece(id, render_special);
    return s;
  }

  std::string token_piece(int32_t id, bool render_special) const override {
    check_id(id);
    switch (kind(id)) {
      case token_kind::token_normal: return pieces_[(size_t)id];
      case token_kind::token_user_defined: return vocab_.tokens[(size_t)id];
      case token_kind::token_control:
      case token_kind::token_unknown: return render_special ? vocab_.tokens[(size_t)id] : std::string();
      case token_kind::token_unused:
      case token_kind::token_byte: return std::string();
    }
    return std::string();
  }

 private:
  struct merge_rule {
    int32_t rank;
    int32_t result;  // symbol id of the merged string
  };
  struct symbol {
    int32_t id;
    int32_t prev, next;  // neighbours in the word, -1 at the ends
    uint32_t start, len;  // bytes of the piece it covers; len 0 once merged into its left neighbour
  };
  struct candidate {
    int32_t rank, left, right, left_id, right_id, result;
    // The heap's top is the greatest: make that the lowest rank, then the leftmost.
    bool operator<(const candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  struct workspace {
    decoded_text text;
    std::vector<uint32_t> ends, next_ends;
    std::vector<symbol> syms;
    std::vector<candidate> heap;  // a max-heap under candidate::operator<
    std::string mapped;
  };

  static uint64_t pair_key(int32_t l, int32_t r) { return ((uint64_t)(uint32_t)l << 32) | (uint32_t)r; }

  void encode_text(std::string_view s, workspace& w, std::vector<int32_t>& out) const {
    XCTX_CHECK(s.size() < UINT32_MAX, "encode: text of ", s.size(), " bytes is too long (limit 4 GiB)");
    decode_text(s, w.text);
    const uint32_t n_cpt = (uint32_t)w.text.cpts.size();
    if (n_cpt == 0) return;
    w.ends.assign(1, n_cpt);
    for (split_pass p : pre_.passes) {
      w.next_ends.clear();
      uint32_t b = 0;
      for (uint32_t e : w.ends) {
        piece_splitter(w.text, b, e, w.next_ends).run(p);
        b = e;
      }
      w.ends.swap(w.next_ends);
    }
    uint32_t b = 0;
    for (uint32_t e : w.ends) {
      const uint32_t b0 = w.text.byte_off[b], b1 = w.text.byte_off[e];
      encode_word(s.substr(b0, b1 - b0), w, out);
      b = e;
    }
  }

  void try_merge_candidate(workspace& w, int32_t l, int32_t r) const {
    if (l < 0 || r < 0) return;
    const symbol& a = w.syms[(size_t)l];
    const symbol& b = w.syms[(size_t)r];
    auto it = merges_.find(pair_key(a.id, b.id));
    if (it == merges_.end()) return;
    w.heap.push_back({it->second.rank, l, r, a.id, b.id, it->second.result});
    std::push_heap(w.heap.begin(), w.heap.end());
  }

  void encode_word(std::string_view word, workspace& w, std::vector<int32_t>& out) const {
    if (pre_.ignore_merges) {
      w.mapped.clear();
      for (char c : word) utf8_append(w.mapped, gpt2_byte_to_cpt((uint8_t)c));
      if (int32_t id = lookup(w.mapped); id >= 0) {
        out.push_back(id);
        return;
      }
    }
    const int32_t n = (int32_t)word.size();
    w.syms.resize((size_t)n);
    for (int32_t i = 0; i < n; ++i)
      w.syms[(size_t)i] = {byte_symbol_[(uint8_t)word[(size_t)i]], i - 1, i + 1 < n ? i + 1 : -1, (uint32_t)i, 1};
    w.heap.clear();
    for (int32_t i = 1; i < n; ++i) try_merge_candidate(w, i - 1, i);
    while (!w.heap.empty()) {
      std::pop_heap(w.heap.begin(), w.heap.end());
      const candidate c = w.heap.back();
      w.heap.pop_back();
      symbol& a = w.syms[(size_t)c.left];
      symbol& b = w.syms[(size_t)c.right];
      // Stale: one side was merged away or grew since the candidate was queued.
      if (a.len == 0 || b.len == 0 || a.next != c.right || a.id != c.left_id || b.id != c.right_id) continue;
      a.id = c.result;
      a.len += b.len;
      b.len = 0;
      a.next = b.next;
      if (b.next >= 0) w.syms[(size_t)b.next].prev = c.left;
      try_merge_candidate(w, a.prev, c.left);
      try_merge_candidate(w, c.left, a.next);
    }
    for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = w.syms[(size_t)i].next) {
      const symbol& s = w.syms[(size_t)i];
      if (s.id < n_vocab()) {
        out.push_back(s.id);
        continue;
      }
      // A merge produced a string the vocabulary lacks: spell it byte by byte.
      for (uint32_t k = s.start; k < s.start + s.len; ++k) {
        const int32_t t = byte_token_[(uint8_t)word[k]];
        if (t >= 0) out.push_back(t);
      }
    }
  }

  pre_tokenizer pre_;
  std::unordered_map<uint64_t, merge_rule> merges_;  // (left symbol, right symbol) -> rule
  std::array<int32_t, 256> byte_symbol_{};            // symbol of each single byte
  std::array<int32_t, 256> byte_token_{};             // token of each single byte, -1 if none
  std::vector<std::string> pieces_;                   // [n_vocab] bytes each normal token stands for
};

}  // namespace

std::unique_ptr<tokenizer> make_bpe_tokenizer(const tokenizer_vocab& vocab) {
  return std::make_unique<bpe_tokenizer>(vocab);
}

}  // namespace xctx::tokenizer_detail
