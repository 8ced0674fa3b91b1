// Thrift structs to bytes and back (binary protocol), bounded: a string or list is never longer
// than the bytes it came in, so a corrupt length cannot make Thrift allocate gigabytes.
#pragma once

#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include <algorithm>
#include <climits>
#include <memory>
#include <string>

namespace xctx {

template <class T>
std::string to_thrift_bytes(const T& value) {
  auto buf = std::make_shared<apache::thrift::transport::TMemoryBuffer>();
  apache::thrift::protocol::TBinaryProtocol proto(buf);
  value.write(&proto);
  return buf->getBufferAsString();
}

// False (with the reason in *error) when the bytes are not a T.
template <class T>
bool from_thrift_bytes(const std::string& bytes, T& out, std::string* error) {
  auto buf = std::make_shared<apache::thrift::transport::TMemoryBuffer>(
      reinterpret_cast<uint8_t*>(const_cast<char*>(bytes.data())), (uint32_t)bytes.size());
  apache::thrift::protocol::TBinaryProtocol proto(buf);
  const auto limit = (int32_t)std::min<size_t>(bytes.size(), INT32_MAX);
  proto.setStringSizeLimit(limit);
  proto.setContainerSizeLimit(limit);
  try {
    out.read(&proto);
    return true;
  } catch (const apache::thrift::TException& e) {
    if (error) *error = e.what();
    return false;
  }
}

}  // namespace xctx
