// Which bf16 arithmetic this core runs faster: VDPBF16PS (an AMD EPYC) or two float32 FMAs on the pair
// widened (an Intel Xeon family 6 model 207, where VDPBF16PS issues at half their rate). bf16_gemv.cpp
// probes it once per process (`bf16_gemv_arithmetic`, overridable with `set_bf16_gemv_arithmetic`); the
// other bf16 kernels follow its answer.
#pragma once

namespace sgl_lite {

// True where VDPBF16PS is built and the probe (or an override) chose it; false without AVX512-BF16.
bool dpbf16_preferred();

}  // namespace sgl_lite
