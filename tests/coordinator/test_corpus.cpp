#include <zlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.h"
#include "model/corpus.h"
#include "test_util.h"

namespace xctx {
namespace {

namespace fs = std::filesystem;

#define XCTX_REQUIRE_AUSTEN()                                                                  \
  if (!fs::exists(std::string(kAustenDataDir) + "/Rdata.rdb")) {                               \
    if (std::getenv("CI")) FAIL() << "r-cran-janeaustenr missing under CI: " << kAustenDataDir; \
    GTEST_SKIP() << "r-cran-janeaustenr not installed (run launch/install-deps): " << kAustenDataDir; \
  }

// ---- building small lazy-load databases -----------------------------------------------------

void put_i32(std::string& s, int32_t v) {
  const uint32_t u = (uint32_t)v;
  s += (char)(u >> 24);
  s += (char)(u >> 16);
  s += (char)(u >> 8);
  s += (char)u;
}
void put_charsxp(std::string& s, const std::string& text) {
  put_i32(s, 0x00040009);  // CHARSXP, UTF-8 flag
  put_i32(s, (int32_t)text.size());
  s += text;
}
std::string header(int version) {
  std::string s = "X\n";
  put_i32(s, version);
  put_i32(s, 0x00040201);
  put_i32(s, 0x00030500);
  if (version == 3) {
    put_i32(s, 5);
    s += "UTF-8";
  }
  return s;
}
// A STRSXP of lines; an empty optional line is NA.
std::string serialize_lines(const std::vector<const char*>& lines, int version) {
  std::string s = header(version);
  put_i32(s, 16);
  put_i32(s, (int32_t)lines.size());
  for (const char* l : lines) {
    if (l) {
      put_charsxp(s, l);
    } else {
      put_i32(s, 0x00000009);
      put_i32(s, -1);
    }
  }
  return s;
}
// The index: list(variables = list(<name> = c(off, len)), references = list()).
std::string serialize_index(const std::string& name, int32_t off, int32_t len, int version) {
  std::string s = header(version);
  put_i32(s, 0x213);  // VECSXP with attributes
  put_i32(s, 2);
  put_i32(s, 0x213);  // variables
  put_i32(s, 1);
  put_i32(s, 13);
  put_i32(s, 2);
  put_i32(s, off);
  put_i32(s, len);
  put_i32(s, 0x402);  // attribute pairlist, tagged
  put_i32(s, 1);      // SYMSXP "names"
  put_charsxp(s, "names");
  put_i32(s, 16);
  put_i32(s, 1);
  put_charsxp(s, name);
  put_i32(s, 254);
  put_i32(s, 19);  // references: empty list
  put_i32(s, 0);
  put_i32(s, 0x402);
  put_i32(s, 0x1FF);  // REFSXP to symbol 1 ("names")
  put_i32(s, 16);
  put_i32(s, 2);
  put_charsxp(s, "variables");
  put_charsxp(s, "references");
  put_i32(s, 254);
  return s;
}
std::string zlib_compress(const std::string& in, int window_bits) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 6, Z_DEFLATED, window_bits, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, in.size()) + 32, '\0');
  zs.next_in = (Bytef*)in.data();
  zs.avail_in = (uInt)in.size();
  zs.next_out = (Bytef*)out.data();
  zs.avail_out = (uInt)out.size();
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}
void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), (std::streamsize)bytes.size());
}

