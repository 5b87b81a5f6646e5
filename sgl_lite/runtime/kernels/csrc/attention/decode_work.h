// The paged decode attention kernel's work items (paged_decode_attention.cpp): which rows, KV heads,
// chunks and queries each item attends, planned once per call before any thread starts.
//
// Not a standalone header: paged_decode_attention.cpp includes it inside its anonymous namespace, after
// kChunk and kMaxVectors.
#pragma once

// A tile against chunk `chunk` of a context, for the KV heads [head_begin, head_end): the queries
// [query_begin, min(query_end, the row's)) of each of the rows row_list[rows_at .. rows_at + num_rows).
// Several rows only where rows hold the same slots over the whole chunk (a shared prompt's), every query
// of each (query_end kAllQueries).
struct Item {
  int64_t rows_at, num_rows, head_begin, head_end, chunk, query_begin, query_end;
};

constexpr int64_t kAllQueries = std::numeric_limits<int64_t>::max();

// Rows sharing a chunk: rows whose chunk `chunk` holds the same slots (a prompt prefix the radix cache
// shares), seen whole by each of their queries, two or more, in row order.
struct SharedChunk {
  int64_t chunk;
  std::vector<int64_t> rows;
};

// Every chunk that two or more rows share, of rows whose queries fit one item (G query vectors each).
// Candidates are sorted by (chunk, first slot, last slot), so that only rows whose chunks agree there are
// compared in full: O(chunks log chunks) for the batches the runtime makes, where two chunks agreeing at
// both ends are one radix-tree path (the same slots throughout). Chunks that agree at the ends and differ
// between (only a hand-made batch) cost a comparison with each group of their run.
std::vector<SharedChunk> shared_chunks(int64_t R, int64_t G, const int32_t* qo, const int32_t* kv, const int64_t* indices) {
  std::vector<std::array<int64_t, 4>> candidates;  // (chunk, first slot, last slot, row)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = qo[r + 1] - qo[r];
    if (n * G > kMaxVectors) continue;
    // a verification row's first query sees n - 1 slots fewer than its last
    for (int64_t c = 0; (c + 1) * kChunk <= kv[r + 1] - kv[r] - (n - 1); ++c) {
      const int64_t* slots = indices + kv[r] + c * kChunk;
      candidates.push_back({c, slots[0], slots[kChunk - 1], r});
    }
  }
  std::sort(candidates.begin(), candidates.end());
  std::vector<SharedChunk> shared;
  for (size_t i = 0; i < candidates.size();) {
    size_t j = i + 1;
    while (j < candidates.size() && std::equal(candidates[j].begin(), candidates[j].begin() + 3, candidates[i].begin())) ++j;
    // [i, j): same chunk and ends; each row joins the first group whose slots it matches in full
    const int64_t c = candidates[i][0];
    const size_t first_group = shared.size();
    for (size_t k = i; k < j; ++k) {
      const int64_t r = candidates[k][3];
      const int64_t* slots = indices + kv[r] + c * kChunk;
      size_t g = first_group;
      while (g < shared.size() && std::memcmp(slots, indices + kv[shared[g].rows[0]] + c * kChunk, kChunk * sizeof(int64_t)) != 0) ++g;
      if (g == shared.size()) shared.push_back({c, {}});
      shared[g].rows.push_back(r);
    }
    i = j;
  }
  shared.erase(std::remove_if(shared.begin(), shared.end(), [](const SharedChunk& s) { return s.rows.size() < 2; }), shared.end());
  return shared;
}

// What the threads share: the items, the rows they name (row_list), where each (row, kv head)'s partial
// softmax states start (first_part: one per chunk and query), and how many items of each (row, kv head)
// are still to finish (the last one merges).
struct WorkPlan {
  std::vector<Item> items;
  std::vector<int64_t> row_list, first_part;
  std::unique_ptr<std::atomic<int64_t>[]> remaining;
};

