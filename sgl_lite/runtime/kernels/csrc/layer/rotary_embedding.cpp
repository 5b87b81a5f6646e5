// Rotate-half RoPE for a prefill's q and k heads in one op: rotary_embedding(x [n, H, D], cos, sin [n, 1, D/2])
// returns cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin) with the same bits (rope.h), contiguous.
//
// Why: in torch that expression is seven ops over the whole [n, H, D] (four products, a difference, a sum, a
// cat), each a pass through memory and a parallel region: a visible share of an agent turn's prefill step
// (docs/journal.md, "Glue around the kernels: a prefill's RoPE in one op"; scripts/profile_step.py
// extend). Here each row's heads are rotated in one pass, rows
// spread over the threads. x may be a view into the qkv matmul's output (rows strided, heads contiguous).
// Other dtypes and layouts take torch's ops (layers/rotary_embedding.py checks before calling).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "rope.h"

namespace {

// Rows a task rotates: a decode step's few rows stay on the calling thread (no parallel region).
constexpr int64_t kRowsPerTask = 16;

template <class T>
void rotate_rows(const T* x, int64_t row_stride, const T* cos, const T* sin, int64_t n, int64_t heads, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t h = 0; h < heads; ++h) {
        sgl_lite::rotate_half(x + i * row_stride + h * dim, cos + i * half, sin + i * half, half, out + (i * heads + h) * dim);
      }
    }
  });
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary_embedding: x must be [n, heads, head_dim] with each row's heads contiguous and head_dim even");
  const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rotary_embedding: x must be bfloat16 or float32");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() && cos.numel() == n * dim / 2 &&
                  sin.numel() == n * dim / 2,
              "rotary_embedding: cos and sin must hold head_dim / 2 values per row, in x's dtype");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor out = at::empty({n, heads, dim}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rotate_rows(x.data_ptr<float>(), x.stride(0), c.data_ptr<float>(), s.data_ptr<float>(), n, heads, dim, out.data_ptr<float>());
  } else {
    rotate_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), c.data_ptr<c10::BFloat16>(), s.data_ptr<c10::BFloat16>(), n, heads, dim,
                out.data_ptr<c10::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) { m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
