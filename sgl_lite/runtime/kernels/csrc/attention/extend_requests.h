// The extend attention ops' inputs (extend_attention.cpp, amx_extend_attention.cpp), checked before any
// kernel reads them: FlashInfer's page-size-1 metadata, one row of `requests` per extend request.
#pragma once

#include <ATen/core/Tensor.h>

#include <climits>
#include <cstdint>
#include <vector>

namespace sgl_lite {

// An extend request: its q rows [q_start, q_start + num_new) and its slots kv_indices[kv_begin : kv_begin +
// kv_len] (the cached prefix, then the new tokens).
struct ExtendRequest {
  int64_t q_start, num_new, kv_begin, kv_len;
};

// `requests` int64 [E, 4] as ExtendRequests, after checking shapes, dtypes, layouts and every index (a slot
// outside the pool would read foreign memory); `op` names the op in the errors.
inline std::vector<ExtendRequest> checked_extend_requests(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const at::Tensor& requests,
                                                          const at::Tensor& kv_indices, const at::Tensor& out,
                                                          int64_t max_head_dim, int64_t max_group) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && out.sizes() == q.sizes(),
              op, ": q and out must be [N, Hq, D], k_cache and v_cache [slots, Hkv, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              op, ": q, out, k_cache and v_cache must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), op, ": dtypes differ");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && D <= max_head_dim && Hkv > 0 && Hq % Hkv == 0 && Hq / Hkv <= max_group,
              op, ": head_dim must match the cache, and Hq be a multiple of Hkv (at most ", max_group, " per KV head)");
  TORCH_CHECK(requests.scalar_type() == at::kLong && requests.dim() == 2 && requests.size(1) == 4 && requests.is_contiguous(),
              op, ": requests must be int64 [E, 4]");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indices.is_contiguous(), op, ": kv_indices must be contiguous int64");
  const int64_t* rq = requests.data_ptr<int64_t>();
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(0);
  std::vector<ExtendRequest> reqs;
  for (int64_t e = 0; e < requests.size(0); ++e) {
    const ExtendRequest r{rq[4 * e], rq[4 * e + 1], rq[4 * e + 2], rq[4 * e + 3]};
    // each sum compared as a difference: hostile values near INT64_MAX must not wrap around the check
    TORCH_CHECK(r.num_new >= 1 && r.q_start >= 0 && r.q_start <= N && r.num_new <= N - r.q_start && r.kv_len >= r.num_new &&
                    r.kv_begin >= 0 && r.kv_begin <= kv_indices.numel() && r.kv_len <= kv_indices.numel() - r.kv_begin &&
                    r.kv_len <= INT32_MAX,
                op, ": request ", e, " has q rows or KV slots out of range");
    for (int64_t i = r.kv_begin; i < r.kv_begin + r.kv_len; ++i) {
      TORCH_CHECK(indices[i] >= 0 && indices[i] < slots, op, ": kv_indices holds a slot outside [0, ", slots, ")");
    }
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace sgl_lite
