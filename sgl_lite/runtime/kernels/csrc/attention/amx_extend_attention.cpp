// Extend (prefill) attention on AMX tiles, for bf16 queries over a bf16 pool, on CPUs with AMX-BF16: the
// long extends of an agent's turn (an observation of hundreds of tokens over thousands cached).
//
// Same inputs as extend_attention.cpp (extend_requests.h). Work items are (request, KV head, run of query
// rows); an item first packs the keys its rows see: K rows gathered from the pool into one [L][D] copy and
// V transposed by blocks of 64 keys ([L/64][D][32] words, a word per pair of keys: 32-bit words transposed
// 16 x 16). Its rows (token-major, the G query heads of a token together) go in tiles of 16, and a tile
// walks the keys in blocks of 32 with flash attention's online softmax, the rows in the 16 lanes of a vector:
//   S^T [32 keys][16 rows] in two C tiles: TDPBF16PS over D / 32 steps (A: 16 key rows x 32 dims as
//   stored, B: the tile's queries transposed in pairs of dims), a block ahead of its softmax;
//   the softmax down the keys in float32, in base 2 (exp2_vectors.h), no horizontal sums, whole blocks of
//   32 keys (past the last row's position, keys are hidden like any other: no short blocks);
//   P^T rounded to bf16 and paired by keys (B), and O^T [64 dims][16 rows] += V^T P^T (A: 16 dims x 32
//   keys) in four C tiles that hold O^T for the whole walk (heads wider than 64 walk once per 64 dims).
// The products run on the tile units; what is left is the softmax's arithmetic. Why: torch's SDPA ran these
// extends at a fraction of the tiles' rate, and at a few thousand tokens of context attention cost as much
// as the model's matmuls (docs/performance.md, "On CPUs with AMX").
//
// A row's result depends only on its own keys and position (blocks and tiles are fixed), not on the batch,
// the chunking of its prompt or the threads. Threads take items from a shared counter, costliest first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "bf16_arithmetic.h"
#include "exp2_vectors.h"
#include "extend_requests.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__linux__)
#include "amx_tiles.h"
#define SGL_LITE_HAS_AMX_EXTEND 1
#else
#define SGL_LITE_HAS_AMX_EXTEND 0
#endif

