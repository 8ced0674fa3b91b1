// UTF-8 decoding/encoding, Unicode category lookups for the pre-tokenizer matchers, and GPT-2's
// byte <-> code point mapping used by byte-level BPE vocabularies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace xctx {

// General-category major class (the first letter of Lu, Nd, Po, ...). Unassigned code points
// (and anything past U+10FFFF) are ucat_undefined.
enum class ucat : uint8_t {
  ucat_undefined = 0,
  ucat_letter,       // \p{L}
  ucat_mark,         // \p{M}
  ucat_number,       // \p{N}
  ucat_punctuation,  // \p{P}
  ucat_symbol,       // \p{S}
  ucat_separator,    // \p{Z}
  ucat_control,      // Cc, Cf, Cs, Co
};

// Bits of unicode_flags(): one category bit plus the White_Space property (\s).
enum unicode_flag : uint8_t {
  uflag_letter = 1u << 0,
  uflag_mark = 1u << 1,
  uflag_number = 1u << 2,
  uflag_punctuation = 1u << 3,
  uflag_symbol = 1u << 4,
  uflag_separator = 1u << 5,
  uflag_control = 1u << 6,
  uflag_whitespace = 1u << 7,
};

ucat unicode_category(uint32_t cpt);
bool unicode_is_whitespace(uint32_t cpt);  // the Unicode White_Space property
uint8_t unicode_flags(uint32_t cpt);       // category bit | uflag_whitespace; 0 if undefined
const char* unicode_version();             // of the generated tables

// Byte length of the UTF-8 sequence a lead byte announces (1 for stray continuation bytes).
inline size_t utf8_seq_len(uint8_t lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

// Code points that stand for a byte that is not valid UTF-8: U+110000 + byte. They are outside
// Unicode, so their category is undefined, and utf8_append writes the original byte back, which
// keeps byte-level tokenization lossless on arbitrary bytes.
constexpr uint32_t k_invalid_byte_base = 0x110000;

// Decodes the code point at `pos` and advances `pos` past it. A malformed sequence yields
// k_invalid_byte_base + (its first byte) and advances by one byte.
uint32_t utf8_decode(std::string_view s, size_t& pos);
void utf8_append(std::string& out, uint32_t cpt);
std::string utf8_encode(uint32_t cpt);

// GPT-2 byte-level alphabet: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order, so every byte is a visible code point in the vocabulary's strings.
uint32_t gpt2_byte_to_cpt(uint8_t byte);
int gpt2_cpt_to_byte(uint32_t cpt);  // -1 if `cpt` is not in the alphabet

namespace unicode_detail {
struct ucat_range {
  uint32_t first, last;
  ucat cat;
};
extern const ucat_range k_ucat_ranges[];  // sorted, disjoint (model/unicode_tables.cpp)
extern const size_t k_ucat_ranges_size;
extern const char* const k_unicode_version;
}  // namespace unicode_detail

}  // namespace xctx
