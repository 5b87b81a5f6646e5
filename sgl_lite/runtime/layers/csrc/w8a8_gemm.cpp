// y = x @ W.T (+ bias) with int8 weights (a scale per output column) and int8 activations (a scale per
// row, taken from the row itself): `--quantization w8a8_int8`, on AVX512-VNNI.
//
// Why: on a CPU whose bf16 matmuls are slow (VDPBF16PS at half the float32 FMA rate on an Intel Xeon,
// family 6 model 207), VPDPBUSD multiplies 64 byte pairs an instruction at twice the FMA rate: ~4x the
// bf16 kernel's rate on a prefill's many rows, and half the bytes a decode step streams.
//
// Arithmetic: each row of x is quantized symmetrically, q = round_half_even(x * 127 / max|x|), and stored
// as q + 128 (VPDPBUSD multiplies unsigned by signed bytes); the column's compensation -128 * sum_k w[k]
// takes the 128 back out, so the int32 sum is exactly sum_k q[k] * w[k] (integer sums: any order gives the
// same). Then y = float(sum) * (row scale * column scale) + bias, rounded once to the output dtype. A row's
// result depends neither on the other rows nor on the threads: the kernel is batch invariant.
//
// Packed weight (int8, [N/16, K4 * 64 + 128], K4 = ceil(K / 4)): per block of 16 output columns, K4 vectors of
// 16 columns x 4 k (zero past K), then the 16 columns' float32 scales, then their int32 compensations.
// Threads take the column tiles (two blocks) from a shared counter, rows go in register tiles of up to 8.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_arithmetic.h"
#include "row_tiles.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SGL_LITE_HAS_VNNI 1
#else
#define SGL_LITE_HAS_VNNI 0
#endif

namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kMaxTileRows = 8;
constexpr int64_t kTilesPerRun = 8;
constexpr int64_t kPrefetchBytes = 2048;  // into L2, as in bf16_gemv.cpp (a Zen 4 EPYC: ~11% off a batch-8 step's w8a8_gemm)
constexpr int64_t kTrailer = 128;  // per block: 16 float32 scales, 16 int32 compensations

bool has_vnni() { return SGL_LITE_HAS_VNNI; }

#if SGL_LITE_HAS_VNNI

// Activations and outputs: float32, bf16 (its bits) or fp16.
inline __m512 widen(__m256i bits, c10::BFloat16*) { return sgl_lite::widen_bf16(bits); }
inline __m512 widen(__m256i bits, c10::Half*) { return _mm512_cvtph_ps(bits); }
inline __m512 load_row16(const float* p) { return _mm512_loadu_ps(p); }
template <typename T>
inline __m512 load_row16(const T* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), static_cast<T*>(nullptr));
}
inline __m512 load_partial(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
template <typename T>
inline __m512 load_partial(const T* p, __mmask16 mask) { return widen(_mm256_maskz_loadu_epi16(mask, p), static_cast<T*>(nullptr)); }

// One row: its scale (max|x| / 127) and q + 128 as bytes, zero-padded (128) to k4 * 4. A row whose 127 / max|x|
// is not finite (all zeros, or below 127 / FLT_MAX) quantizes to zeros, as the torch reference does.
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t k4, uint8_t* q, float* scale) {
  __m512 amax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kCols <= k; i += kCols) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_row16(x + i)));
  const __mmask16 tail = static_cast<__mmask16>((1u << (k - i)) - 1);
  if (i < k) amax = _mm512_max_ps(amax, _mm512_abs_ps(load_partial(x + i, tail)));
  const float max_abs = _mm512_reduce_max_ps(amax);
  const float ratio = 127.f / max_abs;
  const float inv = std::isfinite(ratio) ? ratio : 0.f;
  *scale = max_abs / 127.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i offset = _mm512_set1_epi32(128);
  for (i = 0; i + kCols <= k; i += kCols) {
    const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load_row16(x + i), vinv)), offset);  // MXCSR: half-even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtusepi32_epi8(v));
  }
  if (i < k) {
    const __m512i v = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load_partial(x + i, tail), vinv)), offset);
    _mm_mask_storeu_epi8(q + i, tail, _mm512_cvtusepi32_epi8(v));
  }
  std::memset(q + k, 128, k4 * 4 - k);
}

