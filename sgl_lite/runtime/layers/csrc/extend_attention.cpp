// Extend (prefill) attention on CPU: each request's new tokens against its whole context in the KV pool.
//
// Inputs are FlashInfer's page-size-1 metadata, per extend request: its q rows [q_start, q_start + new) and
// its slots kv_indices[kv_begin : kv_begin + kv_len] (the cached prefix, then the new tokens, whose K/V the
// backend wrote into the pool before the call). New token j sits at position prefix + j (prefix = kv_len -
// new) and sees positions 0..prefix + j. GQA: the G = Hq / Hkv query heads of a KV head share its K/V.
//
// Flash-attention's loop in float32: work items are (request, kv head, tile of 16 new tokens); a tile's
// G x 16 query rows walk the keys up to the tile's last position in blocks of 32, with an online softmax
// per row. Per block: K is widened to float32 and transposed ([D][32]) and V widened ([32][D]) once, then two
// register-blocked products of 4 query rows at a time: S = Q K^T (4 rows x 32 keys) and O += P V (4 rows x D),
// every multiply an FMA. One exp per score, no [rows x context] score matrix in memory, and no gather copy
// of K/V. Why: torch's path (scores, softmax and their casts as separate passes over the whole score matrix)
// ran an agent turn's extend (8 requests x 90 tokens on 450-token prefixes) at ~80 GFLOP/s on a 2-core
// Xeon, a third of its prefill step.
//
// A row's result depends only on its own keys and its position (tiles and blocks are fixed), not on the
// batch or the threads. Threads take items from a shared counter.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define SGL_LITE_HAS_EXTEND_KERNEL 1
#else
#define SGL_LITE_HAS_EXTEND_KERNEL 0
#endif

namespace {

constexpr int64_t kTileTokens = 32;  // new tokens per work item
constexpr int64_t kKeys = 32;        // keys per block: two vectors of scores per row
constexpr int64_t kRows = 4;         // query rows per register block
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool has_extend_kernel() { return SGL_LITE_HAS_EXTEND_KERNEL; }

#if SGL_LITE_HAS_EXTEND_KERNEL

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 in 16 lanes (the decode kernel's polynomial: Cody-Waite reduction, Cephes' degree 6,
// ~1 ulp); -inf gives 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 dead = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~dead), p, _mm512_castsi512_ps(e));
}

// 16 stored K/V elements as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

struct Request {
  int64_t q_start, num_new, kv_begin, kv_len;
};

// One thread's scratch: a tile's queries, outputs and softmax state, and one key block widened.
struct Scratch {
  std::vector<float> q, o, p, kt, v, max, sum;
  explicit Scratch(int64_t rows, int64_t dim)
      : q(rows * dim), o(rows * dim), p(rows * kKeys), kt(dim * kKeys), v(kKeys * dim), max(rows), sum(rows) {}
};

// S[r][0:32] = Q[r] . K^T for rows r0..r0+3 (kt is [D][32]).
template <int64_t C>
inline void scores_block(const float* q, const float* kt, float* s) {
  __m512 a[kRows][2];
  for (int r = 0; r < kRows; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < C * 16; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * kKeys), k1 = _mm512_loadu_ps(kt + d * kKeys + 16);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * C * 16 + d]);
      a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(s + r * kKeys, a[r][0]);
    _mm512_storeu_ps(s + r * kKeys + 16, a[r][1]);
  }
}

// O[r] += P[r][0:n] V[0:n] for rows r0..r0+3 (v is [32][D]).
template <int64_t C>
inline void values_block(const float* p, const float* v, int64_t n, float* o) {
  __m512 a[kRows][C];
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < C; ++c) a[r][c] = _mm512_loadu_ps(o + r * C * 16 + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[C];
    for (int64_t c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + j * C * 16 + c * 16);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * kKeys + j]);
      for (int64_t c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pv, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(o + r * C * 16 + c * 16, a[r][c]);
}

