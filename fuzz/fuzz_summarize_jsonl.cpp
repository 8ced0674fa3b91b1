// The JSONL batch input of `xctx summarize` and of the service's batch jobs
// (coordinator/jobs/summarize.cpp, parse_summary_jsonl), with and without "path" lines allowed, and
// the output lines written back for each document (summary_error_line escapes what it echoes).
#include <cstdint>
#include <string>

#include "common/error.h"
#include "coordinator/jobs/summarize.h"

using namespace xctx;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string jsonl(reinterpret_cast<const char*>(data), size);
  for (bool allow_paths : {true, false}) {
    try {
      const std::vector<summary_document> docs = parse_summary_jsonl(jsonl, "fuzz.jsonl", allow_paths);
      for (const summary_document& d : docs) {
        if (d.id.empty() || d.line < 1) __builtin_trap();  // the parser promises both
        (void)summary_error_line(d.id, d.error.empty() ? d.text : d.error);
        summary_result r;
        r.summary = d.text;
        (void)summary_line(d.id, r, "fp16", 1);
      }
    } catch (const Error&) {
    }
  }
  return 0;
}
