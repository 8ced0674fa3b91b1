// The service's shared secret (--token-file), one rule for both surfaces (Thrift's auth argument,
// HTTP's Authorization: Bearer).
#pragma once

#include <string>

namespace xctx {

// The file's contents with surrounding whitespace trimmed; throws naming --token-file when it is
// unreadable, empty or shorter than 8 characters.
std::string read_secret(const std::string& path);

// Equal-time comparison: how long a wrong token takes to refuse says nothing about the secret.
bool same_secret(const std::string& given, const std::string& secret);

}  // namespace xctx
