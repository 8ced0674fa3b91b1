#include <cctype>
#include "model/corpus.h"

#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "common/error.h"
#include "common/sys.h"

namespace xctx {
namespace {

// R SEXPTYPE codes that occur in data files (the rest are rejected by name).
enum : int {
  r_symsxp = 1,
  r_listsxp = 2,
  r_charsxp = 9,
  r_lglsxp = 10,
  r_intsxp = 13,
  r_realsxp = 14,
  r_strsxp = 16,
  r_vecsxp = 19,
  r_nilvalue = 254,
  r_refsxp = 255,
};
constexpr int kFlagHasAttr = 1 << 9;
constexpr int kFlagHasTag = 1 << 10;
// Nesting depth a data index or a character vector ever needs; bounds recursion on bad input.
constexpr int kMaxDepth = 64;

// The subset of an R object a data file needs.
struct r_value {
  int kind = r_nilvalue;
  std::vector<int32_t> ints;                       // INTSXP, LGLSXP
  std::vector<double> reals;                       // REALSXP
  std::vector<std::optional<std::string>> strings; // STRSXP (nullopt = NA)
  std::vector<r_value> items;                      // VECSXP; LISTSXP values
  std::vector<std::string> tags;                   // LISTSXP tags, parallel to items
  std::vector<std::string> names;                  // the "names" attribute, if any
  std::string symbol;                              // SYMSXP
};

// Big-endian reader over one serialization; every read is bounds-checked.
class xdr_reader {
 public:
  xdr_reader(const std::string& buf, std::string what) : b_(buf), what_(std::move(what)) {}

  int32_t i32() {
    need(4, "integer");
    const auto* p = reinterpret_cast<const uint8_t*>(b_.data() + i_);
    i_ += 4;
    return (int32_t)((uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3]);
  }
  double f64() {
    need(8, "double");
    uint64_t u = 0;
    for (int k = 0; k < 8; ++k) u = u << 8 | (uint8_t)b_[i_ + k];
    i_ += 8;
    double d;
    std::memcpy(&d, &u, sizeof d);
    return d;
  }
  std::string bytes(size_t n, const char* item) {
    need(n, item);
    std::string s = b_.substr(i_, n);
    i_ += n;
    return s;
  }
  // A vector length; R writes -1 then two words for lengths past 2^31-1. Checked against the
  // bytes left so a corrupt length cannot allocate gigabytes.
  size_t length(size_t min_bytes_each, const char* item) {
    int64_t n = i32();
    if (n == -1) {
      const int64_t hi = (uint32_t)i32(), lo = (uint32_t)i32();
      n = hi << 32 | lo;
    }
    XCTX_CHECK(n >= 0, what_, ": negative ", item, " length ", n, " at byte ", i_);
    XCTX_CHECK((uint64_t)n * min_bytes_each <= remaining(), what_, ": ", item, " length ", n, " at byte ", i_,
               " exceeds the ", remaining(), " bytes left (truncated or corrupt)");
    return (size_t)n;
  }
  size_t remaining() const { return b_.size() - i_; }
  size_t pos() const { return i_; }
  const std::string& what() const { return what_; }

 private:
  void need(size_t n, const char* item) {
    XCTX_CHECK(n <= remaining(), what_, ": truncated: ", item, " of ", n, " bytes at byte ", i_, " but only ",
               remaining(), " left");
  }
  const std::string& b_;
  std::string what_;
  size_t i_ = 0;
};

class r_unserializer {
 public:
  r_unserializer(const std::string& buf, const std::string& what) : r_(buf, what) {}

  r_value read() {
    XCTX_CHECK(r_.remaining() >= 2 && r_.bytes(2, "format") == "X\n", r_.what(),
               ": not an XDR R serialization (expected \"X\\n\" magic)");
    const int32_t version = r_.i32();
    XCTX_CHECK(version == 2 || version == 3, r_.what(), ": unsupported R serialization version ", version,
               " (2 or 3)");
    r_.i32();  // R version that wrote it
    r_.i32();  // oldest R version that can read it
    if (version == 3) r_.bytes(r_.length(1, "encoding name"), "encoding name");
    return item(0);
  }

