// y = x @ W.T (+ bias) with int8 weights (a scale per output column) and int8 activations (a scale per
// row, taken from the row itself): `--quantization w8a8_int8`, on AVX512-VNNI.
//
// Why: on a CPU whose bf16 matmuls are slow (VDPBF16PS at half the float32 FMA rate), VPDPBUSD multiplies
// 64 byte pairs an instruction at twice the FMA rate: a multiple of the bf16 kernel's rate on a prefill's
// many rows, and half the bytes a decode step streams (docs/performance.md, "On CPUs whose float32 FMAs
// outrun VDPBF16PS").
//
// Arithmetic: each row of x is quantized symmetrically, q = round_half_even(x * 127 / max|x|), and stored
// as q + 128 (VPDPBUSD multiplies unsigned by signed bytes); the column's compensation -128 * sum_k w[k]
// takes the 128 back out, so the int32 sum is exactly sum_k q[k] * w[k] (integer sums: any order gives the
// same). Then y = float(sum) * (row scale * column scale) + bias, rounded once to the output dtype. A row's
// result depends neither on the other rows nor on the threads: the kernel is batch invariant.
//
// w8a16_gemm, the same weights with 16-bit activations (the LM head of `--quantization w8a8_int8`, whose
// logits decide every token): each row as U = round_half_even(x * 32767 / max|x|) + 32768, taken in two
// unsigned bytes, hi = U >> 8 and lo = U & 255, each multiplied by the weights as above; the row's sum is
// 256 * (hi sum + compensation) + lo sum, the two int32 sums converted to float32 and combined in one FMA
// (one rounding). Twice the products of w8a8 for the bytes of int8 weights: what the activations lose is
// ~1/256 of what 8 bits lose, below the weights' own rounding.
//
// Packed weight (int8, sized [N/16, K4 * 64 + 128], K4 = ceil(K / 4)): per block of 16 output columns, K4 + 2
// vectors of 64 bytes: K4 of 16 columns x 4 k (zero past K), then the 16 columns' float32 scales, then their
// int32 compensations. The blocks go in groups of three (a last group may hold one or two), a group's
// vectors interleaved step by step, [K4 + 2][3][64] bytes (kernels/column_groups.py). A tile is a group, so
// that it reads one stream, not three streams K4 * 64 bytes apart, which fell behind the products at 8 rows,
// as in bf16_gemv.cpp: 8- and 32-row calls gained, one-row calls lost a little whether a one-row call took
// one group a tile or two or three (docs/performance.md, "Matmul tiles read as one stream"). Threads take
// the tiles from a shared counter, rows go in register tiles of up to 8 (4 with 16-bit activations, whose two
// sums per output take twice the registers).

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
#include <tuple>
#include <vector>

#include "bf16_arithmetic.h"
#include "row_tiles.h"

#include "vnni_rows.h"  // SGL_LITE_HAS_VNNI

namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kTilesPerRun = 8;
// per block of a group, into L2, as in bf16_gemv.cpp (docs/journal.md, "Decode kernels prefetch into L2")
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kTrailer = 128;  // per block: 16 float32 scales, 16 int32 compensations

bool has_vnni() { return SGL_LITE_HAS_VNNI; }

#if SGL_LITE_HAS_VNNI

using sgl_lite_rows::load_partial;
using sgl_lite_rows::load_row16;
using sgl_lite_rows::store;

// Activations of kParts bytes: 8-bit (one part) or 16-bit fixed point (two, hi then lo).
template <int kParts>
struct Activations {
  static_assert(kParts == 1 || kParts == 2, "8 or 16 bits");
  static constexpr float kMax = kParts == 1 ? 127.f : 32767.f;
  static constexpr int32_t kOffset = kParts == 1 ? 128 : 32768;
  // A register tile holds kParts x rows x blocks sums, the blocks' weight vectors and a broadcast row (of 32
  // registers). Three blocks, not two: each broadcast of a row's 4 bytes then serves 3 products, which made
  // matmuls of 8 and 32 rows faster (1 row alike); 16-bit activations likewise ran faster as 4 rows x 3
  // blocks than as 6 x 2 (docs/journal.md, "Matmul tiles of three column blocks").
  static constexpr int kMaxTileRows = kParts == 1 ? 8 : 4;
};
constexpr int kGroup = 3;  // blocks per tile: a group of the packing (W8A8Int8's _GROUP)

