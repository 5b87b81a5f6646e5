// Extend (prefill) attention on CPU: each request's new tokens against its whole context in the KV pool.
//
// Inputs are FlashInfer's page-size-1 metadata, per extend request: its q rows [q_start, q_start + new) and
// its slots kv_indices[kv_begin : kv_begin + kv_len] (the cached prefix, then the new tokens, whose K/V the
// backend wrote into the pool before the call). New token j sits at position prefix + j (prefix = kv_len -
// new) and sees positions 0..prefix + j. GQA: the G = Hq / Hkv query heads of a KV head share its K/V.
//
// Flash-attention's loop in float32: work items are (request, kv head, run of tiles of 32 new tokens); a
// tile's G x 32 query rows walk the keys up to the tile's last position in blocks of 32, with an online
// softmax per row. The tile's queries are transposed once ([D][rows]); per block, K and V are widened to
// float32 once, then two register-blocked products: S^T = K Q^T (4 keys x 32 rows: a key's scores for a run of rows
// in one vector, so the softmax runs down the rows 16 at a time) and O += P V (4 rows x D), every multiply
// an FMA. One exp per score, no [rows x context] score matrix in memory, and no gather copy of K/V. Why:
// torch's path (scores, softmax and their casts as separate passes over the whole score matrix) ran an
// agent turn's extend (8 requests x 90 tokens on 450-token prefixes) far below the FMAs' rate, a large
// share of its prefill step (docs/performance.md, "On CPUs whose float32 FMAs outrun VDPBF16PS").
//
// In bf16, on CPUs whose VDPBF16PS outruns their float32 FMAs (as bf16_gemv.cpp's probe finds), both
// products multiply bf16 pairs instead (extend_blocks.h): Q and K as stored, P rounded to bf16 against V
// interleaved by pairs of keys; half the instructions, no widening of K and V (docs/journal.md,
// "Extend attention in VDPBF16PS pairs"; the path is extend_pairs.h). There an item first packs the keys its last tile sees (K rows
// together, V interleaved) and its tiles walk that copy in blocks of 128 keys: the pool's rows of one head
// sit a slot's whole row apart, and a walk per tile gathering and interleaving them again cost as much as
// its products (docs/performance.md, "Prefill at the 1.7B shape").
//
// An 8-bit float pool (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`) is read as it is stored and widened in
// registers (fp8_vectors.h): to float32 for the FMAs, to bf16 for the pairs (exactly: every fp8 value is a
// bf16 value), so a row gets the bits it would get from a bf16 pool holding the same values.
//
// A row's result depends only on its own keys and its position (tiles and blocks are fixed), not on the
// batch or the threads. Threads take items from a shared counter.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_arithmetic.h"
#include "exp2_vectors.h"
#include "extend_requests.h"
#include "fp8_vectors.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define SGL_LITE_HAS_EXTEND_KERNEL 1
#else
#define SGL_LITE_HAS_EXTEND_KERNEL 0
#endif

