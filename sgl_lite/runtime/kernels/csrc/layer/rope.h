// Rotate-half RoPE (the HF layout) with ATen's roundings, shared by the decode layer's op (decode_layer.cpp,
// which also writes k and v into the KV pool) and the prefill path's rotary_embedding op
// (rotary_embedding.cpp): both give the bits of torch's cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace sgl_lite {

// A float rounded to T and back, as ATen rounds each bf16 op's float result (to nearest even; NaN to
// c10's quiet NaN), written without branches so that the loops below vectorize.
inline float rounded(float x, float) { return x; }
inline float rounded(float x, c10::BFloat16) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t nearest = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t bits = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : nearest;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float widened(float x) { return x; }
inline float widened(c10::BFloat16 x) { return static_cast<float>(x); }

// A value of the model's dtype as the KV pool stores it (KVPool.write): as it is, or, in an 8-bit float
// pool, saturated to the format's largest finite value (e5m2 would make inf of an out-of-range value, and
// inf * 0 poisons attention; NaN stays NaN) and converted as torch's .to() converts (c10's conversion).
template <class C>
inline C stored(float x) {
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>) {
    const float finite = static_cast<float>(std::numeric_limits<C>::max());
    return C(x > finite ? finite : x < -finite ? -finite : x);
  } else {
    return static_cast<C>(x);
  }
}

// A value already rounded to bf16 (rounded(x, BFloat16()): NaN as c10's quiet NaN) stored as its upper
// half, which is what c10's conversion gives it; unlike that conversion's branches, this vectorizes.
template <>
inline c10::BFloat16 stored<c10::BFloat16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return c10::BFloat16(static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}

// One head x [2 * half] of the model's dtype T (bf16 or float32) rotated by cos/sin [half] into out: each
// product, then each sum, rounded to T as ATen's ops round them, and no fused
// multiply-adds, which would round once where torch rounds twice (float32: x1 * cos - x2 * sin).
template <class T, class O>
__attribute__((optimize("fp-contract=off"))) inline void rotate_half(const T* x, const T* cos, const T* sin, int64_t half, O* out) {
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = widened(x[d]), x2 = widened(x[d + half]), cd = widened(cos[d]), sd = widened(sin[d]);
    const float lo = rounded(rounded(x1 * cd, T()) - rounded(x2 * sd, T()), T());
    const float hi = rounded(rounded(x2 * cd, T()) + rounded(x1 * sd, T()), T());
    out[d] = stored<O>(lo);  // exact into T: lo and hi are already values of T
    out[d + half] = stored<O>(hi);
  }
}

}  // namespace sgl_lite
