// Paged decode attention on CPU: one query token per request against its KV slots in the pool.
//
// Inputs are FlashInfer's page-size-1 metadata: request b attends over the slots
// kv_indices[kv_indptr[b] : kv_indptr[b+1]] of k_cache/v_cache [num_slots, Hkv, D]. K/V rows are read
// straight from the pool (no gather copy) and converted to fp32 in registers (bf16, fp16, fp32, fp8
// e4m3fn / e5m2 storage). GQA: the G = Hq / Hkv query heads of a KV head share one read of its rows.
// Scores, the online softmax and the P.V accumulation are fp32; for bf16 queries and K/V, where bf16_gemv's
// probe prefers VDPBF16PS, the products are taken in bf16 pairs and summed in fp32 (decode_pairs.h).
//
// Work items are (request, chunk of the context) with all KV heads, reading each slot's row whole, or
// (request, kv head, chunk) when that leaves threads idle; contexts are cut into chunks of a fixed length
// (so that long ones make several items, and a row's arithmetic never depends on its batch). Threads take
// items from a shared counter (a thread that loses its core to another process does not hold up the
// others), and the last chunk of a (request, kv head) to finish merges the chunks' partial softmax states
// in chunk order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16_arithmetic.h"

namespace {

// Floats per vector: one AVX-512 register, else one AVX2 register (two SSE ones). Sixteen lanes on AVX2
// made every vector two registers and the shuffles of the lane reductions cross-register permutes: about
// 3x slower there than eight.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxChunksPerRow = kMaxHeadDim / kLanes;
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kBlock = 32;  // tokens scored between two online-softmax updates
// Contexts are cut into chunks of about this many tokens, whatever the batch and the thread count, so that
// a request's result does not depend on either (the same sums in the same order): decoding alone, in a
// batch, or as a speculative verification row gives the same bits.
constexpr int64_t kChunk = 256;
// Tokens: slots are scattered, so the hardware prefetcher cannot follow. Into L2 (see prefetch_row), 48,
// 96 and 160 ran alike on a 2-core EPYC (Zen 4); 96 was a little ahead.
constexpr int64_t kPrefetchAhead = 96;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

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

// Into L2 (prefetcht1), not L1: a prefetch into L1 holds one of the core's few L1 miss buffers until its
// line arrives, and a whole look-ahead of rows (96 x 6 lines) queued behind them stalled the loads the
// arithmetic waits on. On a 2-core EPYC (Zen 4) the kernel read K/V at 18-20 GB/s this way against 13-15
// into L1 (bench_decode_kernels, interleaved builds, 2026-11-25).
inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(static_cast<const char*>(p) + off, 0, 2);
}

// One block's scores for each query head, as vectors or as floats.
union BlockScores {
  vfloat vec[kBlock / kLanes];
  float at[kBlock];
};
static_assert(kBlock % kLanes == 0, "a block is whole vectors");

// The online softmax step of a block of nb scores for Q query heads: each head's running max rises to the
// block's (its C accumulator vectors and its sum rescaled), and its scores become exp(score - max), exactly
// 0 past nb.
__attribute__((always_inline)) inline void softmax_block(BlockScores* scores, int64_t Q, int64_t nb, int64_t C, vfloat* acc, float* run_max, float* run_sum) {
  for (int64_t g = 0; g < Q; ++g) {
    // A short last block: its unused lanes hold stale scores; they must come out as exactly 0.
    for (int64_t i = nb; i < kBlock; ++i) scores[g].at[i] = kNegInf;
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
    for (int64_t i = nb; i < kBlock; ++i) scores[g].at[i] = 0.f;
    for (int64_t v = 0; v < kBlock / kLanes; ++v) sum += scores[g].vec[v];
    run_sum[g] += hsum(sum);
  }
}

// Softmax state of one (request, kv head, chunk): G running maxima and sums and G unnormalized outputs.
struct Partial {
  float* acc;  // [G, D]
  float* max;  // [G]
  float* sum;  // [G]
};