// One row: its scale (max|x| / kMax) and q + kOffset as kParts bytes (a part of k4 * 4 bytes each, the high
// bytes first), zero-padded (q = 0) to k4 * 4. A row whose kMax / max|x| is not finite (all zeros, or below
// kMax / FLT_MAX) quantizes to zeros, as the torch reference does.
template <int kParts, typename T>
void quantize_row(const T* x, int64_t k, int64_t k4, uint8_t* q, float* scale) {
  using A = Activations<kParts>;
  const float max_abs = sgl_lite_rows::max_abs(x, k);
  const __mmask16 tail = static_cast<__mmask16>((1u << (k % kCols)) - 1);
  const float ratio = A::kMax / max_abs;
  const float inv = std::isfinite(ratio) ? ratio : 0.f;
  *scale = max_abs / A::kMax;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i offset = _mm512_set1_epi32(A::kOffset);
  const int64_t part = k4 * 4;
  for (int64_t i = 0; i < k; i += kCols) {
    const __mmask16 mask = i + kCols <= k ? __mmask16(0xffff) : tail;
    const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load_partial(x + i, mask), vinv)), offset);  // MXCSR: half-even
    if constexpr (kParts == 1) {
      _mm_mask_storeu_epi8(q + i, mask, _mm512_cvtusepi32_epi8(v));
    } else {
      _mm_mask_storeu_epi8(q + i, mask, _mm512_cvtusepi32_epi8(_mm512_srli_epi32(v, 8)));
      _mm_mask_storeu_epi8(q + part + i, mask, _mm512_cvtepi32_epi8(v));  // the low byte (truncation)
    }
  }
  std::memset(q + k, A::kOffset >> (8 * (kParts - 1)), part - k);  // the high byte of the offset, then a low byte of 0
  if constexpr (kParts == 2) std::memset(q + part + k, 0, part - k);
}

struct Operands {
  const uint8_t* xq;        // [m, parts, k4 * 4]
  const float* row_scale;   // [m]
  int64_t m, k4;
  const int8_t* w;          // packed
  int64_t n, block_bytes;   // block_bytes: a block's vectors and trailer, k4 * 64 + kTrailer
  const float* bias;        // float32 [n] or null
};

// Rows [0, R) against the group of NB column blocks at `w` (NB < 3 only for a last group), writing
// out[r][0 : 16 * NB]; one sum per activation part.
template <int kParts, int R, int NB, typename O>
inline void tile(const Operands& o, const uint8_t* xq, const float* row_scale, const int8_t* w, const float* bias, O* out) {
  __m512i acc[kParts][R][NB];
#pragma GCC unroll 8
  for (int j = 0; j < kParts; ++j)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) acc[j][r][b] = _mm512_setzero_si512();
  const int64_t part = o.k4 * 4, ldx = kParts * part;
  for (int64_t p = 0; p < o.k4; ++p) {
    __m512i wv[NB];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const int8_t* line = w + (p * NB + b) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(line) + NB * kPrefetchBytes, _MM_HINT_T1);
      wv[b] = _mm512_loadu_si512(line);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
      for (int j = 0; j < kParts; ++j) {
        int32_t quad;
        std::memcpy(&quad, xq + r * ldx + j * part + p * 4, sizeof(quad));
        const __m512i xv = _mm512_set1_epi32(quad);
        // VPDPBUSD in asm, and every loop over acc unrolled: with the intrinsic, GCC 12 kept two registers per
        // sum and copied between them every step, and spilled one to the stack (a third of the loop's
        // instructions were moves); the "+v" pins each sum to one register.
#pragma GCC unroll 8
        for (int b = 0; b < NB; ++b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc[j][r][b]) : "v"(xv), "v"(wv[b]));
      }
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) {
    // the block's scales and compensations: the group's two vectors after its weights (k4 and k4 + 1)
    const __m512 col_scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w + (o.k4 * NB + b) * 64));
    const __m512i comp = _mm512_loadu_si512(w + ((o.k4 + 1) * NB + b) * 64);
    const __m512 vbias = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + b * kCols);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // the high part's sum exact in int32 (|q - offset| * 127 * K), then in float32 (times 256 exactly)
      __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][r][b], comp));
      if constexpr (kParts == 2) sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(256.f), _mm512_cvtepi32_ps(acc[kParts - 1][r][b]));
      __m512 y = _mm512_mul_ps(sum, _mm512_mul_ps(col_scale, _mm512_set1_ps(row_scale[r])));
      // Two roundings, as the torch reference rounds: the empty asm keeps GCC from contracting the
      // product and the bias add into one FMA (-ffp-contract=fast is its default).
      __asm__("" : "+v"(y));
      if (bias != nullptr) y = _mm512_add_ps(y, vbias);
      store(y, out + r * o.n + b * kCols);
    }
  }
}

