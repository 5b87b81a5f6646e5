// y = x @ W.T (+ bias) for bf16 activations and weights, on AVX512-BF16: every row count on CPUs where
// float32 FMAs outrun VDPBF16PS, up to GEMV_MAX_ROWS rows (decode) elsewhere.
//
// A decode step with 1-16 rows is bound by reading the weights once; oneDNN's small-M bf16 matmuls read
// them well below the machine's read bandwidth. This kernel streams each weight byte once, in
// the order it lies in memory. W is packed for VDPBF16PS: a 64-byte vector holds 16 output columns x one
// pair of the reduction axis ([16][2] bf16), and the vectors go in groups of three 16-column blocks, pair
// by pair: group g (columns 48g .. 48g + 47) is [K/2][3][16][2], a last group of one or two blocks
// [K/2][nb][16][2] (the tensor's shape, [N/16, K/2, 16, 2], gives the sizes; the order is the groups', kernels/column_groups.py).
// A tile of output columns is one group, one sequential run of vectors, and each vector meets every row
// of x (a broadcast pair) in registers. Why groups: the three blocks of a tile stored one after another
// were three streams 18-48 KB apart, and at 8 rows (the products then take most of a core's time) their
// reads fell behind those of the same tiles as one stream each (docs/performance.md, "Matmul tiles read
// as one stream").
//
// Two arithmetics, the same bits. VDPBF16PS computes, per lane, acc += x[2p+1] * w[2p+1], then
// acc += x[2p] * w[2p], each a float32 fused multiply-add of exact bf16 products with subnormals read as
// zero and flushed to zero. `fma` does exactly that with two VFMADD231PS on the pair widened in registers
// (a bf16 is the top half of a float32: the odd half is the lane masked, the even half the lane shifted),
// under MXCSR's DAZ and FTZ. Which is faster depends on the CPU: some run VDPBF16PS at half the rate of
// float32 FMAs, others the other way round (docs/performance.md, "On CPUs whose float32 FMAs outrun
// VDPBF16PS"); `bf16_gemv_arithmetic` probes both once per process (probe_arithmetic) and can be overridden.
// The widening stays in registers at every row count: two integer ops per 64-byte vector, shared by the
// tile's rows (widening a tile to float32 once in memory and reusing it was slower at 17-512 rows).
//
// A row's result does not depend on the other rows or on the thread count: the kernel is batch invariant.
// Threads take runs of groups from a shared counter; rows go in register tiles of up to 8 (three blocks x
// 8 rows of accumulators), so more rows re-read a group from cache, not from memory. Calls of one row take
// three groups a tile and calls of two rows two (groups_per_tile): with little arithmetic per byte, one
// stream a core read slower than the three of the layout before, and several read as fast or faster
// (docs/performance.md, "Matmul tiles read as one stream").

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "bf16_arithmetic.h"
#include "row_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define SGL_LITE_HAS_AVX512_BF16 1
#else
#define SGL_LITE_HAS_AVX512_BF16 0
#endif

namespace {

constexpr int64_t kCols = 16;  // output columns per packed vector
constexpr int64_t kGroup = 3;  // column blocks per group, interleaved pair by pair (the packing)
// Rows of x a register tile holds: a group's 3 blocks x 8 rows of accumulators and the operands fit 32
// registers. (Three blocks a tile, not two: each broadcast pair of x serves three products, which made
// 8-row matmuls faster; docs/journal.md, "Matmul tiles of three column blocks".)
constexpr int64_t kMaxTileRows = 8;
constexpr int64_t kTilesPerRun = 8;  // most tiles a thread takes at once from the shared counter
// Weights are prefetched this many bytes per block of the group ahead of the loads (2 KB of each block's
// run: 32 pairs ahead): a group's run is short (55-147 KB at 135M's shapes), too short for the hardware
// prefetcher to reach full speed on its own (2 KB a block beat 1 and 4 KB, and as one stream 6 KB a group
// beat 4, 5, 7, 8, 12 and 16). Into L2 (_MM_HINT_T1), leaving the last step to the hardware's L1
// prefetcher: a software prefetch into L1 holds an L1 miss buffer for a whole memory latency, which slowed
// the matmuls at every row count (docs/journal.md, "Decode kernels prefetch into L2").
constexpr int64_t kPrefetchBytes = 2048;

enum class Arithmetic : int { kAuto = 0, kDpbf16 = 1, kFma = 2 };
std::atomic<int> g_arithmetic{static_cast<int>(Arithmetic::kAuto)};

bool has_avx512_bf16() { return SGL_LITE_HAS_AVX512_BF16; }

void check_packed(const at::Tensor& packed, int64_t k) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 && packed.size(1) * 2 == k,
              "bf16_gemv: packed weight must be sized [N/16, K/2, 16, 2] (GemvLinear.pack) for K = ", k);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "bf16_gemv: packed weight must be contiguous bf16");
}

