// The MLP's activation in one pass: silu_and_mul(gate_up [n, 2I]) = silu(gate_up[:, :I]) * gate_up[:, I:].
//
// torch computes it as two ops over strided halves (silu into a new tensor, then the product into another),
// and its silu evaluates an exp per element (docs/performance.md, "The MLP's activation in one op"). In
// bf16 a gate value is one of only 65536, so here silu is
// a table of torch's own silu of each (128 KiB, built once by at::silu: its bits exactly), gathered 16 at
// a time, and the product is rounded as torch rounds it: the same bits as torch's two ops, in one pass
// per row. Other dtypes, and CPUs without AVX-512 (F, BW, VL), run torch's ops. Rows are independent.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_arithmetic.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define SGL_LITE_HAS_SILU_KERNEL 1
#else
#define SGL_LITE_HAS_SILU_KERNEL 0
#endif

namespace {

#if SGL_LITE_HAS_SILU_KERNEL

// silu(g) rounded to bf16 for each of the 65536 bf16 values g, computed once by torch's own at::silu:
// what torch's first op returns, exactly. One spare entry: the kernel gathers 32 bits at a 16-bit index.
const uint16_t* silu_table() {
  static const std::vector<uint16_t> table = [] {
    const at::Tensor all = at::arange(65536, at::kInt).to(at::kShort).view(at::kBFloat16);
    const at::Tensor silu = at::silu(all).view(at::kShort).contiguous();
    std::vector<uint16_t> t(65537, 0);
    std::memcpy(t.data(), silu.data_ptr(), 65536 * sizeof(uint16_t));
    return t;
  }();
  return table.data();
}

// 16 bf16 results of silu(g) * u from g's and u's bits: silu(g) looked up (VPGATHERDD of the table's
// 32-bit words at g's index; the low half is the entry), then the product rounded as torch's second op.
inline __m256i silu_mul16(const uint16_t* table, __m256i g, __m256i u) {
  const __m512i words = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(g), table, 2);
  const __m512 silu = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  return sgl_lite::round_to_bf16(_mm512_mul_ps(silu, sgl_lite::widen_bf16(u)));
}

void silu_and_mul_bf16(const c10::BFloat16* in, c10::BFloat16* out, int64_t rows, int64_t inter) {
  const uint16_t* table = silu_table();
  // A decode step's few rows stay on one thread (no parallel region); a prefill's spread over all.
  const int64_t grain = std::max<int64_t>(1, 32768 / inter);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint16_t* gate = reinterpret_cast<const uint16_t*>(in + row * 2 * inter);
      const uint16_t* up = gate + inter;
      uint16_t* dst = reinterpret_cast<uint16_t*>(out + row * inter);
      int64_t i = 0;
      for (; i + 16 <= inter; i += 16) {
        const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate + i));
        const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(up + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), silu_mul16(table, g, u));
      }
      if (i < inter) {  // the row's last < 16 elements, masked (masked-off lanes look up entry 0)
        const __mmask16 m = static_cast<__mmask16>((1u << (inter - i)) - 1);
        const __m256i g = _mm256_maskz_loadu_epi16(m, gate + i), u = _mm256_maskz_loadu_epi16(m, up + i);
        _mm256_mask_storeu_epi16(dst + i, m, silu_mul16(table, g, u));
      }
    }
  });
}

#endif

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up must be [rows, 2 * intermediate]");
  const int64_t inter = gate_up.size(1) / 2;
#if SGL_LITE_HAS_SILU_KERNEL
  if (gate_up.scalar_type() == at::kBFloat16) {
    const at::Tensor in = gate_up.contiguous();
    at::Tensor out = at::empty({gate_up.size(0), inter}, gate_up.options());
    silu_and_mul_bf16(in.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), gate_up.size(0), inter);
    return out;
  }
#endif
  return at::silu(gate_up.slice(1, 0, inter)) * gate_up.slice(1, inter);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
