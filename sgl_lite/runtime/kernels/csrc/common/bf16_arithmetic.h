// Which bf16 arithmetic this core runs faster: VDPBF16PS or two float32 FMAs on the pair widened (on CPUs
// where VDPBF16PS issues at half their rate). bf16_gemv.cpp
// probes it once per process (`bf16_gemv_arithmetic`, overridable with `set_bf16_gemv_arithmetic`); the
// other bf16 kernels follow its answer.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace sgl_lite {

// True where VDPBF16PS is built and the probe (or an override) chose it; false without AVX512-BF16.
bool dpbf16_preferred();

#if defined(__AVX512F__)

// Rows paired for VDPBF16PS with VPUNPCKL/HWD (which work within 128-bit lanes) hold, per 32 dims, the
// low unpack's dims 0-3, 8-11, 16-19, 24-27 then the high one's 4-7, 12-15, 20-23, 28-31 (the interleaved
// order). Those two vectors back in dim order: dims 0-15 in `first`, 16-31 in `second`; two VPERMT2PS.
inline void deinterleave_dims(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  first = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23), hi);
  second = _mm512_permutex2var_ps(lo, _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31), hi);
}

// 16 bf16 (their bits) as float32, exactly: a bf16 is the upper half of a float32. One widening move.
inline __m512 widen_bf16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// 16 floats as bf16 bits, rounded as torch rounds a float to bf16: to nearest even, subnormals kept and
// NaN made quiet (VCVTNEPS2BF16 would flush subnormals, and it needs AVX512-BF16).
inline __m256i round_to_bf16(__m512 y) {
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

// 16 lanes' probabilities of keys a and b as VDPBF16PS pairs of keys (a's bf16 in a word's low half), rounded
// to nearest even: both rounded in one VCVTNE2PS2BF16 (a's in the low 16 words), then word i of a and of b
// side by side. The extend attention kernels' P operand.
inline __m512i bf16_pairs(__m512 a, __m512 b) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                              20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

#endif

}  // namespace sgl_lite