#if SGL_LITE_HAS_AVX512_BF16

// MXCSR's flush-to-zero and denormals-are-zero for the life of a scope (one thread's share of a call):
// VDPBF16PS's subnormal rule, so that the FMA arithmetic gives its bits.
class FlushSubnormals {
 public:
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  unsigned saved_;
};

inline void store(__m512 y, const float* bias, uint16_t* out) {
  if (bias != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(bias));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(y));
}

// VDPBF16PS: rows [0, R) of x against G consecutive groups of NB blocks each (NB < 3 only for a last
// group), writing out[r][0 : 16 * NB * G]. x rows have stride `ldx`, out rows `ldo`; pair p of block b of
// group i is the vector at w + ((i * pairs + p) * NB + b) * 16 x 2.
template <int R, int NB, int G>
inline void tile_dpbf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, const float* bias,
                        uint16_t* out, int64_t ldo) {
  constexpr int B = NB * G;
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[B];
    for (int g = 0; g < G; ++g) {
      const uint16_t* line = w + (g * pairs + p) * NB * 2 * kCols;
      for (int b = 0; b < NB; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(line + b * 2 * kCols) + NB * kPrefetchBytes, _MM_HINT_T1);
        wv[g * NB + b] = (__m512bh)_mm512_loadu_si512(line + b * 2 * kCols);
      }
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) store(acc[r][b], bias == nullptr ? nullptr : bias + b * kCols, out + r * ldo + b * kCols);
}

