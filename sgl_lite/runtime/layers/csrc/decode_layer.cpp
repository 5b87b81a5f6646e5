// One Llama decoder layer for a decode step on CPU, as one op: the same ATen calls and sgl_lite ops, in the
// same order, as LlamaDecoderLayer.forward takes on its decode path (the small-row matmuls, bf16_gemv.cpp,
// avx2_gemv.cpp, avx2_q4_gemv.cpp or w8a8_gemm.cpp by each packed weight's layout, and the paged decode kernel), so the
// result is bit-identical to it.
//
// Why: at batch 1-32 a decode step is ~35 small ops per layer, and each call from Python costs a few
// microseconds of interpreter and dispatcher time on top of its work - about a quarter of a batch-1 step
// on SmolLM2-135M. Called from C++ the same ops cost a fraction of that.
//
// Steps (hidden and residual [n, hidden]; the layer's output and the residual before it, as in Python):
//   normed, residual = rms_norm(hidden) or add_rms_norm(hidden, residual)
//   qkv = gemv(normed, qkv_weight, qkv_bias); rotate-half RoPE on the q and k heads
//   k, v -> k_cache, v_cache at out_cache_loc; attention = paged_decode_attention(q, ...)
//   normed, residual = add_rms_norm(gemv(attention, o_weight, o_bias), residual)
//   gate_up = gemv(normed, gate_up_weight); out = gemv(silu(gate) * up, down_weight)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace {

using Gemv = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_weight, const c10::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o_weight, const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up_weight,
    const at::Tensor& down_weight, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& out_cache_loc, const at::Tensor& kv_indptr, const at::Tensor& kv_indices, int64_t num_heads,
    int64_t num_kv_heads, double scale) {
  static const auto bf16_gemv = op<Gemv>("sgl_lite::bf16_gemv");
  static const auto avx2_gemv = op<Gemv>("sgl_lite::avx2_gemv");
  static const auto avx2_q4_gemv = op<Gemv>("sgl_lite::avx2_q4_gemv");
  static const auto w8a8_gemm = op<Gemv>("sgl_lite::w8a8_gemm");
  // Each weight's kernel by its packing: AVX512-BF16's weights are in pairs along K ([N/16, K/2, 16, 2]),
  // AVX2's are not ([N/16, K, 16]), AVX2's 4-bit blocks are uint8 ([N/16, K/32, 320]) and w8a8's int8.
  const auto gemv = [&](const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
    if (weight.scalar_type() == at::kByte) return avx2_q4_gemv.call(x, weight, bias);
    if (weight.scalar_type() == at::kChar) return w8a8_gemm.call(x, weight, bias);
    return (weight.dim() == 4 ? bf16_gemv : avx2_gemv).call(x, weight, bias);
  };
  static const auto norm = op<Norm>("sgl_lite::rms_norm");
  static const auto add_norm = op<AddNorm>("sgl_lite::add_rms_norm");
  static const auto attention = op<Attention>("sgl_lite::paged_decode_attention");
  TORCH_CHECK(hidden.dim() == 2 && k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads, "decode_layer: hidden must be [n, hidden], k_cache [slots, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.scalar_type() == hidden.scalar_type() && v_cache.scalar_type() == hidden.scalar_type(),
              "decode_layer: the KV cache must have the model's dtype");
  const int64_t n = hidden.size(0), dim = k_cache.size(2), half = dim / 2;
  const int64_t q_size = num_heads * dim, kv_size = num_kv_heads * dim;

  at::Tensor normed, stream;
  if (residual.has_value() && residual->defined()) {
    std::tie(normed, stream) = add_norm.call(hidden.contiguous(), residual->contiguous(), input_norm, eps);
  } else {
    normed = norm.call(hidden.contiguous(), input_norm, eps);
    stream = hidden;
  }
  const at::Tensor qkv = gemv(normed, qkv_weight, qkv_bias);
  const at::Tensor qk = qkv.slice(1, 0, q_size + kv_size).view({n, num_heads + num_kv_heads, dim});
  const at::Tensor x1 = qk.slice(-1, 0, half), x2 = qk.slice(-1, half);
  const at::Tensor rotated = at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
  const at::Tensor q = rotated.slice(1, 0, num_heads), k = rotated.slice(1, num_heads);
  const at::Tensor v = qkv.slice(1, q_size + kv_size).view({n, num_kv_heads, dim});
  k_cache.index_copy_(0, out_cache_loc, k);
  v_cache.index_copy_(0, out_cache_loc, v);
  const at::Tensor attended = attention.call(q.contiguous(), k_cache, v_cache, kv_indptr, kv_indices, scale);
  const at::Tensor projected = gemv(attended.reshape({n, q_size}), o_weight, o_bias);
  std::tie(normed, stream) = add_norm.call(projected, stream.contiguous(), post_norm, eps);
  const at::Tensor gate_up = gemv(normed, gate_up_weight, c10::nullopt);
  const int64_t inter = gate_up.size(1) / 2;
  const at::Tensor act = at::silu(gate_up.slice(1, 0, inter)) * gate_up.slice(1, inter);
  return {gemv(act.contiguous(), down_weight, c10::nullopt), stream};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def(
      "decode_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_weight, "
      "Tensor? qkv_bias, Tensor o_weight, Tensor? o_bias, Tensor gate_up_weight, Tensor down_weight, Tensor cos, Tensor sin, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_cache_loc, Tensor kv_indptr, Tensor kv_indices, int num_heads, "
      "int num_kv_heads, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("decode_layer", &decode_layer); }
