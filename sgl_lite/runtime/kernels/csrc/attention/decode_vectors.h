// The decode attention kernel's vector arithmetic (paged_decode_attention.cpp): float vectors of kLanes
// lanes (GCC/Clang vector extensions), the K/V storage formats decoded into them, the lane reductions, the
// softmax exponential, and a block's online-softmax step, which every arithmetic path shares.
//
// Not a standalone header: paged_decode_attention.cpp includes it inside its anonymous namespace, after its
// constants (kLanes, kBlock, kNegInf).
#pragma once

// GCC/Clang vector extensions: portable source, compiled to the widest vectors the target has.
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vu16 __attribute__((vector_size(kLanes * 2)));
typedef uint8_t vu8 __attribute__((vector_size(kLanes)));

template <class V, class T>
inline V load_vec(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Storage formats: `decode` turns kLanes stored elements into fp32 in registers.
struct Fp32Kv {
  using T = float;
  static inline vfloat decode(const T* p) { return load_vec<vfloat>(p); }
};
struct Bf16Kv {
  using T = uint16_t;  // bf16 is the upper half of an fp32
  static inline vfloat decode(const T* p) {
#if defined(__AVX512F__)
    // one widening move (GCC 12 lowers the vector conversion below to two half-width ones and an insert)
    return reinterpret_cast<vfloat>(sgl_lite::widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
    return reinterpret_cast<vfloat>(__builtin_convertvector(load_vec<vu16>(p), vu32) << 16);
#endif
  }
};
// fp16 and both fp8 formats go through the CPU's fp16 -> fp32 conversion (F16C / AVX-512: exact for
// fp16 subnormals whatever the DAZ/FTZ mode). GCC 12 lowers a _Float16 vector conversion lane by lane,
// hence the intrinsics; other targets take the portable scalar conversion.
inline vfloat half_to_float(vu16 bits) {
#if defined(__AVX512F__)
  return reinterpret_cast<vfloat>(_mm512_cvtph_ps(reinterpret_cast<__m256i>(bits)));
#elif defined(__F16C__)
  return reinterpret_cast<vfloat>(_mm256_cvtph_ps(reinterpret_cast<__m128i>(bits)));
#else
  vfloat f;
  for (int64_t i = 0; i < kLanes; ++i) f[i] = c10::detail::fp16_ieee_to_fp32_value(bits[i]);
  return f;
#endif
}
struct Fp16Kv {
  using T = uint16_t;
  static inline vfloat decode(const T* p) { return half_to_float(load_vec<vu16>(p)); }
};
// e5m2 is the upper byte of an fp16.
struct E5m2Kv {
  using T = uint8_t;
  static inline vfloat decode(const T* p) { return half_to_float(__builtin_convertvector(load_vec<vu8>(p), vu16) << 8); }
};
// e4m3fn (bias 7) has one mantissa bit more than e5m2: placed in an fp16's fields it reads as the value
// times 2^-8 (fp16's bias is 15), subnormals included (they land on fp16 subnormals); rescale in fp32.
// e4m3fn has no infinities; its all-ones magnitude is NaN.
struct E4m3Kv {
  using T = uint8_t;
  static inline vfloat decode(const T* p) {
    const vu16 u = __builtin_convertvector(load_vec<vu8>(p), vu16);
    const vu16 magnitude = u & 0x7f;
    const vfloat value = half_to_float((magnitude << 7) | ((u & 0x80) << 8)) * 256.0f;
    const vu32 is_nan = __builtin_convertvector(magnitude == 0x7f, vu32);
    return is_nan ? std::numeric_limits<float>::quiet_NaN() + vfloat{} : value;
  }
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

#if defined(__AVX512F__)

inline float hsum(vfloat v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

inline float hmax(vfloat v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// Lane i of the result is the sum of v[i]'s lanes: kLanes horizontal sums in 4 rounds of pairwise
// shuffle-adds (15 shuffles' worth per vector of results, not kLanes separate reductions).
inline vfloat reduce_lanes(const vfloat* v) {
  vfloat r1[8], r2[4], r3[2];
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: 8 partials of v[2i]; lanes 8-15: of v[2i+1]
    const vfloat a = v[2 * i], b = v[2 * i + 1];
    r1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // 4 partials each of v[4i], v[4i+2], v[4i+1], v[4i+3]
    const vfloat a = r1[2 * i], b = r1[2 * i + 1];
    r2[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
            __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {  // 2 partials each of v[8i + 0, 4, 2, 6, 1, 5, 3, 7]
    const vfloat a = r2[2 * i], b = r2[2 * i + 1];
    r3[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
            __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  // the sums of v[0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15] (bit-reversed order) ...
  const vfloat w = __builtin_shufflevector(r3[0], r3[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                   __builtin_shufflevector(r3[0], r3[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // ... put back in order (bit reversal is its own inverse)
  return __builtin_shufflevector(w, w, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

#else  // eight lanes: the same reductions in 3 rounds

inline float hsum(vfloat v) {
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  return v[0];
}

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

inline float hmax(vfloat v) {
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  return v[0];
}

inline vfloat reduce_lanes(const vfloat* v) {
  vfloat r1[4], r2[2];
  for (int i = 0; i < 4; ++i) {  // lanes 0-3: 4 partials of v[2i]; lanes 4-7: of v[2i+1]
    const vfloat a = v[2 * i], b = v[2 * i + 1];
    r1[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {  // 2 partials each of v[4i], v[4i+2], v[4i+1], v[4i+3]
    const vfloat a = r1[2 * i], b = r1[2 * i + 1];
    r2[i] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  // the sums of v[0, 4, 2, 6, 1, 5, 3, 7] (bit-reversed order), put back in order
  const vfloat w = __builtin_shufflevector(r2[0], r2[1], 0, 8, 2, 10, 4, 12, 6, 14) +
                   __builtin_shufflevector(r2[0], r2[1], 1, 9, 3, 11, 5, 13, 7, 15);
  return __builtin_shufflevector(w, w, 0, 4, 2, 6, 1, 5, 3, 7);
}

#endif

// exp(x) for x <= 0 (softmax arguments after subtracting the max), kLanes at a time: Cody-Waite range
// reduction and Cephes' degree-6 polynomial, ~1 ulp. Arguments below -87 give exp(-87) ~ 1.6e-38, not 0.
inline vfloat exp_nonpositive(vfloat x) {
  typedef int32_t vi32 __attribute__((vector_size(kLanes * 4)));
  x = x < -87.0f ? vfloat{} - 87.0f : x;  // keeps 2^n a normal float
  // n = round(x / ln 2); x <= 0, so round(y) = -trunc(0.5 - y) and the conversion's truncation does it
  const vi32 n_int = -__builtin_convertvector(0.5f - x * 1.44269504088896341f, vi32);
  const vfloat n = __builtin_convertvector(n_int, vfloat);
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = 1.9875691500e-4f + vfloat{};
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<vfloat>((n_int + 127) << 23);
}

// One block's scores for each query vector, as vectors or as floats.
union BlockScores {
  vfloat vec[kBlock / kLanes];
  float at[kBlock];
};
static_assert(kBlock % kLanes == 0, "a block is whole vectors");

// The online softmax step of a block for Q query vectors, vector g having nb[g] valid scores: each one's
// running max rises to the block's (its C accumulator vectors and its sum rescaled), and its scores become
// exp(score - max), exactly 0 past nb[g]. A vector with no valid score in the block (a verification query
// whose context ends before it) keeps its state, and its probabilities are all 0.
__attribute__((always_inline)) inline void softmax_block(BlockScores* scores, int64_t Q, const int64_t* nb, int64_t C, vfloat* acc, float* run_max, float* run_sum) {
  for (int64_t g = 0; g < Q; ++g) {
    if (nb[g] <= 0) {
      for (int64_t v = 0; v < kBlock / kLanes; ++v) scores[g].vec[v] = vfloat{};
      continue;
    }
    // A short last block: its unused lanes hold stale scores; they must come out as exactly 0.
    for (int64_t i = nb[g]; i < kBlock; ++i) scores[g].at[i] = kNegInf;
    vfloat lanes_max = scores[g].vec[0];
    for (int64_t v = 1; v < kBlock / kLanes; ++v) lanes_max = vmax(lanes_max, scores[g].vec[v]);
    const float block_max = hmax(lanes_max);
    if (block_max > run_max[g]) {
      // exp(-inf) = 0 on the first block: acc and the sum are still zero then
      const float alpha = run_max[g] == kNegInf ? 0.f : std::exp(run_max[g] - block_max);
      for (int64_t c = 0; c < C; ++c) acc[g * C + c] *= alpha;
      run_sum[g] *= alpha;
      run_max[g] = block_max;
    }
    const float m = run_max[g];
    vfloat sum{};
    for (int64_t v = 0; v < kBlock / kLanes; ++v) {
      scores[g].vec[v] = exp_nonpositive(scores[g].vec[v] - m);
    }
    for (int64_t i = nb[g]; i < kBlock; ++i) scores[g].at[i] = 0.f;
    for (int64_t v = 0; v < kBlock / kLanes; ++v) sum += scores[g].vec[v];
    run_sum[g] += hsum(sum);
  }
}