 private:
  std::optional<std::string> charsxp(int flags) {
    XCTX_CHECK((flags & 0xFF) == r_charsxp, r_.what(), ": expected a CHARSXP at byte ", r_.pos(), ", found R type ",
               flags & 0xFF);
    const int32_t n = r_.i32();
    if (n == -1) return std::nullopt;  // NA_STRING
    XCTX_CHECK(n >= 0, r_.what(), ": bad string length ", n, " at byte ", r_.pos());
    return r_.bytes((size_t)n, "string");
  }

  std::string symbol_name(int depth) {
    r_value v = item(depth + 1);
    XCTX_CHECK(v.kind == r_symsxp, r_.what(), ": a tag is R type ", v.kind, ", not a symbol, at byte ", r_.pos());
    return v.symbol;
  }

  // Pairlist cells after the first flags word: [attr] [tag] car, then the next cell's flags.
  void pairlist(int flags, r_value& out, int depth) {
    out.kind = r_listsxp;
    while (true) {
      if (flags & kFlagHasAttr) item(depth + 1);  // cell attributes: not needed
      out.tags.push_back((flags & kFlagHasTag) ? symbol_name(depth) : std::string());
      out.items.push_back(item(depth + 1));
      flags = r_.i32();
      if ((flags & 0xFF) == r_nilvalue) return;
      XCTX_CHECK((flags & 0xFF) == r_listsxp, r_.what(), ": pairlist continues with R type ", flags & 0xFF,
                 " at byte ", r_.pos());
    }
  }

  r_value item(int depth) {
    XCTX_CHECK(depth < kMaxDepth, r_.what(), ": objects nested deeper than ", kMaxDepth, " (corrupt?)");
    const int flags = r_.i32();
    const int kind = flags & 0xFF;
    r_value v;
    v.kind = kind;
    switch (kind) {
      case r_nilvalue:
        return v;
      case r_refsxp: {
        // Index into the table of symbols seen so far, 1-based; 0 means a word follows.
        int32_t idx = flags >> 8;
        if (idx == 0) idx = r_.i32();
        XCTX_CHECK(idx >= 1 && (size_t)idx <= refs_.size(), r_.what(), ": reference ", idx, " to an unseen object (",
                   refs_.size(), " seen) at byte ", r_.pos());
        v.kind = r_symsxp;
        v.symbol = refs_[idx - 1];
        return v;
      }
      case r_symsxp: {
        std::optional<std::string> s = charsxp(r_.i32());
        XCTX_CHECK(s.has_value(), r_.what(), ": NA symbol name at byte ", r_.pos());
        v.symbol = *s;
        refs_.push_back(v.symbol);
        return v;
      }
      case r_listsxp:
        pairlist(flags, v, depth);
        return v;
      case r_charsxp: {
        // A bare CHARSXP (flags already consumed): re-read its length here.
        const int32_t n = r_.i32();
        if (n >= 0) v.strings.push_back(r_.bytes((size_t)n, "string"));
        else v.strings.push_back(std::nullopt);
        return v;
      }
      case r_lglsxp:
      case r_intsxp: {
        v.ints.resize(r_.length(4, "integer vector"));
        for (auto& x : v.ints) x = r_.i32();
        break;
      }
      case r_realsxp: {
        v.reals.resize(r_.length(8, "double vector"));
        for (auto& x : v.reals) x = r_.f64();
        break;
      }
      case r_strsxp: {
        const size_t n = r_.length(8, "character vector");  // each element: flags + length
        v.strings.reserve(n);
        for (size_t i = 0; i < n; ++i) v.strings.push_back(charsxp(r_.i32()));
        break;
      }
      case r_vecsxp: {
        const size_t n = r_.length(4, "list");
        v.items.reserve(n);
        for (size_t i = 0; i < n; ++i) v.items.push_back(item(depth + 1));
        break;
      }
      default:
        fail(r_.what(), ": unsupported R type ", kind, " at byte ", r_.pos(),
             " (a data file holds vectors, lists and strings)");
    }
    if (flags & kFlagHasAttr) {
      r_value attrs = item(depth + 1);
      XCTX_CHECK(attrs.kind == r_listsxp, r_.what(), ": attributes are R type ", attrs.kind, ", not a pairlist");
      for (size_t i = 0; i < attrs.items.size(); ++i) {
        if (attrs.tags[i] != "names") continue;
        const r_value& nm = attrs.items[i];
        XCTX_CHECK(nm.kind == r_strsxp, r_.what(), ": names attribute is R type ", nm.kind);
        for (const auto& s : nm.strings) v.names.push_back(s.value_or(""));
      }
    }
    return v;
  }

