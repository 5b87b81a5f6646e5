// 8-bit float KV rows (torch's float8_e4m3fn and float8_e5m2, stored with scale 1) widened in AVX-512
// registers, 16 values at a time and exactly: every value of either format is a float32 value, and a bf16
// one (e5m2 has 2 mantissa bits, e4m3fn 3, and both exponent ranges fit bf16's). The decode kernel's float32
// path (paged_decode_attention.cpp) does the same with portable vector types, for its AVX2 build too.
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

#if defined(__AVX512BW__)
// Row readers for the kernels' bf16-pair arithmetic (decode_pairs.h, extend_attention.cpp): a pool's stored
// values, 32 at a time, as the bf16 bits of one 64-byte vector. An 8-bit pool is widened by a table of the
// bf16 bits of its 128 magnitudes (the exact conversions above, computed once per reader): two VPERMT2W
// per 32 values, then the sign put back.
struct Bf16Rows {
  using T = uint16_t;
  inline __m512i load32(const T* p) const { return _mm512_loadu_si512(p); }
};
template <__m512 (*widen)(const uint8_t*)>
class Fp8Rows {
 public:
  using T = uint8_t;
  Fp8Rows() {
    alignas(64) uint8_t codes[128];
    alignas(64) uint16_t bits[128];
    for (int i = 0; i < 128; ++i) codes[i] = static_cast<uint8_t>(i);
    for (int i = 0; i < 128; i += 16) _mm256_store_si256(reinterpret_cast<__m256i*>(bits + i), exact_bf16(widen(codes + i)));
    for (int t = 0; t < 4; ++t) table_[t] = _mm512_load_si512(bits + 32 * t);
  }
  inline __m512i load32(const T* p) const {
    const __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i magnitude = _mm512_and_si512(u, _mm512_set1_epi16(0x7f));
    // VPERMT2W reads an index's low 6 bits: bit 5 picks the first or second table of a pair
    const __m512i low = _mm512_permutex2var_epi16(table_[0], magnitude, table_[1]);
    const __m512i high = _mm512_permutex2var_epi16(table_[2], magnitude, table_[3]);
    const __m512i bits = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(u, _mm512_set1_epi16(0x40)), low, high);
    return _mm512_or_si512(bits, _mm512_slli_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x80)), 8));
  }

 private:
  __m512i table_[4];  // the bf16 bits of magnitudes 32t .. 32t + 31
};
using E4m3Rows = Fp8Rows<widen_e4m3fn>;
using E5m2Rows = Fp8Rows<widen_e5m2>;
#endif  // __AVX512BW__

}  // namespace sgl_lite

#endif
