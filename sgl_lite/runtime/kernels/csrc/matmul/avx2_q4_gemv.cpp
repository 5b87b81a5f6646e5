// y = x @ W.T (+ bias) on AVX2 + FMA + F16C over 4-bit weights in groups of 32 along K (GGUF's Q4_1:
// w = scale * q + min, q in 0..15, one fp16 scale and min per group), float32 arithmetic.
//
// Why: a decode step with few rows reads every weight once, so on a CPU whose reads are its limit the
// step's matmuls cost what their weights weigh. torch's int4 kernel (_weight_int4pack_mm_for_cpu) is slower
// than the bf16 small-row kernel on AVX2-only CPUs; this one reads 5 bits a weight (bf16: 16) with the
// same streaming layout as avx2_gemv.cpp.
//
// Packed weight: uint8 [N/16, K/32, 320], one block per (16 output columns, group of 32 k): 32 lines of 8
// bytes (line i holds k = 32 g + i; byte j is column j's q in its low nibble, column j + 8's in its high
// one), then the 16 columns' scales and the 16 columns' mins as fp16. A tile of 16 columns is one
// sequential run of blocks.
//
// Arithmetic: per group, the 32 products x_k * q_k of a row are summed with FMAs in k order (q is an exact
// small integer in float32), then acc = fma(scale, partial, acc) and acc = fma(min, xsum_g, acc), where
// xsum_g is the row's sum of x over the group (sum_k x_k (scale q_k + min) = scale sum x_k q_k + min sum
// x_k); the bias is added last and bf16 outputs are rounded once. A row's result depends neither on the
// other rows nor on the thread count (batch invariant). Up to 4 rows read the packed lines (at most 8
// partial sums, 2 weight vectors, a broadcast and the nibble mask in AVX2's 16 registers); with more rows
// each block is unpacked to float32 once and row tiles of up to 6 read that, with the same products and sums.

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

#if SGL_LITE_HAS_AVX2_FMA && defined(__F16C__)
#define SGL_LITE_HAS_AVX2_Q4 1
#else
#define SGL_LITE_HAS_AVX2_Q4 0
#endif

namespace {

using sgl_lite_avx2::kCols;
constexpr int64_t kGroup = 32;            // k per scale/min pair (GGUF's Q4 block)
constexpr int64_t kLineBytes = kCols / 2;  // one k of 16 columns, two nibbles a byte
constexpr int64_t kBlockBytes = kGroup * kLineBytes + 2 * kCols * 2;  // lines, fp16 scales, fp16 mins
constexpr int64_t kMaxPackedRows = 4;    // rows that read the packed lines (4 tiles at once at 1 row, 2 at 2)
constexpr int64_t kMaxUnpackedRows = 6;  // rows per tile over an unpacked block (12 accumulators)
constexpr int64_t kTilesPerRun = 8;

bool has_avx2_q4() { return SGL_LITE_HAS_AVX2_Q4; }

#if SGL_LITE_HAS_AVX2_Q4

// Line i of a block as two float32 vectors of exact integers 0..15: columns 0-7 and 8-15.
inline void load_line(const uint8_t* block, int64_t i, __m256i mask, __m256& w0, __m256& w1) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + i * kLineBytes)));
  w0 = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask));
  w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
}

// The same line from a block unpacked to float32 [32][16] (unpack_block).
inline void load_line(const float* unpacked, int64_t i, __m256i, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(unpacked + i * kCols);
  w1 = _mm256_loadu_ps(unpacked + i * kCols + 8);
}

void unpack_block(const uint8_t* block, float* unpacked) {
  const __m256i mask = _mm256_set1_epi32(15);
  for (int64_t i = 0; i < kGroup; ++i) {
    __m256 w0, w1;
    load_line(block, i, mask, w0, w1);
    _mm256_storeu_ps(unpacked + i * kCols, w0);
    _mm256_storeu_ps(unpacked + i * kCols + 8, w1);
  }
}

