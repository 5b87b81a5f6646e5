// y = x @ W.T (+ bias) for `--quantization w8a8_int8` on AMX-INT8 tiles, over w8a8_gemm.cpp's own packed
// weight (no second copy), from rows quantized by w8a8_quantize_rows (q + 128 as bytes, a scale per row).
//
// The packed weight's 64-byte vectors (16 output columns x 4 k) are exactly the rows of a TDPBUSD B tile,
// so a column block's B tile is 16 of its vectors, a stride of its group's blocks x 64 bytes apart
// (w8a8_gemm.cpp: blocks in groups of three, interleaved vector by vector). An A tile is 16 rows x 64 bytes
// of the quantized rows. A unit of work is 32 rows x two column blocks: four C tiles of int32 sums over K
// in steps of 64 (two A and two B tiles a step). The sums are exact integers (any order gives the same),
// so with the compensation (-128 x the column's sum, packed after the scales) and the kernel's epilogue,
// y = float(sum) * (column scale * row scale), rounded, + bias, rounded, a row gets the VNNI kernel's bits
// whatever path its call takes: calls of many rows come here without breaking the batch invariance of
// the small ones.
//
// Threads split the column blocks; each walks the rows in slabs of kSlabBytes (the slab's quantized rows
// stay in its L2 while its weights stream past once per slab). Why: oneDNN's int8 matmul over a copy of
// the weight returned float32 sums that a second pass scaled, a round trip through memory as large as the
// output, which held w8a8's prefill at bf16's rate (docs/performance.md, "On CPUs with AMX").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_arithmetic.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__linux__)
#include "amx_tiles.h"
#define SGL_LITE_HAS_AMX_INT8 1
#else
#define SGL_LITE_HAS_AMX_INT8 0
#endif

namespace {

constexpr int64_t kCols = 16;       // output columns per packed block
constexpr int64_t kGroup = 3;       // blocks per group of the packing
constexpr int64_t kStepK = 64;      // k per tile step: 16 vectors of 4
constexpr int64_t kUnitRows = 32;   // rows per unit: two A tiles
constexpr int64_t kSlabBytes = 1 << 20;  // a thread walks its blocks with this many bytes of rows (in its L2)

#if SGL_LITE_HAS_AMX_INT8

inline void store(__m512 y, float* out) { _mm512_storeu_ps(out, y); }
inline void store(__m512 y, c10::BFloat16* out) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), sgl_lite::round_to_bf16(y)); }

struct Operands {
  const uint8_t* xq;       // [rows, K] quantized rows, rows padded to whole units
  const float* row_scale;  // [m]
  const int8_t* w;         // packed weight, [blocks, (K/4 + 2) * 64]
  const float* bias;       // [N] or nullptr
  int64_t m, k, n, blocks;
  int64_t vectors() const { return k / 4 + 2; }  // a block's 64-byte vectors: weights, scales, compensations
  // Vector v of block j: its group's vectors interleave block by block.
  const int8_t* vector(int64_t j, int64_t v) const {
    const int64_t g = j / kGroup, nb = std::min(kGroup, blocks - g * kGroup);
    return w + (g * kGroup * vectors() + v * nb + j % kGroup) * 64;
  }
  int64_t stride(int64_t j) const { return std::min(kGroup, blocks - j / kGroup * kGroup) * 64; }  // between a block's vectors
};

// Rows [r0, r0 + 32) x blocks j .. j + NB - 1: C tile (row half h, block b) is tile 2 h + b; A tiles 4, 5;
// B tiles 6, 7. Then the epilogue into out's rows below m (the rows past it are padding).
template <int NB, typename O>
void unit(const Operands& o, int64_t r0, int64_t j, O* out, int32_t* sums) {
  const uint8_t* a = o.xq + r0 * o.k;
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NB == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int8_t* b0 = o.vector(j, 0);
  const int8_t* b1 = NB == 2 ? o.vector(j + 1, 0) : nullptr;
  const int64_t s0 = o.stride(j), s1 = NB == 2 ? o.stride(j + 1) : 0;
  for (int64_t kk = 0; kk < o.k; kk += kStepK) {
    const int64_t v = kk / 4;  // the step's first vector
    _tile_loadd(4, a + kk, o.k);
    _tile_loadd(5, a + 16 * o.k + kk, o.k);
    _tile_loadd(6, b0 + v * s0, s0);
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(2, 5, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, b1 + v * s1, s1);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, sums, NB * kCols * 4);  // sums: [32 rows][NB * 16]
  _tile_stored(2, sums + 16 * NB * kCols, NB * kCols * 4);
  if constexpr (NB == 2) {
    _tile_stored(1, sums + kCols, NB * kCols * 4);
    _tile_stored(3, sums + 16 * NB * kCols + kCols, NB * kCols * 4);
  }
  const int64_t rows = std::min(kUnitRows, o.m - r0);
  for (int b = 0; b < NB; ++b) {
    const __m512 col_scale = _mm512_loadu_ps(reinterpret_cast<const float*>(o.vector(j + b, o.k / 4)));
    const __m512i comp = _mm512_loadu_si512(o.vector(j + b, o.k / 4 + 1));
    const __m512 vbias = o.bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(o.bias + (j + b) * kCols);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_loadu_si512(sums + r * NB * kCols + b * kCols), comp));
      __m512 y = _mm512_mul_ps(sum, _mm512_mul_ps(col_scale, _mm512_set1_ps(o.row_scale[r0 + r])));
      __asm__("" : "+v"(y));  // two roundings, as the kernel's (no FMA contraction of the bias add)
      if (o.bias != nullptr) y = _mm512_add_ps(y, vbias);
      store(y, out + (r0 + r) * o.n + (j + b) * kCols);
    }
  }
}