namespace {

constexpr int64_t kTileTokens = 32;     // new tokens per tile
constexpr int64_t kKeys = 32;           // keys per block on the float32 path: two vectors of scores per row
constexpr int64_t kPairBlock = 128;     // keys per block on the pairs path: fewer round trips of the outputs
constexpr int64_t kRows = 4;            // query rows per register block
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kItemsPerThread = 4;  // a request's tiles are split into runs until the threads have this many items
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool has_extend_kernel() { return SGL_LITE_HAS_EXTEND_KERNEL; }

using Request = sgl_lite::ExtendRequest;

#if SGL_LITE_HAS_EXTEND_KERNEL

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

using sgl_lite::exp2_lanes;
using sgl_lite::kLog2e;

// 16 stored K/V elements as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return sgl_lite::widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const c10::Float8_e4m3fn* p) { return sgl_lite::widen_e4m3fn(reinterpret_cast<const uint8_t*>(p)); }
inline __m512 load16(const c10::Float8_e5m2* p) { return sgl_lite::widen_e5m2(reinterpret_cast<const uint8_t*>(p)); }

template <typename KT>
constexpr bool kIsFp8 = std::is_same_v<KT, c10::Float8_e4m3fn> || std::is_same_v<KT, c10::Float8_e5m2>;

// One thread's scratch for a tile of R rows (padded to whole vectors of 16): the queries transposed
// ([D][R], scaled), the outputs ([R][D]), a key block's K and V rows in float32 ([32][D]), its scores and
// then probabilities transposed ([keys][R]), and per row the running max and sum and the block's rescale.
// With VDPBF16PS (bf16 only), instead of qt, k and v: the queries transposed in bf16 pairs along D
// ([D/2][R] words), the item's K rows ([L][D/2] words), the block's probabilities in bf16 pairs of keys
// ([64][R] words) and the item's V rows interleaved by pairs of keys ([L/2][D] words), L the item's keys
// rounded up to a block (zeros past them), plus one pair line for the last pair of a block of odd length.
struct Scratch {
  int64_t dim;
  std::vector<float> qt, o, k, v, st, max, sum, alpha;
  std::vector<uint32_t> qp, kb, pp, vp, last_pair;
  std::vector<uint16_t> zero_row, row_a, row_b;  // row_a/b: an 8-bit pool's V rows widened to bf16
  Scratch(int64_t rows, int64_t dim, bool pairs)
      : dim(dim), qt(pairs ? 0 : dim * rows), o(rows * dim), k(pairs ? 0 : kKeys * dim), v(pairs ? 0 : kKeys * dim),
        st((pairs ? kPairBlock : kKeys) * rows), max(rows), sum(rows), alpha(rows), qp(pairs ? dim / 2 * rows : 0), pp(pairs ? kPairBlock / 2 * rows : 0),
        last_pair(pairs ? dim : 0), zero_row(pairs ? dim : 0), row_a(pairs ? dim : 0), row_b(pairs ? dim : 0) {}
};

#include "extend_blocks.h"

// The online softmax over one block of n keys for every row of a tile: st holds the block's scores
// transposed ([n][R], in base 2: scores times log2(e)); on return the unnormalized probabilities (0 for
// hidden keys) are in st, or with kPairs in s.pp as bf16 pairs of keys (the pairs path's operand, from
// exp2_lanes_bf16: they are rounded to bf16 at once), and each row's running max and sum are updated, with
// alpha the factor its output must be rescaled by (the value products apply it as they load the outputs).
// Row i is token t0 + i / G of the tile and sees key positions <= prefix + t0 + i / G.
template <bool kPairs>
inline void softmax_block(float* st, int64_t R, int64_t rows, int64_t G, int64_t prefix, int64_t t0, int64_t k0, int64_t n,
                          Scratch& s) {
  // Only a block that reaches past the tile's first token needs the causal mask.
  const bool causal = k0 + n > prefix + t0 + 1;
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    // row i sees key positions <= its own, prefix + t0 + i / G (padding rows: the last row's)
    alignas(64) int32_t last_seen[16];
    for (int64_t i = 0; i < 16; ++i) last_seen[i] = static_cast<int32_t>(prefix + t0 + std::min(r0 + i, rows - 1) / G);
    const __m512i seen = _mm512_load_si512(last_seen);
    __m512 block_max = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < n; ++j) {
      __m512 x = _mm512_loadu_ps(st + j * R + r0);
      if (causal) {
        const __mmask16 hidden = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(k0 + j)), seen);
        x = _mm512_mask_blend_ps(hidden, x, _mm512_set1_ps(kNegInf));
        _mm512_storeu_ps(st + j * R + r0, x);
      }
      block_max = _mm512_max_ps(block_max, x);
    }
    // every row sees key 0, so the running max is finite from the first block on
    const __m512 old_max = _mm512_loadu_ps(s.max.data() + r0);
    const __m512 new_max = _mm512_max_ps(old_max, block_max);
    const __m512 alpha = exp2_lanes(_mm512_sub_ps(old_max, new_max));  // 0 on the first block (2^-inf)
    __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(s.sum.data() + r0), alpha);
    if constexpr (kPairs) {
#if SGL_LITE_HAS_DPBF16_EXTEND
      const __m512 floor_x = _mm512_set1_ps(-200.f);  // hidden keys' -inf: a probability of 0
      auto probability = [&](int64_t j) {
        return sgl_lite::exp2_lanes_bf16(_mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(st + j * R + r0), new_max), floor_x));
      };
      for (int64_t i = 0; 2 * i < n; ++i) {
        const __m512 pa = probability(2 * i), pb = 2 * i + 1 < n ? probability(2 * i + 1) : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, _mm512_add_ps(pa, pb));
        _mm512_storeu_si512(s.pp.data() + i * R + r0, sgl_lite::bf16_pairs(pa, pb));
      }
