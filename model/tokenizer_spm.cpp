// SentencePiece-style BPE (GGUF tokenizer.ggml.model = "llama"), as llama.cpp runs it:
// spaces become U+2581 "▁" (and one is prepended when add_space_prefix), the text starts as one
// symbol per UTF-8 character, and adjacent symbols whose concatenation is a vocabulary piece are
// merged, highest piece score first (ties: leftmost). A final symbol that is not a piece is
// spelled with byte tokens <0xXX>, or <unk> when the vocabulary has none.
#include <algorithm>
#include <array>
#include <cstdio>

#include "common/error.h"
#include "model/tokenizer_impl.h"
#include "model/unicode.h"

namespace xctx::tokenizer_detail {

namespace {

constexpr std::string_view k_space_marker = "\xE2\x96\x81";  // U+2581

// "<0x4A>" -> 0x4A; -1 if the text is not of that form.
int parse_byte_token(const std::string& s) {
  if (s.size() != 6 || s.compare(0, 3, "<0x") != 0 || s[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(s[3]), lo = hex(s[4]);
  return (hi < 0 || lo < 0) ? -1 : hi * 16 + lo;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size() + s.size() / 4);
  size_t start = 0;
  for (size_t hit; (hit = s.find(from, start)) != std::string_view::npos; start = hit + from.size()) {
    out.append(s, start, hit - start);
    out.append(to);
  }
  out.append(s, start);
  return out;
}

class spm_tokenizer final : public tokenizer_base {
 public:
  explicit spm_tokenizer(const tokenizer_vocab& v) : tokenizer_base(v) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      int32_t id = lookup(name);
      // llama.cpp's fallback for vocabularies without byte pieces: the byte as a one-char piece.
      if (id < 0) id = lookup(std::string(1, (char)b));
      byte_token_[(size_t)b] = id;
    }
    const size_t n = vocab_.tokens.size();
    pieces_.resize(n);
    for (size_t id = 0; id < n; ++id) {
      const std::string& text = vocab_.tokens[id];
      switch (vocab_.kinds[id]) {
        case token_kind::token_normal: pieces_[id] = replace_all(text, k_space_marker, " "); break;
        case token_kind::token_byte: {
          const int byte = parse_byte_token(text);
          XCTX_CHECK(byte >= 0, "SentencePiece byte token ", id, " is '", text, "', expected <0xXX>");
          pieces_[id] = std::string(1, (char)byte);
          break;
        }
        case token_kind::token_user_defined: pieces_[id] = text; break;
        case token_kind::token_unknown:
        case token_kind::token_control:
        case token_kind::token_unused: break;
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
    // The space prefix goes before the text at the start and after every special token, since
    // SentencePiece saw each such stretch as the start of a text.
    bool after_special = true;
    for (const text_fragment& f : split_special(text, parse_special)) {
      if (f.special_id >= 0) {
        out.push_back(f.special_id);
        after_special = true;
        continue;
      }
      std::string s;
      if (vocab_.add_space_prefix && after_special) s = " ";
      s.append(f.text);
      encode_text(replace_all(s, " ", k_space_marker), w, out);
      after_special = false;
    }
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids, bool render_special) const override {
    std::string s;
    bool first_text = true;
    for (int32_t id : ids) {
      std::string piece = token_piece(id, render_special);
      if (piece.empty()) continue;
      // Undo the space prefix encode added in front of the text.
      if (first_text && vocab_.add_space_prefix && kind(id) == token_kind::token_normal && piece[0] == ' ')
        piece.erase(0, 1);
      first_text = false;
      s += piece;
    }
    return s;
  }

  std::string token_piece(int32_t id, bool render_special) const override {
    check_id(id);
    const token_kind k = kind(id);
    if (k == token_kind::token_control || k == token_kind::token_unknown)
      return render_special ? vocab_.tokens[(size_t)id] : std::string();
    return pieces_[(size_t)id];
  }

 private:
  struct symbol {
    int32_t prev, next;   // neighbours, -1 at the ends
    uint32_t start, len;  // bytes covered; len 0 once merged into the left neighbour
  };
  struct candidate {
    float score;
    int32_t left, right;
    uint32_t len;  // bytes of the merged piece, to recognise stale candidates
    // The heap's top is the greatest: the highest score, then the leftmost.
    bool operator<(const candidate& o) const { return score != o.score ? score < o.score : left > o.left; }
  };
  struct workspace {
    std::vector<symbol> syms;
    std::vector<candidate> heap;
  };

  float score(int32_t id) const { return vocab_.scores.empty() ? 0.0f : vocab_.scores[(size_t)id]; }

  void try_merge_candidate(std::string_view text, workspace& w, int32_t l, int32_t r) const {
    if (l < 0 || r < 0) return;
    const symbol& a = w.syms[(size_t)l];
    const symbol& b = w.syms[(size_t)r];
    const int32_t id = lookup(text.substr(a.start, a.len + b.len));
    if (id < 0) return;
    w.heap.push_back({score(id), l, r, a.len + b.len});
    std::push_heap(w.heap.begin(), w.heap.end());
  }

  void encode_text(std::string_view text, workspace& w, std::vector<int32_t>& out) const {
    w.syms.clear();
    for (size_t pos = 0; pos < text.size();) {
      const uint32_t len = (uint32_t)std::min(utf8_seq_len((uint8_t)text[pos]), text.size() - pos);
      const auto i = (int32_t)w.syms.size();
      w.syms.push_back({i - 1, pos + len < text.size() ? i + 1 : -1, (uint32_t)pos, len});
      pos += len;
    }
    w.heap.clear();
    for (int32_t i = 1; i < (int32_t)w.syms.size(); ++i) try_merge_candidate(text, w, i - 1, i);
    while (!w.heap.empty()) {
      std::pop_heap(w.heap.begin(), w.heap.end());
      const candidate c = w.heap.back();
      w.heap.pop_back();
      symbol& a = w.syms[(size_t)c.left];
      symbol& b = w.syms[(size_t)c.right];
      if (a.len == 0 || b.len == 0 || a.len + b.len != c.len) continue;  // stale
      a.len += b.len;
      b.len = 0;
      a.next = b.next;
      if (b.next >= 0) w.syms[(size_t)b.next].prev = c.left;
      try_merge_candidate(text, w, a.prev, c.left);
      try_merge_candidate(text, w, c.left, a.next);
    }
    for (int32_t i = w.syms.empty() ? -1 : 0; i >= 0; i = w.syms[(size_t)i].next) {
      const symbol& s = w.syms[(size_t)i];
      const std::string_view piece = text.substr(s.start, s.len);
      if (int32_t id = lookup(piece); id >= 0) {
        out.push_back(id);
        continue;
      }
      for (char c : piece) {
        int32_t id = byte_token_[(uint8_t)c];
        if (id < 0) id = vocab_.unk_id;
        XCTX_CHECK(id >= 0, "SentencePiece vocabulary has neither a byte token for 0x", std::hex, (int)(uint8_t)c,
                   " nor an <unk> token");
        out.push_back(id);
      }
    }
  }

  std::array<int32_t, 256> byte_token_{};  // <0xXX> token of each byte, -1 if none
  std::vector<std::string> pieces_;        // [n_vocab] text each token decodes to
};

}  // namespace

std::unique_ptr<tokenizer> make_spm_tokenizer(const tokenizer_vocab& vocab) {
  return std::make_unique<spm_tokenizer>(vocab);
}

}  // namespace xctx::tokenizer_detail
