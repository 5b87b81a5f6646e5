// The disk tier's loads: a block's K and V rows into the pool's slots (mem_cache/hicache/kv_transfer.py).
//
// A block is [layers, 2 (K, V), tokens, heads, dim] as the disk stores it; the pool holds one K and one V
// tensor per layer, [slots, heads, dim], of the same element size (an fp8 pool's block is its bytes). Tokens
// [skip, skip + len(slots)) of the block go to `slots` of every layer, a row (heads x dim) at a time, copied
// as bytes on the calling thread. Why: the tier's read threads copy beside the scheduler's forward, which owns
// torch's thread team, and one call per block takes the GIL once, where a copy per layer and side would wait
// for it dozens of times a block while the scheduler runs Python.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// The fewest slots of the caches, after checking that they hold the block's rows.
int64_t checked_capacity(const char* name, const std::vector<at::Tensor>& caches, int64_t layers, int64_t row_bytes, int64_t element_size) {
  TORCH_CHECK(int64_t(caches.size()) == layers, "write_kv_rows: ", caches.size(), " ", name, " caches for a block of ", layers, " layers");
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.device().is_cpu() && cache.is_contiguous() && cache.dim() == 3, "write_kv_rows: ", name,
                " caches must be contiguous CPU tensors [slots, heads, dim]");
    TORCH_CHECK(int64_t(cache.element_size()) == element_size && cache.size(1) * cache.size(2) * element_size == row_bytes,
                "write_kv_rows: a ", name, " cache's rows (", cache.sizes(), ", ", cache.element_size(),
                "-byte elements) differ from the block's (", row_bytes, " bytes)");
  }
  int64_t capacity = caches.empty() ? 0 : caches[0].size(0);
  for (const at::Tensor& cache : caches) capacity = std::min(capacity, cache.size(0));
  return capacity;
}

void write_kv_rows(const at::Tensor& block, const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, int64_t skip,
                   const at::Tensor& slots) {
  TORCH_CHECK(block.device().is_cpu() && block.is_contiguous() && block.dim() == 5 && block.size(1) == 2,
              "write_kv_rows: block must be a contiguous CPU tensor [layers, 2, tokens, heads, dim]; got ", block.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.device().is_cpu() && slots.is_contiguous() && slots.dim() == 1,
              "write_kv_rows: slots must be a contiguous CPU int64 vector");
  const int64_t layers = block.size(0), tokens = block.size(2), n = slots.numel();
  TORCH_CHECK(skip >= 0 && skip + n <= tokens, "write_kv_rows: tokens [", skip, ", ", skip + n, ") outside the block's ", tokens);
  const int64_t element_size = block.element_size(), row_bytes = block.size(3) * block.size(4) * element_size;
  const int64_t capacity = std::min(checked_capacity("K", k_caches, layers, row_bytes, element_size),
                                     checked_capacity("V", v_caches, layers, row_bytes, element_size));
  const int64_t* rows = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < capacity, "write_kv_rows: slot ", rows[i], " outside the pool's ", capacity);
  const auto* src = static_cast<const char*>(block.data_ptr());
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int64_t side = 0; side < 2; ++side) {
      auto* dst = static_cast<char*>((side == 0 ? k_caches : v_caches)[layer].data_ptr());
      const char* from = src + ((layer * 2 + side) * tokens + skip) * row_bytes;
      for (int64_t i = 0; i < n; ++i) std::memcpy(dst + rows[i] * row_bytes, from + i * row_bytes, row_bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("write_kv_rows(Tensor block, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int skip, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("write_kv_rows", &write_kv_rows); }
