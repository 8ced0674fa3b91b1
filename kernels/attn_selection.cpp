// The shape check every attention kernel runs on a retrieval selection (kernels/ops.h).
#include "common/error.h"
#include "kernels/ops.h"

namespace xctx {

void check_selection(const attn_selection& s, int64_t n_q, int n_head_kv, const char* who) {
  XCTX_CHECK(s.lists_per_query == 1 || s.lists_per_query == n_head_kv, who, ": a selection of ", s.lists_per_query,
             " lists per query for ", n_head_kv, " KV heads (1 or one per KV head)");
  XCTX_CHECK(s.n_queries() == n_q && (int64_t)s.offsets.size() == n_q * s.lists_per_query + 1, who,
             ": a selection of ", s.n_queries(), " queries for ", n_q);
  XCTX_CHECK(s.offsets.front() == 0 && s.offsets.back() == (int64_t)s.units.size(), who,
             ": a selection's offsets do not span its units");
}

}  // namespace xctx
