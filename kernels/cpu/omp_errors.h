// An exception must not leave an OpenMP region: the runtime terminates the process (a damaged
// cache's NaN, caught by softmax_acc's checks inside a parallel attention loop, aborted the rank
// instead of reaching the job's error handling). Work inside a region runs through run(): the
// first exception is kept and later work skipped; rethrow() after the region throws it on the
// calling thread. Worksharing constructs and barriers are still met by every thread.
#pragma once

#include <atomic>
#include <exception>
#include <mutex>

namespace xctx::cpu {

class omp_error_carrier {
 public:
  template <class F>
  void run(F&& work) noexcept {
    if (failed_.load(std::memory_order_relaxed)) return;
    try {
      work();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_) first_ = std::current_exception();
      failed_.store(true, std::memory_order_relaxed);
    }
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr first_;
};

}  // namespace xctx::cpu
