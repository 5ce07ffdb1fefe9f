// SPDX-License-Identifier: Apache-2.0
// Host loops over independent items on every core: parallel_for and a parallel std::sort.
// Used by the host statistics (src/reference) and the calibrators' reductions.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace sparseprefill::detail {

// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads.
template <class Fn>
void parallel_for(int n, const Fn& fn) {
  const int threads = std::max(1, std::min<int>(n, static_cast<int>(std::thread::hardware_concurrency())));
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&]() {
      for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
    });
  }
  for (std::thread& th : pool) th.join();
}

// Sorts v by `less` like std::sort (the same sorted sequence), on up to hardware_concurrency
// threads: chunks sorted in parallel, then merged pairwise in parallel rounds. A 128K-token
// sample gives ~17 M statistics per layer to rank (bench/records/2026-11-29-h200-calib-statistics.md:
// the single-threaded sorts were most of the 4.6 s of host reductions per Llama layer).
template <class Less>
void parallel_sort(std::vector<double>* v, Less less) {
  const std::size_t n = v->size();
  const int chunks = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (chunks == 1 || n < (std::size_t{1} << 16)) {
    std::sort(v->begin(), v->end(), less);
    return;
  }
  std::vector<std::ptrdiff_t> bound(static_cast<std::size_t>(chunks) + 1);
  for (int i = 0; i <= chunks; ++i) {
    bound[static_cast<std::size_t>(i)] = static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(i) / static_cast<std::size_t>(chunks));
  }
  const auto at = [&](int i) { return v->begin() + bound[static_cast<std::size_t>(std::min(i, chunks))]; };
  parallel_for(chunks, [&](int i) { std::sort(at(i), at(i + 1), less); });
  for (int width = 1; width < chunks; width *= 2) {
    parallel_for((chunks + 2 * width - 1) / (2 * width), [&](int pair) {
      const int lo = pair * 2 * width;
      if (lo + width < chunks) std::inplace_merge(at(lo), at(lo + width), at(lo + 2 * width), less);
    });
  }
}

}  // namespace sparseprefill::detail