struct fake_db {
  std::string rdx;  // uncompressed serialization
  std::string rdb;  // record bytes
};
fake_db make_db(const std::vector<const char*>& lines, int version) {
  const std::string ser = serialize_lines(lines, version);
  std::string rec;
  put_i32(rec, (int32_t)ser.size());
  rec += zlib_compress(ser, 15);
  return {serialize_index("book", 0, (int32_t)rec.size(), version), rec};
}
void write_db(const fs::path& dir, const fake_db& db) {
  write_file(dir / "Rdata.rdx", zlib_compress(db.rdx, 15 + 16));  // gzip, as R writes it
  write_file(dir / "Rdata.rdb", db.rdb);
}
// The message of the xctx::Error the reader throws, or "" if it does not throw.
std::string read_error(const fs::path& dir) {
  try {
    read_austen_novels(dir.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// ---- the real corpus ------------------------------------------------------------------------

TEST(austen_corpus, reads_six_novels) {
  XCTX_REQUIRE_AUSTEN();
  const auto novels = read_austen_novels();
  ASSERT_EQ(novels.size(), 6u);
  const std::vector<std::string> names = {"emma",       "mansfieldpark",  "northangerabbey",
                                          "persuasion", "prideprejudice", "sensesensibility"};
  for (size_t i = 0; i < novels.size(); ++i) {
    EXPECT_EQ(novels[i].first, names[i]);
    EXPECT_GT(novels[i].second.size(), 400000u) << names[i];  // every novel is > 400 KB of text
  }
  const std::string& pp = novels[4].second;
  EXPECT_EQ(pp.rfind("PRIDE AND PREJUDICE", 0), 0u) << pp.substr(0, 60);
  EXPECT_NE(pp.find("It is a truth universally acknowledged"), std::string::npos);
}

// ---- small files ----------------------------------------------------------------------------

class corpus_version : public testing::TestWithParam<int> {};

TEST_P(corpus_version, reads_written_database) {
  const fs::path dir = test::scratch_dir();
  write_db(dir, make_db({"Line one.", nullptr, "Line three."}, GetParam()));
  const auto out = read_austen_novels(dir.string());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].first, "book");
  EXPECT_EQ(out[0].second, "Line one.\n\nLine three.");  // NA line joins as empty
}
INSTANTIATE_TEST_SUITE_P(xdr, corpus_version, testing::Values(2, 3),
                         [](const auto& info) { return "version" + std::to_string(info.param); });

TEST(austen_corpus, missing_directory_names_the_package) {
  const std::string msg = read_error("/nonexistent/janeaustenr/data");
  EXPECT_NE(msg.find("r-cran-janeaustenr"), std::string::npos) << msg;
}

TEST(austen_corpus, truncated_rdb_record) {
  const fs::path dir = test::scratch_dir();
  fake_db db = make_db({"Some text that is long enough to compress."}, 3);
  write_db(dir, db);
  write_file(dir / "Rdata.rdb", db.rdb.substr(0, db.rdb.size() - 5));
  const std::string msg = read_error(dir);
  EXPECT_NE(msg.find("Rdata.rdb"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(austen_corpus, truncated_zlib_stream_in_record) {
  // The index agrees with the short file, so the cut shows up inside the zlib stream.
  const fs::path dir = test::scratch_dir();
  fake_db db = make_db({"Some text that is long enough to compress, and then some more of it."}, 3);
  db.rdb.resize(db.rdb.size() - 10);
  db.rdx = serialize_index("book", 0, (int32_t)db.rdb.size(), 3);
  write_db(dir, db);
  const std::string msg = read_error(dir);
  EXPECT_NE(msg.find("record 'book'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(austen_corpus, bad_zlib_in_record) {
  const fs::path dir = test::scratch_dir();
  fake_db db = make_db({"Some text."}, 3);
  for (size_t i = 6; i < db.rdb.size(); ++i) db.rdb[i] = (char)0xA5;  // keep length + zlib header
  write_db(dir, db);
  const std::string msg = read_error(dir);
  EXPECT_NE(msg.find("record 'book'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("corrupt compressed data"), std::string::npos) << msg;
}

TEST(austen_corpus, bad_serialization_magic) {
  const fs::path dir = test::scratch_dir();
  fake_db db = make_db({"Some text."}, 2);
  db.rdx[0] = 'A';  // "A\n" is the ASCII format, which the reader does not take
  write_db(dir, db);
  const std::string msg = read_error(dir);
  EXPECT_NE(msg.find("Rdata.rdx"), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic"), std::string::npos) << msg;
}

TEST(austen_corpus, record_outside_the_file) {
  const fs::path dir = test::scratch_dir();
  fake_db db = make_db({"Some text."}, 3);
  db.rdx = serialize_index("book", 0, (int32_t)db.rdb.size() + 100, 3);
  write_db(dir, db);
  const std::string msg = read_error(dir);
  EXPECT_NE(msg.find("outside"), std::string::npos) << msg;
}

TEST(austen_corpus, truncated_serialization) {
  const fs::path dir = test::scratch_dir();
  fake_db db = make_db({"Some text."}, 3);
  db.rdx.resize(db.rdx.size() - 12);  // cut inside the names vector
  write_db(dir, db);
  const std::string msg = read_error(dir);
  EXPECT_NE(msg.find("Rdata.rdx"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(austen_corpus, huge_declared_length_is_rejected) {
  const fs::path dir = test::scratch_dir();
  std::string ser = header(3);
  put_i32(ser, 16);
  put_i32(ser, 0x7FFFFFFF);  // two billion strings in a few bytes
  std::string rec;
  put_i32(rec, (int32_t)ser.size());
  rec += zlib_compress(ser, 15);
  write_db(dir, {serialize_index("book", 0, (int32_t)rec.size(), 3), rec});
  const std::string msg = read_error(dir);
  EXPECT_NE(msg.find("exceeds"), std::string::npos) << msg;
}

}  // namespace
}  // namespace xctx

namespace xctx {
namespace {

TEST(kjv_text, a_book_reads_as_verse_text) {
  if (std::system("command -v bible >/dev/null 2>&1") != 0) {
    if (std::getenv("CI")) FAIL() << "bible-kjv is not installed under CI";
    GTEST_SKIP() << "bible-kjv not installed (launch/install-deps)";
  }
  const std::string jude = load_text("kjv:Jude");
  EXPECT_EQ(jude.rfind("Jude, the servant of Jesus Christ", 0), 0u) << jude.substr(0, 80);
  EXPECT_NE(jude.find("Now unto him that is able to keep you from falling"), std::string::npos);
  EXPECT_EQ(jude.find("Jude 1\n"), std::string::npos);  // no chapter headers
  int lines = 0;
  for (char c : jude) lines += c == '\n';
  EXPECT_EQ(lines, 25);  // Jude has 25 verses
  EXPECT_THROW(load_text("kjv:Hezekiah"), Error);
  EXPECT_THROW(load_text("kjv:Luke;rm"), Error);
}

}  // namespace
}  // namespace xctx
