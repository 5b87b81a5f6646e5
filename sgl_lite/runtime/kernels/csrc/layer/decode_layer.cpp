// One Llama decoder layer for a decode step on CPU, as one op: the same ATen calls and sgl_lite ops, in the
// same order, as LlamaDecoderLayer.forward takes on its decode path (the small-row matmuls, bf16_gemv.cpp,
// avx2_gemv.cpp, avx2_q4_gemv.cpp, w8a8_gemm.cpp or w4a8_gemm.cpp by each packed weight's layout, and the paged decode kernel), so the
// result is bit-identical to it.
//
// Why: at batch 1-32 a decode step is ~35 small ops per layer, and each call from Python costs a few
// microseconds of interpreter and dispatcher time on top of its work - about a quarter of a batch-1 step
// on SmolLM2-135M. Called from C++ the same ops cost a fraction of that.
//
// Steps (hidden and residual [n, hidden]; the layer's output and the residual before it, as in Python):
//   normed, residual = rms_norm(hidden) or add_rms_norm(hidden, residual)
//   qkv = gemv(normed, qkv_weight, qkv_bias); rotate-half RoPE on the q and k heads
//   k, v -> k_cache, v_cache at out_cache_loc; attention = paged_decode_attention(q, ...) (decode rows, or
//   speculative verification rows of several queries each: qo_indptr)
//   normed, residual = add_rms_norm(gemv(attention, o_weight, o_bias), residual)
//   gate_up = gemv(normed, gate_up_weight); out = gemv(silu_and_mul(gate_up), down_weight)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

#include "rope.h"

namespace {

using sgl_lite::stored;
using sgl_lite::widened;

using Gemv = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                             const c10::optional<at::Tensor>&);

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Rotate-half RoPE on the q and k heads of qkv [n, (Hq + 2 Hkv) * D] and the KV write in one pass: q rotated
// into q_out [n, Hq, D], k rotated and v copied into the cache rows `loc` (of the model's dtype T, or 8-bit
// floats C). The ATen expression it replaces, cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin) then two
// index_copy_, costs ~10 dispatched ops a layer; this rounds as it does (each product, then each sum, to T;
// float32 without fused multiply-adds, which would round once), so the bits are the same.
template <class T, class C>
__attribute__((optimize("fp-contract=off"))) void rope_store(const T* qkv, const T* cos, const T* sin, int64_t n,
                                                             int64_t hq, int64_t hkv, int64_t dim, const int64_t* loc,
                                                             T* q_out, C* k_cache, C* v_cache) {
  const int64_t half = dim / 2, width = (hq + 2 * hkv) * dim;
  for (int64_t i = 0; i < n; ++i) {
    const T* row = qkv + i * width;
    const T* c = cos + i * half;
    const T* s = sin + i * half;
    const auto rotate = [&](const T* x, auto* out) { sgl_lite::rotate_half(x, c, s, half, out); };
    for (int64_t h = 0; h < hq; ++h) rotate(row + h * dim, q_out + (i * hq + h) * dim);
    for (int64_t h = 0; h < hkv; ++h) rotate(row + (hq + h) * dim, k_cache + (loc[i] * hkv + h) * dim);
    const T* v = row + (hq + hkv) * dim;
    C* v_out = v_cache + loc[i] * hkv * dim;
    if constexpr (std::is_same_v<C, T>) {
      std::memcpy(v_out, v, hkv * dim * sizeof(T));
    } else {
      for (int64_t j = 0; j < hkv * dim; ++j) v_out[j] = stored<C>(widened(v[j]));
    }
  }
}

