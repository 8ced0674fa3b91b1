#include "model/unicode.h"

#include <algorithm>
#include <array>
#include <vector>

namespace xctx {

namespace {

using unicode_detail::k_ucat_ranges;
using unicode_detail::k_ucat_ranges_size;

// White_Space from the UCD's PropList.txt (unchanged since Unicode 6.1). Python's str.isspace
// also counts U+001C..U+001F, which regex engines' \s (and llama.cpp) do not.
constexpr std::array<std::pair<uint32_t, uint32_t>, 10> k_whitespace = {{
    {0x0009, 0x000D}, {0x0020, 0x0020}, {0x0085, 0x0085}, {0x00A0, 0x00A0}, {0x1680, 0x1680},
    {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
}};

ucat category_by_search(uint32_t cpt) {
  const auto* end = k_ucat_ranges + k_ucat_ranges_size;
  const auto* it = std::upper_bound(k_ucat_ranges, end, cpt,
                                    [](uint32_t c, const unicode_detail::ucat_range& r) { return c < r.first; });
  if (it == k_ucat_ranges) return ucat::ucat_undefined;
  --it;
  return cpt <= it->last ? it->cat : ucat::ucat_undefined;
}

uint8_t category_flag(ucat c) {
  switch (c) {
    case ucat::ucat_undefined: return 0;
    case ucat::ucat_letter: return uflag_letter;
    case ucat::ucat_mark: return uflag_mark;
    case ucat::ucat_number: return uflag_number;
    case ucat::ucat_punctuation: return uflag_punctuation;
    case ucat::ucat_symbol: return uflag_symbol;
    case ucat::ucat_separator: return uflag_separator;
    case ucat::ucat_control: return uflag_control;
  }
  return 0;
}

bool whitespace_by_search(uint32_t cpt) {
  for (const auto& [lo, hi] : k_whitespace)
    if (cpt >= lo && cpt <= hi) return true;
  return false;
}

// The Basic Multilingual Plane holds nearly all text, so its flags are one table lookup; the
// table is built once (thread-safe static init) and never written afterwards.
constexpr uint32_t k_bmp = 0x10000;
const std::vector<uint8_t>& bmp_flags() {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(k_bmp, 0);
    for (size_t i = 0; i < k_ucat_ranges_size; ++i) {
      const auto& r = k_ucat_ranges[i];
      if (r.first >= k_bmp) break;
      const uint8_t f = category_flag(r.cat);
      for (uint32_t c = r.first; c <= std::min<uint32_t>(r.last, k_bmp - 1); ++c) t[c] = f;
    }
    for (const auto& [lo, hi] : k_whitespace)
      for (uint32_t c = lo; c <= hi; ++c) t[c] |= uflag_whitespace;
    return t;
  }();
  return table;
}

struct gpt2_tables {
  std::array<uint32_t, 256> byte_to_cpt{};
  std::array<int16_t, 324> cpt_to_byte{};  // every mapped code point is < 256 + 68
};

const gpt2_tables& gpt2() {
  static const gpt2_tables t = [] {
    gpt2_tables g;
    g.cpt_to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      g.byte_to_cpt[b] = printable ? (uint32_t)b : next++;
      g.cpt_to_byte[g.byte_to_cpt[b]] = (int16_t)b;
    }
    return g;
  }();
  return t;
}

}  // namespace

ucat unicode_category(uint32_t cpt) { return category_by_search(cpt); }

bool unicode_is_whitespace(uint32_t cpt) { return cpt < k_bmp ? (bmp_flags()[cpt] & uflag_whitespace) != 0 : false; }

uint8_t unicode_flags(uint32_t cpt) {
  if (cpt < k_bmp) return bmp_flags()[cpt];
  return (uint8_t)(category_flag(category_by_search(cpt)) | (whitespace_by_search(cpt) ? uflag_whitespace : 0));
}

const char* unicode_version() { return unicode_detail::k_unicode_version; }

uint32_t utf8_decode(std::string_view s, size_t& pos) {
  const auto lead = (uint8_t)s[pos];
  const size_t n = utf8_seq_len(lead);
  if (n == 1) {
    ++pos;
    // A stray continuation byte or an invalid lead (F8..FF) is not a code point.
    return lead < 0x80 ? lead : k_invalid_byte_base + lead;
  }
  if (pos + n > s.size()) {
    ++pos;
    return k_invalid_byte_base + lead;
  }
  uint32_t cpt = lead & (0x7F >> n);
  for (size_t i = 1; i < n; ++i) {
    const auto b = (uint8_t)s[pos + i];
    if ((b & 0xC0) != 0x80) {
      ++pos;
      return k_invalid_byte_base + lead;
    }
    cpt = (cpt << 6) | (b & 0x3F);
  }
  if (cpt > 0x10FFFF) {  // F4 90.. and above: past Unicode, and would collide with the byte codes
    ++pos;
    return k_invalid_byte_base + lead;
  }
  pos += n;
  return cpt;
}

void utf8_append(std::string& out, uint32_t cpt) {
  if (cpt < 0x80) {
    out.push_back((char)cpt);
  } else if (cpt < 0x800) {
    out.push_back((char)(0xC0 | (cpt >> 6)));
    out.push_back((char)(0x80 | (cpt & 0x3F)));
  } else if (cpt < 0x10000) {
    out.push_back((char)(0xE0 | (cpt >> 12)));
    out.push_back((char)(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back((char)(0x80 | (cpt & 0x3F)));
  } else if (cpt < k_invalid_byte_base) {
    out.push_back((char)(0xF0 | (cpt >> 18)));
    out.push_back((char)(0x80 | ((cpt >> 12) & 0x3F)));
    out.push_back((char)(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back((char)(0x80 | (cpt & 0x3F)));
  } else {
    out.push_back((char)(uint8_t)(cpt - k_invalid_byte_base));
  }
}

std::string utf8_encode(uint32_t cpt) {
  std::string s;
  utf8_append(s, cpt);
  return s;
}

uint32_t gpt2_byte_to_cpt(uint8_t byte) { return gpt2().byte_to_cpt[byte]; }

int gpt2_cpt_to_byte(uint32_t cpt) {
  const auto& t = gpt2().cpt_to_byte;
  return cpt < t.size() ? t[cpt] : -1;
}

}  // namespace xctx