// Rows [0, R) of one group in T adjacent column tiles. x points at the group's first k of row 0 (rows ldx
// apart), xsum at row 0's group sum (rows ldsum apart), lines at tile 0's 32 lines (packed blocks, tiles
// `stride` bytes apart, or one block's unpacked lines), tail at tile 0's fp16 scales and mins (tiles
// `stride` bytes apart); acc [T][m][16] (tiles acc_stride floats apart) gathers the groups. Several tiles
// at once give a row's sums independent chains (an FMA waits 4 cycles for its accumulator); each column's
// arithmetic is the same for every R and T.
template <int R, int T, typename Lines>
inline void group_tile(const float* x, int64_t ldx, const float* xsum, int64_t ldsum, const Lines* lines,
                       const uint8_t* tail, int64_t stride, float* acc, int64_t acc_stride) {
  const __m256i mask = _mm256_set1_epi32(15);
  __m256 lo[T][R], hi[T][R];
#pragma GCC unroll 4
  for (int j = 0; j < T; ++j) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) lo[j][r] = hi[j][r] = _mm256_setzero_ps();
  }
  if constexpr (std::is_same_v<Lines, uint8_t>) {
    // The blocks two groups ahead, one 64-byte line per k in eight: several tiles at once are several
    // streams, more than the hardware prefetcher follows well.
#pragma GCC unroll 4
    for (int j = 0; j < T; ++j) {
      for (int64_t at = 0; at < kBlockBytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(lines) + j * stride + 2 * kBlockBytes + at, _MM_HINT_T0);
    }
  }
  for (int64_t i = 0; i < kGroup; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < T; ++j) {
      __m256 w0, w1;
      load_line(reinterpret_cast<const Lines*>(reinterpret_cast<const uint8_t*>(lines) + j * stride), i, mask, w0, w1);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
        lo[j][r] = _mm256_fmadd_ps(xv, w0, lo[j][r]);
        hi[j][r] = _mm256_fmadd_ps(xv, w1, hi[j][r]);
      }
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < T; ++j) {
    const uint8_t* t = tail + j * stride;
    const auto half = [&](int64_t at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t + at))); };
    const __m256 scale0 = half(0), scale1 = half(16), min0 = half(32), min1 = half(48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_broadcast_ss(xsum + r * ldsum);
      float* a = acc + j * acc_stride + r * kCols;
      _mm256_storeu_ps(a, _mm256_fmadd_ps(min0, s, _mm256_fmadd_ps(scale0, lo[j][r], _mm256_loadu_ps(a))));
      _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(min1, s, _mm256_fmadd_ps(scale1, hi[j][r], _mm256_loadu_ps(a + 8))));
    }
  }
}

// One group of rows [0, rows) over a block's unpacked lines, in row tiles of up to kMaxUnpackedRows.
void unpacked_rows(int64_t rows, const float* x, int64_t ldx, const float* xsum, int64_t ldsum, const float* lines,
                   const uint8_t* tail, float* acc) {
  for (int64_t r0 = 0; r0 < rows; r0 += kMaxUnpackedRows) {
    const float* xr = x + r0 * ldx;
    const float* sr = xsum + r0 * ldsum;
    float* a = acc + r0 * kCols;
    switch (std::min(kMaxUnpackedRows, rows - r0)) {
      case 1: group_tile<1, 1>(xr, ldx, sr, ldsum, lines, tail, 0, a, 0); break;
      case 2: group_tile<2, 1>(xr, ldx, sr, ldsum, lines, tail, 0, a, 0); break;
      case 3: group_tile<3, 1>(xr, ldx, sr, ldsum, lines, tail, 0, a, 0); break;
      case 4: group_tile<4, 1>(xr, ldx, sr, ldsum, lines, tail, 0, a, 0); break;
      case 5: group_tile<5, 1>(xr, ldx, sr, ldsum, lines, tail, 0, a, 0); break;
      default: group_tile<6, 1>(xr, ldx, sr, ldsum, lines, tail, 0, a, 0);
    }
  }
}