inline void store(__m512 y, float* out) { _mm512_storeu_ps(out, y); }
inline void store(__m512 y, c10::BFloat16* out) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), sgl_lite::round_to_bf16(y)); }
inline void store(__m512 y, c10::Half* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

struct Operands {
  const uint8_t* xq;        // [m, k4 * 4]
  const float* row_scale;   // [m]
  int64_t m, k4;
  const int8_t* w;          // packed
  int64_t n, block_bytes;
  const float* bias;        // float32 [n] or null
};

// Rows [0, R) against NB column blocks from `w`, writing out[r][0 : 16 * NB].
template <int R, int NB, typename O>
inline void tile(const Operands& o, const uint8_t* xq, const float* row_scale, const int8_t* w, const float* bias, O* out) {
  __m512i acc[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_si512();
  const int64_t ldx = o.k4 * 4;
  for (int64_t p = 0; p < o.k4; ++p) {
    __m512i wv[NB];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const int8_t* line = w + b * o.block_bytes + p * 64;
      _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T1);
      wv[b] = _mm512_loadu_si512(line);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, xq + r * ldx + p * 4, sizeof(quad));
      const __m512i xv = _mm512_set1_epi32(quad);
      // VPDPBUSD in asm, and every loop over acc unrolled: with the intrinsic, GCC 12 kept two registers per
      // sum and copied between them every step, and spilled one to the stack (a third of the loop's
      // instructions were moves); the "+v" pins each sum to one register.
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc[r][b]) : "v"(xv), "v"(wv[b]));
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b) {
    const int8_t* trailer = w + b * o.block_bytes + o.k4 * 64;
    const __m512 col_scale = _mm512_loadu_ps(reinterpret_cast<const float*>(trailer));
    const __m512i comp = _mm512_loadu_si512(trailer + 64);
    const __m512 vbias = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + b * kCols);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[r][b], comp));
      __m512 y = _mm512_mul_ps(sum, _mm512_mul_ps(col_scale, _mm512_set1_ps(row_scale[r])));
      // Two roundings, as the torch reference rounds: the empty asm keeps GCC from contracting the
      // product and the bias add into one FMA (-ffp-contract=fast is its default).
      __asm__("" : "+v"(y));
      if (bias != nullptr) y = _mm512_add_ps(y, vbias);
      store(y, out + r * o.n + b * kCols);
    }
  }
}

template <typename O>
void gemm(const Operands& o, O* out) {
  const int64_t blocks = o.n / kCols, tiles = (blocks + 1) / 2;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  // a shared counter, not fixed shares: a thread that loses its core must not hold up the others (bf16_gemv.cpp)
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(kTilesPerRun, tiles / (threads * 4)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(run, std::memory_order_relaxed); begin < tiles;
         begin = next.fetch_add(run, std::memory_order_relaxed)) {
      for (int64_t t = begin; t < std::min(tiles, begin + run); ++t) {
        const int64_t b0 = 2 * t, nb = std::min<int64_t>(2, blocks - b0);
        const int8_t* w = o.w + b0 * o.block_bytes;
        const float* bias = o.bias == nullptr ? nullptr : o.bias + b0 * kCols;
        for (int64_t r0 = 0; r0 < o.m; r0 += kMaxTileRows) {
          const uint8_t* xq = o.xq + r0 * o.k4 * 4;
          O* dst = out + r0 * o.n + b0 * kCols;
          sgl_lite_tiles::with_rows<kMaxTileRows>(o.m - r0, [&](auto rows) {
            constexpr int R = decltype(rows)::value;
            (nb == 2 ? tile<R, 2, O> : tile<R, 1, O>)(o, xq, o.row_scale + r0, w, bias, dst);
          });
        }
      }
    }
  });
}

#endif

// The trailer's scales and compensations live in the packed tensor itself, so one tensor is the weight
// (csrc/decode_layer.cpp dispatches on its dtype).
at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_vnni(), "w8a8_gemm: this build has no AVX512-VNNI (check sgl_lite::w8a8_gemm_supported first)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "w8a8_gemm runs on CPU tensors");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && x.is_contiguous(),
              "w8a8_gemm: x must be contiguous float32, bf16 or fp16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), k4 = (k + 3) / 4;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(1) == k4 * 64 + kTrailer,
              "w8a8_gemm: packed weight must be contiguous int8 [N/16, ceil(K/4) * 64 + 128] for K = ", k);
  const int64_t n = packed.size(0) * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "w8a8_gemm: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if SGL_LITE_HAS_VNNI
  if (m > 0) {
    std::vector<uint8_t> xq(m * k4 * 4);
    std::vector<float> row_scale(m);
    const Operands o{xq.data(), row_scale.data(), m, k4, packed.data_ptr<int8_t>(), n, packed.size(1),
                     bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr};
    const auto run = [&](const auto* xs, auto* os) {
      at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) quantize_row(xs + r * k, k, k4, xq.data() + r * k4 * 4, &row_scale[r]);
      });
      gemm(o, os);
    };
    if (dtype == at::kFloat) {
      run(x.data_ptr<float>(), out.data_ptr<float>());
    } else if (dtype == at::kBFloat16) {
      run(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
    } else {
      run(x.data_ptr<c10::Half>(), out.data_ptr<c10::Half>());
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("w8a8_gemm_supported() -> bool", &has_vnni);
  m.def("w8a8_gemm(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("w8a8_gemm", &w8a8_gemm); }
