// The service's request path (coordinator/service/job_table.cpp, coordinator/service/xctx.thrift): bytes decoded
// as a Job with the binary protocol (parse_job, what the size limit counts), then the checks a
// job passes before it is queued (check_job_request, which also parses a batch job's JSONL).
// The same bytes are also read as the arguments of a submit() call, the way the server's
// processor reads them off a frame, and as a Job in the compact protocol.
//
// Documented outcomes: xctx::Error from parse_job, rpc::RequestError (BAD_REQUEST, TOO_LARGE)
// from check_job_request, apache::thrift::TException from the generated readers.
#include <thrift/TConfiguration.h>
#include <thrift/protocol/TBinaryProtocol.h>
#include <thrift/protocol/TCompactProtocol.h>
#include <thrift/transport/TBufferTransports.h>

#include <cstdint>
#include <memory>
#include <string>

#include "Xctx.h"
#include "common/error.h"
#include "coordinator/service/job_table.h"

using namespace xctx;
namespace th = apache::thrift;

namespace {

void check(const rpc::Job& job) {
  service_limits limits;
  limits.max_request_bytes = 1 << 20;
  try {
    check_job_request(job, limits);
  } catch (const rpc::RequestError&) {
  }
}

template <class T, class MakeProtocol>
bool read_as(const uint8_t* data, size_t size, T& out, MakeProtocol make) {
  // As the server reads (coordinator/service/service.cpp): frames, strings and lists bounded by the
  // frame limit (1 MiB here).
  auto config = std::make_shared<th::TConfiguration>(1 << 20, 1 << 20);
  auto buf = std::make_shared<th::transport::TMemoryBuffer>(const_cast<uint8_t*>(data), (uint32_t)size,
                                                            th::transport::TMemoryBuffer::OBSERVE, config);
  auto proto = make(buf);
  try {
    out.read(proto.get());
    return true;
  } catch (const th::TException&) {
    return false;
  }
}

constexpr int32_t kLimit = 1 << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > (1 << 20)) return 0;
  try {
    const rpc::Job job = parse_job(std::string(reinterpret_cast<const char*>(data), size));
    check(job);
  } catch (const Error&) {
  }
  using buffer = std::shared_ptr<th::transport::TMemoryBuffer>;
  rpc::Xctx_submit_args args;
  if (read_as(data, size, args, [](buffer b) {
        return std::make_shared<th::protocol::TBinaryProtocol>(b, kLimit, kLimit, false, true);
      }))
    check(args.job);
  rpc::Job compact;
  if (read_as(data, size, compact,
              [](buffer b) { return std::make_shared<th::protocol::TCompactProtocol>(b, kLimit, kLimit); }))
    check(compact);
  return 0;
}
