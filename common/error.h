// Two tiers of errors (DESIGN.md §5.5):
//   XCTX_CHECK(cond, parts...)  bad input from a user or a file: throws xctx::Error with what,
//                               where and the offending values. Library code never exit()s.
//   XCTX_ASSERT(cond, parts...) an internal invariant: prints and aborts (a bug, not bad input).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

namespace xctx {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}
[[noreturn]] inline void assert_fail(const char* cond, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "xctx internal error: %s:%d: assertion `%s` failed%s%s\n", file, line, cond,
               msg.empty() ? "" : ": ", msg.c_str());
  std::abort();
}
}  // namespace detail

// Throws xctx::Error built from the streamed parts.
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw Error(detail::concat(parts...));
}

}  // namespace xctx

#define XCTX_CHECK(cond, ...)                                          \
  do {                                                                 \
    if (!(cond)) [[unlikely]] ::xctx::fail(__VA_ARGS__);               \
  } while (0)

#define XCTX_ASSERT(cond, ...)                                                                   \
  do {                                                                                           \
    if (!(cond)) [[unlikely]]                                                                    \
      ::xctx::detail::assert_fail(#cond, __FILE__, __LINE__, ::xctx::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