struct Shape {
  int64_t group, dim, row_stride;  // row_stride: elements between consecutive slots (Hkv * D)
};

// One chunk of `n` slots for H consecutive kv heads (1, or all of them: see run()): q_scaled [H * G, D/kLanes]
// (already times the softmax scale; the query heads of those kv heads, in order), k_base / v_base the
// first of those heads' part of slot 0's row, outs[h] the h-th head's partial. Each head's sums are the
// same, in the same order, whatever H is. row_bytes: how much of each slot's K and V rows to prefetch.
// kC: the vectors per row (D / kLanes) when known at compile time (0: read from `shape`); with it the
// compiler keeps a row and each head's accumulator in registers instead of memory (~2x at D = 64).
// kG: the query heads per KV head when known at compile time (0: from `shape`); with it the P.V pass keeps
// a kv head's accumulators in registers and adds each V row to all of them as it is decoded, so that the
// heads' FMA chains interleave (one head at a time waited on each FMA's latency).
template <class Kv, int64_t kC, int64_t kG>
void attend_chunk(const vfloat* q_scaled, const typename Kv::T* k_base, const typename Kv::T* v_base,
                  const int64_t* slots, int64_t n, const Shape& shape, int64_t H, int64_t row_bytes, Partial* outs) {
  const int64_t G = kG ? kG : shape.group, C = kC ? kC : shape.dim / kLanes, stride = shape.row_stride, D = shape.dim;
  const int64_t Q = H * G;  // query heads, at most kMaxGroup
  vfloat acc[kMaxGroup * kMaxChunksPerRow];
  vfloat row[kMaxChunksPerRow];
  BlockScores scores[kMaxGroup];
  float run_max[kMaxGroup], run_sum[kMaxGroup];
  for (int64_t j = 0; j < Q * C; ++j) acc[j] = vfloat{};
  std::fill(run_max, run_max + Q, kNegInf);
  std::fill(run_sum, run_sum + Q, 0.f);
  // the chunk's first rows, which the loop's look-ahead prefetch never covers
  for (int64_t t = 0; t < std::min(n, kPrefetchAhead); ++t) prefetch_row(k_base + slots[t] * stride, row_bytes);
  vfloat dots[kMaxGroup][kLanes];  // per query head, kLanes tokens' unreduced q.k products
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t nb = std::min(kBlock, n - start);
    for (int64_t v = 0; v < kBlock / kLanes; ++v) {
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t t = start + v * kLanes + i;
        if (t >= n) {  // past the end: any finite value, masked to -inf below
          for (int64_t g = 0; g < Q; ++g) dots[g][i] = vfloat{};
          continue;
        }
        if (t + kPrefetchAhead < n) prefetch_row(k_base + slots[t + kPrefetchAhead] * stride, row_bytes);
        prefetch_row(v_base + slots[t] * stride, row_bytes);  // read by the P.V pass of this block
        for (int64_t h = 0; h < H; ++h) {
          const typename Kv::T* k_row = k_base + slots[t] * stride + h * D;
          for (int64_t c = 0; c < C; ++c) row[c] = Kv::decode(k_row + c * kLanes);
          for (int64_t g = h * G; g < (h + 1) * G; ++g) {
            const vfloat* qg = q_scaled + g * C;
            vfloat dot = qg[0] * row[0];
            for (int64_t c = 1; c < C; ++c) dot += qg[c] * row[c];
            dots[g][i] = dot;
          }
        }
      }
      for (int64_t g = 0; g < Q; ++g) scores[g].vec[v] = reduce_lanes(dots[g]);
    }
    softmax_block(scores, Q, nb, C, acc, run_max, run_sum);
    // P.V, one kv head at a time. Every head's accumulator adds the tokens in order, whichever way the loops
    // nest (the same bits).
    for (int64_t h = 0; h < H; ++h) {
      if constexpr (kG != 0 && kC != 0) {
        // each V row decoded into registers and added to every head's accumulator (all in registers)
        vfloat a[kG * kC];
        for (int64_t j = 0; j < kG * kC; ++j) a[j] = acc[h * kG * kC + j];
        for (int64_t i = 0; i < nb; ++i) {
          const typename Kv::T* v_row = v_base + slots[start + i] * stride + h * D;
          vfloat vr[kC];
          for (int64_t c = 0; c < kC; ++c) vr[c] = Kv::decode(v_row + c * kLanes);
          for (int64_t g = 0; g < kG; ++g) {
            const float p = scores[h * kG + g].at[i];
            for (int64_t c = 0; c < kC; ++c) a[g * kC + c] += p * vr[c];
          }
        }
        for (int64_t j = 0; j < kG * kC; ++j) acc[h * kG * kC + j] = a[j];
      } else {
        // the block's V rows decoded once, then one head at a time so that its accumulator stays in registers
        vfloat values[kBlock * kMaxChunksPerRow];
        for (int64_t i = 0; i < nb; ++i) {
          const typename Kv::T* v_row = v_base + slots[start + i] * stride + h * D;
          for (int64_t c = 0; c < C; ++c) values[i * C + c] = Kv::decode(v_row + c * kLanes);
        }
        for (int64_t g = h * G; g < (h + 1) * G; ++g) {
          vfloat a[kMaxChunksPerRow];
          for (int64_t c = 0; c < C; ++c) a[c] = acc[g * C + c];
          for (int64_t i = 0; i < nb; ++i) {
            const float p = scores[g].at[i];
            for (int64_t c = 0; c < C; ++c) a[c] += p * values[i * C + c];
          }
          for (int64_t c = 0; c < C; ++c) acc[g * C + c] = a[c];
        }
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    std::memcpy(outs[h].acc, acc + h * G * C, G * C * sizeof(vfloat));
    std::memcpy(outs[h].max, run_max + h * G, G * sizeof(float));
    std::memcpy(outs[h].sum, run_sum + h * G, G * sizeof(float));
  }
}

