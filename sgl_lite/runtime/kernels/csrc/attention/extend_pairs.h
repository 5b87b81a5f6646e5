// The extend attention kernel's VDPBF16PS path (extend_attention.cpp): bf16 queries over a bf16 or 8-bit
// float pool, D a multiple of 32. An item packs the keys its last tile sees once (K rows together, V rows
// interleaved by pairs of keys), and its tiles walk that copy with extend_blocks.h's pair products.
//
// Not a standalone header: extend_attention.cpp includes it inside its anonymous namespace, after its
// scratch (Scratch), softmax step (softmax_block) and tile helpers (Tile, row_offset, start_tile).
#pragma once

#if SGL_LITE_HAS_DPBF16_EXTEND

// The pairs path reads a bf16 pool or an 8-bit float one through fp8_vectors.h's row readers.
template <typename KT>
struct PairRowsOf {
  static_assert(std::is_same_v<KT, c10::BFloat16>, "the pairs path reads bf16 or 8-bit float pools");
  using type = sgl_lite::Bf16Rows;
};
template <> struct PairRowsOf<c10::Float8_e4m3fn> { using type = sgl_lite::E4m3Rows; };
template <> struct PairRowsOf<c10::Float8_e5m2> { using type = sgl_lite::E5m2Rows; };

// A stored K/V row of D elements (D a multiple of 32) as D bf16 (their bits) at `out`.
template <class Rows, typename KT>
inline void bf16_row(const Rows& rows, const KT* row, int64_t D, uint16_t* out) {
  const auto* stored = reinterpret_cast<const typename Rows::T*>(row);
  for (int64_t d = 0; d < D; d += 32) _mm512_storeu_si512(out + d, rows.load32(stored + d));
}

// The first n keys of KV head h (slots[0 : n]) as the pairs path reads them: K rows into s.kb, V rows
// interleaved two by two into s.vp (an odd last key paired with zeros), zeros up to a whole block.
template <int64_t C, typename KT>
void pack_keys_dp(const KT* k_cache, const KT* v_cache, const int64_t* slots, int64_t n, int64_t h, int64_t Hkv, Scratch& s) {
  constexpr int64_t D = C * 16;
  const typename PairRowsOf<KT>::type rows;  // an 8-bit pool's table
  const int64_t L = (n + kPairBlock - 1) / kPairBlock * kPairBlock;
  if (int64_t(s.kb.size()) < L * D / 2) s.kb.resize(L * D / 2);
  if (int64_t(s.vp.size()) < L / 2 * D) s.vp.resize(L / 2 * D);
  for (int64_t j = 0; j < n; ++j)
    bf16_row(rows, k_cache + (slots[j] * Hkv + h) * D, D, reinterpret_cast<uint16_t*>(s.kb.data() + j * D / 2));
  std::fill(s.kb.begin() + n * D / 2, s.kb.begin() + L * D / 2, 0u);
  for (int64_t i = 0; 2 * i < n; ++i) {
    const KT* a = v_cache + (slots[2 * i] * Hkv + h) * D;
    const KT* b = 2 * i + 1 < n ? v_cache + (slots[2 * i + 1] * Hkv + h) * D : nullptr;
    if constexpr (kIsFp8<KT>) {
      bf16_row(rows, a, D, s.row_a.data());
      if (b != nullptr) bf16_row(rows, b, D, s.row_b.data());
      interleave_rows(s.row_a.data(), b != nullptr ? s.row_b.data() : s.zero_row.data(), D, s.vp.data() + i * D);
    } else {
      interleave_rows(reinterpret_cast<const uint16_t*>(a), b != nullptr ? reinterpret_cast<const uint16_t*>(b) : s.zero_row.data(), D,
                      s.vp.data() + i * D);
    }
  }
  std::fill(s.vp.begin() + (n + 1) / 2 * D, s.vp.begin() + L / 2 * D, 0u);
}

