// The decode attention kernel's float32 path (paged_decode_attention.cpp): K/V rows decoded to float32 in
// registers (any storage format of decode_vectors.h), q.k and P.V by FMAs. It runs wherever the pairs path
// (decode_pairs.h) does not: float32 or fp16 queries or pools, head sizes other than 64 and 128, group sizes
// it is not compiled for, CPUs without AVX512-BF16, or where bf16_gemv's probe prefers FMAs.
//
// Not a standalone header: paged_decode_attention.cpp includes it inside its anonymous namespace, after its
// helpers (decode_vectors.h, prefetch_row) and types (Partial, Shape, Tile, LookAhead).
#pragma once

// One chunk of a row's slots for a tile: q_scaled [Q, D/kLanes] (already times the softmax scale),
// k_base / v_base the first tile head's part of slot 0's row, outs[u] unit u's partial. Each query vector's
// sums are the same, in the same order, whatever the tile around it: a verification query gives the bits of
// the same query decoded alone. row_bytes: how much of each slot's K and V rows to prefetch; the first
// `cold` rows are prefetched at the start (the previous item's look-ahead did the others), and past the
// chunk's end `ahead` takes the look-ahead on into the next item.
// kC: the vectors per row (D / kLanes) when known at compile time (0: read from `shape`); with it the
// compiler keeps a row and each head's accumulator in registers instead of memory (~2x at D = 64).
// kG: the query heads per KV head when known at compile time (0: from `shape`); with it the P.V pass keeps
// a unit's accumulators in registers and adds each V row to all of them as it is decoded, so that the
// heads' FMA chains interleave (one head at a time waited on each FMA's latency).
template <class Kv, int64_t kC, int64_t kG>
void attend_chunk(const vfloat* q_scaled, const typename Kv::T* k_base, const typename Kv::T* v_base,
                  const int64_t* slots, const Shape& shape, const Tile& tile, int64_t row_bytes, int64_t cold,
                  LookAhead& ahead, Partial* outs) {
  const int64_t G = kG ? kG : shape.group, C = kC ? kC : shape.dim / kLanes, stride = shape.row_stride, D = shape.dim;
  const int64_t H = tile.heads, T = tile.queries, n = tile.tokens(), HG = T * G;  // HG: query vectors per head
  const int64_t Q = H * HG;
  vfloat acc[kMaxVectors * kMaxChunksPerRow];
  vfloat row[kMaxChunksPerRow];
  BlockScores scores[kMaxVectors];
  float run_max[kMaxVectors], run_sum[kMaxVectors];
  int64_t nb[kMaxVectors];
  for (int64_t j = 0; j < Q * C; ++j) acc[j] = vfloat{};
  std::fill(run_max, run_max + Q, kNegInf);
  std::fill(run_sum, run_sum + Q, 0.f);
  // the chunk's first rows that the previous item's look-ahead did not cover
  for (int64_t t = 0; t < std::min(n, cold); ++t) prefetch_row(k_base + slots[t] * stride, row_bytes);
  const int64_t lines = (row_bytes + 63) / 64;  // of a slot's K row (and of its V row), prefetch_row's count
  vfloat dots[kMaxVectors][kLanes];  // per query vector, kLanes tokens' unreduced q.k products
  for (int64_t start = 0; start < n; start += kBlock) {
    for (int64_t v = 0; v < kBlock / kLanes; ++v) {
      for (int64_t i = 0; i < kLanes; ++i) {
        const int64_t t = start + v * kLanes + i;
        if (t >= n) {  // past the end: any finite value, masked to -inf below
          for (int64_t g = 0; g < Q; ++g) dots[g][i] = vfloat{};
          continue;
        }
        // The rows on their way: K's kPrefetchAhead tokens ahead, V's for this block's P.V pass, their lines
        // spread over the heads' loads rather than issued at once (as the pairs path, decode_pairs.h).
        const typename Kv::T* k_next = t + kPrefetchAhead < n ? k_base + slots[t + kPrefetchAhead] * stride : nullptr;
        if (k_next == nullptr) ahead.prefetch(t + kPrefetchAhead - n);
        const typename Kv::T* v_now = v_base + slots[t] * stride;
        int64_t line = 0;
        for (int64_t h = 0; h < H; ++h) {
          for (const int64_t upto = (h + 1) * lines / H; line < upto; ++line) {
            if (k_next != nullptr) prefetch_line(k_next, line);
            prefetch_line(v_now, line);
          }
          const typename Kv::T* k_row = k_base + slots[t] * stride + h * D;
          for (int64_t c = 0; c < C; ++c) row[c] = Kv::decode(k_row + c * kLanes);
          for (int64_t g = h * HG; g < (h + 1) * HG; ++g) {
            const vfloat* qg = q_scaled + g * C;
            vfloat dot = qg[0] * row[0];
            for (int64_t c = 1; c < C; ++c) dot += qg[c] * row[c];
            dots[g][i] = dot;
          }
        }
      }
      for (int64_t g = 0; g < Q; ++g) scores[g].vec[v] = reduce_lanes(dots[g]);
    }
    tile.block_counts(start, G, nb);
    softmax_block(scores, Q, nb, C, acc, run_max, run_sum);
    // P.V, one unit at a time. Every vector's accumulator adds the tokens in order, whichever way the loops
    // nest (the same bits).
    for (int64_t u = 0; u < H * T; ++u) {
      const int64_t h = u / T, count = nb[u * G];
      if (count <= 0) continue;
      if constexpr (kG != 0 && kC != 0) {
        // each V row decoded into registers and added to every vector's accumulator (all in registers)
        vfloat a[kG * kC];
        for (int64_t j = 0; j < kG * kC; ++j) a[j] = acc[u * kG * kC + j];
        for (int64_t i = 0; i < count; ++i) {
          const typename Kv::T* v_row = v_base + slots[start + i] * stride + h * D;
          vfloat vr[kC];
          for (int64_t c = 0; c < kC; ++c) vr[c] = Kv::decode(v_row + c * kLanes);
          for (int64_t g = 0; g < kG; ++g) {
            const float p = scores[u * kG + g].at[i];
            for (int64_t c = 0; c < kC; ++c) a[g * kC + c] += p * vr[c];
          }
        }
        for (int64_t j = 0; j < kG * kC; ++j) acc[u * kG * kC + j] = a[j];
      } else {
        // the unit's V rows decoded once, then one vector at a time so that its accumulator stays in registers
        vfloat values[kBlock * kMaxChunksPerRow];
        for (int64_t i = 0; i < count; ++i) {
          const typename Kv::T* v_row = v_base + slots[start + i] * stride + h * D;
          for (int64_t c = 0; c < C; ++c) values[i * C + c] = Kv::decode(v_row + c * kLanes);
        }
        for (int64_t g = u * G; g < (u + 1) * G; ++g) {
          vfloat a[kMaxChunksPerRow];
          for (int64_t c = 0; c < C; ++c) a[c] = acc[g * C + c];
          for (int64_t i = 0; i < count; ++i) {
            const float p = scores[g].at[i];
            for (int64_t c = 0; c < C; ++c) a[c] += p * values[i * C + c];
          }
          for (int64_t c = 0; c < C; ++c) acc[g * C + c] = a[c];
        }
      }
    }
  }
  for (int64_t u = 0; u < H * T; ++u) {
    std::memcpy(outs[u].acc, acc + u * G * C, G * C * sizeof(vfloat));
    std::memcpy(outs[u].max, run_max + u * G, G * sizeof(float));
    std::memcpy(outs[u].sum, run_sum + u * G, G * sizeof(float));
  }
}

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