// One work item: new tokens [t0, t1) of request `req`, KV head h. Rows are (token, query head of the group),
// token-major: row i is token t0 + i / G, head h * G + i % G.
template <int64_t C, typename QT, typename KT>
void attend_tile(const QT* q, const KT* k_cache, const KT* v_cache, const int64_t* slots, const Request& req, int64_t t0,
                 int64_t t1, int64_t h, int64_t Hq, int64_t Hkv, float scale, Scratch& s, QT* out) {
  constexpr int64_t D = C * 16;
  const int64_t G = Hq / Hkv, prefix = req.kv_len - req.num_new;
  const int64_t rows = (t1 - t0) * G, padded = (rows + kRows - 1) / kRows * kRows;
  for (int64_t i = 0; i < padded; ++i) {
    const int64_t t = t0 + std::min(i, rows - 1) / G, head = h * G + std::min(i, rows - 1) % G;  // pad: repeat the last row
    const QT* src = q + ((req.q_start + t) * Hq + head) * D;
    for (int64_t d = 0; d < D; ++d) s.q[i * D + d] = to_float(src[d]) * scale;
  }
  std::fill(s.o.begin(), s.o.begin() + padded * D, 0.f);
  std::fill(s.max.begin(), s.max.begin() + padded, kNegInf);
  std::fill(s.sum.begin(), s.sum.begin() + padded, 0.f);
  const int64_t keys = prefix + t1;  // the tile's last token sees positions 0..prefix + t1 - 1
  for (int64_t k0 = 0; k0 < keys; k0 += kKeys) {
    const int64_t n = std::min(kKeys, keys - k0);
    for (int64_t j = 0; j < kKeys; ++j) {  // K transposed, V as rows, float32; past n: zeros
      if (j < n) {
        const int64_t slot = slots[k0 + j];
        const KT* kr = k_cache + (slot * Hkv + h) * D;
        const KT* vr = v_cache + (slot * Hkv + h) * D;
        alignas(64) float kf[D];
        for (int64_t c = 0; c < C; ++c) {
          _mm512_store_ps(kf + c * 16, load16(kr + c * 16));
          _mm512_storeu_ps(s.v.data() + j * D + c * 16, load16(vr + c * 16));
        }
        for (int64_t d = 0; d < D; ++d) s.kt[d * kKeys + j] = kf[d];
      } else {
        for (int64_t d = 0; d < D; ++d) s.kt[d * kKeys + j] = 0.f;
        std::fill(s.v.begin() + j * D, s.v.begin() + (j + 1) * D, 0.f);
      }
    }
    // Only a block that reaches past the tile's first token needs the causal mask.
    const bool causal = k0 + n > prefix + t0 + 1;
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      float* sc = s.p.data() + r0 * kKeys;
      scores_block<C>(s.q.data() + r0 * D, s.kt.data(), sc);
      for (int64_t r = r0; r < r0 + kRows; ++r) {
        float* row = s.p.data() + r * kKeys;
        // keys this row sees in the block: positions < its own + 1, and < n
        const int64_t visible = causal ? std::min<int64_t>(n, prefix + t0 + std::min(r, rows - 1) / G + 1 - k0) : n;
        const __mmask16 m0 = static_cast<__mmask16>(visible >= 16 ? 0xFFFF : (visible <= 0 ? 0 : (1u << visible) - 1));
        const __mmask16 m1 = static_cast<__mmask16>(visible >= 32 ? 0xFFFF : (visible <= 16 ? 0 : (1u << (visible - 16)) - 1));
        const __m512 x0 = _mm512_mask_blend_ps(m0, _mm512_set1_ps(kNegInf), _mm512_loadu_ps(row));
        const __m512 x1 = _mm512_mask_blend_ps(m1, _mm512_set1_ps(kNegInf), _mm512_loadu_ps(row + 16));
        const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
        float& run_max = s.max[r];
        if (block_max > run_max) {
          // exp(-inf) = 0 on the row's first block: its sum and output are still zero then
          const float alpha = run_max == kNegInf ? 0.f : std::exp(run_max - block_max);
          float* o = s.o.data() + r * D;
          for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
          s.sum[r] *= alpha;
          run_max = block_max;
        }
        const __m512 m = _mm512_set1_ps(run_max);
        const __m512 p0 = exp_nonpositive(_mm512_sub_ps(x0, m)), p1 = exp_nonpositive(_mm512_sub_ps(x1, m));
        _mm512_storeu_ps(row, p0);
        _mm512_storeu_ps(row + 16, p1);
        s.sum[r] += _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      }
      values_block<C>(sc, s.v.data(), n, s.o.data() + r0 * D);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = t0 + i / G, head = h * G + i % G;
    QT* dst = out + ((req.q_start + t) * Hq + head) * D;
    const float inv = 1.f / s.sum[i];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<QT>(s.o[i * D + d] * inv);
  }
}