namespace {

constexpr int64_t kRows = 16;                // query rows per tile
constexpr int64_t kBlock = 64;               // keys per block of the packed V^T (two walk blocks of 32)
constexpr int64_t kBlockWords = kBlock / 2;  // a block's keys in pairs
constexpr int64_t kMaxHeadDim = 256;         // a multiple of 32 up to this
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMinItemRows = 64;         // the fewest rows an item is split into for the threads
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kPrefetchBlocks = 2;       // how many blocks of 32 keys ahead a walk prefetches

#if SGL_LITE_HAS_AMX_EXTEND

using sgl_lite::configure_tiles;
using sgl_lite::tiles_granted;
using sgl_lite::transpose16x16;

// One thread's buffers: an item's keys, and a tile's queries, scores, probabilities and outputs.
struct Scratch {
  std::vector<uint16_t> k;   // [L][D]: K rows, L = the item's keys rounded up to a block, zeros past them
  std::vector<uint32_t> vt;  // [L / 64][D][32]: V transposed by block, a word per pair of keys (even key low)
  alignas(64) uint32_t q_rows[kRows * kMaxHeadDim / 2];  // the tile's query rows as words (pairs of dims)
  alignas(64) uint32_t qp[kMaxHeadDim / 2 * kRows];      // ... transposed: [D / 2][16], the B operand of S^T
  alignas(64) float st[2 * 32 * kRows];                  // S^T of two blocks of 32 keys: [32 keys][16 rows] each
  alignas(64) uint32_t pp[16 * kRows];                   // P^T in bf16 pairs of keys: [16][16], B of O^T
  alignas(64) float ot[64 * kRows];                      // O^T of a walk's dims [64][16], float32
};

// K and V of the item's first n keys (of KV head h) into the scratch, as the tiles read them.
void pack_keys(const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* slots, int64_t n, int64_t h, int64_t Hkv,
               int64_t D, Scratch& s) {
  const int64_t L = (n + kBlock - 1) / kBlock * kBlock, words = L / 2;
  if (int64_t(s.k.size()) < L * D) s.k.resize(L * D);
  if (int64_t(s.vt.size()) < D * words) s.vt.resize(D * words);
  for (int64_t j = 0; j < n; ++j) std::memcpy(s.k.data() + j * D, k_cache + (slots[j] * Hkv + h) * D, D * sizeof(uint16_t));
  std::memset(s.k.data() + n * D, 0, (L - n) * D * sizeof(uint16_t));
  alignas(64) uint32_t pairs[16 * 16];  // [16 pairs of keys][16 dims]
  for (int64_t p0 = 0; p0 < words; p0 += 16) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = 2 * (p0 + i);
        const __m256i even = j < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_cache + (slots[j] * Hkv + h) * D + d0))
                                   : _mm256_setzero_si256();
        const __m256i odd = j + 1 < n ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_cache + (slots[j + 1] * Hkv + h) * D + d0))
                                      : _mm256_setzero_si256();
        const __m512i word = _mm512_or_si512(_mm512_cvtepu16_epi32(even), _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
        _mm512_store_si512(pairs + i * 16, word);
      }
      transpose16x16(pairs, 16, s.vt.data() + (p0 / kBlockWords) * D * kBlockWords + d0 * kBlockWords + p0 % kBlockWords, kBlockWords);
    }
  }
}

// A tile's rows: [r0, r0 + 16) of a request's num_new x G (row r: token r / G, query head h G + r % G; rows
// past `rows` repeat the last and are not written).
struct TileRows {
  const sgl_lite::ExtendRequest& req;
  int64_t h, G, Hq, D, r0, rows;
  int64_t offset(int64_t i) const {  // where row r0 + i sits in q and out
    const int64_t row = std::min(r0 + i, rows - 1);
    return ((req.q_start + row / G) * Hq + h * G + row % G) * D;
  }
  int32_t last_seen(int64_t i) const { return int32_t(req.kv_len - req.num_new + std::min(r0 + i, rows - 1) / G); }
};

// The tile's queries transposed in pairs of dims: the B operand of S^T.
void load_queries(const uint16_t* q, const TileRows& t, Scratch& s) {
  const int64_t words_per_row = t.D / 2;
  for (int64_t i = 0; i < kRows; ++i) std::memcpy(s.q_rows + i * words_per_row, q + t.offset(i), t.D * sizeof(uint16_t));
  for (int64_t c = 0; c < words_per_row; c += 16) transpose16x16(s.q_rows + c, words_per_row, s.qp + c * kRows, kRows);
}

// Probabilities are taken against a reference max per row, 2^(scale (s - ref)): a row's reference moves (to
// its block's max, its O and sum rescaled) only when its scores pass it by kSlack (base 2), so they stay
// below 2^kSlack, and the outputs rarely make a round trip through memory.
constexpr float kSlack = 8.f;

