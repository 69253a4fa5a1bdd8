// parallel_for for jaxinfer's C++ kernels on XLA:CPU's intra-op pool (included by each kernel source;
// jaxinfer/device/native.py compiles with this folder on the include path and keys builds by it too).
//
// Runs body(i) for i in [0, n) on the caller and `helpers` tasks of the pool. Work is taken from a shared
// counter and the caller waits only for items a running thread has taken, so it never waits on a task the
// pool has not started (no deadlock when the pool is busy or absent): a pool thread that starts late finds
// less work left, or none.
#ifndef JAXINFER_PARALLEL_FOR_H_
#define JAXINFER_PARALLEL_FOR_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

struct Progress {
  std::atomic<int64_t> next{0};
  int64_t done = 0;
  std::mutex mu;
  std::condition_variable cv;
};

template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t helpers, const Body& body) {
  if (helpers <= 0 || n <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  auto progress = std::make_shared<Progress>();
  auto work = [progress, n, &body] {
    int64_t mine = 0;
    for (int64_t i; (i = progress->next.fetch_add(1)) < n; ++mine) body(i);
    if (mine > 0) {
      std::lock_guard<std::mutex> lock(progress->mu);
      progress->done += mine;
      if (progress->done == n) progress->cv.notify_all();
    }
  };
  for (int64_t t = 0; t < helpers; ++t) {  // a helper that starts after the work is gone touches only `progress`
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(progress->mu);
  progress->cv.wait(lock, [&] { return progress->done == n; });
}

}  // namespace jaxinfer

#endif  // JAXINFER_PARALLEL_FOR_H_
