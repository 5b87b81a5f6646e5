// Which bf16 arithmetic this core runs faster: VDPBF16PS (an AMD EPYC) or two float32 FMAs on the pair
// widened (an Intel Xeon family 6 model 207, where VDPBF16PS issues at half their rate). bf16_gemv.cpp
// probes it once per process (`bf16_gemv_arithmetic`, overridable with `set_bf16_gemv_arithmetic`); the
// other bf16 kernels follow its answer.
#pragma once

#include <cstdint>

namespace sgl_lite {

// True where VDPBF16PS is built and the probe (or an override) chose it; false without AVX512-BF16.
bool dpbf16_preferred();

// Rows paired for VDPBF16PS with VPUNPCKL/HWD (which work within 128-bit lanes) hold, per 32 dims, the
// low unpack's dims 0-3, 8-11, 16-19, 24-27 then the high one's 4-7, 12-15, 20-23, 28-31: the dim that
// position m of such a row holds.
inline int64_t interleaved_dim(int64_t m) {
  const int64_t lane = m % 16, high = (m % 32) / 16;
  return m / 32 * 32 + lane / 4 * 8 + high * 4 + lane % 4;
}

}  // namespace sgl_lite