// Output dims [d0, d0 + 16 T) of the tile's rows (T = 2 or 4), written into out: O^T stays in C tiles 0..T-1
// for the whole walk over the keys, in blocks of 32 (S^T in tiles 4 and 5), so the outputs make no round
// trip through memory per block. Wider heads take several walks: the same scores and probabilities each time.
template <int T>
void attend_dims(const TileRows& t, int64_t d0, float scale, Scratch& s, c10::BFloat16* out) {
  constexpr int64_t kKeys = 32;
  const int64_t D = t.D;
  alignas(64) int32_t last_seen[kRows];
  for (int64_t i = 0; i < kRows; ++i) last_seen[i] = t.last_seen(i);
  const __m512i seen = _mm512_load_si512(last_seen);
  const float base2 = scale * sgl_lite::kLog2e;
  const __m512 c = _mm512_set1_ps(base2), slack = _mm512_set1_ps(kSlack / base2);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 ref = neg_inf, sum = _mm512_setzero_ps();
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (T == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  // S^T of the block from k0 into st: issued a block ahead of its softmax, so that the tile units compute
  // it while the vector units run the softmax before it.
  auto block_scores = [&](int64_t k0, float* st) {
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t chunk = 0; chunk < D / 32; ++chunk) {
      _tile_loadd(7, s.qp + chunk * 16 * kRows, 64);
      _tile_loadd(6, s.k.data() + k0 * D + chunk * 32, D * 2);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(6, s.k.data() + (k0 + 16) * D + chunk * 32, D * 2);
      _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(4, st, 64);
    _tile_stored(5, st + 16 * kRows, 64);
  };
  auto outputs = [&](bool store) {  // O^T's tiles to (or back from) s.ot
    for (int tile = 0; tile < T; ++tile) {
      float* ot = s.ot + tile * 16 * kRows;
      if (store) {
        if (tile == 0) _tile_stored(0, ot, 64);
        if (tile == 1) _tile_stored(1, ot, 64);
        if (tile == 2) _tile_stored(2, ot, 64);
        if (tile == 3) _tile_stored(3, ot, 64);
      } else {
        if (tile == 0) _tile_loadd(0, ot, 64);
        if (tile == 1) _tile_loadd(1, ot, 64);
        if (tile == 2) _tile_loadd(2, ot, 64);
        if (tile == 3) _tile_loadd(3, ot, 64);
      }
    }
  };
  const int64_t last_key = last_seen[kRows - 1];
  block_scores(0, s.st);
  for (int64_t k0 = 0, b = 0; k0 <= last_key; k0 += kKeys, ++b) {
    float* st = s.st + (b % 2) * kKeys * kRows;  // the two halves of s.st take turns
    if (k0 + kKeys <= last_key) block_scores(k0 + kKeys, s.st + (1 - b % 2) * kKeys * kRows);
    // keys past some row's position are hidden from it (-inf); past the last row's, from all: a short last
    // block is a whole one whose tail weighs 0
    const bool masked = k0 + kKeys - 1 > last_seen[0];
    if (masked) {
      for (int64_t j = 0; j < kKeys; ++j) {
        const __mmask16 hidden = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(int32_t(k0 + j)), seen);
        _mm512_store_ps(st + j * kRows, _mm512_mask_blend_ps(hidden, _mm512_load_ps(st + j * kRows), neg_inf));
      }
    }
    // whole blocks, unrolled: the maxes and sums stay in registers (four and two chains: latency, not rate)
    __m512 m0 = neg_inf, m1 = neg_inf, m2 = neg_inf, m3 = neg_inf;
#pragma GCC unroll 8
    for (int64_t j = 0; j < kKeys; j += 4) {
      m0 = _mm512_max_ps(m0, _mm512_load_ps(st + j * kRows));
      m1 = _mm512_max_ps(m1, _mm512_load_ps(st + (j + 1) * kRows));
      m2 = _mm512_max_ps(m2, _mm512_load_ps(st + (j + 2) * kRows));
      m3 = _mm512_max_ps(m3, _mm512_load_ps(st + (j + 3) * kRows));
    }
    const __m512 block_max = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
    // rows whose scores passed their reference take a new one (each row's own: the others' rows never decide it)
    const __mmask16 passed = _mm512_cmp_ps_mask(block_max, _mm512_add_ps(ref, slack), _CMP_GT_OQ);
    if (passed != 0) {
      const __m512 new_ref = _mm512_mask_blend_ps(passed, ref, block_max);  // every row sees key 0, in the first block
      const __m512 alpha = sgl_lite::exp2_lanes(_mm512_mul_ps(_mm512_sub_ps(ref, new_ref), c));
      sum = _mm512_mul_ps(sum, alpha);
      ref = new_ref;
      if (k0 > 0) {  // O^T through memory, rescaled
        outputs(true);
        for (int64_t d = 0; d < 16 * T; ++d) _mm512_store_ps(s.ot + d * kRows, _mm512_mul_ps(_mm512_load_ps(s.ot + d * kRows), alpha));
        outputs(false);
      }
    }
    const __m512 offset = _mm512_mul_ps(ref, c);
    // the exponential takes finite inputs: hidden keys' -inf clamped to -200 (a probability of 0)
    const __m512 floor_x = _mm512_set1_ps(masked ? -200.f : -std::numeric_limits<float>::max());
    __m512 sum0 = sum, sum1 = _mm512_setzero_ps();
    // the K and V^T lines of the block kPrefetchBlocks on, into L1 over the block's probabilities: the tile
    // loads then find them there, not in L2
    const int64_t ahead = std::min(k0 + kPrefetchBlocks * kKeys, last_key);
    const char* k_ahead = reinterpret_cast<const char*>(s.k.data() + (ahead / kKeys * kKeys) * D);
    const char* v_ahead = reinterpret_cast<const char*>(s.vt.data() + (ahead / kBlock * D + d0) * kBlockWords + (ahead / kKeys * kKeys % kBlock) / 2);
    const int64_t k_lines = kKeys * D * 2 / 64, v_lines = 16 * T;  // V^T: a 64-byte line per dim
#pragma GCC unroll 16
    for (int64_t p = 0; p < kKeys / 2; ++p) {
      for (int64_t l = p; l < k_lines; l += kKeys / 2) _mm_prefetch(k_ahead + l * 64, _MM_HINT_T0);
      for (int64_t l = p; l < v_lines; l += kKeys / 2) _mm_prefetch(v_ahead + l * kBlockWords * 4, _MM_HINT_T0);
      const __m512 even = sgl_lite::exp2_lanes_bf16(_mm512_max_ps(_mm512_fmsub_ps(_mm512_load_ps(st + 2 * p * kRows), c, offset), floor_x));
      const __m512 odd = sgl_lite::exp2_lanes_bf16(_mm512_max_ps(_mm512_fmsub_ps(_mm512_load_ps(st + (2 * p + 1) * kRows), c, offset), floor_x));
      if (p % 2 == 0) sum0 = _mm512_add_ps(sum0, _mm512_add_ps(even, odd));
      else sum1 = _mm512_add_ps(sum1, _mm512_add_ps(even, odd));
      _mm512_store_si512(s.pp + p * kRows, sgl_lite::bf16_pairs(even, odd));
    }
    sum = _mm512_add_ps(sum0, sum1);
    _tile_loadd(7, s.pp, 64);  // O^T += V^T P^T, A: 16 dims x 32 keys of V^T
    const uint32_t* vt = s.vt.data() + (k0 / kBlock * D + d0) * kBlockWords + (k0 % kBlock) / 2;
    constexpr int64_t stride = kBlockWords * sizeof(uint32_t);
    _tile_loadd(6, vt, stride);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(6, vt + 16 * kBlockWords, stride);
    _tile_dpbf16ps(1, 6, 7);
    if constexpr (T == 4) {
      _tile_loadd(6, vt + 32 * kBlockWords, stride);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(6, vt + 48 * kBlockWords, stride);
      _tile_dpbf16ps(3, 6, 7);
    }
  }
  outputs(true);
  alignas(64) float sums[kRows];
  _mm512_store_ps(sums, sum);
  for (int64_t i = 0; i < kRows && t.r0 + i < t.rows; ++i) {
    c10::BFloat16* dst = out + t.offset(i) + d0;
    const float inv = 1.f / sums[i];
    for (int64_t d = 0; d < 16 * T; ++d) dst[d] = c10::BFloat16(s.ot[d * kRows + i] * inv);
  }
}