// The items of R rows (row r: queries qo[r] .. qo[r + 1] - 1 over the slots indices[kv[r] : kv[r + 1]])
// for Hkv KV heads of G query heads each, shared chunks' items first (the larger ones), for `threads` threads.
inline WorkPlan plan_work(int64_t R, int64_t Hkv, int64_t G, const int32_t* qo, const int32_t* kv, const int64_t* indices,
                          int64_t threads) {
  // Where there are enough chunks to keep every thread busy, an item takes all KV heads of its chunk and
  // reads each slot's row whole (every head's K, then V, one contiguous run): reading one head's 128 bytes
  // of each 384-byte row read memory at under half the rate of whole rows. Otherwise (one short request,
  // say) items are single heads, as many as there are. Either way each (request, head, chunk) is computed
  // alike, so the bits do not depend on the choice. (The kernel, whose arithmetic overlaps its reads less
  // well than a plain sum does, gains less from it than the reads alone would, but gains at 8-32 rows.)
  // A verification row's queries share the reads of each chunk: up to kMaxVectors query vectors an item.
  // So do rows holding the same slots over a whole chunk (shared_chunks: a prompt the radix cache shares):
  // an item per KV head takes as many of them as fit, so that each block's K rows are transposed once for
  // all their query vectors and its V rows interleaved once. Each query's sums are those of its own item
  // (attend_chunk's contract), so sharing changes no bit.
  WorkPlan plan;
  std::vector<int64_t>& first_part = plan.first_part;
  first_part.assign(R * Hkv + 1, 0);
  std::vector<int64_t> chunk_at(R + 1, 0);  // chunk_at: the rows' chunks before row r
  const auto chunks_of = [&](int64_t r) { return chunk_at[r + 1] - chunk_at[r]; };
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = kv[r + 1] - kv[r], n = qo[r + 1] - qo[r];
    chunk_at[r + 1] = chunk_at[r] + (len + kChunk - 1) / kChunk;
    for (int64_t h = 0; h < Hkv; ++h) first_part[r * Hkv + h + 1] = first_part[r * Hkv + h] + chunks_of(r) * n;
  }
  std::vector<int64_t>& row_list = plan.row_list;
  row_list.resize(R);  // an item's rows: row r's own items read row_list[r] = r, shared chunks' follow
  std::iota(row_list.begin(), row_list.end(), int64_t{0});
  std::vector<Item>& items = plan.items;
  // items per (row, kv head): the last of them to finish merges (no thread runs yet: relaxed counts)
  plan.remaining.reset(new std::atomic<int64_t>[R * Hkv]);
  std::atomic<int64_t>* remaining = plan.remaining.get();
  for (int64_t rh = 0; rh < R * Hkv; ++rh) remaining[rh].store(0, std::memory_order_relaxed);
  const auto count_item = [&](int64_t rh) { remaining[rh].fetch_add(1, std::memory_order_relaxed); };
  std::vector<uint8_t> is_shared;  // per chunk of each row (empty: none shared)
  for (const SharedChunk& sc : R > 1 ? shared_chunks(R, G, qo, kv, indices) : std::vector<SharedChunk>{}) {
    is_shared.resize(chunk_at[R], 0);
    for (const int64_t r : sc.rows) is_shared[chunk_at[r] + sc.chunk] = 1;
    for (size_t b = 0; b < sc.rows.size();) {
      const int64_t at = int64_t(row_list.size());
      for (int64_t vectors = 0; b < sc.rows.size() && vectors + (qo[sc.rows[b] + 1] - qo[sc.rows[b]]) * G <= kMaxVectors; ++b) {
        vectors += (qo[sc.rows[b] + 1] - qo[sc.rows[b]]) * G;
        row_list.push_back(sc.rows[b]);
      }
      const int64_t m = int64_t(row_list.size()) - at;
      for (int64_t h = 0; h < Hkv; ++h) {
        items.push_back({at, m, h, h + 1, sc.chunk, 0, kAllQueries});
        for (int64_t u = 0; u < m; ++u) count_item(row_list[at + u] * Hkv + h);
      }
    }
  }
  const int64_t own_chunks = chunk_at[R] - std::count(is_shared.begin(), is_shared.end(), uint8_t{1});
  const bool whole_rows = Hkv > 1 && own_chunks + int64_t(items.size()) >= 2 * threads;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = kv[r + 1] - kv[r], n = qo[r + 1] - qo[r];
    const int64_t H = whole_rows && Hkv * n * G <= kMaxVectors ? Hkv : 1, T = std::min(n, kMaxVectors / (H * G));
    for (int64_t h = 0; h < Hkv; h += H) {
      for (int64_t c = 0; c < chunks_of(r); ++c) {
        if (!is_shared.empty() && is_shared[chunk_at[r] + c]) continue;
        for (int64_t j = 0; j < n; j += T) {
          const int64_t last = std::min(n, j + T);  // the tile's last query sees len - (n - last) positions
          if (len - (n - last) <= c * kChunk) continue;  // its queries' contexts all end before the chunk
          items.push_back({r, 1, h, h + H, c, j, last});
          for (int64_t k = h; k < h + H; ++k) count_item(r * Hkv + k);
        }
      }
    }
  }
  return plan;
}
