// The decode attention kernel's VDPBF16PS arithmetic (paged_decode_attention.cpp): bf16 queries and K/V,
// products of bf16 pairs accumulated in float32, where this CPU runs it faster than float32 FMAs.
//
// Scores: a block's K rows (one head) are transposed in registers, a token per lane, so that a query
// vector's scores of 16 tokens are 32 VDPBF16PS with its pairs broadcast (score_vectors: no horizontal
// sums), and the transposition is shared by every query vector of the tile - the G heads of a decode
// query, or the G x (1 + draft) of a verification row. Before, each query vector summed the 16 lanes of
// its q.k products per token (as many shuffles as products), which the transposition now does once per
// block for all of them: a verification row of 9 queries runs faster than it did as 9 decode rows, and
// decode rows as fast (docs/performance.md, "Verification rows share their reads").
// The products of two bf16 are exact in float32; the scale is applied to the sums.
// P.V pairs two tokens: the two V rows are interleaved with VPUNPCKL/HWD in registers, which works within
// 128-bit lanes, so the accumulators hold the dims in the interleaved order (bf16_arithmetic.h) until the
// chunk's partial is written; each probability is taken as its bf16 rounding plus the bf16 rounding of
// what that leaves out (two products, ~16 significant bits). With the probabilities rounded to bf16 once,
// as the extend kernel's pairs path and flash attention on GPUs do, the bf16 outputs' RMS error against a
// float64 reference was 9% above that of rounding the exact result (8 requests, 50-2000 tokens); with the
// remainder it equals it, as the float32 path's does.
//
// An 8-bit float pool is read as stored and widened to bf16 in registers as its rows are loaded (exactly:
// every fp8 value is a bf16 value), so a query gets the bits it would get from a bf16 pool holding the same
// values, at half the bytes read: fp8_vectors.h's row readers (a table lookup, two VPERMT2W per 32 values).
// (Converted arithmetically, 16 values at a time through fp16 and float32, the widening cost more than the
// bytes it saved: an 8-bit pool decoded slower than a bf16 one.)
//
// Not a standalone header: paged_decode_attention.cpp includes it inside its anonymous namespace, after
// its helpers (softmax_block, prefetch_row) and types (Partial, Shape, Tile, LookAhead), and fp8_vectors.h before it.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // BW: fp8_vectors.h's row readers
#define SGL_LITE_HAS_DPBF16_DECODE 1

// A 16 x 16 matrix of 32-bit words transposed in registers: r[i] holds row i before, column i after.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane k: rows 2i, 2i + 1 interleaved, words 4k, 4k + 1 (then + 2, + 3)
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + m], lane k: word 4k + m of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int m = 0; m < 4; ++m) {
      t[8 * i + m] = _mm512_shuffle_i32x4(r[8 * i + m], r[8 * i + 4 + m], 0x88);
      t[8 * i + 4 + m] = _mm512_shuffle_i32x4(r[8 * i + m], r[8 * i + 4 + m], 0xdd);
    }
  }
  for (int m = 0; m < 8; ++m) {
    r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xdd);
  }
}

// The K rows (one head's part, D = 32 kP bf16) of the `count` slots of a block transposed into
// keys[v][p]: pair p (dims 2p, 2p + 1) of tokens 16v .. 16v + 15, a token per lane. Tokens past `count` read
// as zero rows (their scores are masked). on_load() runs after each row load (see attend_chunk_pairs).
template <class Rows, int64_t kP, class OnLoad>
inline void transpose_keys(const Rows& rows, const typename Rows::T* k_base, const int64_t* slots, int64_t count, int64_t stride,
                           __m512i (*keys)[16 * kP], OnLoad on_load) {
  for (int64_t v = 0; v < kBlock / kLanes; ++v) {
    for (int64_t p = 0; p < kP; ++p) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = v * 16 + i;
        if (t < count) {
          r[i] = rows.load32(k_base + slots[t] * stride + p * 32);
          on_load();
        } else {
          r[i] = _mm512_setzero_si512();
        }
      }
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) keys[v][p * 16 + i] = r[i];
    }
  }
}

// The block's scores of kN query vectors (qv: each D/2 pairs as kP vectors): score(t) = (A + B) * scale with
// A the sum of pairs 0 .. P/2 - 1 of q.k_t and B of the others (P = 16 kP pairs), each summed in pair order
// by VDPBF16PS, 16 tokens a vector. The order is the kernel's definition of a score, whatever the tile:
// two sums of each vector and block's two token vectors make 4 kN independent chains, enough to hide
// VDPBF16PS's latency at kN = 3 (one decode query of a 3-query-head group).
template <int64_t kP, int64_t kN>
inline void score_vectors(const __m512bh* qv, const __m512i (*keys)[16 * kP], float scale, BlockScores* scores) {
  constexpr int64_t P = 16 * kP, half = P / 2;
  const uint32_t* q = reinterpret_cast<const uint32_t*>(qv);  // vector j's pair p at q[j * P + p]
  __m512 a[kN][2][2];
  for (int64_t j = 0; j < kN; ++j)
    for (int64_t v = 0; v < 2; ++v) a[j][v][0] = a[j][v][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half; ++p) {
    for (int64_t v = 0; v < 2; ++v) {
      const __m512bh k0 = (__m512bh)keys[v][p], k1 = (__m512bh)keys[v][half + p];
      for (int64_t j = 0; j < kN; ++j) {
        a[j][v][0] = _mm512_dpbf16_ps(a[j][v][0], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[j * P + p])), k0);
        a[j][v][1] = _mm512_dpbf16_ps(a[j][v][1], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[j * P + half + p])), k1);
      }
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < kN; ++j)
    for (int64_t v = 0; v < 2; ++v) scores[j].vec[v] = reinterpret_cast<vfloat>(_mm512_mul_ps(_mm512_add_ps(a[j][v][0], a[j][v][1]), s));
}