// Combine the chunks of one (request, kv head) and write its G output rows.
template <class OutT>
void merge_chunks(const Partial* parts, int64_t num_parts, const Shape& shape, OutT* out) {
  const int64_t G = shape.group, D = shape.dim;
  alignas(64) float acc[kMaxHeadDim];
  for (int64_t g = 0; g < G; ++g) {
    float m = kNegInf;
    for (int64_t c = 0; c < num_parts; ++c) m = std::max(m, parts[c].max[g]);
    std::fill(acc, acc + D, 0.f);
    float sum = 0.f;
    for (int64_t c = 0; c < num_parts; ++c) {
      const float w = std::exp(parts[c].max[g] - m);
      sum += w * parts[c].sum[g];
      const float* a = parts[c].acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += w * a[d];
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<OutT>(acc[d] * inv);
  }
}

#include "decode_pairs.h"

// A chunk of one request's context for the KV heads [head_begin, head_end); chunk: its index in the request.
struct Item {
  int64_t request, head_begin, head_end, chunk_begin, chunk_end, chunk;
};

// attend_chunk for a head size kC compiled for the group size G where it is a common one (MHA, and the GQA
// ratios of Llama 3, Mistral, SmolLM2, Qwen2: 1, 2, 3, 4, 7, 8), else for any group.
template <class Kv, int64_t kC>
auto for_group(int64_t G) {
  switch (G) {
    case 1: return attend_chunk<Kv, kC, 1>;
    case 2: return attend_chunk<Kv, kC, 2>;
    case 3: return attend_chunk<Kv, kC, 3>;
    case 4: return attend_chunk<Kv, kC, 4>;
    case 7: return attend_chunk<Kv, kC, 7>;
    case 8: return attend_chunk<Kv, kC, 8>;
    default: return attend_chunk<Kv, kC, 0>;
  }
}

template <class QT, class Kv>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* indptr,
         const int64_t* indices, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const Shape shape{Hq / Hkv, D, Hkv * D};
  const int64_t G = shape.group;

  // Where there are enough chunks to keep every thread busy, an item takes all KV heads of its chunk and
  // reads each slot's row whole (every head's K, then V, one contiguous run): reading one head's 128 bytes
  // of each 384-byte row got 11-12 GB/s from memory on a 2-core EPYC, whole rows 25-27 GB/s. Otherwise (one
  // short request, say) items are single heads, as many as there are. Either way each (request, head,
  // chunk) is computed alike, so the bits do not depend on the choice. (The kernel, whose arithmetic
  // overlaps its reads less well than a plain sum does, gained 1.05-1.08x from it at 8-32 x 480-2000.)
  std::vector<int64_t> first_part(B * Hkv + 1, 0), chunks_of(B);
  int64_t num_chunks = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = indptr[b + 1] - indptr[b];
    chunks_of[b] = std::max<int64_t>(1, (len + kChunk - 1) / kChunk);
    num_chunks += chunks_of[b];
    for (int64_t h = 0; h < Hkv; ++h) first_part[b * Hkv + h + 1] = first_part[b * Hkv + h] + chunks_of[b];
  }
  const bool whole_rows = Hkv > 1 && Hq <= kMaxGroup && num_chunks >= 2 * at::get_num_threads();
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = indptr[b + 1] - indptr[b], chunks = chunks_of[b];
    for (int64_t h = 0; h < (whole_rows ? 1 : Hkv); ++h) {
      for (int64_t c = 0; c < chunks; ++c) {
        items.push_back({b, h, whole_rows ? Hkv : h + 1, indptr[b] + c * len / chunks, indptr[b] + (c + 1) * len / chunks, c});
      }
    }
  }
  const int64_t num_parts = first_part[B * Hkv];
  std::vector<float> part_acc(num_parts * G * D), part_max(num_parts * G), part_sum(num_parts * G);
  std::vector<Partial> parts(num_parts);
  for (int64_t p = 0; p < num_parts; ++p) parts[p] = {&part_acc[p * G * D], &part_max[p * G], &part_sum[p * G]};
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[B * Hkv]);
  for (int64_t bh = 0; bh < B * Hkv; ++bh) remaining[bh].store(first_part[bh + 1] - first_part[bh], std::memory_order_relaxed);
  std::atomic<int64_t> next{0};

  const int64_t row_bytes = D * int64_t(sizeof(typename Kv::T));  // one head's part of a slot row
  const auto* q_ptr = q.data_ptr<QT>();
  const auto* k_ptr = reinterpret_cast<const typename Kv::T*>(k_cache.data_ptr());
  const auto* v_ptr = reinterpret_cast<const typename Kv::T*>(v_cache.data_ptr());
  auto* out_ptr = out.data_ptr<QT>();
  const int64_t num_items = int64_t(items.size());

  // the common head sizes (64: Llama 3.2 1B, SmolLM2, Qwen2 0.5B; 128: most larger models) and groups compiled for their size
  const auto attend = D == 64 ? for_group<Kv, 64 / kLanes>(G) : D == 128 ? for_group<Kv, 128 / kLanes>(G) : attend_chunk<Kv, 0, 0>;
