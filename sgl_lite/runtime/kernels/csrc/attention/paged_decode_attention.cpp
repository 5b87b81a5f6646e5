// Paged decode attention on CPU: rows of a few query tokens each against their KV slots in the pool.
//
// Inputs are FlashInfer's page-size-1 metadata: row r attends over the slots
// kv_indices[kv_indptr[r] : kv_indptr[r+1]] of k_cache/v_cache [num_slots, Hkv, D] with the queries
// q[qo_indptr[r] : qo_indptr[r+1]] (one for a decode row; 1 + draft for a speculative verification row,
// whose last query sees every slot and each earlier one a slot fewer). K/V rows are read straight from
// the pool (no gather copy) and converted to fp32 in registers (bf16, fp16, fp32, fp8 e4m3fn / e5m2
// storage). GQA: the G = Hq / Hkv query heads of a KV head share one read of its rows, and a verification
// row's queries share it too. Scores, the online softmax and the P.V accumulation are fp32; for bf16 queries
// and bf16 or 8-bit K/V, where bf16_gemv's probe prefers VDPBF16PS, the products are taken in bf16 pairs and
// summed in fp32 (decode_pairs.h).
//
// Work items are (row, chunk of the context) with all KV heads, reading each slot's row whole, or (row, kv
// head, chunk) when that leaves threads idle or a verification row has too many query vectors for one
// item (then its queries go in tiles); contexts are cut into chunks at fixed positions (so that long ones
// make several items, and a query's arithmetic never depends on its batch, its row or its row's other
// queries). Threads take items from a shared counter (a thread that loses its core to another process
// does not hold up the others), and the last item of a (row, kv head) to finish merges each query's chunks'
// partial softmax states in chunk order. A thread claims its next item when the current one's prefetch
// look-ahead runs past its end, and the look-ahead runs on into the next item's first rows (LookAhead).
//
// Beside this file: decode_vectors.h (the vector arithmetic and the softmax step), decode_fma.h (the float32
// path), decode_pairs.h (the VDPBF16PS path), decode_work.h (the work items).

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
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

#include "bf16_arithmetic.h"
#include "fp8_vectors.h"

namespace {

// Floats per vector: one AVX-512 register, else one AVX2 register (two SSE ones). Sixteen lanes on AVX2
// made every vector two registers and the shuffles of the lane reductions cross-register permutes: far
// slower there than eight.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxChunksPerRow = kMaxHeadDim / kLanes;
constexpr int64_t kMaxGroup = 16;
// Query vectors (query heads x queries of a verification row) one work item attends together: they share
// each K/V row it reads. 32 x 16 lanes of a block's unreduced products fill a 32 KB L1.
constexpr int64_t kMaxVectors = 32;
static_assert(kMaxVectors >= kMaxGroup, "a decode row's query heads of one kv head fit one item");
constexpr int64_t kBlock = 32;  // tokens scored between two online-softmax updates
// Contexts are cut into chunks at multiples of this many positions, whatever the batch, the thread count
// and the context's length, so that a query's result depends on none of them (the same sums in the same
// order): decoding alone, in a batch, or as one query of a speculative verification row (whose queries see
// contexts of different lengths) gives the same bits.
constexpr int64_t kChunk = 256;
// Tokens: slots are scattered, so the hardware prefetcher cannot follow. Into L2 (see prefetch_row), 48,
// 96 and 160 ran alike; 96 was a little ahead (docs/journal.md, "Decode kernels prefetch into L2").
constexpr int64_t kPrefetchAhead = 96;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#include "decode_vectors.h"

// Into L2 (prefetcht1), not L1: a prefetch into L1 holds one of the core's few L1 miss buffers until its
// line arrives, and a whole look-ahead of rows (96 x 6 lines) queued behind them stalled the loads the
// arithmetic waits on. The kernel reads K/V markedly faster this way than into L1 (docs/journal.md,
// "Decode kernels prefetch into L2"). Line `line` (64 bytes) of a row at `row`:
inline void prefetch_line(const void* row, int64_t line) {
  __builtin_prefetch(static_cast<const char*>(row) + line * 64, 0, 2);
}

inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t line = 0; line * 64 < bytes; ++line) prefetch_line(p, line);
}

