// The matmul kernels' register tiles take their row count as a template argument (so the compiler keeps
// every row's accumulators in registers); this turns a run-time count into that argument. And the int8
// kernels' split of their column tiles between threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

namespace sgl_lite_tiles {

// f(std::integral_constant<int, R>{}) for R = rows, 1 <= rows <= kMax (rows beyond kMax: kMax).
template <int kMax, int R = 1, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R >= kMax) {
    f(std::integral_constant<int, kMax>{});
  } else {
    if (rows <= R) return f(std::integral_constant<int, R>{});
    with_rows<kMax, R + 1>(rows, f);
  }
}

// f(t) for every column tile t in [0, tiles), on up to at::get_num_threads() threads that take runs of up to
// max_run tiles from a shared counter, not fixed shares: a thread that loses its core for a moment must not
// leave the others waiting at the end of every matmul (bf16_gemv.cpp).
template <typename F>
inline void for_each_column_tile(int64_t tiles, int64_t max_run, F&& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(max_run, tiles / (threads * 4)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(run, std::memory_order_relaxed); begin < tiles;
         begin = next.fetch_add(run, std::memory_order_relaxed)) {
      for (int64_t t = begin; t < std::min(tiles, begin + run); ++t) f(t);
    }
  });
}

}  // namespace sgl_lite_tiles