  xdr_reader r_;
  std::vector<std::string> refs_;
};

r_value unserialize(const std::string& buf, const std::string& what) { return r_unserializer(buf, what).read(); }

}  // namespace

std::string inflate_stream(const uint8_t* data, size_t size, const std::string& what, int64_t expected_size,
                           size_t max_size) {
  z_stream zs{};
  // 15 + 32: the largest window, with gzip or zlib header detected automatically.
  XCTX_CHECK(inflateInit2(&zs, 15 + 32) == Z_OK, what, ": zlib init failed");
  std::string out;
  if (expected_size >= 0) {
    XCTX_CHECK((uint64_t)expected_size <= max_size, what, ": declared size ", expected_size, " exceeds the limit ",
               max_size);
    out.reserve((size_t)expected_size);
  }
  zs.next_in = const_cast<Bytef*>(data);
  zs.avail_in = (uInt)size;
  XCTX_ASSERT(size <= UINT32_MAX, "input too large for one inflate call");
  char chunk[1 << 16];
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    zs.next_out = reinterpret_cast<Bytef*>(chunk);
    zs.avail_out = sizeof chunk;
    rc = inflate(&zs, Z_NO_FLUSH);
    if (rc != Z_OK && rc != Z_STREAM_END) {
      const std::string msg = zs.msg ? zs.msg : (rc == Z_BUF_ERROR ? "stream truncated" : "inflate error");
      inflateEnd(&zs);
      fail(what, ": corrupt compressed data (zlib: ", msg, ")");
    }
    out.append(chunk, sizeof chunk - zs.avail_out);
    if (out.size() > max_size) {
      inflateEnd(&zs);
      fail(what, ": inflates past ", max_size, " bytes (corrupt?)");
    }
    if (rc == Z_OK && zs.avail_in == 0 && zs.avail_out != 0) {
      inflateEnd(&zs);
      fail(what, ": compressed stream truncated after ", size, " bytes");
    }
  }
  inflateEnd(&zs);
  XCTX_CHECK(expected_size < 0 || (int64_t)out.size() == expected_size, what, ": inflated to ", out.size(),
             " bytes, the record header says ", expected_size);
  return out;
}

std::vector<std::pair<std::string, std::string>> read_austen_novels(const std::string& dir) {
  namespace fs = std::filesystem;
  XCTX_CHECK(fs::is_directory(dir), "Jane Austen corpus not found at ", dir,
             ": install Debian's r-cran-janeaustenr (launch/install-deps does)");
  const std::string rdx_path = dir + "/Rdata.rdx", rdb_path = dir + "/Rdata.rdb";
  const std::string rdx_raw = read_file_bytes(rdx_path);
  const std::string rdx = inflate_stream(reinterpret_cast<const uint8_t*>(rdx_raw.data()), rdx_raw.size(), rdx_path);
  const r_value index = unserialize(rdx, rdx_path);
  XCTX_CHECK(index.kind == r_vecsxp && !index.items.empty(), rdx_path,
             ": the index is not a list (R type ", index.kind, ")");
  const r_value& vars = index.items[0];  // "variables"
  XCTX_CHECK(vars.kind == r_vecsxp && vars.names.size() == vars.items.size(), rdx_path,
             ": the variables entry is not a named list");

  const std::string rdb = read_file_bytes(rdb_path);
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t v = 0; v < vars.items.size(); ++v) {
    const std::string& name = vars.names[v];
    const r_value& loc = vars.items[v];
    XCTX_CHECK(loc.kind == r_intsxp && loc.ints.size() == 2, rdx_path, ": variable '", name,
               "' has no (offset, length) pair");
    const int64_t off = loc.ints[0], len = loc.ints[1];
    XCTX_CHECK(off >= 0 && len >= 4 && (uint64_t)(off + len) <= rdb.size(), rdb_path, ": record of '", name,
               "' at offset ", off, " length ", len, " lies outside the ", rdb.size(), "-byte file (truncated?)");
    const auto* rec = reinterpret_cast<const uint8_t*>(rdb.data() + off);
    const int64_t raw_size = (int64_t)((uint32_t)rec[0] << 24 | (uint32_t)rec[1] << 16 | (uint32_t)rec[2] << 8 | rec[3]);
    const std::string what = rdb_path + " record '" + name + "'";
    const std::string ser = inflate_stream(rec + 4, (size_t)len - 4, what, raw_size);
    const r_value obj = unserialize(ser, what);
    if (obj.kind != r_strsxp) continue;  // only character vectors are text
    std::string text;
    for (size_t i = 0; i < obj.strings.size(); ++i) {
      if (i) text += '\n';
      if (obj.strings[i]) text += *obj.strings[i];
    }
    out.emplace_back(name, std::move(text));
  }
  XCTX_CHECK(!out.empty(), rdx_path, ": no character vectors in the database");
  return out;
}