// The K rows a work item reads first: slot slots[j]'s at k_base + slots[j] * stride_bytes, row_bytes of them.
struct FirstRows {
  const char* k_base = nullptr;
  const int64_t* slots = nullptr;
  int64_t count = 0, stride_bytes = 0, row_bytes = 0;
};

// A thread's next work item, claimed when its current item's look-ahead runs past the item's last token,
// so that the look-ahead goes on into the next item's first rows. Each item used to start cold: its first
// block's rows, prefetched only as it began, came from memory with nothing to overlap them, which made
// chunks of 512 positions run faster than chunks of 256 at 8-32 rows from memory. Now the rows are on
// their way while the previous item finishes: faster at 8 and 32 rows from memory, level from cache and at
// one row, the same bits (docs/performance.md, "Decode attention: the next work item's rows on their
// way"; scripts/ab_attention_builds.py). `claim` takes the next item from the
// shared counter and returns its rows (count 0: none left); the first rows the look-ahead did not reach,
// [0, cold_rows()), the item prefetches itself when it starts.
class LookAhead {
 public:
  explicit LookAhead(const std::function<FirstRows()>& claim) : claim_(claim) {}
  // Row j of the next item (claiming it on the first call).
  void prefetch(int64_t j) {
    if (!claimed_) {
      rows_ = claim_();
      claimed_ = true;
      first_ = j;
    }
    if (j < rows_.count) prefetch_row(rows_.k_base + rows_.slots[j] * rows_.stride_bytes, rows_.row_bytes);
  }
  // The next item's first rows the look-ahead did not prefetch: [0, cold_rows()).
  int64_t cold_rows() const { return claimed_ ? first_ : kPrefetchAhead; }

 private:
  const std::function<FirstRows()>& claim_;
  FirstRows rows_;
  bool claimed_ = false;
  int64_t first_ = 0;
};

// Softmax state of one (row, kv head, chunk, query): G running maxima and sums and G unnormalized outputs.
struct Partial {
  float* acc;  // [G, D]
  float* max;  // [G]
  float* sum;  // [G]
};

struct Shape {
  int64_t group, dim, row_stride;  // row_stride: elements between consecutive slots (Hkv * D)
};

// What a work item attends within one chunk of a row's context: `heads` consecutive KV heads and `queries`
// consecutive queries of the row, query j seeing the chunk's first limits[j] tokens (non-decreasing in j;
// a decode row is one query seeing the whole chunk). Its query vectors are ordered (head, query, group
// member): Q = heads * queries * G of them, at most kMaxVectors; unit u = head * queries + query owns the
// vectors u * G .. u * G + G - 1 and the partial outs[u].
struct Tile {
  int64_t heads, queries;
  const int64_t* limits;
  int64_t tokens() const { return limits[queries - 1]; }
  // per query vector (G per unit): how many of the block at `start` it sees (<= 0: none)
  void block_counts(int64_t start, int64_t G, int64_t* nb) const {
    for (int64_t u = 0; u < heads * queries; ++u) {
      const int64_t count = std::min(kBlock, limits[u % queries] - start);
      for (int64_t g = 0; g < G; ++g) nb[u * G + g] = count;
    }
  }
};

