// `xctx info`: hyper-parameters, metadata and the tensor table of a model; with --cache, the
// per-token byte breakdown of a cache format for this model.
#include <cstdio>
#include <filesystem>
#include <map>

#include "cache/format.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs.h"
#include "coordinator/session.h"
#include "model/gguf.h"
#include "worker/llama_engine.h"

namespace xctx {
namespace {

void print_hparams(const model_hparams& hp) {
  std::printf("model         %s (%s)\n", hp.name.c_str(), hp.arch.c_str());
  std::printf("layers        %d\n", hp.n_layer);
  std::printf("width         %d (ffn %d)\n", hp.n_embd, hp.n_ff);
  std::printf("heads         %d query / %d kv (GQA group %d), head_dim %d\n", hp.n_head, hp.n_head_kv, hp.n_gqa(),
              hp.head_dim);
  std::printf("rope          base %g, %d rotated dims, scaling %s x%g\n", hp.rope_freq_base, hp.n_rot,
              hp.rope_scale_type == rope_scaling::rope_scaling_linear ? "linear"
              : hp.rope_scale_type == rope_scaling::rope_scaling_ntk  ? "ntk"
                                                                       : "none",
              hp.rope_scale_factor);
  std::printf("context       %d trained\n", hp.n_ctx_train);
  std::printf("rms eps       %g\n", hp.rms_eps);
  std::printf("vocab         %d, output %s\n", hp.n_vocab, hp.tied_output ? "tied to token_embd" : "separate");
}

}  // namespace

int run_info(const info_options& opt) {
  const std::string path = opt.model.empty() ? default_model_path() : opt.model;
  model_weights w = load_model(path);
  std::printf("file          %s\n", path.c_str());
  print_hparams(w.hp);
  std::printf("weights       %s as stored\n", format_bytes((double)w.weight_bytes()).c_str());

  if (!std::filesystem::is_directory(path)) {
    auto f = gguf_file::open(path);
    std::printf("\nGGUF v%u, alignment %zu, %zu metadata keys, %zu tensors\n", f->version(), f->alignment(),
                f->metadata().size(), f->tensors().size());
    for (const auto& [key, value] : f->metadata()) {
      const bool bulky = key.rfind("tokenizer.ggml.", 0) == 0 && value.type == gguf_value_type::gguf_array;
      std::printf("  %-40s %s\n", key.c_str(),
                  gguf_value_to_string(value, opt.all_metadata ? SIZE_MAX : (bulky ? 4 : 16)).c_str());
    }
    std::printf("\n  %-32s %-6s %-18s %12s\n", "tensor", "type", "shape", "bytes");
    std::map<std::string, size_t> bytes_by_type;
    for (const auto& t : f->tensors()) {
      std::string shape;
      for (size_t i = 0; i < t.shape.size(); ++i) shape += (i ? " x " : "") + std::to_string(t.shape[i]);
      const char* tname = ggml_traits(t.type).name;
      std::printf("  %-32s %-6s %-18s %12zu\n", t.name.c_str(), tname, shape.c_str(), t.bytes);
      bytes_by_type[tname] += t.bytes;
    }
    for (const auto& [type, bytes] : bytes_by_type)
      std::printf("  total %-6s %s\n", type.c_str(), format_bytes((double)bytes).c_str());
  }

  if (!opt.cache.empty()) {
    const cache_format fmt = parse_cache_format(opt.cache);
    run_params rp;
    rp.cache = fmt;
    const cache_geometry g = make_cache_geometry(w.hp, make_rope_config(w.hp, rp), opt.context);
    const size_t per_token = cache_bytes_per_token(fmt, g);
    const size_t fp16 = cache_bytes_per_token(cache_format::cache_fp16, g);
    const double elems = 2.0 * g.n_layer * g.n_head_kv * g.head_dim;
    std::printf("\ncache %s for this model\n", format_traits(fmt).name);
    std::printf("  K and V elements per token      %.0f (%d layers x 2 x %d kv heads x %d)\n", elems, g.n_layer,
                g.n_head_kv, g.head_dim);
    std::printf("  stored bits per element         %d\n", format_traits(fmt).bits_per_element);
    std::printf("  position per token              %zu bytes\n", sizeof(int32_t));
    std::printf("  bytes per token                 %zu (%.3f bits per K/V element all-in)\n", per_token,
                per_token * 8.0 / elems);
    std::printf("  relative to fp16                %.3f\n", (double)per_token / (double)fp16);
    std::printf("  %lld tokens                     %s\n", (long long)opt.context,
                format_bytes((double)per_token * (double)opt.context).c_str());
  }
  return 0;
}

}  // namespace xctx
