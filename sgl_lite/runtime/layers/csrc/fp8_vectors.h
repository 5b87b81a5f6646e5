// 8-bit float KV rows (torch's float8_e4m3fn and float8_e5m2, stored with scale 1) widened in AVX-512
// registers, 16 values at a time and exactly: every value of either format is a float32 value, and a bf16
// one (e5m2 has 2 mantissa bits, e4m3fn 3, and both exponent ranges fit bf16's). The decode kernel
// (paged_decode_attention.cpp) does the same with portable vector types, for its AVX2 build too.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace sgl_lite {

inline __m256i widen_bytes(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// e5m2 is the upper byte of an fp16; the CPU's fp16 conversion is exact, subnormals included (whatever
// MXCSR's DAZ and FTZ say).
inline __m512 widen_e5m2(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_slli_epi16(widen_bytes(p), 8)); }

// e4m3fn (bias 7) placed in an fp16's fields reads as its value times 2^-8 (fp16's bias is 15), subnormals
// included; rescaled in float32. It has no infinities; its all-ones magnitude is NaN.
inline __m512 widen_e4m3fn(const uint8_t* p) {
  const __m256i u = widen_bytes(p);
  const __m256i magnitude = _mm256_and_si256(u, _mm256_set1_epi16(0x7f));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7), _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8));
  const __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_cvtepu16_epi32(magnitude), _mm512_set1_epi32(0x7f));
  return _mm512_mask_blend_ps(nan, value, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// A widened 8-bit float as bf16 bits: its upper half, exactly (the lower half is zero).
inline __m256i exact_bf16(__m512 widened) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(widened), 16)); }

}  // namespace sgl_lite

#endif
