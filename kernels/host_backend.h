// Backends whose memory is host memory (ref, cpu): one class, parameterized by the table of
// kernel functions it forwards to.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "kernels/ops.h"

namespace xctx {

struct host_kernels {
  const char* name;
  // A std::function: the CPU backend binds its matmul_settings into it.
  std::function<void(const weight_view&, const float*, int64_t, float*)> matmul;
  void (*get_rows)(const weight_view&, const int32_t*, int64_t, float*);
  void (*rms_norm)(const float*, const float*, int64_t, int64_t, float, float*);
  void (*rope)(float*, const int32_t*, int64_t, int, const rope_config&);
  void (*swiglu)(const float*, const float*, int64_t, float*);
  void (*add)(float*, const float*, int64_t);
  // std::functions where the CPU backend binds its attention_switches.
  std::function<void(const attn_args&)> attention_partial;
  void (*merge_partials)(const float*, const float*, int, int64_t, int, float*, float*);
  void (*kvq_encode)(const kvq_encode_job&);
  std::function<void(const kvq_attn_args&)> attention_kvq;
  void (*xq_encode)(const xq_encode_job&);
  void (*xq_project)(const float*, const float*, int64_t, int, int, float*);
  std::function<void(const xq_attn_args&)> attention_xq;
  void (*xq_decode_rows)(const xq_stream&, int64_t, int64_t, float*);
  void (*xq_add_projected)(const float*, const float*, int64_t, int, int, float*);
  // Optional (empty: one matmul call per weight).
  std::function<void(const weight_view*, int, const float*, int64_t, float* const*)> matmul_n;
  backend_settings settings;  // what backend::settings() reports: the choices bound above
  std::string arithmetic;     // what backend::arithmetic() reports
};

std::unique_ptr<backend> make_host_backend(const host_kernels& k);

}  // namespace xctx