// rope_store for the model's dtype T into caches of the model's dtype or of 8-bit floats.
template <class T>
void rope_store_into(const T* qkv, const T* cos, const T* sin, int64_t n, int64_t hq, int64_t hkv, int64_t dim,
                     const int64_t* loc, T* q_out, at::Tensor& k_cache, at::Tensor& v_cache) {
  switch (k_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return rope_store(qkv, cos, sin, n, hq, hkv, dim, loc, q_out, k_cache.data_ptr<c10::Float8_e4m3fn>(),
                        v_cache.data_ptr<c10::Float8_e4m3fn>());
    case at::kFloat8_e5m2:
      return rope_store(qkv, cos, sin, n, hq, hkv, dim, loc, q_out, k_cache.data_ptr<c10::Float8_e5m2>(),
                        v_cache.data_ptr<c10::Float8_e5m2>());
    default:
      return rope_store(qkv, cos, sin, n, hq, hkv, dim, loc, q_out, k_cache.data_ptr<T>(), v_cache.data_ptr<T>());
  }
}

// The ATen form of KVPool.write: rows x into the cache at `loc`, saturated and converted for an 8-bit float cache.
void store_rows(at::Tensor& cache, const at::Tensor& loc, const at::Tensor& x) {
  if (cache.scalar_type() != at::kFloat8_e4m3fn && cache.scalar_type() != at::kFloat8_e5m2) {
    cache.index_copy_(0, loc, x);
    return;
  }
  const double finite = cache.scalar_type() == at::kFloat8_e4m3fn ? static_cast<double>(std::numeric_limits<c10::Float8_e4m3fn>::max())
                                                                  : static_cast<double>(std::numeric_limits<c10::Float8_e5m2>::max());
  at::Tensor bytes = cache.view(at::kByte);  // index_copy_ has no float8 kernel; the bytes are the same
  bytes.index_copy_(0, loc, x.clamp(-finite, finite).to(cache.scalar_type()).view(at::kByte));
}