// attend_tile in VDPBF16PS (bf16 queries, a bf16 or 8-bit float pool, D a multiple of 32; see
// extend_blocks.h) over the keys pack_keys_dp packed for the tile's item. The same tiles, blocks and
// softmax, so a row still depends only on its own keys and position.
template <int64_t C>
void attend_tile_dp(const c10::BFloat16* q, const Request& req, const Tile& t, int64_t Hq, float scale, Scratch& s, c10::BFloat16* out) {
  constexpr int64_t D = C * 16;
  static_assert(D % 32 == 0, "rows interleave 32 dims at a time");
  const int64_t prefix = req.kv_len - req.num_new, R = t.R;
  for (int64_t i = 0; i < R; ++i) {
    const auto* src = reinterpret_cast<const uint16_t*>(query_row(q, req, t, i, Hq, D));
    for (int64_t p = 0; p < D / 2; ++p) s.qp[p * R + i] = uint32_t(src[2 * p]) | uint32_t(src[2 * p + 1]) << 16;
  }
  start_tile(t, D, s);
  const int64_t keys = prefix + t.t1;
  for (int64_t k0 = 0; k0 < keys; k0 += kPairBlock) {
    const int64_t n = std::min(kPairBlock, keys - k0), n8 = (n + kPairKeys - 1) / kPairKeys * kPairKeys, pairs = (n + 1) / 2;
    static_assert(kPairBlock % kPairKeys == 0, "a block is whole runs of keys");
    const uint32_t* kb = s.kb.data() + k0 * D / 2;  // keys n..n8: later keys or zeros, whose scores are never read
    const uint32_t* vp = s.vp.data() + k0 / 2 * D;
    float* st = s.st.data();
    for (int64_t j0 = 0; j0 < n8; j0 += kPairKeys)
      for (int64_t r0 = 0; r0 < R; r0 += 32) scores_block_dp<C>(s.qp.data() + r0, R, kb + j0 * D / 2, scale * kLog2e, st + j0 * R + r0);
    softmax_block<true>(st, R, t.rows, t.G, prefix, t.t0, k0, n, s);
    // An odd block's last pair holds, in the pack, the tile's last key and one past the tile: that key
    // weighs 0 and its V (whatever it holds) is left out rather than multiplied by 0, from a copy of the line.
    const bool odd = n % 2 == 1;
    if (odd) {
      const __m512i even_only = _mm512_set1_epi32(0xffff);
      for (int64_t d = 0; d < D; d += 16)
        _mm512_storeu_si512(s.last_pair.data() + d, _mm512_and_si512(_mm512_loadu_si512(vp + (pairs - 1) * D + d), even_only));
    }
    static_assert(kRows == 4, "kOnes: one factor per row of a register block");
    static const float kOnes[kRows] = {1.f, 1.f, 1.f, 1.f};
    for (int64_t r0 = 0; r0 < R; r0 += kRows) {
      values_block_dp<C>(s.pp.data() + r0, R, vp, odd ? pairs - 1 : pairs, s.alpha.data() + r0, s.o.data() + r0 * D);
      if (odd) values_block_dp<C>(s.pp.data() + (pairs - 1) * R + r0, R, s.last_pair.data(), 1, kOnes, s.o.data() + r0 * D);
    }
  }
  for (int64_t i = 0; i < t.rows; ++i) {  // in dim order again, rounded as static_cast<c10::BFloat16> rounds
    auto* dst = reinterpret_cast<__m256i*>(out + row_offset(req, t, i, Hq, D));
    const __m512 inv = _mm512_set1_ps(1.f / s.sum[i]);
    for (int64_t p = 0; p < C / 2; ++p) {
      __m512 first, second;
      sgl_lite::deinterleave_dims(_mm512_loadu_ps(s.o.data() + i * D + p * 32), _mm512_loadu_ps(s.o.data() + i * D + p * 32 + 16), first, second);
      _mm256_storeu_si256(dst + 2 * p, sgl_lite::round_to_bf16(_mm512_mul_ps(first, inv)));
      _mm256_storeu_si256(dst + 2 * p + 1, sgl_lite::round_to_bf16(_mm512_mul_ps(second, inv)));
    }
  }
}

#endif
