// RMSNorm for CPU in one pass per row, optionally fused with the residual add that precedes it.
//
// Same arithmetic as transformers' LlamaRMSNorm: the row in fp32, variance = mean(x^2) in fp32,
// y = x * rsqrt(variance + eps) rounded to the input dtype, then weight * y rounded again. The fused form
// first rounds x + residual to the dtype (what `hidden + attn_out` gives in torch) and returns that sum as
// well, for the next residual. A row is a few hundred to a few thousand elements: one thread per block of
// rows, so a decode step's few rows never start a parallel region (the point: torch's composite rms_norm
// is ~8 ops a call, and at decode sizes its cost is mostly their dispatch).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t kRowsPerTask = 16;

// Element <-> fp32 conversions the compiler can vectorize: bf16 by bit operations (round to nearest even,
// NaN kept quiet, as c10::BFloat16 does), float as is, fp16 through c10 (rare on CPU).
template <typename T>
struct Elem {
  using Raw = T;
  static float load(Raw v) { return static_cast<float>(v); }
  static Raw store(float f) { return static_cast<Raw>(f); }
};

template <>
struct Elem<c10::BFloat16> {
  using Raw = uint16_t;
  static float load(Raw v) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  static Raw store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<Raw>(0x7FC0) : static_cast<Raw>(rounded);
  }
};

template <typename T>
void rms_norm_rows(const typename Elem<T>::Raw* x, const typename Elem<T>::Raw* residual, const typename Elem<T>::Raw* weight,
                   typename Elem<T>::Raw* out, typename Elem<T>::Raw* sum_out, int64_t rows, int64_t n, float eps) {
  using E = Elem<T>;
  using R = typename E::Raw;
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const R* xr = x + r * n;
      R* yr = out + r * n;
      R* sr = sum_out ? sum_out + r * n : nullptr;
      if (residual) {
        const R* rr = residual + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) sr[i] = E::store(E::load(xr[i]) + E::load(rr[i]));
        xr = sr;
      }
      // One loop for both forms, so the fused norm sums its squares in the same order as the plain one
      // (folding the sum into the add loop vectorized differently on AVX2 and changed bf16 roundings).
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < n; ++i) {
        const float f = E::load(xr[i]);
        squares += f * f;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float normed = E::load(E::store(E::load(xr[i]) * inv));
        yr[i] = E::store(E::load(weight[i]) * normed);
      }
    }
  });
}

template <typename R>
R* raw(const at::Tensor& t) {
  return static_cast<R*>(t.data_ptr());
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), "rms_norm: weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x must share a dtype");
}

template <typename Fn>
void dispatch(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(c10::BFloat16{}); break;
    case at::kHalf: fn(c10::Half{}); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", dtype);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  at::Tensor out = at::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    using R = typename Elem<T>::Raw;
    rms_norm_rows<T>(raw<R>(x), nullptr, raw<R>(weight), raw<R>(out), nullptr, x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                                double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous and match x");
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = at::empty_like(x);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    using R = typename Elem<T>::Raw;
    rms_norm_rows<T>(raw<R>(x), raw<R>(residual), raw<R>(weight), raw<R>(out), raw<R>(sum), x.size(0), x.size(1),
                     static_cast<float>(eps));
  });
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
