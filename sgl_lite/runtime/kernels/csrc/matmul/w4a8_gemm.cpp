// y = x @ W.T (+ bias) with 4-bit weights in groups of 32 (w = scale * q + min, q in 0..15: GGUF's Q4_1
// values, Q4_0 the case min = -8 * scale) and int8 activations (a scale per row, taken from the row itself):
// the calls of few rows of `--quantization w4a8_int4`, on AVX512-VNNI.
//
// Why: a decode step of few rows streams the weights; 4 bits stream half of w8a8's bytes. torch's int4 kernel
// widens every weight to float and multiplies with FMAs, which bounds it by arithmetic, not by the memory,
// on this kernel's CPUs (bench_quant --kernels). Here VPDPBUSD multiplies 64 nibbles (widened to bytes by an
// AND or a shift and an AND) by 64 activation bytes an instruction.
//
// Arithmetic: each row of x is quantized symmetrically, q_x = round_half_even(x * 127 / max|x|) (w8a8's
// rows, without its offset: here the weights are the unsigned operand). Per group g of 32 k and column c the
// int32 sum d = sum_k q[c, k] * q_x[k] is exact; then, in float32, group by group in order,
//   acc = fma(float(d), scale[g, c], acc); acc = fma(min[g, c], float(sum_k q_x[k]), acc)
// and y = acc * row scale (+ bias), each a rounding of its own. A row's result depends neither on the other
// rows nor on the threads: the kernel is batch invariant.
//
// Packed weight (uint8, [N/16, K/32 * 320]): per block of 16 output columns, per group of 32 k, five vectors of
// 64 bytes: four of 16 columns x 8 k (byte 4c + j holds column c's k = 8v + j in its low nibble and k = 8v + 4 + j
// in its high one, so that both halves line up with VPDPBUSD's four bytes per column), then the 16 columns'
// scales and their 16 mins as fp16. Blocks go in groups of three, vector by vector (kernels/column_groups.py),
// as in w8a8_gemm.cpp: a register tile reads one stream.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "row_tiles.h"

#include "vnni_rows.h"  // SGL_LITE_HAS_VNNI

namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kGroupK = 32;          // k per group of scales
constexpr int64_t kWeightVectors = 4;    // 64-byte vectors of nibbles per group and block
constexpr int64_t kGroupBytes = (kWeightVectors + 1) * 64;  // and one of fp16 scales and mins
constexpr int64_t kTilesPerRun = 8;
constexpr int64_t kPrefetchBytes = 2048;  // per block of a tile, into L2, as in w8a8_gemm.cpp
constexpr int kGroup = 3;                 // blocks per tile: a group of the packing
// A register tile holds rows x 3 int32 sums of the current group, as many float32 sums, 3 widened weight
// vectors, the nibble mask and a broadcast row: 29 registers at 4 rows.
constexpr int kMaxTileRows = 4;

bool has_vnni() { return SGL_LITE_HAS_VNNI; }

#if SGL_LITE_HAS_VNNI

// One row (k a multiple of 32): q_x as int8, its scale (max|x| / 127), and each group's sum of q_x. A row
// whose 127 / max|x| is not finite quantizes to zeros, as w8a8's rows do.
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, int32_t* group_sums, float* scale) {
  const float max_abs = sgl_lite_rows::max_abs(x, k);
  const float ratio = 127.f / max_abs;
  *scale = max_abs / 127.f;
  const __m512 vinv = _mm512_set1_ps(std::isfinite(ratio) ? ratio : 0.f);
  for (int64_t g = 0; g < k / kGroupK; ++g) {
    const int64_t i = g * kGroupK;
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(sgl_lite_rows::load_row16(x + i), vinv));  // MXCSR: half-even
    const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(sgl_lite_rows::load_row16(x + i + 16), vinv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(a));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i + 16), _mm512_cvtsepi32_epi8(b));
    group_sums[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
  }
}

struct Operands {
  const int8_t* xq;          // [m, k]
  const int32_t* group_sums; // [m, k / 32]
  const float* row_scale;    // [m]
  int64_t m, k;
  const uint8_t* w;          // packed
  int64_t n, block_bytes;    // block_bytes: k / 32 * kGroupBytes
  const float* bias;         // float32 [n] or null
};

// Rows [0, R) against the group of NB column blocks at `w` (NB < 3 only for a last group), writing
// out[r][0 : 16 * NB].
template <int R, int NB, typename O>
inline void tile(const Operands& o, const int8_t* xq, const int32_t* group_sums, const float* row_scale, const uint8_t* w,
                 const float* bias, O* out) {
  const int64_t groups = o.k / kGroupK;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gw = w + g * NB * kGroupBytes;
    __m512i sum[R][NB];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) sum[r][b] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int v = 0; v < kWeightVectors; ++v) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // the low nibbles (k = 8v + j), then the high ones (k = 8v + 4 + j)
        __m512i wv[NB];
