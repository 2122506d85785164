// A minimal parallel loop over std::thread for the CPU kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace jax_flashattn::cpu {

// Calls fn(i) once for every i in [0, n_tasks), on at most hardware_concurrency threads and no
// more threads than tasks; the calling thread is one of them, and a single task runs inline.
// Tasks are handed out one at a time, so uneven tasks (causal heads, short sequences) balance.
// An exception thrown by a task stops further tasks from starting and is rethrown here once
// every thread has joined: it never escapes a thread, which would terminate the process.
template <typename Fn>
void parallel_for(int64_t n_tasks, const Fn& fn) {
  if (n_tasks <= 0) return;
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t n_threads = std::min(hardware, n_tasks);
  if (n_threads == 1) {
    for (int64_t i = 0; i < n_tasks; ++i) fn(i);
    return;
  }

  std::atomic<int64_t> next{0};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto work = [&]() noexcept {
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n_tasks) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
        next.store(n_tasks, std::memory_order_relaxed);
      }
    }
  };

  std::vector<std::thread> helpers;
  helpers.reserve(n_threads - 1);
  for (int64_t t = 1; t < n_threads; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      // The system refused another thread: the threads already running take every task.
      break;
    }
  }
  work();
  for (std::thread& helper : helpers) helper.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace jax_flashattn::cpu
