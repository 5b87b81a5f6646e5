// y = x @ W.T (+ bias) on AVX2 + FMA, float32 arithmetic over float32 or bf16 activations and weights.
//
// The counterpart of bf16_gemv.cpp for CPUs without AVX512-BF16 (AVX2-only ones, say). There MKL's
// small-M sgemm reads the weights of a batch-1 decode step at under half of what the machine reads, and
// torch's bf16 matmul has no fast path at all (docs/performance.md, "On CPUs without AVX-512 (AVX2 +
// FMA)"). This kernel streams each
// weight byte once, in memory order: W is packed as [N/16][K][16] (16 output columns of one k: a 64-byte
// line in float32, half a line in bf16), so a tile of 16 output columns is one sequential run, and each
// run meets every row of x (a broadcast float) in registers. bf16 weights are widened to float32 in
// registers (a bf16 is the top half of a float32), so they cost half the memory traffic of float32 ones.
//
// Arithmetic: one fused multiply-add per product in float32, in a fixed order along K, the bias added
// last; bf16 outputs are rounded once at the end (to nearest even, as torch rounds). A row's result
// depends neither on the other rows nor on the thread count: the kernel is batch invariant (its sums run
// in another order than MKL's, so results differ from F.linear by summation-order noise).
//
// Threads take the 16-column tiles in runs from a shared counter; rows go in register tiles of up to 6
// (12 accumulators + 2 weight vectors + 1 broadcast of AVX2's 16 registers), so more rows re-read a
// tile's weights from cache, not from memory.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx2_vectors.h"

namespace {

using sgl_lite_avx2::kCols;
constexpr int64_t kMaxTileRows = 6;  // rows of x held in registers at once
constexpr int64_t kTilesPerRun = 8;  // most tiles a thread takes at once from the shared counter
constexpr int64_t kPrefetchBytes = 1024;  // into L1: prefetcht1 (as bf16_gemv.cpp) made 8+ rows slower (docs/journal.md, "Decode kernels prefetch into L2")

bool has_avx2_fma() { return SGL_LITE_HAS_AVX2_FMA; }

#if SGL_LITE_HAS_AVX2_FMA

// The 16 weights of one k as two float32 vectors.
inline void load_line(const float* line, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(line);
  w1 = _mm256_loadu_ps(line + 8);
}

inline void load_line(const uint16_t* line, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
  w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
}

using sgl_lite_avx2::store_row;

// Rows [0, R) of x (float32) against one 16-column tile `w` ([K][16]), writing out[r][0:16].
// The loops over R are fully unrolled: else GCC keeps the accumulator arrays in memory and stores all
// twelve at every k (far slower, even in cache).
template <int R, typename W, typename O>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t k, const float* bias, O* out, int64_t ldo) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const W* line = w + i * kCols;
    _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T0);
    __m256 w0, w1;
    load_line(line, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) store_row(lo[r], hi[r], bias, out + r * ldo);
}

template <typename W, typename O>
void rows_tile(int64_t rows, const float* x, int64_t ldx, const W* w, int64_t k, const float* bias, O* out, int64_t ldo) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, w, k, bias, out, ldo);
    case 2: return tile<2>(x, ldx, w, k, bias, out, ldo);
    case 3: return tile<3>(x, ldx, w, k, bias, out, ldo);
    case 4: return tile<4>(x, ldx, w, k, bias, out, ldo);
    case 5: return tile<5>(x, ldx, w, k, bias, out, ldo);
    default: return tile<6>(x, ldx, w, k, bias, out, ldo);
  }
}

// A bf16 tile [K][16] as float32 into `wide`.
template <typename W>
void widen(const W* tile_w, int64_t k, std::vector<float>& wide) {
  wide.resize(k * kCols);
  for (int64_t i = 0; i < k; ++i) {
    __m256 w0, w1;
    load_line(tile_w + i * kCols, w0, w1);
    _mm256_storeu_ps(wide.data() + i * kCols, w0);
    _mm256_storeu_ps(wide.data() + i * kCols + 8, w1);
  }
}

template <typename W, typename O>
void gemv(const float* x, int64_t m, int64_t k, const W* w, int64_t n, const float* bias, O* out) {
  const int64_t tiles = n / kCols;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  // A shared counter rather than fixed shares, as in bf16_gemv.cpp: a thread that loses its core for a
  // moment must not leave the other waiting at the end of every matmul.
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(kTilesPerRun, tiles / (threads * 4)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> wide;  // this thread's widened weight tile (bf16 weights, many rows)
    for (int64_t begin = next.fetch_add(run, std::memory_order_relaxed); begin < tiles;
         begin = next.fetch_add(run, std::memory_order_relaxed)) {
      for (int64_t t = begin; t < std::min(tiles, begin + run); ++t) {
        const W* tile_w = w + t * k * kCols;
        const float* tile_bias = bias == nullptr ? nullptr : bias + t * kCols;
        const auto every_row_tile = [&](const auto* weights) {
          for (int64_t r0 = 0; r0 < m; r0 += kMaxTileRows) {
            rows_tile(std::min(kMaxTileRows, m - r0), x + r0 * k, k, weights, k, tile_bias, out + r0 * n + t * kCols, n);
          }
        };
        if (std::is_same_v<W, uint16_t> && m > 2 * kMaxTileRows) {
          // Three or more row tiles meet this weight tile: widen it to float32 once (exactly: the same products
          // and sums as widening in registers) instead of once per row tile.
          widen(tile_w, k, wide);
          every_row_tile(wide.data());
        } else {
          every_row_tile(tile_w);
        }
      }
    }
  });
}

#endif

at::Tensor avx2_gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_avx2_fma(), "avx2_gemv: this build has no AVX2/FMA (check sgl_lite::avx2_gemv_supported first)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "avx2_gemv runs on CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && x.is_contiguous(),
              "avx2_gemv: x must be contiguous float32 or bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k && packed.size(2) == kCols && packed.scalar_type() == dtype &&
                  packed.is_contiguous(),
              "avx2_gemv: packed weight must be contiguous [N/16, K, 16] of x's dtype for K = ", k);
  const int64_t n = packed.size(0) * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "avx2_gemv: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if SGL_LITE_HAS_AVX2_FMA
  if (m > 0) {
    const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
    if (dtype == at::kFloat) {
      gemv(x.data_ptr<float>(), m, k, packed.data_ptr<float>(), n, b, out.data_ptr<float>());
    } else {
      const at::Tensor x_f32 = x.to(at::kFloat);  // widened once, not once per tile
      gemv(x_f32.data_ptr<float>(), m, k, reinterpret_cast<const uint16_t*>(packed.data_ptr()), n, b,
           reinterpret_cast<uint16_t*>(out.data_ptr()));
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("avx2_gemv_supported() -> bool", &has_avx2_fma);
  m.def("avx2_gemv(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("avx2_gemv", &avx2_gemv); }