// Combine the chunks of one (row, kv head, query), parts[0], parts[stride], ..., and write its G output rows.
template <class OutT>
void merge_chunks(const Partial* parts, int64_t num_parts, int64_t stride, const Shape& shape, OutT* out) {
  const int64_t G = shape.group, D = shape.dim;
  alignas(64) float acc[kMaxHeadDim];
  for (int64_t g = 0; g < G; ++g) {
    float m = kNegInf;
    for (int64_t c = 0; c < num_parts; ++c) m = std::max(m, parts[c * stride].max[g]);
    std::fill(acc, acc + D, 0.f);
    float sum = 0.f;
    for (int64_t c = 0; c < num_parts; ++c) {
      const Partial& part = parts[c * stride];
      const float w = std::exp(part.max[g] - m);
      sum += w * part.sum[g];
      const float* a = part.acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += w * a[d];
    }
    const float inv = 1.f / sum;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<OutT>(acc[d] * inv);
  }
}

#include "decode_fma.h"
#include "decode_pairs.h"
#include "decode_work.h"

#if SGL_LITE_HAS_DPBF16_DECODE
// The pairs path's reader of each storage format it takes (void: none, the FMA path reads it).
template <class Kv> struct PairRows { using type = void; };
template <> struct PairRows<Bf16Kv> { using type = sgl_lite::Bf16Rows; };
template <> struct PairRows<E4m3Kv> { using type = sgl_lite::E4m3Rows; };
template <> struct PairRows<E5m2Kv> { using type = sgl_lite::E5m2Rows; };
#endif

// Rows: row r has the queries qo[r] .. qo[r + 1] - 1 (one for a decode row, 1 + its draft's length for a
// verification row) and the slots indices[kv[r] : kv[r + 1]]; its query j of n sees the first
// len - (n - 1 - j) of them (the causal mask of a row's last n positions).
template <class QT, class Kv>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t R, const int32_t* qo,
         const int32_t* kv, const int64_t* indices, float scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  const Shape shape{Hq / Hkv, D, Hkv * D};
  const int64_t G = shape.group;

  WorkPlan plan = plan_work(R, Hkv, G, qo, kv, indices, at::get_num_threads());
  const std::vector<Item>& items = plan.items;
  const std::vector<int64_t>& row_list = plan.row_list;
  const std::vector<int64_t>& first_part = plan.first_part;
  std::atomic<int64_t>* remaining = plan.remaining.get();
  const int64_t num_parts = first_part[R * Hkv];
  std::vector<float> part_acc(num_parts * G * D), part_max(num_parts * G), part_sum(num_parts * G);
  std::vector<Partial> parts(num_parts);
  for (int64_t p = 0; p < num_parts; ++p) parts[p] = {&part_acc[p * G * D], &part_max[p * G], &part_sum[p * G]};
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
  // bf16 queries and bf16 or 8-bit K/V in VDPBF16PS where bf16_gemv.cpp's probe found it the faster arithmetic
  using Rows = typename PairRows<Kv>::type;
  constexpr bool kPairable = std::is_same_v<QT, c10::BFloat16> && !std::is_void_v<Rows>;
  // (without pairs for this pool the pointer stays null and unused; Bf16Rows only names its type)
  PairsAttend<std::conditional_t<kPairable, Rows, sgl_lite::Bf16Rows>> attend_pairs = nullptr;
  if constexpr (kPairable) {
    if (sgl_lite::dpbf16_preferred()) attend_pairs = pairs_for<Rows>(D, G);
  }
