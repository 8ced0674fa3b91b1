// Backends whose memory is host memory (ref, cpu): one class, parameterized by the table of
// kernel functions it forwards to.
#pragma once

#include <memory>

#include "kernels/ops.h"

namespace xctx {

struct host_kernels {
  const char* name;
  void (*matmul)(const weight_view&, const float*, int64_t, float*);
  void (*get_rows)(const weight_view&, const int32_t*, int64_t, float*);
  void (*rms_norm)(const float*, const float*, int64_t, int64_t, float, float*);
  void (*rope)(float*, const int32_t*, int64_t, int, const rope_config&);
  void (*swiglu)(const float*, const float*, int64_t, float*);
  void (*add)(float*, const float*, int64_t);
  void (*attention_partial)(const attn_args&);
  void (*merge_partials)(const float*, const float*, int, int64_t, int, float*, float*);
  void (*kvq_encode)(const kvq_encode_job&);
  void (*attention_kvq)(const kvq_attn_args&);
  void (*xq_encode)(const xq_encode_job&);
  void (*xq_project)(const float*, const float*, int64_t, int, int, float*);
  void (*attention_xq)(const xq_attn_args&);
  void (*xq_decode_rows)(const xq_stream&, int64_t, int64_t, float*);
  void (*xq_add_projected)(const float*, const float*, int64_t, int, int, float*);
  // Optional (nullptr: one matmul call per weight).
  void (*matmul_n)(const weight_view*, int, const float*, int64_t, float* const*);
};

std::unique_ptr<backend> make_host_backend(const host_kernels& k);

}  // namespace xctx