template <int64_t C, typename QT, typename KT>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const std::vector<Request>& reqs,
         const int64_t* indices, float scale, at::Tensor& out) {
  const int64_t Hq = q.size(1), Hkv = k_cache.size(1), G = Hq / Hkv;
  struct Item {
    int64_t req, head, t0, t1;
  };
  std::vector<Item> items;
  for (int64_t r = 0; r < int64_t(reqs.size()); ++r)
    for (int64_t t0 = 0; t0 < reqs[r].num_new; t0 += kTileTokens)
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({r, h, t0, std::min(reqs[r].num_new, t0 + kTileTokens)});
  // Costlier items (later tiles see more keys) first, so that the last ones to run are short.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return reqs[a.req].kv_len - reqs[a.req].num_new + a.t1 > reqs[b.req].kv_len - reqs[b.req].num_new + b.t1;
  });
  const auto* qp = q.data_ptr<QT>();
  const auto* kp = k_cache.data_ptr<KT>();
  const auto* vp = v_cache.data_ptr<KT>();
  auto* op = out.data_ptr<QT>();
  std::atomic<int64_t> next{0};
  const int64_t num_items = int64_t(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    Scratch scratch(kTileTokens * G + kRows, C * 16);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const Request& req = reqs[it.req];
      attend_tile<C>(qp, kp, vp, indices + req.kv_begin, req, it.t0, it.t1, it.head, Hq, Hkv, scale, scratch, op);
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
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "extend_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && out.sizes() == q.sizes(),
              "extend_attention: q and out must be [N, Hq, D], k_cache and v_cache [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "extend_attention: q, out, k_cache and v_cache must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), "extend_attention: dtypes differ");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D <= kMaxHeadDim && Hq % Hkv == 0 && Hq / Hkv <= kMaxGroup,
              "extend_attention: head_dim must match the cache, and Hq be a multiple of Hkv (at most ", kMaxGroup, " per KV head)");
  TORCH_CHECK(requests.scalar_type() == at::kLong && requests.dim() == 2 && requests.size(1) == 4 && requests.is_contiguous(),
              "extend_attention: requests must be int64 [E, 4]");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.is_contiguous(), "extend_attention: kv_indices must be contiguous int64");
  const int64_t* rq = requests.data_ptr<int64_t>();
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(0);
  std::vector<Request> reqs;
  for (int64_t e = 0; e < requests.size(0); ++e) {
    const Request r{rq[4 * e], rq[4 * e + 1], rq[4 * e + 2], rq[4 * e + 3]};
    TORCH_CHECK(r.num_new >= 1 && r.q_start >= 0 && r.q_start + r.num_new <= N && r.kv_len >= r.num_new && r.kv_begin >= 0 &&
                    r.kv_begin + r.kv_len <= kv_indices.numel(),
                "extend_attention: request ", e, " has q rows or KV slots out of range");
    for (int64_t i = r.kv_begin; i < r.kv_begin + r.kv_len; ++i) {  // a foreign slot would read foreign memory
      TORCH_CHECK(indices[i] >= 0 && indices[i] < slots, "extend_attention: kv_indices holds a slot outside [0, ", slots, ")");
    }
    reqs.push_back(r);
  }
  if (reqs.empty()) return;
#if SGL_LITE_HAS_EXTEND_KERNEL
  const float s = static_cast<float>(scale);
  const auto kv = k_cache.scalar_type();
  TORCH_CHECK(kv == at::kFloat || kv == at::kBFloat16 || kv == at::kHalf, "extend_attention: KV cache must be float32, bf16 or fp16");
  switch (q.scalar_type()) {
    case at::kFloat:
      if (kv == at::kFloat) return dispatch_dim<float, float>(q, k_cache, v_cache, reqs, indices, s, out);
      break;
    case at::kBFloat16:
      if (kv == at::kBFloat16) return dispatch_dim<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, reqs, indices, s, out);
      break;
    case at::kHalf:
      if (kv == at::kHalf) return dispatch_dim<c10::Half, c10::Half>(q, k_cache, v_cache, reqs, indices, s, out);
      break;
    default:
      break;
  }
  TORCH_CHECK(false, "extend_attention: q and the KV cache must share a dtype (float32, bf16 or fp16)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("extend_attention_supported() -> bool", &has_extend_kernel);
  m.def("extend_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor requests, Tensor kv_indices, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("extend_attention", &extend_attention); }
