// The X caches (docs/x_formats.md): make_cache routes xquant*, xquant-cl* and clkv here. The
// extra functions look inside for tests and tools.
#pragma once

#include <memory>

#include "cache/cache.h"
#include "kernels/x_quant.h"

namespace xctx {

// xquant*, clkv (cache/x_cache.cpp).
std::unique_ptr<kv_cache> make_x_window_cache(const cache_spec& spec, const cache_geometry& g, backend& be);
// xquant-cl* (cache/x_cl_cache.cpp).
std::unique_ptr<kv_cache> make_x_cl_cache(const cache_spec& spec, const cache_geometry& g, backend& be);

// A layer's stored stream as the kernels read it. xquant/clkv: which 0 = key side, 1 = value
// side (xquant on MHA has only 0). xquant-cl: which must be 0 (the layer's X or delta codes).
// Throws for other caches.
xq_stream x_cache_stream(const kv_cache& c, int layer, int which);
xq_stream x_cl_cache_stream(const kv_cache& c, int layer, int which);
// xquant-cl: the accumulator X̂_layer of every token the layer holds ([n, n_embd] f32), brought
// to that layer the way attention does it (layer >= the base layer).
void x_cl_accumulator(kv_cache& c, int layer, float* out /*[n, n_embd]*/);

}  // namespace xctx