#if SGL_LITE_HAS_DPBF16_DECODE
  // bf16 queries and K/V in VDPBF16PS where bf16_gemv.cpp's probe found it the faster arithmetic
  PairsAttend attend_pairs = nullptr;
  if constexpr (std::is_same_v<QT, c10::BFloat16> && std::is_same_v<Kv, Bf16Kv>) {
    if (sgl_lite::dpbf16_preferred()) attend_pairs = pairs_for(D, G);
  }
#endif
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    vfloat q_scaled[kMaxGroup * kMaxChunksPerRow];
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= num_items) break;
      const Item& it = items[i];
      const int64_t h0 = it.head_begin, H = it.head_end - it.head_begin;
      const QT* qh = q_ptr + (it.request * Hq + h0 * G) * D;
      Partial outs[kMaxGroup];
      for (int64_t h = 0; h < H; ++h) outs[h] = parts[first_part[it.request * Hkv + h0 + h] + it.chunk];
      const int64_t* slots = indices + it.chunk_begin;
      const int64_t n = it.chunk_end - it.chunk_begin;
#if SGL_LITE_HAS_DPBF16_DECODE
      if (attend_pairs != nullptr) {
        attend_pairs(reinterpret_cast<const uint16_t*>(qh), scale, reinterpret_cast<const uint16_t*>(k_ptr + h0 * D),
                     reinterpret_cast<const uint16_t*>(v_ptr + h0 * D), slots, n, shape, H, H * row_bytes, outs);
      } else
