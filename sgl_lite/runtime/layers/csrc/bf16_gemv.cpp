// y = x @ W.T (+ bias) for bf16 activations and weights with few rows of x (decode), on AVX512-BF16.
//
// A decode step with 1-16 rows is bound by reading the weights once; oneDNN's small-M bf16 matmuls reach
// about 30 GB/s here, two thirds of what the machine reads. This kernel streams each weight byte once, in
// the order it lies in memory: W is packed as [N/16][K/2][16][2] (16 output columns x one pair of the
// reduction axis per 64-byte vector, the operand layout of VDPBF16PS), so a tile of output columns is one
// sequential run of vectors and each vector meets every row of x (a broadcast pair) in registers.
//
// Arithmetic: bf16 products summed in fp32 (VDPBF16PS: pairs in fp32, subnormal inputs read as zero),
// a fixed order along K, the bias added in fp32, one rounding to bf16 at the end (as oneDNN rounds). A
// row's result does not depend on the other rows or on the thread count: the kernel is batch invariant.
//
// Threads take the output columns in tiles of 32 (16 for a last odd block) from a shared counter; rows go
// in register tiles of up to 8, so more rows re-read a tile's weights from cache, not from memory.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SGL_LITE_HAS_AVX512_BF16 1
#else
#define SGL_LITE_HAS_AVX512_BF16 0
#endif



namespace {

constexpr int64_t kCols = 16;      // output columns per packed vector
constexpr int64_t kMaxTileRows = 8;  // rows of x held in registers at once
constexpr int64_t kTilesPerRun = 8;  // most tiles a thread takes at once from the shared counter
// Weights are prefetched this far ahead of the loads: a tile's run is short (18-50 KB at 135M's shapes),
// too short for the hardware prefetcher to reach full speed on its own (measured: 2 KB beat 1 and 4 KB).
constexpr int64_t kPrefetchBytes = 2048;

bool has_avx512_bf16() { return SGL_LITE_HAS_AVX512_BF16; }

void check_packed(const at::Tensor& packed, int64_t k) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 && packed.size(1) * 2 == k,
              "bf16_gemv: packed weight must be [N/16, K/2, 16, 2] (pack_bf16_gemv_weight) for K = ", k);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "bf16_gemv: packed weight must be contiguous bf16");
}

#if SGL_LITE_HAS_AVX512_BF16

// Rows [0, R) of x against NB (1 or 2) column blocks starting at `w` (block stride `block`), writing
// out[r][0 : 16*NB]. x rows have stride `ldx`, out rows `ldo`.
template <int R, int NB>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t block, int64_t pairs, const float* bias,
                 uint16_t* out, int64_t ldo) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(w + b * block + p * 2 * kCols) + kPrefetchBytes, _MM_HINT_T0);
      wv[b] = (__m512bh)_mm512_loadu_si512(w + b * block + p * 2 * kCols);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int b = 0; b < NB; ++b) {
      __m512 y = acc[r][b];
      if (bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + b * kCols));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + b * kCols), (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

template <int NB>
void rows_tile(int64_t rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t block, int64_t pairs,
               const float* bias, uint16_t* out, int64_t ldo) {
  switch (rows) {
    case 1: return tile<1, NB>(x, ldx, w, block, pairs, bias, out, ldo);
    case 2: return tile<2, NB>(x, ldx, w, block, pairs, bias, out, ldo);
    case 3: return tile<3, NB>(x, ldx, w, block, pairs, bias, out, ldo);
    case 4: return tile<4, NB>(x, ldx, w, block, pairs, bias, out, ldo);
    case 5: return tile<5, NB>(x, ldx, w, block, pairs, bias, out, ldo);
    case 6: return tile<6, NB>(x, ldx, w, block, pairs, bias, out, ldo);
    case 7: return tile<7, NB>(x, ldx, w, block, pairs, bias, out, ldo);
    default: return tile<8, NB>(x, ldx, w, block, pairs, bias, out, ldo);
  }
}

// Output columns [16 * b0, 16 * (b0 + nb)) for every row of x.
void column_tile(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n, const float* bias, uint16_t* out,
                 int64_t b0, int64_t nb) {
  const int64_t pairs = k / 2, block = pairs * 2 * kCols;
  const float* tile_bias = bias == nullptr ? nullptr : bias + b0 * kCols;
  for (int64_t r0 = 0; r0 < m; r0 += kMaxTileRows) {
    const int64_t rows = std::min(kMaxTileRows, m - r0);
    if (nb == 2) {
      rows_tile<2>(rows, x + r0 * k, k, w + b0 * block, block, pairs, tile_bias, out + r0 * n + b0 * kCols, n);
    } else {
      rows_tile<1>(rows, x + r0 * k, k, w + b0 * block, block, pairs, tile_bias, out + r0 * n + b0 * kCols, n);
    }
  }
}

void gemv(const uint16_t* x, int64_t m, int64_t k, const uint16_t* w, int64_t n, const float* bias, uint16_t* out) {
  const int64_t blocks = n / kCols;
  const int64_t tiles = (blocks + 1) / 2;  // two blocks per tile; the last may hold one
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  // Threads take runs of tiles from a shared counter rather than fixed shares: on a 2-core box a thread
  // that loses its core for a moment (the HTTP front waking up, a neighbour) would otherwise leave the
  // other one waiting at the end of every matmul.
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(kTilesPerRun, tiles / (threads * 4)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(run, std::memory_order_relaxed); begin < tiles;
         begin = next.fetch_add(run, std::memory_order_relaxed)) {
      for (int64_t t = begin; t < std::min(tiles, begin + run); ++t) {
        column_tile(x, m, k, w, n, bias, out, 2 * t, std::min<int64_t>(2, blocks - 2 * t));
      }
    }
  });
}

#endif

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_avx512_bf16(), "bf16_gemv: this build has no AVX512-BF16 (check sgl_lite::bf16_gemv_supported first)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "bf16_gemv runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "bf16_gemv: x must be contiguous bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  check_packed(packed, k);
  const int64_t n = packed.size(0) * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bf16_gemv: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if SGL_LITE_HAS_AVX512_BF16
  if (m > 0) {
    gemv(reinterpret_cast<const uint16_t*>(x.data_ptr()), m, k, reinterpret_cast<const uint16_t*>(packed.data_ptr()), n,
         bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr()));
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("bf16_gemv_supported() -> bool", &has_avx512_bf16);
  m.def("bf16_gemv(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
