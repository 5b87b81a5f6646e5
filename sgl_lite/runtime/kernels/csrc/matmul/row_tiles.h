// The matmul kernels' register tiles take their row count as a template argument (so the compiler keeps
// every row's accumulators in registers); this turns a run-time count into that argument.
#pragma once

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

}  // namespace sgl_lite_tiles
