// The softmax's exponential in 16 float32 lanes, shared by the extend attention kernels
// (extend_attention.cpp on AVX-512, amx_extend_attention.cpp on AMX tiles).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace sgl_lite {

constexpr float kLog2e = 1.44269504088896341f;

// 2^x in 16 lanes, for x below 128: x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor series to
// f^6 (relative error < 2e-7, about an ulp), times 2^n by VSCALEFPS, which also underflows to 0 exactly.
// Inputs below -200 (masked keys' -inf included) are clamped there: 0. Scores are kept in base 2 (the query
// scale carries log2(e)), so this is the softmax's exp with nine instructions where exp(x) took seventeen.
inline __m512 exp2_lanes(__m512 x) {
  constexpr float kTerms[7] = {1.f, 6.9314718055994531e-1f, 2.4022650695910071e-1f, 5.5504108664821580e-2f,
                               9.6181291076284772e-3f, 1.3333558146428443e-3f, 1.5403530393381606e-4f};  // ln(2)^k / k!
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kTerms[6]);
  for (int k = 5; k >= 0; --k) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kTerms[k]));
  return _mm512_scalef_ps(p, n);
}

// 2^x for probabilities rounded to bf16 right after, x finite and below 128: 2^frac(x) by a cubic fitted on
// [0, 1) (relative error < 8e-5, a 27th of bf16's rounding), times 2^floor(x) by VSCALEFPS, which floors its
// exponent itself and underflows to 0 exactly. Six instructions.
inline __m512 exp2_lanes_bf16(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.802443206310272e-2f), f, _mm512_set1_ps(2.2606728971004486e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335041999817e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251961708069e-1f));
  return _mm512_scalef_ps(p, x);
}

}  // namespace sgl_lite

#endif
