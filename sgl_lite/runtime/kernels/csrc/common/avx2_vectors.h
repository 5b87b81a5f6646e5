// Vector helpers shared by the AVX2 + FMA matmuls (avx2_gemv.cpp, avx2_q4_gemv.cpp): 16 output columns of
// one k held as two float32 vectors, and their store (after the bias) as float32 or as bf16 rounded once.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SGL_LITE_HAS_AVX2_FMA 1
#else
#define SGL_LITE_HAS_AVX2_FMA 0
#endif

namespace sgl_lite_avx2 {

constexpr int64_t kCols = 16;  // output columns per packed run of one k

#if SGL_LITE_HAS_AVX2_FMA

inline void store_row(const __m256& y0, const __m256& y1, float* out) {
  _mm256_storeu_ps(out, y0);
  _mm256_storeu_ps(out + 8, y1);
}

inline void store_row(const __m256& y0, const __m256& y1, uint16_t* out) {
  alignas(32) float wide[kCols];
  _mm256_store_ps(wide, y0);
  _mm256_store_ps(wide + 8, y1);
  for (int64_t c = 0; c < kCols; ++c) out[c] = c10::BFloat16(wide[c]).x;  // round to nearest even
}

// A row's 16 sums plus the columns' bias (none when null), stored: the bias last, as F.linear's reference sums.
template <typename O>
inline void store_row(__m256 y0, __m256 y1, const float* bias, O* out) {
  if (bias != nullptr) {
    y0 = _mm256_add_ps(y0, _mm256_loadu_ps(bias));
    y1 = _mm256_add_ps(y1, _mm256_loadu_ps(bias + 8));
  }
  store_row(y0, y1, out);
}

#endif

}  // namespace sgl_lite_avx2