#endif
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const __m512 p = exp2_lanes(_mm512_sub_ps(_mm512_loadu_ps(st + j * R + r0), new_max));
        _mm512_storeu_ps(st + j * R + r0, p);
        sum = _mm512_add_ps(sum, p);
      }
    }
    _mm512_storeu_ps(s.max.data() + r0, new_max);
    _mm512_storeu_ps(s.sum.data() + r0, sum);
    _mm512_storeu_ps(s.alpha.data() + r0, alpha);
  }
}

// A tile's rows: (token, query head of the group), token-major: row i is token t0 + i / G, head h * G + i % G.
struct Tile {
  int64_t t0, t1, h, G, rows, R;  // R: rows padded to whole pairs of vectors (padding rows repeat the last row)
};

inline Tile make_tile(int64_t t0, int64_t t1, int64_t h, int64_t G) {
  const int64_t rows = (t1 - t0) * G;
  return {t0, t1, h, G, rows, (rows + 31) / 32 * 32};
}

// Where row i of the tile (i < rows) sits in q and out [N, Hq, D].
inline int64_t row_offset(const Request& req, const Tile& t, int64_t i, int64_t Hq, int64_t D) {
  return ((req.q_start + t.t0 + i / t.G) * Hq + t.h * t.G + i % t.G) * D;
}

template <typename QT>
inline const QT* query_row(const QT* q, const Request& req, const Tile& t, int64_t i, int64_t Hq, int64_t D) {
  return q + row_offset(req, t, std::min(i, t.rows - 1), Hq, D);
}

inline void start_tile(const Tile& t, int64_t D, Scratch& s) {
  std::fill(s.o.begin(), s.o.begin() + t.R * D, 0.f);
  std::fill(s.max.begin(), s.max.begin() + t.R, kNegInf);
  std::fill(s.sum.begin(), s.sum.begin() + t.R, 0.f);
}