// One group of all `rows` (at most kMaxPackedRows) rows straight from the packed lines: 1 row four tiles at
// once and 2 rows two when `span` tiles are left (acc [span][rows][16]), else one tile.
void packed_rows(int64_t rows, int64_t span, const float* x, int64_t ldx, const float* xsum, int64_t ldsum,
                 const uint8_t* block, int64_t tile_bytes, float* acc) {
  const uint8_t* tail = block + kGroup * kLineBytes;
  if (rows == 1 && span == 4) return group_tile<1, 4>(x, ldx, xsum, ldsum, block, tail, tile_bytes, acc, kCols);
  if (rows == 2 && span == 2) return group_tile<2, 2>(x, ldx, xsum, ldsum, block, tail, tile_bytes, acc, 2 * kCols);
  switch (rows) {
    case 1: return group_tile<1, 1>(x, ldx, xsum, ldsum, block, tail, 0, acc, 0);
    case 2: return group_tile<2, 1>(x, ldx, xsum, ldsum, block, tail, 0, acc, 0);
    case 3: return group_tile<3, 1>(x, ldx, xsum, ldsum, block, tail, 0, acc, 0);
    default: return group_tile<4, 1>(x, ldx, xsum, ldsum, block, tail, 0, acc, 0);
  }
}

template <typename O>
void q4_gemv(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, const float* bias, O* out) {
  const int64_t groups = k / kGroup, tiles = n / kCols, tile_bytes = groups * kBlockBytes;
  std::vector<float> xsum(m * groups);  // each row's sum over each group, in k order
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < kGroup; ++i) s += x[r * k + g * kGroup + i];
      xsum[r * groups + g] = s;
    }
  }
  // Tiles a thread takes together (packed_rows); more rows than kMaxPackedRows unpack each block once.
  const int64_t together = m == 1 ? 4 : m == 2 ? 2 : 1;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  // A shared counter rather than fixed shares (see avx2_gemv.cpp): a thread that loses its core for a
  // moment must not leave the other waiting at the end of every matmul.
  const int64_t run = std::max<int64_t>(together, std::min<int64_t>(kTilesPerRun, tiles / (threads * 4)) / together * together);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> acc(together * m * kCols);
    std::vector<float> unpacked(m > kMaxPackedRows ? kGroup * kCols : 0);
    for (int64_t begin = next.fetch_add(run, std::memory_order_relaxed); begin < tiles;
         begin = next.fetch_add(run, std::memory_order_relaxed)) {
      for (int64_t t = begin; t < std::min(tiles, begin + run);) {
        const int64_t span = t + together <= tiles ? together : 1;  // a last odd tile goes alone: same sums
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* block = w + t * tile_bytes + g * kBlockBytes;
          if (m > kMaxPackedRows) {
            unpack_block(block, unpacked.data());
            unpacked_rows(m, x + g * kGroup, k, xsum.data() + g, groups, unpacked.data(), block + kGroup * kLineBytes, acc.data());
          } else {
            packed_rows(m, span, x + g * kGroup, k, xsum.data() + g, groups, block, tile_bytes, acc.data());
          }
        }
        for (int64_t j = 0; j < span; ++j) {
          for (int64_t r = 0; r < m; ++r) {
            const float* a = acc.data() + (j * m + r) * kCols;
            sgl_lite_avx2::store_row(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8), bias == nullptr ? nullptr : bias + (t + j) * kCols,
                                     out + r * n + (t + j) * kCols);
          }
        }
        t += span;
      }
    }
  });
}

#endif

at::Tensor avx2_q4_gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_avx2_q4(), "avx2_q4_gemv: this build has no AVX2/FMA/F16C (check sgl_lite::avx2_q4_gemv_supported first)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "avx2_q4_gemv runs on CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && x.is_contiguous(),
              "avx2_q4_gemv: x must be contiguous float32 or bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) * kGroup == k && packed.size(2) == kBlockBytes &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "avx2_q4_gemv: packed weight must be contiguous uint8 [N/16, K/32, ", kBlockBytes, "] for K = ", k);
  const int64_t n = packed.size(0) * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "avx2_q4_gemv: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if SGL_LITE_HAS_AVX2_Q4
  if (m > 0) {
    const float* b = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
    const at::Tensor x_f32 = x.to(at::kFloat).contiguous();  // widened once, not once per tile
    if (dtype == at::kFloat) {
      q4_gemv(x_f32.data_ptr<float>(), m, k, packed.data_ptr<uint8_t>(), n, b, out.data_ptr<float>());
    } else {
      q4_gemv(x_f32.data_ptr<float>(), m, k, packed.data_ptr<uint8_t>(), n, b, reinterpret_cast<uint16_t*>(out.data_ptr()));
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("avx2_q4_gemv_supported() -> bool", &has_avx2_q4);
  m.def("avx2_q4_gemv(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("avx2_q4_gemv", &avx2_q4_gemv); }