// The King James Bible of Debian's bible-kjv, through the package's own reader (`bible`, which
// decodes its compressed /usr/lib/bible.data): "BOOK1:1-999:999" prints a whole book as
// "Book N" chapter headers and "  N text" verse lines; we keep the verse text only.
std::string read_kjv_book(const std::string& book) {
  XCTX_CHECK(!book.empty() && book.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789") ==
                                  std::string::npos,
             "kjv: book name '", book, "' must be letters and digits (e.g. Genesis, Luke, 1Kings)");
  const std::string cmd = "bible -l0 '" + book + "1:1-999:999' 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  XCTX_CHECK(p != nullptr, "kjv: cannot run `bible` (install the bible-kjv package: launch/install-deps)");
  std::string out, line, text, header;
  char buf[4096];
  while (fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = pclose(p);
  XCTX_CHECK(rc == 0, "kjv: `bible` failed (exit ", rc, "); install bible-kjv (launch/install-deps)");
  std::istringstream in(out);
  int verses = 0;
  while (std::getline(in, line)) {
    if (line.rfind("Bad ", 0) == 0) fail("kjv: unknown book '", book, "' (", line, ")");
    // Verse lines are indented ("  12 text"); chapter headers and blank lines are not verses.
    const size_t i = line.find_first_not_of(' ');
    if (i == 0 && header.empty()) {  // "Hebrews 1": `bible` resolves prefixes, so check its pick
      header = line.substr(0, line.rfind(' '));
      std::string a, b;
      for (char c : header)
        if (c != ' ') a += (char)std::tolower((unsigned char)c);
      for (char c : book) b += (char)std::tolower((unsigned char)c);
      XCTX_CHECK(a.rfind(b, 0) == 0, "kjv: unknown book '", book, "' (`bible` matched it to ", header, ")");
    }
    if (i == 0 || i == std::string::npos || !std::isdigit((unsigned char)line[i])) continue;
    const size_t num_end = line.find(' ', i);
    if (num_end == std::string::npos) continue;
    text += line.substr(num_end + 1);
    text += '\n';
    ++verses;
  }
  XCTX_CHECK(verses > 0, "kjv: no verses read for '", book, "' (is bible-kjv installed?)");
  return text;
}

std::string load_text(const std::string& source) {
  const std::string prefix = "austen:";
  if (source.rfind("kjv:", 0) == 0) {
    std::string out, want = source.substr(4);
    size_t at = 0;
    while (at <= want.size()) {
      const size_t comma = want.find(',', at);
      const std::string book = want.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      out += (out.empty() ? "" : "\n") + read_kjv_book(book);
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
    return out;
  }
  if (source.rfind(prefix, 0) != 0) {
    std::string t = read_file_bytes(source);
    XCTX_CHECK(!t.empty(), "text file ", source, " is empty");
    return t;
  }
  const auto novels = read_austen_novels();
  std::string want = source.substr(prefix.size()), out, known;
  for (const auto& [name, text] : novels) known += (known.empty() ? "" : ", ") + name;
  size_t at = 0;
  while (at <= want.size()) {
    const size_t comma = want.find(',', at);
    const std::string name = want.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
    bool found = false;
    for (const auto& [n, text] : novels)
      if (name == "all" || name == n) {
        out += (out.empty() ? "" : "\n\n") + text;
        found = true;
      }
    XCTX_CHECK(found, "unknown Austen novel '", name, "' in ", source, " (known: ", known, ", or all)");
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

}  // namespace xctx