#endif
      {
        for (int64_t j = 0; j < H * G * D; ++j) q_scaled[j / kLanes][j % kLanes] = to_float(qh[j]) * scale;
        attend(q_scaled, k_ptr + h0 * D, v_ptr + h0 * D, slots, n, shape, H, H * row_bytes, outs);
      }
      for (int64_t h = h0; h < h0 + H; ++h) {
        const int64_t bh = it.request * Hkv + h;
        // The last chunk to finish merges; acq_rel makes the other chunks' partials visible to it.
        if (remaining[bh].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          merge_chunks(&parts[first_part[bh]], first_part[bh + 1] - first_part[bh], shape, out_ptr + (it.request * Hq + h * G) * D);
        }
      }
    }
  });
}

template <class QT>
void dispatch_kv(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int32_t* indptr,
                 const int64_t* indices, float scale, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run<QT, Fp32Kv>(q, k_cache, v_cache, indptr, indices, scale, out);
    case at::kBFloat16: return run<QT, Bf16Kv>(q, k_cache, v_cache, indptr, indices, scale, out);
    case at::kHalf: return run<QT, Fp16Kv>(q, k_cache, v_cache, indptr, indices, scale, out);
    case at::kFloat8_e4m3fn: return run<QT, E4m3Kv>(q, k_cache, v_cache, indptr, indices, scale, out);
    case at::kFloat8_e5m2: return run<QT, E5m2Kv>(q, k_cache, v_cache, indptr, indices, scale, out);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& kv_indptr, const at::Tensor& kv_indices, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "q must be [B, Hq, D], k_cache/v_cache [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "q, k_cache and v_cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D <= kMaxHeadDim && D % kLanes == 0,
              "head_dim must match the cache, be a multiple of ", kLanes, " and at most ", kMaxHeadDim);
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "Hq must be a multiple of Hkv, at most ", kMaxGroup, " query heads per kv head");
  TORCH_CHECK(kv_indptr.scalar_type() == at::kInt && kv_indptr.is_contiguous() && kv_indptr.numel() == B + 1, "kv_indptr must be int32 [B+1]");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.is_contiguous(), "kv_indices must be contiguous int64");
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(indptr[b + 1] > indptr[b], "request ", b, " has no KV slots (a decode row attends at least to itself)");
  }
  TORCH_CHECK(indptr[0] >= 0 && indptr[B] <= kv_indices.numel(), "kv_indptr runs past kv_indices");
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;  // a slot outside the cache would read foreign memory: check them all (cheap next to the reads)
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t i = indptr[0]; i < indptr[B]; ++i) {
    lo = std::min(lo, indices[i]);
    hi = std::max(hi, indices[i]);
  }
  TORCH_CHECK(lo >= 0 && hi < k_cache.size(0), "kv_indices holds a slot outside [0, ", k_cache.size(0), ")");
  at::Tensor out = at::empty_like(q);
  if (B == 0) return out;
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_kv<float>(q, k_cache, v_cache, indptr, indices, s, out); break;
    case at::kBFloat16: dispatch_kv<c10::BFloat16>(q, k_cache, v_cache, indptr, indices, s, out); break;
    case at::kHalf: dispatch_kv<c10::Half>(q, k_cache, v_cache, indptr, indices, s, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(sgl_lite, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
