#include "coordinator/service/secret.h"

#include <algorithm>

#include "common/error.h"
#include "common/sys.h"

namespace xctx {

std::string read_secret(const std::string& path) {
  std::string s = read_file_bytes(path, "--token-file");
  const auto first = s.find_first_not_of(" \t\r\n"), last = s.find_last_not_of(" \t\r\n");
  XCTX_CHECK(first != std::string::npos, "--token-file ", path, " is empty");
  s = s.substr(first, last - first + 1);
  XCTX_CHECK(s.size() >= 8, "--token-file ", path, " holds a secret of ", s.size(), " characters; use at least 8");
  return s;
}

bool same_secret(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) diff |= (unsigned char)(a[i] ^ b[i % std::max<size_t>(1, b.size())]);
  return diff == 0;
}

}  // namespace xctx
