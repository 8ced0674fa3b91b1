// The CUDA scratch bound the fit check counts (kernels/cuda/scratch.h) against what the launch
// code asks for, over the plans' whole range: every query count of a batch, key counts up to the
// shard, device sizes from one SM to an H200's 132, the fullest retrieval selection. Host code
// (the same plan and request functions the .cu files call), so it runs in every build.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "kernels/cuda/scratch.h"
#include "registry/registry.h"

namespace xctx {
namespace {

struct model_shape {
  const char* name;
  int n_head, n_head_kv, head_dim, n_embd;
  int64_t n_ff, n_vocab;
};

// SmolLM2-135M (the bundled model), a Llama-8B-like shape, and a head_dim-256 shape.
const model_shape kModels[] = {{"smollm2", 9, 3, 64, 576, 1536, 49152},
                               {"llama8b", 32, 8, 128, 4096, 14336, 128256},
                               {"hd256", 8, 1, 256, 2048, 16384, 256000}};

TEST(cuda_scratch, bound_covers_every_request_of_the_shape) {
  size_t largest_bound = 0;
  for (const model_shape& m : kModels)
    for (const int64_t n_batch : {int64_t(1), int64_t(64), int64_t(512)})
      for (const int64_t capacity : {int64_t(1000), int64_t(1) << 17, int64_t(1) << 20}) {
        workspace_shape s;
        s.n_batch = n_batch, s.kv_dim = (int64_t)m.n_head_kv * m.head_dim, s.q_dim = (int64_t)m.n_head * m.head_dim;
        s.n_head = m.n_head, s.n_head_kv = m.n_head_kv, s.head_dim = m.head_dim, s.n_embd = m.n_embd;
        s.max_weight_cols = std::max<int64_t>(m.n_embd, m.n_ff);
        s.capacity = capacity;
        const size_t bound = cuda::scratch_bound(s);
        EXPECT_EQ(bound, kernel_workspace_bytes(backend_kind::backend_cuda, s));
        largest_bound = std::max(largest_bound, bound);
        size_t worst = 0;
        // Weight panels: every matrix of the model (the output's rows are the vocabulary).
        for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{m.n_ff, m.n_embd}, {m.n_embd, m.n_ff},
                                         {s.q_dim, m.n_embd}, {s.kv_dim, m.n_embd}, {m.n_vocab, m.n_embd}})
          worst = std::max(worst, cuda::scratch_allocation(cuda::matmul_panel_request(rows, cols)));
        // Attention calls: the fullest selection (per-KV-head lists naming every unit).
        const std::vector<int64_t> q_counts = {1, 2, 3, 8, n_batch};
        for (const int64_t n_q : q_counts) {
          if (n_q > n_batch) continue;
          const int64_t n_row = n_q * m.n_head;
          for (const int64_t n_kv : {int64_t(1), int64_t(255), int64_t(4096), capacity})
            for (const int n_sm : {1, 8, 132}) {
              const size_t lists_n = (size_t)n_q * m.n_head_kv;
              const size_t lists = cuda::selection_list_bytes(lists_n + 1, lists_n * (size_t)(n_kv / cuda::attn_unit + 1));
              const auto ap = cuda::plan_attention(n_q, n_kv, m.n_head, m.n_head_kv, m.head_dim, n_sm);
              const auto kp = cuda::plan_kvq_attention(n_q, n_kv, m.n_head, m.n_head_kv, m.head_dim, m.head_dim, n_sm);
              const auto xp = cuda::plan_xq_attention(n_q, n_kv, m.n_head, m.n_head_kv, m.head_dim, m.head_dim,
                                                      m.n_embd, n_sm, size_t(227) << 10);
              for (const size_t parts : {cuda::split_partial_bytes(ap.n_split, n_row, m.head_dim),
                                         cuda::split_partial_bytes(kp.n_split, n_row, m.head_dim),
                                         cuda::xq_partial_bytes(xp.n_split, n_row, m.n_embd),
                                         cuda::xq_partial_bytes(xp.n_split, n_row, m.head_dim)})
                worst = std::max(worst, cuda::scratch_allocation(cuda::scratch_request(parts, lists)));
            }
        }
        EXPECT_LE(worst, bound) << m.name << " batch " << n_batch << " capacity " << capacity;
      }
  // The bound is the caps' (256 MiB of partials) plus lists and rounding: about what a device of
  // 80+ GiB gives up, and it says so in the fit check.
  std::printf("[cuda scratch] largest bound over the shapes: %.1f MiB\n", (double)largest_bound / (1 << 20));
  EXPECT_LT(largest_bound, size_t(1) << 30);
}

// Requests as the launch code forms them: nothing when unsplit and unselected, the lists from an
// aligned byte behind the partials, whole MiB from the allocator.
TEST(cuda_scratch, request_layout) {
  EXPECT_EQ(cuda::scratch_request(0, 0), 0u);
  EXPECT_EQ(cuda::split_partial_bytes(1, 100, 64), 0u);
  EXPECT_EQ(cuda::split_partial_bytes(3, 10, 64), 3u * 10 * 65 * 4);
  EXPECT_EQ(cuda::xq_partial_bytes(1, 10, 576), 10u * 577 * 4);
  EXPECT_EQ(cuda::scratch_request(1, 8), 256u + 8);
  EXPECT_EQ(cuda::scratch_request(0, 8), 8u);
  EXPECT_EQ(cuda::scratch_allocation(1), size_t(1) << 20);
  EXPECT_EQ(cuda::matmul_panel_request(10, 4096), 10u * 4096 * 4);  // all rows fit one panel
  EXPECT_EQ(cuda::matmul_panel_request(1 << 20, 1 << 25), size_t(1) << 27);  // one row wider than a panel
}

}  // namespace
}  // namespace xctx
