#include "worker/attention_sum.h"

#include <cstring>

#include "common/error.h"

namespace xctx {

attention_sum::attention_sum(backend& be)
    : be_(be), exact_(be.exact_accumulator()), o_parts_(be), lse_parts_(be), o_all_(be), lse_all_(be) {}

void attention_sum::begin(int64_t n_q, int n_head, int head_dim) {
  rows_ = n_q * n_head;
  width_ = head_dim;
  n_parts_ = 0;
  n_all_ = 0;
  if (exact_) {
    acc_.reset(rows_, width_);
    return;
  }
  o_parts_.reserve_as<float>(2 * rows_ * width_);
  lse_parts_.reserve_as<float>(2 * rows_);
}

int attention_sum::next_slot() {
  if (n_parts_ == 2) {
    // merge_partials lets o/lse alias part 0: the first two become one, in the order added.
    float* o = o_parts_.as<float>();
    float* lse = lse_parts_.as<float>();
    be_.merge_partials(o, lse, 2, rows_, width_, o, lse);
    n_parts_ = 1;
  }
  return n_parts_++;
}

void attention_sum::add(kv_cache& c, int layer, const float* q, const int32_t* q_pos, int64_t n_q, attend_path path,
                        const attn_selection* select) {
  c.attend(layer, attend_source::own_tokens(), {q, q_pos, n_q, path}, select, next_sink());
}

void attention_sum::add_exported(kv_cache& c, int layer, const void* block, size_t bytes, const float* q,
                                 const int32_t* q_pos, int64_t n_q, attend_path path, const void* block_on_backend) {
  c.attend(layer, attend_source::exported(block, bytes, block_on_backend), {q, q_pos, n_q, path}, nullptr,
           next_sink());
}

attend_sink attention_sum::next_sink() {
  if (exact_) return attend_sink::exact_sum(acc_);
  const int s = next_slot();
  return attend_sink::partial(o_parts_.as<float>() + s * rows_ * width_, lse_parts_.as<float>() + s * rows_);
}

size_t attention_sum::all_reduce(communicator& comm, communicator* device_comm) {
  const int p = comm.size();
  if (p == 1) return 0;
  if (exact_) {
    // Every rank gathers every rank's exact partial and adds them: identical o on all ranks, and
    // the same o one rank holding the whole cache would get.
    const size_t bytes = acc_.serialized_bytes();
    packed_.resize(bytes);
    acc_.serialize(packed_.data());
    gathered_.resize(bytes * p);
    comm.all_gather(packed_.data(), gathered_.data(), bytes);
    acc_.reset(rows_, width_);
    for (int r = 0; r < p; ++r) acc_.merge_serialized(gathered_.data() + bytes * r, bytes);
    return bytes;
  }
  XCTX_CHECK(n_parts_ > 0, "attention_sum: all_reduce before any partial");
  // This rank's partials as one, then every rank's gathered and merged in rank order (finish).
  float* o = o_parts_.as<float>();
  float* lse = lse_parts_.as<float>();
  if (n_parts_ == 2) be_.merge_partials(o, lse, 2, rows_, width_, o, lse);
  n_parts_ = 1;
  const size_t o_bytes = (size_t)rows_ * width_ * sizeof(float), lse_bytes = (size_t)rows_ * sizeof(float);
  const size_t bytes = o_bytes + lse_bytes;
  float* o_all = o_all_.reserve_as<float>((int64_t)p * rows_ * width_);
  float* lse_all = lse_all_.reserve_as<float>((int64_t)p * rows_);
  n_all_ = p;
  if (device_comm != nullptr) {
    XCTX_CHECK(device_comm->size() == p, "attention_sum: device communicator of ", device_comm->size(),
               " ranks beside a host one of ", p);
    be_.synchronize();  // the collective runs on its own stream: the partial must be complete
    device_comm->all_gather(o, o_all, o_bytes);
    device_comm->all_gather(lse, lse_all, lse_bytes);
    return bytes;
  }
  // Through the host: the communicator moves host memory.
  packed_.resize(bytes);
  be_.download(packed_.data(), o, o_bytes);
  be_.download(packed_.data() + o_bytes, lse, lse_bytes);
  gathered_.resize(bytes * p);
  comm.all_gather(packed_.data(), gathered_.data(), bytes);
  for (int r = 0; r < p; ++r) {
    be_.upload(reinterpret_cast<uint8_t*>(o_all) + o_bytes * r, gathered_.data() + bytes * r, o_bytes);
    be_.upload(reinterpret_cast<uint8_t*>(lse_all) + lse_bytes * r, gathered_.data() + bytes * r + o_bytes, lse_bytes);
  }
  return bytes;
}

void attention_sum::finish(float* o) {
  if (exact_) {
    acc_.finish(o);
    return;
  }
  // lse of the result is not needed: it goes to the slot-0 lse the merge may overwrite.
  if (n_all_ > 0) {
    be_.merge_partials(o_all_.as<float>(), lse_all_.as<float>(), n_all_, rows_, width_, o, lse_all_.as<float>());
  } else {
    XCTX_CHECK(n_parts_ > 0, "attention_sum: finish before any partial");
    be_.merge_partials(o_parts_.as<float>(), lse_parts_.as<float>(), n_parts_, rows_, width_, o, lse_parts_.as<float>());
  }
}

}  // namespace xctx