template <typename O>
void gemm(const Operands& o, O* out) {
  const int64_t pairs = (o.blocks + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    sgl_lite::configure_tiles();
    alignas(64) int32_t sums[kUnitRows * 2 * kCols];
    const int64_t slab = std::max(kUnitRows, kSlabBytes / o.k / kUnitRows * kUnitRows);
    for (int64_t s0 = 0; s0 < o.m; s0 += slab) {
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t r0 = s0; r0 < std::min(o.m, s0 + slab); r0 += kUnitRows) {
          if (2 * p + 1 < o.blocks) {
            unit<2>(o, r0, 2 * p, out, sums);
          } else {
            unit<1>(o, r0, 2 * p, out, sums);
          }
        }
      }
    }
    _tile_release();
  });
}

#endif

bool amx_w8a8_supported() {
#if SGL_LITE_HAS_AMX_INT8
  return sgl_lite::tiles_granted();
#else
  return false;
#endif
}

// `xq` uint8 [M, K] and `row_scale` float32 [M] from w8a8_quantize_rows; `packed_weight` as w8a8_gemm takes
// it (K a multiple of 64 here); out [M, N] in `out_dtype` (float32 or bf16), N the packed columns.
at::Tensor amx_w8a8_gemm(const at::Tensor& xq, const at::Tensor& row_scale, const at::Tensor& packed_weight,
                         const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  TORCH_CHECK(amx_w8a8_supported(), "amx_w8a8_gemm: no AMX tiles here (check sgl_lite::amx_w8a8_gemm_supported first)");
  TORCH_CHECK(xq.device().is_cpu() && xq.dim() == 2 && xq.scalar_type() == at::kByte && xq.is_contiguous(),
              "amx_w8a8_gemm: xq must be contiguous uint8 [M, K] (w8a8_quantize_rows)");
  const int64_t m = xq.size(0), k = xq.size(1);
  TORCH_CHECK(k % kStepK == 0 && k > 0, "amx_w8a8_gemm: K must be a positive multiple of ", kStepK, "; got ", k);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.numel() == m && row_scale.is_contiguous(),
              "amx_w8a8_gemm: row_scale must be float32 [M]");
  TORCH_CHECK(packed_weight.scalar_type() == at::kChar && packed_weight.dim() == 2 && packed_weight.is_contiguous() &&
                  packed_weight.size(1) == (k / 4 + 2) * 64,
              "amx_w8a8_gemm: packed_weight must be int8 [N/16, (K/4 + 2) * 64] (W8A8Int8) for K = ", k);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "amx_w8a8_gemm: float32 or bf16 output");
  const int64_t blocks = packed_weight.size(0), n = blocks * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n, "amx_w8a8_gemm: bias must be [N] for the packed N = ", n);
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, xq.options().dtype(out_dtype));
  if (m == 0) return out;
#if SGL_LITE_HAS_AMX_INT8
  at::Tensor rows = xq;  // the last unit's A tiles read 32 rows: a zero-padded copy when m is not a multiple
  if (m % kUnitRows) {
    rows = at::zeros({(m + kUnitRows - 1) / kUnitRows * kUnitRows, k}, xq.options());
    std::memcpy(rows.data_ptr<uint8_t>(), xq.data_ptr<uint8_t>(), m * k);
  }
  const Operands o{rows.data_ptr<uint8_t>(), row_scale.data_ptr<float>(), packed_weight.data_ptr<int8_t>(),
                   bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, m, k, n, blocks};
  if (out_dtype == at::kFloat) gemm(o, out.data_ptr<float>());
  else gemm(o, out.data_ptr<c10::BFloat16>());
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("amx_w8a8_gemm_supported() -> bool", &amx_w8a8_supported);
  m.def("amx_w8a8_gemm(Tensor xq, Tensor row_scale, Tensor packed_weight, Tensor? bias, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("amx_w8a8_gemm", &amx_w8a8_gemm); }
