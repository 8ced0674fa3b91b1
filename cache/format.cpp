#include "cache/format.h"

#include "cache/block_summary.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/error.h"

namespace xctx {

cache_format_traits format_traits(cache_format f) {
  using cf = cache_family;
  switch (f) {
    case cache_format::cache_fp32: return {"fp32", cf::family_fp, 32, 0.0, false, false};
    case cache_format::cache_fp16: return {"fp16", cf::family_fp, 16, 0.0, false, false};
    case cache_format::cache_kivi4: return {"kivi4", cf::family_kivi, 4, 0.0, true, false};
    case cache_format::cache_kivi3: return {"kivi3", cf::family_kivi, 3, 0.0, true, false};
    case cache_format::cache_kivi2: return {"kivi2", cf::family_kivi, 2, 0.0, true, false};
    case cache_format::cache_nuq4: return {"nuq4", cf::family_nuq, 4, 0.0, true, true};
    case cache_format::cache_nuq3: return {"nuq3", cf::family_nuq, 3, 0.0, true, true};
    case cache_format::cache_nuq2: return {"nuq2", cf::family_nuq, 2, 0.0, true, true};
    case cache_format::cache_nuq4_1pct: return {"nuq4-1%", cf::family_nuq, 4, 0.01, true, true};
    case cache_format::cache_nuq3_1pct: return {"nuq3-1%", cf::family_nuq, 3, 0.01, true, true};
    case cache_format::cache_nuq2_1pct: return {"nuq2-1%", cf::family_nuq, 2, 0.01, true, true};
    case cache_format::cache_xquant4: return {"xquant4", cf::family_xquant, 4, 0.0, true, false};
    case cache_format::cache_xquant3: return {"xquant3", cf::family_xquant, 3, 0.0, true, false};
    case cache_format::cache_xquant2: return {"xquant2", cf::family_xquant, 2, 0.0, true, false};
    case cache_format::cache_xquant_cl4: return {"xquant-cl4", cf::family_xquant_cl, 4, 0.0, true, false};
    case cache_format::cache_xquant_cl3: return {"xquant-cl3", cf::family_xquant_cl, 3, 0.0, true, false};
    case cache_format::cache_xquant_cl2: return {"xquant-cl2", cf::family_xquant_cl, 2, 0.0, true, false};
    // Mixed 2/1-bit codes per layer (clkv_layer_config); 2 is the widest.
    case cache_format::cache_clkv: return {"clkv", cf::family_clkv, 2, 0.0, true, false};
  }
  XCTX_ASSERT(false, "bad cache_format ", (int)f);
  return {};
}

std::vector<cache_format> all_cache_formats() {
  using c = cache_format;
  return {c::cache_fp32,       c::cache_fp16,       c::cache_kivi4,      c::cache_kivi3,     c::cache_kivi2,
          c::cache_nuq4,       c::cache_nuq3,       c::cache_nuq2,       c::cache_nuq4_1pct, c::cache_nuq3_1pct,
          c::cache_nuq2_1pct,  c::cache_xquant4,    c::cache_xquant3,    c::cache_xquant2,   c::cache_xquant_cl4,
          c::cache_xquant_cl3, c::cache_xquant_cl2, c::cache_clkv};
}

std::vector<cache_format> formats_of(std::initializer_list<cache_family> families) {
  std::vector<cache_format> out;
  for (cache_format f : all_cache_formats())
    for (cache_family fam : families)
      if (format_traits(f).family == fam) out.push_back(f);
  return out;
}

std::vector<cache_format> x_cache_formats() {
  return formats_of({cache_family::family_xquant, cache_family::family_xquant_cl, cache_family::family_clkv});
}

cache_format parse_cache_format(const std::string& name) {
  std::ostringstream names;
  for (cache_format f : all_cache_formats()) {
    if (name == format_traits(f).name) return f;
    names << (names.tellp() > 0 ? ", " : "") << format_traits(f).name;
  }
  fail("unknown cache format '", name, "' (known: ", names.str(), ")");
}

cl_ring_mode parse_cl_ring_mode(const std::string& name) {
  if (name == "deltas") return cl_ring_mode::cl_ring_deltas;
  if (name == "latent") return cl_ring_mode::cl_ring_latent;
  if (name == "auto") return cl_ring_mode::cl_ring_auto;
  fail("unknown xquant-cl ring mode '", name, "' (deltas, latent, auto)");
}

const char* cl_ring_mode_name(cl_ring_mode m) {
  switch (m) {
    case cl_ring_mode::cl_ring_deltas: return "deltas";
    case cl_ring_mode::cl_ring_latent: return "latent";
    case cl_ring_mode::cl_ring_auto: return "auto";
  }
  XCTX_ASSERT(false, "bad cl_ring_mode ", (int)m);
  return "?";
}

bool qnorm_enabled(cache_format f, const cache_options& o) {
  // KVQuant App. H: Q-Norm helps at 2 bits and not measurably at 3-4; the paper uses it at 2.
  return o.qnorm < 0 ? format_traits(f).bits_per_element == 2 : o.qnorm != 0;
}

bool xquant_uses_latents(const cache_geometry& g) { return g.n_head_kv < g.n_head; }
int xquant_rank(const cache_geometry& g) {
  const int C = g.n_head_kv * g.head_dim;
  return xquant_uses_latents(g) ? std::min(g.n_embd, C) : g.n_embd;
}
int xquant_cl_hi_layers(const cache_options& o, int n_layer) { return std::clamp(o.cl_hi_layers, 1, n_layer); }
int xquant_cl_rank(const cache_geometry& g) {
  const int C = g.n_head_kv * g.head_dim;
  return xquant_uses_latents(g) ? std::min(g.n_embd, 2 * C) : g.n_embd;
}
int xquant_cl_bits(cache_format f, const cache_options& o, int n_layer, int layer) {
  return layer < xquant_cl_hi_layers(o, n_layer) ? 4 : format_traits(f).bits_per_element;
}
int xquant_cl_channels(const cache_geometry& g, const cache_options& o, int layer) {
  return layer < xquant_cl_hi_layers(o, g.n_layer) ? g.n_embd : xquant_cl_rank(g);
}

clkv_layer clkv_layer_config(const cache_options& o, int n_layer, int layer) {
  // ACL paper App. A: kq = 30, vq = 2, km = 32, vm = 16 for 32 layers; scaled to n_layer as
  // "all but the last two key layers at 2 bits" and "value sharing in the upper half".
  const int kq = o.clkv_key_2bit_layers >= 0 ? o.clkv_key_2bit_layers : std::max(0, n_layer - 2);
  const int vq = o.clkv_value_2bit_layers;
  const int km = o.clkv_key_share_from >= 0 ? o.clkv_key_share_from : n_layer;
  const int vm = o.clkv_value_share_from >= 0 ? o.clkv_value_share_from : n_layer / 2;
  clkv_layer c;
  c.key_bits = layer < kq ? 2 : 1;
  c.value_bits = layer < vq ? 2 : 1;
  // Algorithm 1: odd layers at or above the threshold take layer l-1's codes. The lower layer
  // must have the same width for its codes to be reused, so an odd layer right at the 2/1-bit
  // boundary keeps its own codes.
  c.key_shared = layer >= km && layer % 2 == 1 && (layer - 1 < kq) == (layer < kq);
  c.value_shared = layer >= vm && layer % 2 == 1 && (layer - 1 < vq) == (layer < vq);
  c.key_eta = c.key_bits == 1 ? o.clkv_eta1 : o.clkv_eta2;
  c.value_eta = c.value_bits == 1 ? o.clkv_eta1 : o.clkv_eta2;
  return c;
}

int value_outliers_per_side(double fraction, int channels) {
  if (fraction <= 0.0) return 0;
  return std::max(1, (int)std::lround(fraction * channels / 2.0));
}

namespace {

cache_bytes format_bytes_for(const cache_spec& spec, const cache_geometry& g, int64_t n, int64_t n_sink,
                             int64_t n_key_outliers) {
  const cache_format_traits t = format_traits(spec.format);
  const size_t L = (size_t)g.n_layer, C = (size_t)g.n_head_kv * g.head_dim;
  cache_bytes b;
  b.positions = (size_t)n * sizeof(int32_t);
  switch (t.family) {
    case cache_family::family_fp:
      b.codes = 2 * L * (size_t)n * C * (size_t)t.bits_per_element / 8;
      return b;
    case cache_family::family_kivi: {
      const int64_t G = spec.options.group_size;
      const int64_t q = n / G * G;  // tokens in full groups; the rest is the fp16 residual window
      const size_t n_vg = (C + G - 1) / G;
      b.codes = 2 * L * (size_t)q * C * t.bits_per_element / 8;
      b.fp16_rows = 2 * L * (size_t)(n - q) * C * 2;
      b.scales = L * ((size_t)(q / G) * C + (size_t)q * n_vg) * 4;  // fp16 scale + zero
      return b;
    }
    case cache_family::family_nuq: {
      const int64_t q = n - n_sink;
      const size_t lut = (size_t)1 << t.bits_per_element;
      const bool outl = t.outlier_fraction > 0.0;
      b.codes = 2 * L * (size_t)q * C * t.bits_per_element / 8;
      b.fp16_rows = 2 * L * (size_t)n_sink * C * 2;
      b.scales = L * (size_t)q * 4;  // value per-token fp16 scale + zero
      // Two LUTs, key channel scale + zero, and with outliers the key thresholds (f32).
      b.tables = L * (2 * lut * 4 + 2 * C * 4 + (outl ? 2 * C * 4 : 0));
      if (outl) {
        const size_t v_side = (size_t)value_outliers_per_side(t.outlier_fraction, (int)C);
        b.outliers = L * ((size_t)q + 1) * 4 + (size_t)n_key_outliers * 4 + L * (size_t)q * 2 * v_side * 4;
      }
      return b;
    }
    case cache_family::family_xquant: {
      const int64_t G = spec.options.group_size;
      const int64_t q = n / G * G;
      const size_t r = (size_t)xquant_rank(g), n_vg = (r + G - 1) / G;
      const size_t bits = (size_t)t.bits_per_element;
      if (!xquant_uses_latents(g)) {  // X per token, one stream
        b.codes = L * (size_t)q * r * bits / 8;
        b.fp16_rows = L * (size_t)(n - q) * r * 2;
        b.scales = L * (size_t)q * n_vg * 4;
        return b;
      }
      b.codes = 2 * L * (size_t)q * r * bits / 8;
      b.fp16_rows = 2 * L * (size_t)(n - q) * r * 2 + (spec.options.x_fp16_first_channel ? L * (size_t)q * 2 : 0);
      b.scales = L * ((size_t)(q / G) * r + (size_t)q * n_vg) * 4;
      return b;
    }
    case cache_family::family_xquant_cl: {
      const size_t G = (size_t)spec.options.group_size;
      for (int l = 0; l < g.n_layer; ++l) {  // every token quantized per token when appended
        const size_t ch = (size_t)xquant_cl_channels(g, spec.options, l);
        b.codes += (size_t)n * ch * xquant_cl_bits(spec.format, spec.options, g.n_layer, l) / 8;
        b.scales += (size_t)n * ((ch + G - 1) / G) * 4;
      }
      return b;
    }
    case cache_family::family_clkv: {
      const int64_t R = spec.options.group_size, G = spec.options.clkv_group;
      const int64_t q = n / R * R;
      const size_t n_vg = (C + G - 1) / G;
      for (int l = 0; l < g.n_layer; ++l) {
        const clkv_layer c = clkv_layer_config(spec.options, g.n_layer, l);
        if (!c.key_shared) b.codes += (size_t)q * C * c.key_bits / 8;
        if (!c.value_shared) b.codes += (size_t)q * C * c.value_bits / 8;
      }
      b.fp16_rows = 2 * L * (size_t)(n - q) * C * 2;
      b.scales = L * ((size_t)(q / G) * C + (size_t)q * n_vg) * 4;
      return b;
    }
  }
  XCTX_ASSERT(false, "bad cache family");
  return b;
}

}  // namespace

cache_bytes cache_bytes_for(const cache_spec& spec, const cache_geometry& g, int64_t n, int64_t n_sink,
                            int64_t n_key_outliers) {
  cache_bytes b = format_bytes_for(spec, g, n, n_sink, n_key_outliers);
  if (spec.options.summary_block > 0) b.summaries = summary_bytes_for(g, n, spec.options.summary_block);
  return b;
}

double cache_bytes_per_token(const cache_spec& spec, const cache_geometry& g) {
  // Differences of a long shard: fixed per-layer parts and the residual window cancel.
  const int64_t n0 = 1 << 20, n1 = 2 << 20;
  const double frac = format_traits(spec.format).outlier_fraction;
  const double C = (double)g.n_head_kv * g.head_dim;
  const auto key_out = [&](int64_t n) { return (int64_t)std::llround(frac * C * (double)n * g.n_layer); };
  const cache_bytes a = cache_bytes_for(spec, g, n0, 0, key_out(n0));
  const cache_bytes b = cache_bytes_for(spec, g, n1, 0, key_out(n1));
  return (double)(b.total() - a.total()) / (double)(n1 - n0);
}

}  // namespace xctx
