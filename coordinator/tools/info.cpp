// `xctx info`: hyper-parameters, metadata and the tensor table of a model; with --cache, the
// per-token byte breakdown of a cache format for this model.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>

#include "cache/format.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs/jobs.h"
#include "coordinator/jobs/session.h"
#include "model/gguf.h"
#include "worker/llama_engine.h"
#include "worker/retrieval.h"

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
    const cache_format_traits t = format_traits(fmt);
    run_params rp;
    rp.cache = fmt;
    const cache_geometry g = make_cache_geometry(w.hp, make_rope_config(w.hp, rp), opt.context);
    const cache_spec spec(fmt);  // default options: group 128, sink on
    const double per_token = cache_bytes_per_token(spec, g);
    const double fp16 = cache_bytes_per_token(cache_format::cache_fp16, g);
    const double elems = 2.0 * g.n_layer * g.n_head_kv * g.head_dim;
    const int64_t n = opt.context;
    const int64_t n_sink = t.family == cache_family::family_nuq ? 1 : 0;
    const double C = (double)g.n_head_kv * g.head_dim;
    const int64_t key_out = (int64_t)std::llround(t.outlier_fraction * C * (double)(n - n_sink) * g.n_layer);
    const cache_bytes b = cache_bytes_for(spec, g, n, n_sink, key_out);
    std::printf("\ncache %s for this model\n", t.name);
    std::printf("  K and V elements per token      %.0f (%d layers x 2 x %d kv heads x %d)\n", elems, g.n_layer,
                g.n_head_kv, g.head_dim);
    std::printf("  code bits per element           %d\n", t.bits_per_element);
    std::printf("  bytes per token (long context)  %.2f (%.3f bits per K/V element all-in)\n", per_token,
                per_token * 8.0 / elems);
    std::printf("  relative to fp16                %.4f (%.2fx smaller)\n", per_token / fp16, fp16 / per_token);
    std::printf("  %lld tokens on one shard         %s, of which:\n", (long long)n, format_bytes((double)b.total()).c_str());
    const auto row = [&](const char* what, size_t bytes, const char* how) {
      if (bytes != 0) std::printf("    %-26s %12s  %s\n", what, format_bytes((double)bytes).c_str(), how);
    };
    const char* codes = "packed K and V codes";
    const char* rows = "";
    const char* scales = "";
    switch (t.family) {
      case cache_family::family_fp: codes = "K and V elements"; break;
      case cache_family::family_kivi:
        rows = "residual window (tokens of the open group)";
        scales = "fp16 per key group x channel and per token x value group";
        break;
      case cache_family::family_nuq:
        rows = "attention sink (position 0)";
        scales = "fp16 per value token";
        break;
      case cache_family::family_xquant:
        codes = "packed latents X.U_k (per channel) and X.U_v (per token)";
        rows = "residual window (tokens of the open group)";
        scales = "fp16 per latent group";
        break;
      case cache_family::family_xquant_cl:
        codes = "packed X (first layers) and cross-layer deltas";
        rows = "fp16 parts (see docs/x_formats.md)";
        scales = "fp16 per token x channel group";
        break;
      case cache_family::family_clkv:
        codes = "packed 2/1-bit K and V codes (shared layers store none)";
        rows = "residual window (tokens of the open group)";
        scales = "fp16 per group, every layer its own (shared codes too)";
        break;
    }
    row("positions", b.positions, "int32 per token");
    row("codes", b.codes, codes);
    row("fp16 rows", b.fp16_rows, rows);
    row("scales and zero points", b.scales, scales);
    row("per-layer tables", b.tables, "LUTs, key channel scales/zeros, outlier thresholds (f32)");
    row("sparse outliers", b.outliers, "fp16 value + uint16 channel; key column offsets uint32 (nominal 1%)");
    if (n > w.hp.n_ctx_train) {  // what --attention auto runs there: retrieval, with block summaries
      const retrieval_options r;
      cache_spec with_summaries = spec;
      with_summaries.options.summary_block = r.block;
      const cache_bytes bs = cache_bytes_for(with_summaries, g, n, n_sink, key_out);
      std::printf("  past the trained %d positions, retrieval attention adds block summaries (blocks of %lld):\n",
                  w.hp.n_ctx_train, (long long)r.block);
      row("block summaries", bs.summaries, "per block, layer, KV head: key min, max, mean (bf16), id, count");
      std::printf("    %-26s %12s\n", "total with summaries", format_bytes((double)bs.total()).c_str());
    }
    if (t.needs_calibration) std::printf("  needs --calib FILE (xctx calibrate)\n");
  }
  return 0;
}

}  // namespace xctx