// The odd and even halves of one packed vector (16 columns x a pair along K) as float32 vectors.
inline void widen_pair(const uint16_t* line, __m512& odd, __m512& even) {
  const __m512i v = _mm512_loadu_si512(line);
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

template <int NB>
inline void load_pair(const uint16_t* line, __m512& odd, __m512& even) {
  _mm_prefetch(reinterpret_cast<const char*>(line) + NB * kPrefetchBytes, _MM_HINT_T1);
  widen_pair(line, odd, even);
}

// FMA: the same tile (one group) with x in float32 (`xf`, widened once per call) and two FMAs per pair,
// odd first. The loops over R are fully unrolled: else GCC may keep the accumulators in memory.
template <int R, int NB>
inline void tile_fma(const float* xf, int64_t ldx, const uint16_t* w, int64_t pairs, const float* bias,
                     uint16_t* out, int64_t ldo) {
  __m512 acc[R][NB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512 odd[NB], even[NB];
    for (int b = 0; b < NB; ++b) load_pair<NB>(w + (p * NB + b) * 2 * kCols, odd[b], even[b]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xo = _mm512_set1_ps(xf[r * ldx + 2 * p + 1]);
      const __m512 xe = _mm512_set1_ps(xf[r * ldx + 2 * p]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(xe, even[b], _mm512_fmadd_ps(xo, odd[b], acc[r][b]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) store(acc[r][b], bias == nullptr ? nullptr : bias + b * kCols, out + r * ldo + b * kCols);
}

// One call's operands: x as bf16 (dpbf16) or float32 (fma), W packed, the output.
struct Operands {
  const uint16_t* x;
  const float* xf;
  int64_t m, k;
  const uint16_t* w;
  int64_t n;
  const float* bias;
  uint16_t* out;
};

// Output columns [16 * b0, 16 * (b0 + nb)) for every row of x: `groups` groups from block b0 (a multiple
// of kGroup), nb blocks in all (fewer than 3 x groups only in a last group).
void column_tile(const Operands& o, bool fma, int64_t b0, int64_t groups, int64_t nb) {
  const int64_t pairs = o.k / 2;
  const float* bias = o.bias == nullptr ? nullptr : o.bias + b0 * kCols;
  const uint16_t* w = o.w + b0 * pairs * 2 * kCols;  // the groups before are whole: 3 blocks each
  for (int64_t r0 = 0; r0 < o.m; r0 += kMaxTileRows) {
    uint16_t* out = o.out + r0 * o.n + b0 * kCols;
    sgl_lite_tiles::with_rows<kMaxTileRows>(o.m - r0, [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      // the tile's groups one at a time: tile(blocks, weights, bias, out) for each
      const auto each_group = [&](auto tile) {
        for (int64_t g = 0; g < groups; ++g) {
          tile(std::min<int64_t>(kGroup, nb - g * kGroup), w + g * kGroup * pairs * 2 * kCols,
               bias == nullptr ? nullptr : bias + g * kGroup * kCols, out + g * kGroup * kCols);
        }
      };
      if (fma) {
        const float* xf = o.xf + r0 * o.k;
        return each_group([&](int64_t blocks, const uint16_t* wg, const float* bg, uint16_t* og) {
          (blocks == 3 ? tile_fma<R, 3> : blocks == 2 ? tile_fma<R, 2> : tile_fma<R, 1>)(xf, o.k, wg, pairs, bg, og, o.n);
        });
      }
      const uint16_t* x = o.x + r0 * o.k;
      if constexpr (R == 1) {
        if (groups == 3 && nb == 3 * kGroup) return tile_dpbf16<R, 3, 3>(x, o.k, w, pairs, bias, out, o.n);
      }
      if constexpr (R <= 2) {
        if (groups == 2 && nb == 2 * kGroup) return tile_dpbf16<R, 3, 2>(x, o.k, w, pairs, bias, out, o.n);
      }
      each_group([&](int64_t blocks, const uint16_t* wg, const float* bg, uint16_t* og) {
        (blocks == 3 ? tile_dpbf16<R, 3, 1> : blocks == 2 ? tile_dpbf16<R, 2, 1> : tile_dpbf16<R, 1, 1>)(x, o.k, wg, pairs, bg, og, o.n);
      });
    });
  }
}

// Groups a tile takes (column_tile's cases): several streams a core where the arithmetic is light.
int64_t groups_per_tile(int64_t rows, bool fma) { return fma || rows > 2 ? 1 : rows == 1 ? 3 : 2; }

void gemv(const Operands& o, bool fma) {
  const int64_t blocks = o.n / kCols, groups = (blocks + kGroup - 1) / kGroup;  // the last may hold fewer
  const int64_t per_tile = groups_per_tile(o.m, fma), tiles = (groups + per_tile - 1) / per_tile;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  // Threads take runs of tiles from a shared counter rather than fixed shares: with few cores a thread
  // that loses its core for a moment (the HTTP front waking up, a neighbour) would otherwise leave the
  // other one waiting at the end of every matmul.
  const int64_t run = std::max<int64_t>(1, std::min<int64_t>(kTilesPerRun, tiles / (threads * 4)));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    FlushSubnormals flush;  // per thread: MXCSR is each thread's own
    for (int64_t begin = next.fetch_add(run, std::memory_order_relaxed); begin < tiles;
         begin = next.fetch_add(run, std::memory_order_relaxed)) {
      for (int64_t t = begin; t < std::min(tiles, begin + run); ++t) {
        const int64_t b0 = t * per_tile * kGroup;
        column_tile(o, fma, b0, std::min(per_tile, groups - t * per_tile), std::min(per_tile * kGroup, blocks - b0));
      }
    }
  });
}

// Seconds for `iters` rounds of 12 independent chains of `step` (throughput, not latency, bound).
template <typename Step>
double time_chains(int64_t iters, Step step) {
  // distinct starts: identical chains would be merged into one by the compiler (a latency, not a rate)
  __m512 a0 = _mm512_set1_ps(0.f), a1 = _mm512_set1_ps(1.f), a2 = _mm512_set1_ps(2.f), a3 = _mm512_set1_ps(3.f),
         a4 = _mm512_set1_ps(4.f), a5 = _mm512_set1_ps(5.f), a6 = _mm512_set1_ps(6.f), a7 = _mm512_set1_ps(7.f),
         a8 = _mm512_set1_ps(8.f), a9 = _mm512_set1_ps(9.f), a10 = _mm512_set1_ps(10.f), a11 = _mm512_set1_ps(11.f);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    a0 = step(a0), a1 = step(a1), a2 = step(a2), a3 = step(a3), a4 = step(a4), a5 = step(a5);
    a6 = step(a6), a7 = step(a7), a8 = step(a8), a9 = step(a9), a10 = step(a10), a11 = step(a11);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                   _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
                                                 _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
  volatile float sink = _mm512_reduce_add_ps(sum);  // keeps the chains alive
  (void)sink;
  return seconds;
}

// Which arithmetic multiplies a pair faster on this core: one VDPBF16PS or two FMAs (the widening's two
// integer ops are left out: with several rows they are shared by every row). Best of three short runs of
// each, so a moment of preemption does not decide; FMAs must win by 1/4 (where they are the faster they win
// by far more: docs/performance.md, "On CPUs whose float32 FMAs outrun VDPBF16PS"), since a wrong `fma`
// also moves prefill off oneDNN.
Arithmetic probe_arithmetic() {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __m512 x = _mm512_set1_ps(1e-3f);
  double dpbf16 = 1e9, fma = 1e9;
  for (int round = 0; round < 3; ++round) {
    dpbf16 = std::min(dpbf16, time_chains(4000, [&](__m512 a) { return _mm512_dpbf16_ps(a, ones, ones); }));
    fma = std::min(fma, time_chains(4000, [&](__m512 a) { return _mm512_fmadd_ps(x, x, _mm512_fmadd_ps(x, x, a)); }));
  }
  return fma < 0.75 * dpbf16 ? Arithmetic::kFma : Arithmetic::kDpbf16;
}

#endif

Arithmetic arithmetic() {
  int value = g_arithmetic.load(std::memory_order_relaxed);
#if SGL_LITE_HAS_AVX512_BF16
  if (value == static_cast<int>(Arithmetic::kAuto)) {
    value = static_cast<int>(probe_arithmetic());
    g_arithmetic.store(value, std::memory_order_relaxed);
  }
#endif
  return static_cast<Arithmetic>(value);
}

std::string bf16_gemv_arithmetic() {
  if (!has_avx512_bf16()) return "none";
  return arithmetic() == Arithmetic::kFma ? "fma" : "dpbf16";
}

// "dpbf16" or "fma" forces an arithmetic (tests, benchmarks); "auto" probes again on the next call.
void set_bf16_gemv_arithmetic(const std::string& name) {
  TORCH_CHECK(name == "auto" || name == "dpbf16" || name == "fma", "bf16_gemv: arithmetic must be auto, dpbf16 or fma; got ", name);
  const Arithmetic value = name == "fma" ? Arithmetic::kFma : name == "dpbf16" ? Arithmetic::kDpbf16 : Arithmetic::kAuto;
  g_arithmetic.store(static_cast<int>(value), std::memory_order_relaxed);
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_avx512_bf16(), "bf16_gemv: this build has no AVX512-BF16 (check sgl_lite::bf16_gemv_supported first)");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "bf16_gemv runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "bf16_gemv: x must be contiguous bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1);
  check_packed(packed, k);
  const int64_t n = packed.size(0) * kCols;
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bf16_gemv: bias must be [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m, n}, x.options());
#if SGL_LITE_HAS_AVX512_BF16
  if (m > 0) {
    const bool fma = arithmetic() == Arithmetic::kFma;
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    // x widened once (exactly), not once per tile, and not through ATen's dispatcher: a decode step makes
    // ~120 of these calls, where x.to(float) cost more than the widening itself.
    std::unique_ptr<float[]> xf(fma ? new float[m * k] : nullptr);
    if (fma) {
      at::parallel_for(0, m * k, 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const uint32_t bits = uint32_t(xb[i]) << 16;
          std::memcpy(&xf[i], &bits, sizeof(float));
        }
      });
    }
    const Operands o{xb, xf.get(), m, k,
                     reinterpret_cast<const uint16_t*>(packed.data_ptr()), n,
                     bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(out.data_ptr())};
    gemv(o, fma);
  }
#endif
  return out;
}

}  // namespace

bool sgl_lite::dpbf16_preferred() { return has_avx512_bf16() && arithmetic() == Arithmetic::kDpbf16; }

TORCH_LIBRARY_FRAGMENT(sgl_lite, m) {
  m.def("bf16_gemv_supported() -> bool", &has_avx512_bf16);
  m.def("bf16_gemv_arithmetic() -> str", &bf16_gemv_arithmetic);
  m.def("set_bf16_gemv_arithmetic(str name) -> ()", &set_bf16_gemv_arithmetic);
  m.def("bf16_gemv(Tensor x, Tensor packed_weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(sgl_lite, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
