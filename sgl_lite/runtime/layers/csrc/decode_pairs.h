// The decode attention kernel's VDPBF16PS arithmetic (paged_decode_attention.cpp): bf16 queries and K/V,
// products of bf16 pairs accumulated in float32, where this CPU runs it faster than float32 FMAs.
//
// Scores pair Q and K along D as both are stored (no widening of K, the scale applied to the sums; the
// products of two bf16 are exact in float32). P.V pairs two tokens: the two V rows are interleaved with
// VPUNPCKL/HWD in registers, which works within 128-bit lanes, so the accumulators hold the dims in
// the interleaved order (bf16_arithmetic.h) until the chunk's partial is written; each probability is taken as its bf16
// rounding plus the bf16 rounding of what that leaves out (two products, ~16 significant bits). With the
// probabilities rounded to bf16 once, as the extend kernel's pairs path and flash attention on GPUs do,
// the bf16 outputs' RMS error against a float64 reference was 9% above that of rounding the exact result
// (8 requests, 50-2000 tokens); with the remainder it equals it, as the float32 path's does, at the same
// speed here (decode attention reads K/V from memory: the saved instructions are what the pairs buy).
//
// Not a standalone header: paged_decode_attention.cpp includes it inside its anonymous namespace, after
// its helpers (reduce_lanes, softmax_block, prefetch_row) and types (Partial, Shape).
#pragma once

#if defined(__AVX512BF16__)
#define SGL_LITE_HAS_DPBF16_DECODE 1