void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<sgl_lite::ExtendRequest>& reqs,
         const int64_t* indices, float scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1), G = Hq / Hkv;
  const int64_t threads = at::get_num_threads();
  struct Item {
    int64_t req, head, r0, r1;  // rows [r0, r1) of the request's num_new x G
  };
  // Each (request, KV head) is one item, split into runs of rows when there are too few for the threads.
  const int64_t splits = std::max<int64_t>(1, (kItemsPerThread * threads + int64_t(reqs.size()) * Hkv - 1) / (int64_t(reqs.size()) * Hkv));
  std::vector<Item> items;
  for (int64_t e = 0; e < int64_t(reqs.size()); ++e) {
    const int64_t rows = reqs[e].num_new * G;
    const int64_t chunk = std::max(kMinItemRows, ((rows + splits - 1) / splits + kRows - 1) / kRows * kRows);
    for (int64_t r0 = 0; r0 < rows; r0 += chunk)
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({e, h, r0, std::min(rows, r0 + chunk)});
  }
  auto cost = [&](const Item& it) {  // keys seen by the item's last row, times its rows
    return (reqs[it.req].kv_len - reqs[it.req].num_new + (it.r1 - 1) / G) * (it.r1 - it.r0);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  std::atomic<int64_t> next{0};
  const int64_t num_items = int64_t(items.size());
  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    configure_tiles();
    auto scratch = std::make_unique<Scratch>();
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const sgl_lite::ExtendRequest& req = reqs[it.req];
      const int64_t rows = req.num_new * G, seen = req.kv_len - req.num_new + (it.r1 - 1) / G + 1;
      pack_keys(kp, vp, indices + req.kv_begin, seen, it.head, Hkv, D, *scratch);
      for (int64_t r0 = it.r0; r0 < it.r1; r0 += kRows) {
        const TileRows tile{req, it.head, G, Hq, D, r0, rows};
        load_queries(qp, tile, *scratch);
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) attend_dims<4>(tile, d0, scale, *scratch, op);
        if (d0 < D) attend_dims<2>(tile, d0, scale, *scratch, op);
      }
    }
    _tile_release();
  });
}