#endif
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    vfloat q_scaled[kMaxVectors * kMaxChunksPerRow];
    alignas(64) QT q_tile[kMaxVectors * kMaxHeadDim];  // the tile's query vectors in (head, query, member) order
    int64_t claimed = -1, cold = kPrefetchAhead;  // an item claimed ahead, and its first rows not prefetched yet
    const std::function<FirstRows()> claim = [&]() -> FirstRows {
      claimed = next.fetch_add(1, std::memory_order_relaxed);
      if (claimed >= num_items) return {};
      const Item& it = items[claimed];
      const int64_t row = row_list[it.rows_at];  // its rows share the chunk's slots
      const int64_t start = kv[row] + it.chunk * kChunk, end = std::min<int64_t>(kv[row + 1], start + kChunk);
      return {reinterpret_cast<const char*>(k_ptr + it.head_begin * D), indices + start, end - start,
              int64_t(sizeof(typename Kv::T)) * shape.row_stride, (it.head_end - it.head_begin) * row_bytes};
    };
    for (;;) {
      const int64_t i = claimed >= 0 ? claimed : next.fetch_add(1, std::memory_order_relaxed);
      claimed = -1;
      if (i >= num_items) break;
      LookAhead ahead(claim);
      const Item& it = items[i];
      const int64_t* rows = &row_list[it.rows_at];
      const int64_t h0 = it.head_begin, H = it.head_end - it.head_begin, chunk_start = it.chunk * kChunk;
      const auto queries_of = [&](int64_t r) { return std::min<int64_t>(it.query_end, qo[r + 1] - qo[r]) - it.query_begin; };
      int64_t T = 0;  // the tile's queries, row by row
      for (int64_t u = 0; u < it.num_rows; ++u) T += queries_of(rows[u]);
      int64_t limits[kMaxVectors];
      Partial outs[kMaxVectors];
      for (int64_t u = 0, t = 0; u < it.num_rows; ++u) {
        const int64_t r = rows[u], len = kv[r + 1] - kv[r], n = qo[r + 1] - qo[r];
        const int64_t chunk_len = std::min(kChunk, len - chunk_start);
        for (int64_t query = it.query_begin; query < it.query_begin + queries_of(r); ++query, ++t) {
          limits[t] = std::clamp<int64_t>(len - (n - 1 - query) - chunk_start, 0, chunk_len);
          for (int64_t h = 0; h < H; ++h) {
            std::memcpy(q_tile + (h * T + t) * G * D, q_ptr + ((qo[r] + query) * Hq + (h0 + h) * G) * D, G * D * sizeof(QT));
            outs[h * T + t] = parts[first_part[r * Hkv + h0 + h] + it.chunk * n + query];
          }
        }
      }
      const Tile tile{H, T, limits};
      const int64_t* slots = indices + kv[rows[0]] + chunk_start;
      bool attended = false;
#if SGL_LITE_HAS_DPBF16_DECODE
      if constexpr (kPairable) {
        if (attend_pairs != nullptr) {
          attend_pairs(reinterpret_cast<const uint16_t*>(q_tile), scale, k_ptr + h0 * D, v_ptr + h0 * D, slots, shape, tile,
                       H * row_bytes, cold, ahead, outs);
          attended = true;
        }
      }
#endif
      if (!attended) {
        for (int64_t j = 0; j < H * T * G * D; ++j) q_scaled[j / kLanes][j % kLanes] = to_float(q_tile[j]) * scale;
        attend(q_scaled, k_ptr + h0 * D, v_ptr + h0 * D, slots, shape, tile, H * row_bytes, cold, ahead, outs);
      }
      cold = ahead.cold_rows();
      for (int64_t u = 0; u < it.num_rows; ++u) {
        const int64_t r = rows[u], len = kv[r + 1] - kv[r], n = qo[r + 1] - qo[r];
        for (int64_t h = h0; h < h0 + H; ++h) {
          const int64_t rh = r * Hkv + h;
          // The last item of a (row, kv head) to finish merges; acq_rel makes the others' partials visible to it.
          if (remaining[rh].fetch_sub(1, std::memory_order_acq_rel) == 1) {
            for (int64_t query = 0; query < n; ++query) {
              const int64_t seen = len - (n - 1 - query);
              merge_chunks(&parts[first_part[rh] + query], (seen + kChunk - 1) / kChunk, n, shape,
                           out_ptr + ((qo[r] + query) * Hq + h * G) * D);
            }
          }
        }
      }
    }
  });
}