// One work item in float32 FMAs: new tokens [t0, t1) of request `req`, KV head h. Scores are kept
// transposed (a key's scores for all rows in a run), so the online softmax runs down the rows 16 at a time
// with no horizontal sums.
template <int64_t C, typename QT, typename KT>
void attend_tile(const QT* q, const KT* k_cache, const KT* v_cache, const int64_t* slots, const Request& req, const Tile& t,
                 int64_t Hq, int64_t Hkv, float scale, Scratch& s, QT* out) {
  constexpr int64_t D = C * 16;
  const int64_t prefix = req.kv_len - req.num_new, R = t.R;
  for (int64_t i = 0; i < R; ++i) {
    const QT* src = query_row(q, req, t, i, Hq, D);
    for (int64_t d = 0; d < D; ++d) s.qt[d * R + i] = to_float(src[d]) * (scale * kLog2e);
  }
  start_tile(t, D, s);
  const int64_t keys = prefix + t.t1;  // the tile's last token sees positions 0..prefix + t1 - 1
  for (int64_t k0 = 0; k0 < keys; k0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - k0), n4 = (n + 3) / 4 * 4;
    // K and V rows in float32. K rows n..n4 keep an earlier block's rows (or the zeros they start as): finite,
    // and their scores are never read; V rows past n are never read either.
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = slots[k0 + j];
      const KT* kr = k_cache + (slot * Hkv + t.h) * D;
      const KT* vr = v_cache + (slot * Hkv + t.h) * D;
      for (int64_t c = 0; c < C; ++c) {
        _mm512_storeu_ps(s.k.data() + j * D + c * 16, load16(kr + c * 16));
        _mm512_storeu_ps(s.v.data() + j * D + c * 16, load16(vr + c * 16));
      }
    }
    float* st = s.st.data();
    for (int64_t j0 = 0; j0 < n4; j0 += 4)
      for (int64_t r0 = 0; r0 < R; r0 += 32) scores_block<C>(s.qt.data() + r0, R, s.k.data() + j0 * D, st + j0 * R + r0);
    softmax_block<false>(st, R, t.rows, t.G, prefix, t.t0, k0, n, s);
    for (int64_t r0 = 0; r0 < R; r0 += kRows) values_block<C>(st + r0, R, s.v.data(), n, s.alpha.data() + r0, s.o.data() + r0 * D);
  }
  for (int64_t i = 0; i < t.rows; ++i) {
    QT* dst = out + row_offset(req, t, i, Hq, D);
    const float inv = 1.f / s.sum[i];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<QT>(s.o[i * D + d] * inv);
  }
}

#include "extend_pairs.h"

template <int64_t C, typename QT, typename KT>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<Request>& reqs,
         const int64_t* indices, float scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), Hkv = k_cache.size(1), G = Hq / Hkv;
  struct Item {
    int64_t req, head, t0, t1;  // new tokens [t0, t1): whole tiles but the request's last
  };
  // Each (request, KV head) is one item, its tiles split into runs when there are too few for the threads.
  const int64_t heads = int64_t(reqs.size()) * Hkv;
  const int64_t splits = std::max<int64_t>(1, (kItemsPerThread * at::get_num_threads() + heads - 1) / heads);
  std::vector<Item> items;
  for (int64_t r = 0; r < int64_t(reqs.size()); ++r) {
    const int64_t tiles = (reqs[r].num_new + kTileTokens - 1) / kTileTokens;
    const int64_t run_tokens = (tiles + splits - 1) / splits * kTileTokens;
    for (int64_t t0 = 0; t0 < reqs[r].num_new; t0 += run_tokens)
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({r, h, t0, std::min(reqs[r].num_new, t0 + run_tokens)});
  }
  // Costlier items (more tokens, later ones seeing more keys) first, so that the last ones to run are short.
  auto cost = [&](const Item& it) { return (it.t1 - it.t0) * (reqs[it.req].kv_len - reqs[it.req].num_new + (it.t0 + it.t1) / 2); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const auto* qp = q.data_ptr<QT>();
  const auto* kp = k_cache.data_ptr<KT>();
  const auto* vp = v_cache.data_ptr<KT>();
  auto* op = out.data_ptr<QT>();
  bool pairs = false;  // VDPBF16PS, where this CPU runs it faster than float32 FMAs (bf16_gemv.cpp's probe)
#if SGL_LITE_HAS_DPBF16_EXTEND
  constexpr bool kPairable = std::is_same_v<QT, c10::BFloat16> && (std::is_same_v<KT, c10::BFloat16> || kIsFp8<KT>) && C % 2 == 0;
  if constexpr (kPairable) pairs = sgl_lite::dpbf16_preferred();
#endif
  std::atomic<int64_t> next{0};
  const int64_t num_items = int64_t(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    Scratch scratch((kTileTokens * G + 31) / 32 * 32, C * 16, pairs);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const Request& req = reqs[it.req];
      const int64_t* slots = indices + req.kv_begin;
#if SGL_LITE_HAS_DPBF16_EXTEND
      if constexpr (kPairable) {
        if (pairs) {
          pack_keys_dp<C, KT>(kp, vp, slots, req.kv_len - req.num_new + it.t1, it.head, Hkv, scratch);
          for (int64_t t0 = it.t0; t0 < it.t1; t0 += kTileTokens)
            attend_tile_dp<C>(qp, req, make_tile(t0, std::min(it.t1, t0 + kTileTokens), it.head, G), Hq, scale, scratch, op);
          continue;
        }
      }
#endif
      for (int64_t t0 = it.t0; t0 < it.t1; t0 += kTileTokens)
        attend_tile<C>(qp, kp, vp, slots, req, make_tile(t0, std::min(it.t1, t0 + kTileTokens), it.head, G), Hq, Hkv, scale, scratch, op);
    }
  });
}

