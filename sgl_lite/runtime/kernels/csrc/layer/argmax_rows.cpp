// argmax over the last axis of float32 logits [B, V], as torch.argmax(x, -1) answers it: the first index of
// the row's largest value, NaN counting as the largest (its first index).
//
// Why: torch's CPU argmax walks a row at ~4 cycles an element, and every greedy decode row and every
// position of a speculative draft takes one over the whole vocabulary: a visible share of a decode step
// (docs/performance.md, "Verification rows share their reads"). Here a row is one pass of 16-lane
// compares (each lane keeping its first largest value and where it was), rows split among threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

namespace {

// The first index of the row's largest value, or of its first NaN: the scalar definition.
int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 best = _mm512_loadu_ps(x);
    __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i index = where;
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n && i < (int64_t(1) << 31) - 16; i += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: a lane keeps its first
      best = _mm512_mask_mov_ps(best, greater, v);
      where = _mm512_mask_mov_epi32(where, greater, index);
    }
    if (nan) return argmax_scalar(x, n);  // rare: the scalar pass finds the first NaN
    // among the lanes holding the largest value, the earliest index; then the tail, later than all of them
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    int64_t arg = _mm512_mask_reduce_min_epi32(holders, where);
    float value = top;
    for (; i < n; ++i) {
      if (std::isnan(x[i])) return i;
      if (x[i] > value) value = x[i], arg = i;
    }
    return arg;
  }
#endif
  return argmax_scalar(x, n);
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "argmax_rows takes contiguous float32 CPU logits [B, V]");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = argmax_row(data + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) { m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows); }
