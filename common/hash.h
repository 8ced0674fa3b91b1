// A 64-bit checksum for large payloads (cache snapshots: hundreds of MiB per rank at 1M tokens),
// streamed in pieces of any size: one multiply-rotate step per 8-byte word (several GB/s, where
// a byte-wise FNV-1a manages ~1), then a final avalanche. Detects corruption; not a MAC.
// The value depends only on the bytes, never on how they were split into update() calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace xctx {

class hash64 {
 public:
  explicit hash64(uint64_t seed = 0) : h_(seed ^ kMulA) {}

  void update(const void* data, size_t n) {
    if (n == 0) return;  // data may be null then (an empty vector's data()); memcpy must not see it
    const auto* p = static_cast<const uint8_t*>(data);
    total_ += n;
    if (n_carry_ > 0) {  // finish the word a previous piece started
      const size_t take = n < 8 - n_carry_ ? n : 8 - n_carry_;
      std::memcpy(carry_ + n_carry_, p, take);
      n_carry_ += take, p += take, n -= take;
      if (n_carry_ < 8) return;
      mix(load(carry_));
      n_carry_ = 0;
    }
    for (; n >= 8; p += 8, n -= 8) mix(load(p));
    std::memcpy(carry_, p, n);
    n_carry_ = n;
  }

  uint64_t digest() const {
    uint64_t h = h_;
    if (n_carry_ > 0) {
      uint8_t last[8] = {};
      std::memcpy(last, carry_, n_carry_);
      h = step(h, load(last));
    }
    h ^= total_ * kMulB;  // the length: trailing zero bytes change the digest
    h ^= h >> 33;
    h *= kMulA;
    h ^= h >> 29;
    h *= kMulB;
    h ^= h >> 32;
    return h;
  }

  static uint64_t of(const void* data, size_t n, uint64_t seed = 0) {
    hash64 h(seed);
    h.update(data, n);
    return h.digest();
  }

 private:
  static constexpr uint64_t kMulA = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio
  static constexpr uint64_t kMulB = 0xd6e8feb86659fd93ull;  // an odd constant with mixed bits
  static uint64_t load(const uint8_t* p) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    return w;
  }
  static uint64_t step(uint64_t h, uint64_t w) {
    h ^= w * kMulB;
    h = (h << 27) | (h >> 37);
    return h * kMulA + 0x52dce729;
  }
  void mix(uint64_t w) { h_ = step(h_, w); }

  uint64_t h_;
  uint64_t total_ = 0;
  uint8_t carry_[8] = {};
  size_t n_carry_ = 0;
};

}  // namespace xctx