#pragma GCC unroll 8
        for (int b = 0; b < NB; ++b) {
          const uint8_t* line = gw + (v * NB + b) * 64;
          if (half == 0) _mm_prefetch(reinterpret_cast<const char*>(line) + NB * kPrefetchBytes, _MM_HINT_T1);
          if (half == 0 && v == 0)  // the group's trailer line (every fifth line of the stream) ahead too
            _mm_prefetch(reinterpret_cast<const char*>(gw + (kWeightVectors * NB + b) * 64) + NB * kPrefetchBytes, _MM_HINT_T1);
          const __m512i bytes = _mm512_loadu_si512(line);
          wv[b] = _mm512_and_si512(half == 0 ? bytes : _mm512_srli_epi16(bytes, 4), nibble);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, xq + r * o.k + g * kGroupK + v * 8 + half * 4, sizeof(quad));
          const __m512i xv = _mm512_set1_epi32(quad);
          // weights the unsigned operand, activations the signed one; asm for the reason w8a8_gemm.cpp gives
#pragma GCC unroll 8
          for (int b = 0; b < NB; ++b) __asm__("vpdpbusd %2, %1, %0" : "+v"(sum[r][b]) : "v"(wv[b]), "v"(xv));
        }
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const uint8_t* trailer = gw + (kWeightVectors * NB + b) * 64;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(trailer)));
      const __m512 min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(trailer + 32)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), scale, acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(min, _mm512_set1_ps(static_cast<float>(group_sums[r * groups + g])), acc[r][b]);
      }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) {
    const __m512 vbias = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + b * kCols);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 y = _mm512_mul_ps(acc[r][b], _mm512_set1_ps(row_scale[r]));
      __asm__("" : "+v"(y));  // two roundings: no contraction of the product and the bias add into one FMA
      if (bias != nullptr) y = _mm512_add_ps(y, vbias);
      sgl_lite_rows::store(y, out + r * o.n + b * kCols);
    }
  }
}

template <typename O>
void gemm(const Operands& o, O* out) {
  const int64_t blocks = o.n / kCols, tiles = (blocks + kGroup - 1) / kGroup, groups = o.k / kGroupK;
  sgl_lite_tiles::for_each_column_tile(tiles, kTilesPerRun, [&](int64_t t) {
    const int64_t b0 = kGroup * t, nb = std::min<int64_t>(kGroup, blocks - b0);
    const uint8_t* w = o.w + b0 * o.block_bytes;  // the groups before are whole
    const float* bias = o.bias == nullptr ? nullptr : o.bias + b0 * kCols;
    for (int64_t r0 = 0; r0 < o.m; r0 += kMaxTileRows) {
      O* dst = out + r0 * o.n + b0 * kCols;
      sgl_lite_tiles::with_rows<kMaxTileRows>(o.m - r0, [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        const auto run_tile = nb == kGroup ? tile<R, kGroup, O> : nb == 2 ? tile<R, 2, O> : tile<R, 1, O>;
        run_tile(o, o.xq + r0 * o.k, o.group_sums + r0 * groups, o.row_scale + r0, w, bias, dst);
      });
    }
  });
}

#endif

at::Tensor w4a8_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_vnni(), "w4a8_gemm: this build has no AVX512-VNNI (check sgl_lite::w4a8_gemm_supported first)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "w4a8_gemm runs on CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && x.is_contiguous(),
              "w4a8_gemm: x must be contiguous float32, bf16 or fp16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kGroupK == 0 && k > 0, "w4a8_gemm: K must be a positive multiple of 32; got ", k);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == k / kGroupK * kGroupBytes,
              "w4a8_gemm: packed weight must be contiguous uint8 [N/16, K/32 * 320] for K = ", k);
  const int64_t n = packed.size(0) * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "w4a8_gemm: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if SGL_LITE_HAS_VNNI
  if (m > 0) {
    const int64_t groups = k / kGroupK;
    std::vector<int8_t> xq(m * k);
    std::vector<int32_t> group_sums(m * groups);
    std::vector<float> row_scale(m);
    const Operands o{xq.data(), group_sums.data(), row_scale.data(), m, k, packed.data_ptr<uint8_t>(), n, packed.size(1),
                     bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr};
    const auto run = [&](const auto* xs, auto* os) {
      at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) quantize_row(xs + r * k, k, xq.data() + r * k, group_sums.data() + r * groups, &row_scale[r]);
      });
      gemm(o, os);
    };
    sgl_lite_rows::with_row_pointers(x, out, run);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("w4a8_gemm_supported() -> bool", &has_vnni);
  m.def("w4a8_gemm(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("w4a8_gemm", &w4a8_gemm); }