template <typename QT, typename KT>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<Request>& reqs,
                  const int64_t* indices, float scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return run<4, QT, KT>(q, k, v, reqs, indices, scale, out);
    case 128: return run<8, QT, KT>(q, k, v, reqs, indices, scale, out);
    case 256: return run<16, QT, KT>(q, k, v, reqs, indices, scale, out);
    case 32: return run<2, QT, KT>(q, k, v, reqs, indices, scale, out);
    case 16: return run<1, QT, KT>(q, k, v, reqs, indices, scale, out);
    default: TORCH_CHECK(false, "extend_attention: head_dim must be 16, 32, 64, 128 or 256; got ", q.size(2));
  }
}

#endif

// `requests` int64 [E, 4]: per extend request (first q row, new tokens, first index into kv_indices, kv length).
// Writes those requests' rows of `out` [N, Hq, D] (other rows are left as they are).
void extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& requests,
                      const at::Tensor& kv_indices, double scale, at::Tensor& out) {
  TORCH_CHECK(has_extend_kernel(), "extend_attention: this build has no AVX-512 (check sgl_lite::extend_attention_supported first)");
  const std::vector<Request> reqs = sgl_lite::checked_extend_requests("extend_attention", q, k_cache, v_cache, requests, kv_indices,
                                                                       out, kMaxHeadDim, kMaxGroup);
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  if (reqs.empty()) return;
#if SGL_LITE_HAS_EXTEND_KERNEL
  const float s = static_cast<float>(scale);
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf || kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2,
              "extend_attention: KV cache must be float32, bf16, fp16, float8_e4m3fn or float8_e5m2");
  if (kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2) {  // an 8-bit pool, widened as it is read
    const bool e4m3 = kv == at::kFloat8_e4m3fn;
    switch (q.scalar_type()) {
      case at::kFloat:
        return e4m3 ? dispatch_dim<float, c10::Float8_e4m3fn>(q, k_cache, v_cache, reqs, indices, s, out)
                    : dispatch_dim<float, c10::Float8_e5m2>(q, k_cache, v_cache, reqs, indices, s, out);
      case at::kBFloat16:
        return e4m3 ? dispatch_dim<c10::BFloat16, c10::Float8_e4m3fn>(q, k_cache, v_cache, reqs, indices, s, out)
                    : dispatch_dim<c10::BFloat16, c10::Float8_e5m2>(q, k_cache, v_cache, reqs, indices, s, out);
      default:
        TORCH_CHECK(false, "extend_attention: an 8-bit float KV cache takes float32 or bf16 queries");
    }
  }
  const auto qt = q.scalar_type();
  if (qt == at::kFloat && kv == at::kFloat) return dispatch_dim<float, float>(q, k_cache, v_cache, reqs, indices, s, out);
  if (qt == at::kBFloat16 && kv == at::kBFloat16) return dispatch_dim<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, reqs, indices, s, out);
  if (qt == at::kHalf && kv == at::kHalf) return dispatch_dim<c10::Half, c10::Half>(q, k_cache, v_cache, reqs, indices, s, out);
  TORCH_CHECK(false, "extend_attention: q and the KV cache must share a dtype (float32, bf16 or fp16), or the cache hold 8-bit floats");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("extend_attention_supported() -> bool", &has_extend_kernel);
  m.def("extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor requests, Tensor kv_indices, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("extend_attention", &extend_attention); }