#endif

bool amx_extend_supported() {
#if SGL_LITE_HAS_AMX_EXTEND
  return tiles_granted();
#else
  return false;
#endif
}

// As extend_attention (same `requests` and `kv_indices`), for bf16 q, out and pool and a head_dim that is a
// multiple of 32.
void amx_extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& requests,
                          const at::Tensor& kv_indices, double scale, at::Tensor& out) {
  TORCH_CHECK(amx_extend_supported(), "amx_extend_attention: no AMX tiles here (check sgl_lite::amx_extend_attention_supported first)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "amx_extend_attention: q and the KV cache must be bf16");
  TORCH_CHECK(q.dim() == 3 && q.size(2) > 0 && q.size(2) % 32 == 0, "amx_extend_attention: head_dim must be a positive multiple of 32; got q of ",
              q.sizes());
  const float s = static_cast<float>(scale);  // what the kernel computes with: a positive normal float32
  TORCH_CHECK(s >= std::numeric_limits<float>::min() && std::isfinite(s), "amx_extend_attention: scale must be positive and finite; got ", scale);
  const auto reqs = sgl_lite::checked_extend_requests("amx_extend_attention", q, k_cache, v_cache, requests, kv_indices, out,
                                                      kMaxHeadDim, kMaxGroup);
  if (reqs.empty()) return;
#if SGL_LITE_HAS_AMX_EXTEND
  run(q, k_cache, v_cache, reqs, kv_indices.data_ptr<int64_t>(), s, out);
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("amx_extend_attention_supported() -> bool", &amx_extend_supported);
  m.def("amx_extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor requests, Tensor kv_indices, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("amx_extend_attention", &amx_extend_attention); }