// attend_chunk's contract in pairs: q [H * kG, D] bf16 as the model gave it (not scaled), kP = D / 32.
template <int64_t kP, int64_t kG>
void attend_chunk_pairs(const uint16_t* q, float scale, const uint16_t* k_base, const uint16_t* v_base, const int64_t* slots,
                        int64_t n, const Shape& shape, int64_t H, int64_t row_bytes, Partial* outs) {
  static_assert(kLanes == 16 && kBlock == 32, "a block's probabilities are one vector of 16 bf16 pairs");
  constexpr int64_t C = 2 * kP;  // float32 vectors per accumulator row
  const int64_t stride = shape.row_stride, D = shape.dim, Q = H * kG;
  __m512bh qv[kMaxGroup][kP];
  for (int64_t g = 0; g < Q; ++g)
    for (int64_t p = 0; p < kP; ++p) qv[g][p] = (__m512bh)_mm512_loadu_si512(q + g * D + p * 32);
  vfloat acc[kMaxGroup * C];
  for (int64_t j = 0; j < Q * C; ++j) acc[j] = vfloat{};
  BlockScores scores[kMaxGroup];
  // per query head, tokens 2i and 2i + 1's probabilities: their bf16 roundings, then what those leave out
  alignas(64) uint32_t pairs[kMaxGroup][kBlock / 2], rests[kMaxGroup][kBlock / 2];
  float run_max[kMaxGroup], run_sum[kMaxGroup];
  std::fill(run_max, run_max + Q, kNegInf);
  std::fill(run_sum, run_sum + Q, 0.f);
  for (int64_t t = 0; t < std::min(n, kPrefetchAhead); ++t) prefetch_row(k_base + slots[t] * stride, row_bytes);
  vfloat dots[kMaxGroup][kLanes];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t nb = std::min(kBlock, n - start);
    for (int64_t v = 0; v < kBlock / kLanes; ++v) {
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t t = start + v * kLanes + i;
        if (t >= n) {
          for (int64_t g = 0; g < Q; ++g) dots[g][i] = vfloat{};
          continue;
        }
        if (t + kPrefetchAhead < n) prefetch_row(k_base + slots[t + kPrefetchAhead] * stride, row_bytes);
        prefetch_row(v_base + slots[t] * stride, row_bytes);
        for (int64_t h = 0; h < H; ++h) {
          const uint16_t* k_row = k_base + slots[t] * stride + h * D;
          __m512bh kr[kP];
          for (int64_t p = 0; p < kP; ++p) kr[p] = (__m512bh)_mm512_loadu_si512(k_row + p * 32);
          for (int64_t g = h * kG; g < (h + 1) * kG; ++g) {
            __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kr[0]);
            for (int64_t p = 1; p < kP; ++p) dot = _mm512_dpbf16_ps(dot, qv[g][p], kr[p]);
            dots[g][i] = reinterpret_cast<vfloat>(dot);
          }
        }
      }
      for (int64_t g = 0; g < Q; ++g) scores[g].vec[v] = reduce_lanes(dots[g]) * scale;
    }
    softmax_block(scores, Q, nb, C, acc, run_max, run_sum);
    for (int64_t g = 0; g < Q; ++g) {
      const __m512 p0 = reinterpret_cast<__m512>(scores[g].vec[0]), p1 = reinterpret_cast<__m512>(scores[g].vec[1]);
      const __m512bh p = _mm512_cvtne2ps_pbh(p1, p0);
      _mm512_store_si512(pairs[g], reinterpret_cast<__m512i>(p));
      const __m512i bits = reinterpret_cast<__m512i>(p);
      const __m512 r0 = _mm512_sub_ps(p0, sgl_lite::widen_bf16(_mm512_castsi512_si256(bits)));
      const __m512 r1 = _mm512_sub_ps(p1, sgl_lite::widen_bf16(_mm512_extracti64x4_epi64(bits, 1)));
      _mm512_store_si512(rests[g], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(r1, r0)));
    }
    for (int64_t h = 0; h < H; ++h) {
      __m512 a[kG * C];
      for (int64_t j = 0; j < kG * C; ++j) a[j] = reinterpret_cast<__m512>(acc[h * kG * C + j]);
      for (int64_t i = 0; 2 * i < nb; ++i) {
        const uint16_t* va = v_base + slots[start + 2 * i] * stride + h * D;
        // an odd block's last pair: its second probability is 0, any finite row will do
        const uint16_t* vb = 2 * i + 1 < nb ? v_base + slots[start + 2 * i + 1] * stride + h * D : va;
        __m512bh lo[kP], hi[kP];
        for (int64_t p = 0; p < kP; ++p) {
          const __m512i x = _mm512_loadu_si512(va + p * 32), y = _mm512_loadu_si512(vb + p * 32);
          lo[p] = (__m512bh)_mm512_unpacklo_epi16(x, y);
          hi[p] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int64_t g = 0; g < kG; ++g) {
          const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[h * kG + g][i]));
          const __m512bh rv = (__m512bh)_mm512_set1_epi32(static_cast<int>(rests[h * kG + g][i]));
          for (int64_t p = 0; p < kP; ++p) {
            a[g * C + 2 * p] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g * C + 2 * p], pv, lo[p]), rv, lo[p]);
            a[g * C + 2 * p + 1] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g * C + 2 * p + 1], pv, hi[p]), rv, hi[p]);
          }
        }
      }
      for (int64_t j = 0; j < kG * C; ++j) acc[h * kG * C + j] = reinterpret_cast<vfloat>(a[j]);
    }
  }
  // back in dim order (bf16_arithmetic.h's deinterleave_dims)
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t g = 0; g < kG; ++g) {
      for (int64_t p = 0; p < kP; ++p) {
        const __m512 lo = reinterpret_cast<__m512>(acc[(h * kG + g) * C + 2 * p]);
        const __m512 hi = reinterpret_cast<__m512>(acc[(h * kG + g) * C + 2 * p + 1]);
        __m512 first, second;
        sgl_lite::deinterleave_dims(lo, hi, first, second);
        _mm512_storeu_ps(outs[h].acc + g * D + p * 32, first);
        _mm512_storeu_ps(outs[h].acc + g * D + p * 32 + 16, second);
      }
    }
    std::memcpy(outs[h].max, run_max + h * kG, kG * sizeof(float));
    std::memcpy(outs[h].sum, run_sum + h * kG, kG * sizeof(float));
  }
}

using PairsAttend = decltype(&attend_chunk_pairs<2, 1>);

// attend_chunk_pairs for head sizes 64 and 128 and the group sizes attend_chunk is compiled for; else none.
template <int64_t kP>
PairsAttend pairs_for_group(int64_t G) {
  switch (G) {
    case 1: return attend_chunk_pairs<kP, 1>;
    case 2: return attend_chunk_pairs<kP, 2>;
    case 3: return attend_chunk_pairs<kP, 3>;
    case 4: return attend_chunk_pairs<kP, 4>;
    case 7: return attend_chunk_pairs<kP, 7>;
    case 8: return attend_chunk_pairs<kP, 8>;
    default: return nullptr;
  }
}

inline PairsAttend pairs_for(int64_t D, int64_t G) {
  return D == 64 ? pairs_for_group<2>(G) : D == 128 ? pairs_for_group<4>(G) : nullptr;
}

#else
#define SGL_LITE_HAS_DPBF16_DECODE 0
#endif
