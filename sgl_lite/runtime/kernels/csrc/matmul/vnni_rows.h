// The int8 matmul kernels' row I/O (w8a8_gemm.cpp, w4a8_gemm.cpp): SGL_LITE_HAS_VNNI, whether the build has
// AVX512-VNNI, BW and VL (the kernels' instructions), and where it does, activations and outputs of float32,
// bf16 (its bits) or fp16, 16 lanes at a time.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SGL_LITE_HAS_VNNI 1
#else
#define SGL_LITE_HAS_VNNI 0
#endif

#if SGL_LITE_HAS_VNNI
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "bf16_arithmetic.h"

namespace sgl_lite_rows {

inline __m512 widen(__m256i bits, c10::BFloat16*) { return sgl_lite::widen_bf16(bits); }
inline __m512 widen(__m256i bits, c10::Half*) { return _mm512_cvtph_ps(bits); }
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
template <typename T>
inline __m512 load_row16(const T* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), static_cast<T*>(nullptr));
}
inline __m512 load_partial(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
template <typename T>
inline __m512 load_partial(const T* p, __mmask16 mask) { return widen(_mm256_maskz_loadu_epi16(mask, p), static_cast<T*>(nullptr)); }

inline void store(__m512 y, float* out) { _mm512_storeu_ps(out, y); }
inline void store(__m512 y, c10::BFloat16* out) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), sgl_lite::round_to_bf16(y)); }
inline void store(__m512 y, c10::Half* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// run(x's data, out's data) as pointers of x's dtype (float32, bf16 or fp16; out has the same).
template <typename F>
inline void with_row_pointers(const at::Tensor& x, at::Tensor& out, F&& run) {
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  } else {
    run(x.data_ptr<c10::Half>(), out.data_ptr<c10::Half>());
  }
}

// max|x| over a row of k values.
template <typename T>
inline float max_abs(const T* x, int64_t k) {
  __m512 amax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_row16(x + i)));
  if (i < k) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_partial(x + i, static_cast<__mmask16>((1u << (k - i)) - 1))));
  return _mm512_reduce_max_ps(amax);
}

}  // namespace sgl_lite_rows

#endif