// attend_chunk's contract in pairs: q [Q, D] bf16 as the model gave it (not scaled), kP = D / 32.
template <class Rows, int64_t kP, int64_t kG>
void attend_chunk_pairs(const uint16_t* q, float scale, const typename Rows::T* k_base, const typename Rows::T* v_base, const int64_t* slots,
                        const Shape& shape, const Tile& tile, int64_t row_bytes, int64_t cold, LookAhead& ahead,
                        Partial* outs) {
  static_assert(kLanes == 16 && kBlock == 32, "a block's probabilities are one vector of 16 bf16 pairs");
  constexpr int64_t C = 2 * kP;  // float32 vectors per accumulator row
  const int64_t stride = shape.row_stride, D = shape.dim;
  const int64_t H = tile.heads, T = tile.queries, n = tile.tokens(), HG = T * kG, Q = H * HG;
  const Rows rows;  // an 8-bit pool's table (fp8_vectors.h's Fp8Rows)
  __m512bh qv[kMaxVectors][kP];
  for (int64_t g = 0; g < Q; ++g)
    for (int64_t p = 0; p < kP; ++p) qv[g][p] = (__m512bh)_mm512_loadu_si512(q + g * D + p * 32);
  vfloat acc[kMaxVectors * C];
  for (int64_t j = 0; j < Q * C; ++j) acc[j] = vfloat{};
  BlockScores scores[kMaxVectors];
  // per query vector, tokens 2i and 2i + 1's probabilities: their bf16 roundings, then what those leave out
  alignas(64) uint32_t pairs[kMaxVectors][kBlock / 2], rests[kMaxVectors][kBlock / 2];
  // a block's V rows of one head interleaved by pairs of tokens, where a tile's queries share them
  alignas(64) __m512i values[kBlock / 2][C];
  float run_max[kMaxVectors], run_sum[kMaxVectors];
  int64_t nb[kMaxVectors];
  std::fill(run_max, run_max + Q, kNegInf);
  std::fill(run_sum, run_sum + Q, 0.f);
  for (int64_t t = 0; t < std::min(n, cold); ++t) prefetch_row(k_base + slots[t] * stride, row_bytes);
  // the block's K rows of one head, transposed: keys[v][p] holds pair p of tokens 16v .. 16v + 15
  alignas(64) __m512i keys[kBlock / kLanes][16 * kP];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t block = std::min(kBlock, n - start);
    // Prefetches into L2, a token's rows (K kPrefetchAhead tokens ahead, V for this block's P.V pass), one line
    // of each after every load of K, so that they spread evenly over the block's transpositions: issued as one
    // burst at the block's start they filled the queue of misses, and the core waited there with its arithmetic
    // no longer overlapping the reads (docs/performance.md, "Verification rows share their reads"); a whole
    // token's rows after every `lines` loads were still bursts of 2 x `lines` prefetches, 128 at a 1.7B model's
    // 32 heads of 64, and read slower ("Decode attention: prefetches one line at a time").
    const int64_t lines = row_bytes / 64;  // a row's lines of K (and as many of V)
    int64_t line = 0, token = start;  // after each load of K, one line of each row on its way
    const auto prefetch = [&] {
      if (token + kPrefetchAhead < n) {
        prefetch_line(k_base + slots[token + kPrefetchAhead] * stride, line);
      } else if (line == 0) {
        ahead.prefetch(token + kPrefetchAhead - n);  // the next item's first rows
      }
      prefetch_line(v_base + slots[token] * stride, line);  // this block's P.V pass
      if (++line == lines) {
        line = 0;
        ++token;
      }
    };
    for (int64_t h = 0; h < H; ++h) {
      transpose_keys<Rows, kP>(rows, k_base + h * D, slots + start, block, stride, keys, prefetch);
      int64_t g = h * HG;
      for (; g + 4 <= (h + 1) * HG; g += 4) score_vectors<kP, 4>(&qv[g][0], keys, scale, &scores[g]);
      switch ((h + 1) * HG - g) {
        case 1: score_vectors<kP, 1>(&qv[g][0], keys, scale, &scores[g]); break;
        case 2: score_vectors<kP, 2>(&qv[g][0], keys, scale, &scores[g]); break;
        case 3: score_vectors<kP, 3>(&qv[g][0], keys, scale, &scores[g]); break;
        default: break;
      }
    }
    tile.block_counts(start, kG, nb);
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
      // unit u's accumulators in registers over the pairs of tokens it sees; pair_lines(i, count, vv) gives
      // pair i's V lines interleaved (count: the tokens of the block the unit sees)
      const auto accumulate = [&](int64_t u, auto pair_lines) {
        const int64_t count = nb[u * kG];
        if (count <= 0) return;
        __m512 a[kG * C];
        for (int64_t j = 0; j < kG * C; ++j) a[j] = reinterpret_cast<__m512>(acc[u * kG * C + j]);
        for (int64_t i = 0; 2 * i < count; ++i) {
          __m512bh vv[C];
          pair_lines(i, count, vv);
          for (int64_t g = 0; g < kG; ++g) {
            const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[u * kG + g][i]));
            const __m512bh rv = (__m512bh)_mm512_set1_epi32(static_cast<int>(rests[u * kG + g][i]));
            for (int64_t c = 0; c < C; ++c) a[g * C + c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a[g * C + c], pv, vv[c]), rv, vv[c]);
          }
        }
        for (int64_t j = 0; j < kG * C; ++j) acc[u * kG * C + j] = reinterpret_cast<vfloat>(a[j]);
      };
      // tokens 2i and 2i + 1's V rows interleaved; an odd last pair's second probability is 0 for every
      // vector that reads it, so any finite row will do (and a vector that sees fewer of the block's tokens
      // than another adds 0 times the next token's row: exactly what its own row added when decoded alone)
      const auto interleave = [&](int64_t i, int64_t count, __m512i* out) {
        const typename Rows::T* va = v_base + slots[start + 2 * i] * stride + h * D;
        const typename Rows::T* vb = 2 * i + 1 < count ? v_base + slots[start + 2 * i + 1] * stride + h * D : va;
        for (int64_t p = 0; p < kP; ++p) {
          const __m512i x = rows.load32(va + p * 32), y = rows.load32(vb + p * 32);
          out[2 * p] = _mm512_unpacklo_epi16(x, y);
          out[2 * p + 1] = _mm512_unpackhi_epi16(x, y);
        }
      };
      if (T == 1) {  // a decode row: V read as the products go, so that its loads overlap them
        accumulate(h, [&](int64_t i, int64_t count, __m512bh* vv) { interleave(i, count, reinterpret_cast<__m512i*>(vv)); });
        continue;
      }
      // a verification row's queries: the head's V rows interleaved once, then held in registers per pair
      for (int64_t i = 0; 2 * i < block; ++i) interleave(i, block, values[i]);
      for (int64_t u = h * T; u < (h + 1) * T; ++u) {
        accumulate(u, [&](int64_t i, int64_t, __m512bh* vv) {
          for (int64_t c = 0; c < C; ++c) {
            __m512i line = values[i][c];
            __asm__("" : "+v"(line));  // one load per line, not one per product (see extend_blocks.h)
            vv[c] = (__m512bh)line;
          }
        });
      }
    }
  }
  // back in dim order (bf16_arithmetic.h's deinterleave_dims)
  for (int64_t u = 0; u < H * T; ++u) {
    for (int64_t g = 0; g < kG; ++g) {
      for (int64_t p = 0; p < kP; ++p) {
        const __m512 lo = reinterpret_cast<__m512>(acc[(u * kG + g) * C + 2 * p]);
        const __m512 hi = reinterpret_cast<__m512>(acc[(u * kG + g) * C + 2 * p + 1]);
        __m512 first, second;
        sgl_lite::deinterleave_dims(lo, hi, first, second);
        _mm512_storeu_ps(outs[u].acc + g * D + p * 32, first);
        _mm512_storeu_ps(outs[u].acc + g * D + p * 32 + 16, second);
      }
    }
    std::memcpy(outs[u].max, run_max + u * kG, kG * sizeof(float));
    std::memcpy(outs[u].sum, run_sum + u * kG, kG * sizeof(float));
  }
}

template <class Rows>
using PairsAttend = decltype(&attend_chunk_pairs<Rows, 2, 1>);

// attend_chunk_pairs for head sizes 64 and 128 and the group sizes attend_chunk is compiled for; else none.
template <class Rows, int64_t kP>
PairsAttend<Rows> pairs_for_group(int64_t G) {
  switch (G) {
    case 1: return attend_chunk_pairs<Rows, kP, 1>;
    case 2: return attend_chunk_pairs<Rows, kP, 2>;
    case 3: return attend_chunk_pairs<Rows, kP, 3>;
    case 4: return attend_chunk_pairs<Rows, kP, 4>;
    case 7: return attend_chunk_pairs<Rows, kP, 7>;
    case 8: return attend_chunk_pairs<Rows, kP, 8>;
    default: return nullptr;
  }
}

template <class Rows>
PairsAttend<Rows> pairs_for(int64_t D, int64_t G) {
  return D == 64 ? pairs_for_group<Rows, 2>(G) : D == 128 ? pairs_for_group<Rows, 4>(G) : nullptr;
}

#else
#define SGL_LITE_HAS_DPBF16_DECODE 0
#endif