// q [n, Hq, D] rotated, with k rotated and v stored in the caches: rope_store where it applies (bf16 or
// float32, contiguous operands), else the ATen expression it stands for.
at::Tensor rotate_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& out_cache_loc, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t n = qkv.size(0), dim = k_cache.size(2), half = dim / 2;
  const at::ScalarType dtype = qkv.scalar_type();
  const bool fused = (dtype == at::kBFloat16 || dtype == at::kFloat) && qkv.is_contiguous() &&
                     qkv.size(1) == (num_heads + 2 * num_kv_heads) * dim && k_cache.is_contiguous() &&
                     v_cache.is_contiguous() && out_cache_loc.scalar_type() == at::kLong && cos.scalar_type() == dtype &&
                     sin.scalar_type() == dtype && cos.numel() == n * half && sin.numel() == n * half;
  if (fused) {
    at::Tensor q = at::empty({n, num_heads, dim}, qkv.options());
    const at::Tensor c = cos.contiguous(), s = sin.contiguous(), loc = out_cache_loc.contiguous();
    // the loop writes rows loc[i] unchecked (index_copy_ checks its indices): an out-of-pool slot is an error, not a stray write
    const int64_t* slots = loc.data_ptr<int64_t>();
    TORCH_CHECK(loc.numel() == n && std::all_of(slots, slots + n, [&](int64_t slot) { return slot >= 0 && slot < k_cache.size(0); }),
                "decode_layer: out_cache_loc must hold one slot in [0, ", k_cache.size(0), ") per row");
    if (dtype == at::kFloat) {
      rope_store_into(qkv.data_ptr<float>(), c.data_ptr<float>(), s.data_ptr<float>(), n, num_heads, num_kv_heads, dim, slots,
                      q.data_ptr<float>(), k_cache, v_cache);
    } else {
      rope_store_into(qkv.data_ptr<c10::BFloat16>(), c.data_ptr<c10::BFloat16>(), s.data_ptr<c10::BFloat16>(), n, num_heads,
                      num_kv_heads, dim, slots, q.data_ptr<c10::BFloat16>(), k_cache, v_cache);
    }
    return q;
  }
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;
  const at::Tensor qk = qkv.slice(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, dim});
  const at::Tensor x1 = qk.slice(-1, 0, half), x2 = qk.slice(-1, half);
  const at::Tensor rotated = at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  store_rows(k_cache, out_cache_loc, rotated.slice(1, num_heads));
  store_rows(v_cache, out_cache_loc, qkv.slice(1, q_size + kv_size).view({n, num_kv_heads, dim}));
  return rotated.slice(1, 0, num_heads).contiguous();
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_weight, const c10::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o_weight, const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up_weight,
    const at::Tensor& down_weight, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& out_cache_loc, const at::Tensor& kv_indptr, const at::Tensor& kv_indices, int64_t num_heads,
    int64_t num_kv_heads, double scale, const c10::optional<at::Tensor>& qo_indptr) {
  static const auto bf16_gemv = op<Gemv>("sgl_lite::bf16_gemv");
  static const auto avx2_gemv = op<Gemv>("sgl_lite::avx2_gemv");
  static const auto avx2_q4_gemv = op<Gemv>("sgl_lite::avx2_q4_gemv");
  static const auto w8a8_gemm = op<Gemv>("sgl_lite::w8a8_gemm");
  static const auto w4a8_gemm = op<Gemv>("sgl_lite::w4a8_gemm");
  // Each weight's kernel by its packing: AVX512-BF16's weights are in pairs along K (sized [N/16, K/2, 16, 2]),
  // AVX2's are not ([N/16, K, 16]), AVX2's 4-bit blocks are uint8 [N/16, K/32, 320], w4a8's uint8
  // [N/16, K/32 * 320], and w8a8's int8.
  const auto gemv = [&](const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    if (weight.scalar_type() == at::kByte) return (weight.dim() == 3 ? avx2_q4_gemv : w4a8_gemm).call(x, weight, bias);
    if (weight.scalar_type() == at::kChar) return w8a8_gemm.call(x, weight, bias);
    return (weight.dim() == 4 ? bf16_gemv : avx2_gemv).call(x, weight, bias);
  };
  static const auto norm = op<Norm>("sgl_lite::rms_norm");
  static const auto add_norm = op<AddNorm>("sgl_lite::add_rms_norm");
  static const auto attention = op<Attention>("sgl_lite::paged_decode_attention");
  static const auto silu_and_mul = op<at::Tensor(const at::Tensor&)>("sgl_lite::silu_and_mul");
  TORCH_CHECK(hidden.dim() == 2 && k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads, "decode_layer: hidden must be [n, hidden], k_cache [slots, num_kv_heads, head_dim]");
  const at::ScalarType kv = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == kv && (kv == hidden.scalar_type() || kv == at::kFloat8_e4m3fn || kv == at::kFloat8_e5m2),
              "decode_layer: the KV cache must have the model's dtype or hold 8-bit floats");
  const int64_t n = hidden.size(0), q_size = num_heads * k_cache.size(2);

  at::Tensor normed, stream;
  if (residual.has_value() && residual->defined()) {
    std::tie(normed, stream) = add_norm.call(hidden.contiguous(), residual->contiguous(), input_norm, eps);
  } else {
    normed = norm.call(hidden.contiguous(), input_norm, eps);
    stream = hidden;
  }
  const at::Tensor qkv = gemv(normed, qkv_weight, qkv_bias);
  const at::Tensor q = rotate_and_store(qkv, cos, sin, k_cache, v_cache, out_cache_loc, num_heads, num_kv_heads);
  const at::Tensor attended = attention.call(q, k_cache, v_cache, kv_indptr, kv_indices, scale, qo_indptr);
  const at::Tensor projected = gemv(attended.reshape({n, q_size}), o_weight, o_bias);
  std::tie(normed, stream) = add_norm.call(projected, stream.contiguous(), post_norm, eps);
  const at::Tensor gate_up = gemv(normed, gate_up_weight, c10::nullopt);
  const at::Tensor act = silu_and_mul.call(gate_up);
  return {gemv(act.contiguous(), down_weight, c10::nullopt), stream};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_weight, "
      "Tensor? qkv_bias, Tensor o_weight, Tensor? o_bias, Tensor gate_up_weight, Tensor down_weight, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_cache_loc, Tensor kv_indptr, Tensor kv_indices, int num_heads, "
      "int num_kv_heads, float scale, Tensor? qo_indptr=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("decode_layer", &decode_layer); }
