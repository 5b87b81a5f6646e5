// The register-blocked products of the extend attention kernel (extend_attention.cpp), one tile's rows
// against a block of keys: scores S^T = K Q^T and outputs O += P V, in two arithmetics.
//
// float32 FMAs (every dtype): Q^T, K and V widened to float32 first.
// VDPBF16PS (bf16, on CPUs where it outruns float32 FMAs): products of bf16 pairs, accumulated in float32.
// The scores pair Q and K along D as they are stored (Q^T rearranged into pairs once per tile, K read
// straight from the pool). The outputs pair two keys: the block's probabilities are rounded to bf16 (as
// flash attention does on GPUs) and its V rows interleaved two by two with VPUNPCKL/HWD, which works
// within 128-bit lanes, so O's dims sit in the interleaved order (bf16_arithmetic.h) until the tile is written.
//
// Not a standalone header: extend_attention.cpp includes it inside its anonymous namespace, after its
// constants (kRows) and AVX-512 includes.
#pragma once

// S^T[j][r0 : r0 + 32] = K[j] . Q^T for keys j0..j0+3 and two vectors of rows (qt is [D][R]).
template <int64_t C>
inline void scores_block(const float* qt, int64_t R, const float* k, float* st) {
  __m512 a[4][2];
  for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < C * 16; ++d) {
    const __m512 q0 = _mm512_loadu_ps(qt + d * R), q1 = _mm512_loadu_ps(qt + d * R + 16);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 kv = _mm512_set1_ps(k[j * C * 16 + d]);
      a[j][0] = _mm512_fmadd_ps(kv, q0, a[j][0]);
      a[j][1] = _mm512_fmadd_ps(kv, q1, a[j][1]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    _mm512_storeu_ps(st + j * R, a[j][0]);
    _mm512_storeu_ps(st + j * R + 16, a[j][1]);
  }
}

// The outputs of rows r0..r0+3 (C vectors each, from o) in registers, each times its online-softmax rescale
// alpha[r]; and stored back: what values_block and values_block_dp do before and after their products.
template <int64_t C>
__attribute__((always_inline)) inline void load_rescaled_outputs(const float* o, const float* alpha, __m512 (&a)[kRows][C]) {
  for (int r = 0; r < kRows; ++r) {
    const __m512 scale = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < C; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * C * 16 + c * 16), scale);
  }
}
template <int64_t C>
__attribute__((always_inline)) inline void store_outputs(const __m512 (&a)[kRows][C], float* o) {
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(o + r * C * 16 + c * 16, a[r][c]);
}

// O[r] = alpha[r] O[r] + P[r][0:n] V[0:n] for rows r0..r0+3 (pt is [32][R], v [32][D]): the online
// softmax's rescale applied as the outputs are loaded, not in a pass of its own.
template <int64_t C>
inline void values_block(const float* pt, int64_t R, const float* v, int64_t n, const float* alpha, float* o) {
  __m512 a[kRows][C];
  load_rescaled_outputs<C>(o, alpha, a);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + j * C * 16 + c * 16);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512 pv = _mm512_set1_ps(pt[j * R + r]);
      for (int64_t c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pv, vv[c], a[r][c]);
    }
  }
  store_outputs<C>(a, o);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // BW: fp8_vectors.h's row readers
#define SGL_LITE_HAS_DPBF16_EXTEND 1

// As scores_block from bf16 pairs, for keys j0..j0+7 (kPairKeys): qp is Q^T as [D/2][R] words (a row's dims
// 2p, 2p + 1), kb the keys' rows copied together ([8][D/2] words: one base register for the broadcasts,
// where eight row pointers were reloaded from the stack every step); the scale is applied to the sums.
// Eight keys, not four: VDPBF16PS's latency needs 16 independent sums in flight to issue every cycle.
constexpr int64_t kPairKeys = 8;
template <int64_t C>
inline void scores_block_dp(const uint32_t* qp, int64_t R, const uint32_t* kb, float scale, float* st) {
  __m512 a[kPairKeys][2];
  for (int j = 0; j < kPairKeys; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < C * 8; ++p) {
    const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qp + p * R), q1 = (__m512bh)_mm512_loadu_si512(qp + p * R + 16);
#pragma GCC unroll 8
    for (int j = 0; j < kPairKeys; ++j) {
      const __m512bh kv = (__m512bh)_mm512_set1_epi32(static_cast<int>(kb[j * C * 8 + p]));
      a[j][0] = _mm512_dpbf16_ps(a[j][0], kv, q0);
      a[j][1] = _mm512_dpbf16_ps(a[j][1], kv, q1);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int j = 0; j < kPairKeys; ++j) {
    _mm512_storeu_ps(st + j * R, _mm512_mul_ps(a[j][0], s));
    _mm512_storeu_ps(st + j * R + 16, _mm512_mul_ps(a[j][1], s));
  }
}

// As values_block over `pairs` pairs of keys: pp is P^T as [pairs][R] words (a row's probabilities of keys
// 2i and 2i + 1 in bf16), vp the V rows interleaved ([pairs][D] words), o in interleaved dim order.
template <int64_t C>
inline void values_block_dp(const uint32_t* pp, int64_t R, const uint32_t* vp, int64_t pairs, const float* alpha, float* o) {
  __m512 a[kRows][C];
  load_rescaled_outputs<C>(o, alpha, a);
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh vv[C];
    for (int64_t c = 0; c < C; ++c) {
      __m512i line = _mm512_loadu_si512(vp + i * C * 16 + c * 16);
      // Opaque to GCC, which otherwise reloads the V line for every row: a load per product, where the
      // loads, not VDPBF16PS, then bound the loop (as perf annotate shows).
      __asm__("" : "+v"(line));
      vv[c] = (__m512bh)line;
    }
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i * R + r]));
      for (int64_t c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], pv, vv[c]);
    }
  }
  store_outputs<C>(a, o);
}

// Rows a and b (D bf16 each, D a multiple of 32) interleaved into D words: per 32 dims, VPUNPCKLWD's 16
// words (dims 0-3, 8-11, 16-19, 24-27 of a and b) then VPUNPCKHWD's (4-7, 12-15, 20-23, 28-31).
inline void interleave_rows(const uint16_t* a, const uint16_t* b, int64_t D, uint32_t* out) {
  for (int64_t c = 0; c < D; c += 32) {
    const __m512i va = _mm512_loadu_si512(a + c), vb = _mm512_loadu_si512(b + c);
    _mm512_storeu_si512(out + c, _mm512_unpacklo_epi16(va, vb));
    _mm512_storeu_si512(out + c + 16, _mm512_unpackhi_epi16(va, vb));
  }
}

#else
#define SGL_LITE_HAS_DPBF16_EXTEND 0
#endif
