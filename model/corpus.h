// Real English prose for long-context tests: Jane Austen's six novels as shipped by Debian's
// r-cran-janeaustenr, read straight from R's lazy-load database without R.
//
// Layout of <dir>/Rdata.rdx / Rdata.rdb (R's lazy-load DB, zlib compression):
//   Rdata.rdx  gzip (or zlib) of one R serialization: a named list whose "variables" element is
//              a named list mapping each object name to an INTSXP (offset, length) into the .rdb.
//   Rdata.rdb  records; each is a 4-byte big-endian uncompressed length + a zlib stream holding
//              one R serialization. A novel is a STRSXP of lines (NA lines count as empty).
//   Serializations are XDR ("X\n"), version 2 or 3 (3 adds the native encoding name).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace xctx {

inline constexpr const char* kAustenDataDir = "/usr/lib/R/site-library/janeaustenr/data";

// (name, text) for every character vector in the database, in index order (for the Debian
// package: emma, mansfieldpark, northangerabbey, persuasion, prideprejudice, sensesensibility);
// lines are joined with '\n'. Throws xctx::Error naming the file and the defect on a missing,
// truncated or corrupt database.
std::vector<std::pair<std::string, std::string>> read_austen_novels(const std::string& dir = kAustenDataDir);

// A text named on the command line: "austen:NAME[,NAME...]" (novels from the database above,
// joined with blank lines; "austen:all" for all six) or a path to a UTF-8 file.
std::string load_text(const std::string& source);

// Exposed for tests: inflates a gzip or zlib stream (auto-detected). `what` names the source in
// errors; `expected_size` >= 0 must match the inflated size exactly. Output capped at `max_size`.
std::string inflate_stream(const uint8_t* data, size_t size, const std::string& what, int64_t expected_size = -1,
                           size_t max_size = size_t(1) << 30);

}  // namespace xctx