template <class QT>
void dispatch_kv(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t R, const int32_t* qo,
                 const int32_t* kv, const int64_t* indices, float scale, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run<QT, Fp32Kv>(q, k_cache, v_cache, R, qo, kv, indices, scale, out);
    case at::kBFloat16: return run<QT, Bf16Kv>(q, k_cache, v_cache, R, qo, kv, indices, scale, out);
    case at::kHalf: return run<QT, Fp16Kv>(q, k_cache, v_cache, R, qo, kv, indices, scale, out);
    case at::kFloat8_e4m3fn: return run<QT, E4m3Kv>(q, k_cache, v_cache, R, qo, kv, indices, scale, out);
    case at::kFloat8_e5m2: return run<QT, E5m2Kv>(q, k_cache, v_cache, R, qo, kv, indices, scale, out);
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported KV cache dtype ", k_cache.scalar_type());
  }
}

// qo_indptr (int32 [R+1], optional): row r's queries are q[qo_indptr[r] : qo_indptr[r+1]] (see run); without
// it every q row is a row of its own (a decode batch).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& kv_indptr, const at::Tensor& kv_indices, double scale,
                                  const c10::optional<at::Tensor>& qo_indptr) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), "q must be [N, Hq, D], k_cache/v_cache [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "q, k_cache and v_cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must share a dtype");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D <= kMaxHeadDim && D % kLanes == 0,
              "head_dim must match the cache, be a multiple of ", kLanes, " and at most ", kMaxHeadDim);
  TORCH_CHECK(Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup, "Hq must be a multiple of Hkv, at most ", kMaxGroup, " query heads per kv head");
  const bool rows_given = qo_indptr.has_value() && qo_indptr->defined();
  const int64_t R = rows_given ? qo_indptr->numel() - 1 : N;
  TORCH_CHECK(kv_indptr.scalar_type() == at::kInt && kv_indptr.is_contiguous() && kv_indptr.numel() == R + 1,
              "kv_indptr must be int32 [R+1], one entry per row and one more");
  std::vector<int32_t> one_each;
  const int32_t* qo = nullptr;
  if (rows_given) {
    TORCH_CHECK(qo_indptr->scalar_type() == at::kInt && qo_indptr->is_contiguous() && R >= 0, "qo_indptr must be contiguous int32 [R+1]");
    qo = qo_indptr->data_ptr<int32_t>();
    TORCH_CHECK(qo[0] == 0 && qo[R] == N, "qo_indptr must run from 0 to the number of q rows (", N, ")");
  } else {
    one_each.resize(N + 1);
    for (int64_t b = 0; b <= N; ++b) one_each[b] = int32_t(b);
    qo = one_each.data();
  }
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(qo[r + 1] > qo[r], "row ", r, " has no queries");
    TORCH_CHECK(indptr[r + 1] - indptr[r] >= qo[r + 1] - qo[r],
                "row ", r, " has fewer KV slots than queries (each query attends at least to itself)");
  }
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.is_contiguous(), "kv_indices must be contiguous int64");
  TORCH_CHECK(indptr[0] >= 0 && indptr[R] <= kv_indices.numel(), "kv_indptr runs past kv_indices");
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;  // a slot outside the cache would read foreign memory: check them all (cheap next to the reads)
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t i = indptr[0]; i < indptr[R]; ++i) {
    lo = std::min(lo, indices[i]);
    hi = std::max(hi, indices[i]);
  }
  TORCH_CHECK(lo >= 0 && hi < k_cache.size(0), "kv_indices holds a slot outside [0, ", k_cache.size(0), ")");
  at::Tensor out = at::empty_like(q);
  if (R == 0) return out;
  const float s = static_cast<float>(scale);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_kv<float>(q, k_cache, v_cache, R, qo, indptr, indices, s, out); break;
    case at::kBFloat16: dispatch_kv<c10::BFloat16>(q, k_cache, v_cache, R, qo, indptr, indices, s, out); break;
    case at::kHalf: dispatch_kv<c10::Half>(q, k_cache, v_cache, R, qo, indptr, indices, s, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported query dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, float scale, "
        "Tensor? qo_indptr=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