template <int kParts, typename O>
void gemm(const Operands& o, O* out) {
  constexpr int kMaxTileRows = Activations<kParts>::kMaxTileRows;
  const int64_t blocks = o.n / kCols, tiles = (blocks + kGroup - 1) / kGroup;
  sgl_lite_tiles::for_each_column_tile(tiles, kTilesPerRun, [&](int64_t t) {
    const int64_t b0 = kGroup * t, nb = std::min<int64_t>(kGroup, blocks - b0);
    const int8_t* w = o.w + b0 * o.block_bytes;  // the groups before are whole
    const float* bias = o.bias == nullptr ? nullptr : o.bias + b0 * kCols;
    for (int64_t r0 = 0; r0 < o.m; r0 += kMaxTileRows) {
      const uint8_t* xq = o.xq + r0 * kParts * o.k4 * 4;
      O* dst = out + r0 * o.n + b0 * kCols;
      sgl_lite_tiles::with_rows<kMaxTileRows>(o.m - r0, [&](auto rows) {
        constexpr int R = decltype(rows)::value;
        const auto run_tile = nb == kGroup ? tile<kParts, R, kGroup, O> : nb == 2 ? tile<kParts, R, 2, O> : tile<kParts, R, 1, O>;
        run_tile(o, xq, o.row_scale + r0, w, bias, dst);
      });
    }
  });
}

#endif

// The trailer's scales and compensations live in the packed tensor itself, so one tensor is the weight
// (csrc/layer/decode_layer.cpp dispatches on its dtype). kParts: bytes per activation (w8a8_gemm 1, w8a16_gemm 2).
template <int kParts>
at::Tensor int8_gemm(const char* name, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_vnni(), name, ": this build has no AVX512-VNNI (check sgl_lite::w8a8_gemm_supported first)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), name, " runs on CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && x.is_contiguous(),
              name, ": x must be contiguous float32, bf16 or fp16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), k4 = (k + 3) / 4;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(1) == k4 * 64 + kTrailer,
              name, ": packed weight must be contiguous int8 [N/16, ceil(K/4) * 64 + 128] for K = ", k);
  const int64_t n = packed.size(0) * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, name, ": bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if SGL_LITE_HAS_VNNI
  if (m > 0) {
    const int64_t row_bytes = kParts * k4 * 4;
    std::vector<uint8_t> xq(m * row_bytes);
    std::vector<float> row_scale(m);
    const Operands o{xq.data(), row_scale.data(), m, k4, packed.data_ptr<int8_t>(), n, packed.size(1),
                     bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr};
    const auto run = [&](const auto* xs, auto* os) {
      at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) quantize_row<kParts>(xs + r * k, k, k4, xq.data() + r * row_bytes, &row_scale[r]);
      });
      gemm<kParts>(o, os);
    };
    sgl_lite_rows::with_row_pointers(x, out, run);
  }
#endif
  return out;
}

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return int8_gemm<1>("w8a8_gemm", x, packed, bias);
}

at::Tensor w8a16_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return int8_gemm<2>("w8a16_gemm", x, packed, bias);
}

// Each row of x quantized as the kernel quantizes it, stored as q + 128 in [M, K] bytes, with its scale: the
// rows amx_w8a8_gemm.cpp multiplies on AMX tiles, so that a row gets the kernel's bits from both.
std::tuple<at::Tensor, at::Tensor> w8a8_quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(has_vnni(), "w8a8_quantize_rows: this build has no AVX512-VNNI");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "w8a8_quantize_rows: x must be contiguous float32 or bf16 [M, K] on CPU");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 4 == 0, "w8a8_quantize_rows: K must be a multiple of 4; got ", k);
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({m}, x.options().dtype(at::kFloat));
#if SGL_LITE_HAS_VNNI
  const auto run = [&](const auto* xs) {
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        quantize_row<1>(xs + r * k, k, k / 4, q.data_ptr<uint8_t>() + r * k, scale.data_ptr<float>() + r);
    });
  };
  if (dtype == at::kFloat) run(x.data_ptr<float>());
  else run(x.data_ptr<c10::BFloat16>());
#endif
  return {q, scale};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("w8a8_quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.def("w8a8_gemm_supported() -> bool", &has_vnni);
  m.def("w8a8_gemm(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
  m.def("w8a16_gemm(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) {
  m.impl("w8a8_gemm", &w8a8_gemm);
  m.impl("w8a16_gemm", &w8a16_gemm);
  m.impl("w8a8_quantize_rows", &w8a8_quantize_rows);
}
