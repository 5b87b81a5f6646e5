"""The model's matmuls: plain F.linear, oneDNN-prepacked bf16, the small-row kernels, or weight-only
int8/int4, chosen per call by row count.

A decode step with few rows reads every weight once and does little else, so it wants the kernel that
streams weights fastest. In bf16 on AVX512-BF16 that is csrc/matmul/bf16_gemv.cpp: over SmolLM2-135M's 30
layers of weights (too many to stay in cache) it beats oneDNN's packed matmuls from 1 to 128 rows on CPUs
where its VDPBF16PS arithmetic wins, and oneDNN takes calls above GEMV_MAX_ROWS. On CPUs whose float32
FMAs outrun VDPBF16PS, the kernel computes the same bits with FMAs over weights widened in registers,
which beats oneDNN's bf16 (VDPBF16PS-bound) matmuls at every row count, so there it takes every call,
prefill too (`bf16_gemv_fma`; docs/performance.md, "On CPUs whose float32 FMAs outrun VDPBF16PS"), unless
the CPU has AMX: oneDNN's matmuls then run on its tile units and outrun the kernel from a few rows up.
There the kernel keeps a decode or verification forward's calls (where its rows are batch invariant, below)
and a forward with prefill rows hands oneDNN every call of more than AMX_PREFILL_GEMV_MAX_ROWS rows, unless
the weights are packed batch invariant (--enable-deterministic-inference: oneDNN's rows on AMX depend on
the row count) (`amx_matmuls`; docs/performance.md, "On CPUs with AMX").
Elsewhere, on AVX2 + FMA, it is csrc/matmul/avx2_gemv.cpp (float32 arithmetic over float32 or bf16 weights): on
an AVX2-only CPU, in float32, it beats MKL's sgemm from 1 row (reading weights at the machine's read
rate) up to 1024 rows, so on such a CPU it takes every call (prefill too; docs/performance.md, "On CPUs
without AVX-512 (AVX2 + FMA)"); on a CPU with AVX512, where MKL's sgemm is wider, only calls up to
GEMV_MAX_ROWS rows.
The kernels' rows are independent of each other, so within the kernel's row limit a token's matmuls
give the same bits in any batch: a request decoded alone, batched, or verified as a speculative draft row.

Weight-only kernels read 2-4x fewer weight bytes, which is what a step with few rows is bound by; with
many rows the matmul is compute bound and the dense (prepacked) kernel wins (at SmolLM2-135M's shapes on
AVX512-BF16: int4/int8 well ahead at 1 row, about even at 8, well behind at 32; docs/performance.md,
"Weight-only quantization (`--quantization`)"). So a QuantizedLinear keeps the dense weight too and
picks per call: the quantized kernel up to
`max_rows` rows (decode at small batch), the dense one above (prefill, large decode batches). On a CPU
without AVX-512, int4 runs on csrc/matmul/avx2_q4_gemv.cpp instead of torch's kernel (which is slower there
than the dense bf16 kernel): well ahead of the bf16 kernel at 1 row, about even from 3 to 32 rows, slower
above (docs/performance.md, "On CPUs without AVX-512 (AVX2 + FMA)", its int4 rows), so it serves every
decode batch up to AVX2_INT4_MAX_ROWS rows, and a request's tokens get the same bits whatever the batch
up to there. `w4a8_int4` keeps no dense weight: its calls of up to W4A8_MAX_ROWS rows run
csrc/matmul/w4a8_gemm.cpp (the int4 values by int8 activations: half the bytes w8a8_int8 streams, where torch's
int4 kernel is bound by its arithmetic; at a 1.7B model's shapes its decode steps of up to 4 rows are at
least as fast as the int8 kernel's, faster when the host's reads are slow, and from 5 rows its products
catch up with its reads and it no longer gains), and calls of more the int4 values
rounded to int8 per output column on w8a8_int8's kernels, whose integer products outrun the bf16 matmuls on
a prefill's many rows (docs/performance.md, "`w4a8_int4`: 4-bit weights by 8-bit activations").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sgl_lite.runtime.kernels import ops
from sgl_lite.runtime.kernels.column_groups import interleave_groups
from sgl_lite.runtime.layers.onednn import amx_matmuls, onednn_bf16_supported
from sgl_lite.runtime.layers.quantization import INT4_METHODS, QUANTIZATION_METHODS
from sgl_lite.runtime.layers.quantization.w4a8 import W4A8Int4, w4a8_kernel_available
from sgl_lite.runtime.layers.quantization.w8a8 import W8A8Int8
from sgl_lite.runtime.layers.quantization.weight_only import (
    Int4Avx2,
    Int4Values,
    Int4WeightOnly,
    Int8WeightOnly,
    QuantizedWeight,
)

# Calls with at most this many rows use the quantized kernel (see the module docstring).
QUANTIZED_MAX_ROWS = 2
W4A8_MAX_ROWS = 4  # csrc/matmul/w4a8_gemm.cpp's calls (the module docstring)
AVX2_INT4_MAX_ROWS = 32
# Calls with at most this many rows use the small-row kernel (see the module docstring and gemv_max_rows).
GEMV_MAX_ROWS = 128
# On a CPU with AMX, a forward with prefill rows runs calls of at most this many rows on the small-row
# kernel (where it and oneDNN are about even) and oneDNN the rest.
AMX_PREFILL_GEMV_MAX_ROWS = 8
GEMV_COLUMNS = 16  # the kernel packs output columns in blocks of this many


def cpu_packed_linear_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN prepacked bf16 linear (what torch.compile's CPU freezing uses): faster matmuls than unpacked bf16."""
    return device.type == "cpu" and dtype == torch.bfloat16 and onednn_bf16_supported()


def gemv_kernel(weight: torch.Tensor) -> str | None:
    """Which small-row kernel serves `weight` [N, K]: "avx512_bf16" (bf16 on a CPU with AVX512-BF16),
    "avx2" (float32, or bf16 elsewhere, on a CPU with AVX2 and FMA), or None; the ops must be built."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[0] % GEMV_COLUMNS:
        return None
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    from sgl_lite.runtime.kernels.loader import runs_here

    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0 and runs_here("bf16_gemv"):
        return "avx512_bf16"
    return "avx2" if runs_here("avx2_gemv") else None


def gemv_supported(weight: torch.Tensor) -> bool:
    """Whether a small-row kernel serves `weight` [N, K] (see gemv_kernel)."""
    return gemv_kernel(weight) is not None


@functools.cache
def avx2_int4_preferred() -> bool:
    """Whether int4 weights run on csrc/matmul/avx2_q4_gemv.cpp: on a CPU whose widest vectors are AVX2 (where
    torch's int4 kernel is the slower one), with the op built."""
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    from sgl_lite.runtime.kernels.loader import runs_here

    return runs_here("avx2_q4_gemv")


def gemv_max_rows(kernel: str) -> int | None:
    """The most rows a call of `kernel` takes (None: any). The AVX2 kernel takes every call on a CPU
    whose widest vectors are AVX2 (MKL's sgemm is no wider there, and torch has no fast bf16 matmul), and
    the AVX512-BF16 kernel where it computes with FMAs (oneDNN's bf16 matmuls are VDPBF16PS-bound there)
    (a forward with prefill rows has its own limit with AMX, GemvLinear.pack), see the module docstring;
    elsewhere the vendor kernels win above GEMV_MAX_ROWS."""
    if kernel == "avx2" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        return None
    if kernel == "avx512_bf16" and bf16_gemv_fma():
        return None
    return GEMV_MAX_ROWS


def prefill_rows_on_onednn(kernel: str | None, batch_invariant: bool) -> bool:
    """Whether a prefill forward hands oneDNN the calls of `kernel` above AMX_PREFILL_GEMV_MAX_ROWS rows:
    the AVX512-BF16 kernel on a CPU with AMX, unless the weights are packed batch invariant."""
    return kernel == "avx512_bf16" and amx_matmuls() and not batch_invariant


@functools.cache
def bf16_gemv_fma() -> bool:
    """Whether the AVX512-BF16 kernel computes with float32 FMAs on this CPU (its probe found them faster
    than VDPBF16PS; the same bits either way, see csrc/matmul/bf16_gemv.cpp). Decided once per process, by the
    first probe, and what calls it takes follows from it; `set_bf16_gemv_arithmetic` afterwards changes
    only the arithmetic."""
    from sgl_lite.runtime.kernels.loader import has_op

    return has_op("bf16_gemv_arithmetic") and ops.bf16_gemv_arithmetic() == "fma"


@dataclass
class GemvLinear:
    """A weight packed for the small-row kernel that serves it, with the form calls of more rows use."""

    # avx512_bf16: sized [N/16, K/2, 16, 2], 16 output columns x one pair along K per 64-byte vector, the
    # vectors of groups of three blocks interleaved pair by pair (bf16_gemv.cpp, column_groups.py);
    # avx2: [N/16, K, 16], 16 output columns of one k in a run (avx2_gemv.cpp)
    gemv_weight: torch.Tensor
    packed_dense: torch.Tensor | None  # oneDNN-packed weight, or None for F.linear on the weight
    max_rows: int | None = GEMV_MAX_ROWS  # None: every call takes the kernel
    prefill_max_rows: int | None = GEMV_MAX_ROWS  # the limit in a forward with prefill rows

    @classmethod
    def pack(cls, weight: torch.Tensor, packed_dense: torch.Tensor | None, batch_invariant: bool = False) -> GemvLinear:
        """`weight` in the kernel's layout; `batch_invariant`: a prefill forward keeps the decode limit."""
        kernel = gemv_kernel(weight)
        if kernel is None:
            raise ValueError(f"no small-row kernel for a {weight.dtype} weight of shape {tuple(weight.shape)} on this CPU")
        n, k = weight.shape
        w = weight.detach()
        if kernel == "avx512_bf16":
            blocks = w.reshape(n // GEMV_COLUMNS, GEMV_COLUMNS, k // 2, 2).permute(0, 2, 1, 3)  # [N/16, K/2, 16, 2]
            gemv = interleave_groups(blocks).reshape(blocks.shape)
        else:
            gemv = w.reshape(n // GEMV_COLUMNS, GEMV_COLUMNS, k).permute(0, 2, 1).contiguous()
        limit = gemv_max_rows(kernel)
        amx_prefill = packed_dense is not None and prefill_rows_on_onednn(kernel, batch_invariant)
        return cls(gemv, packed_dense, limit, AMX_PREFILL_GEMV_MAX_ROWS if amx_prefill else limit)

    def takes(self, rows: int, prefill: bool = False) -> bool:
        """Whether a call of `rows` rows (in a forward with prefill rows: `prefill`) runs the small-row kernel."""
        limit = self.prefill_max_rows if prefill else self.max_rows
        return limit is None or rows <= limit

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prefill: bool = False) -> torch.Tensor:
        if not self.takes(x.shape[0], prefill):
            return linear(x, weight, bias, self.packed_dense)
        if self.gemv_weight.dim() == 4:
            return ops.small_row_matmul("bf16_gemv", x, self.gemv_weight, bias)
        return ops.small_row_matmul("avx2_gemv", x, self.gemv_weight, bias)


@dataclass
class QuantizedLinear:
    """A quantized matmul, with the dense weight kept for calls of many rows (weight-only methods)."""

    quantized: QuantizedWeight | W8A8Int8
    packed_dense: torch.Tensor | GemvLinear | None  # a packed dense form (see `linear`), or None for F.linear
    max_rows: int | None = QUANTIZED_MAX_ROWS  # None: every call takes the quantized kernel

    def takes(self, rows: int) -> bool:
        """Whether a call of `rows` rows runs the quantized kernel."""
        return self.max_rows is None or rows <= self.max_rows

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prefill: bool = False) -> torch.Tensor:
        if not self.takes(x.shape[0]):
            return linear(x, weight, bias, self.packed_dense, prefill)
        return self.quantized.matmul(x, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | GemvLinear | QuantizedLinear | None, prefill: bool = False) -> torch.Tensor:
    """x @ weight.T + bias through `packed` when given: a oneDNN-packed copy of weight, a GemvLinear or a
    QuantizedLinear. `prefill`: the call is part of a forward with prefill rows (GemvLinear.takes)."""
    if isinstance(packed, (GemvLinear, QuantizedLinear)):
        return packed(x, weight, bias, prefill)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def reads_dense_weight(form: torch.Tensor | GemvLinear | QuantizedLinear | None) -> bool:
    """Whether some call through `form` (what `linear` is given as `packed`) reads the plain weight: F.linear
    does, for calls no packed form takes. Where none does, the weight itself is only its shape."""
    if isinstance(form, GemvLinear):
        return form.packed_dense is None and (form.max_rows is not None or form.prefill_max_rows is not None)
    if isinstance(form, QuantizedLinear):
        return form.max_rows is not None and reads_dense_weight(form.packed_dense)
    return form is None


def dense_forms(weight: torch.Tensor, onednn: bool, batch_hint: int = 32,
                batch_invariant: bool = False) -> torch.Tensor | GemvLinear | None:
    """What the model's calls of `weight` run on: the small-row kernel's form where one serves it, around
    oneDNN's packed copy (`onednn`: packing is available) for the calls above its row limit (none where
    the kernel takes every call - with AMX, every call of a decode forward, and of a prefill forward when
    `batch_invariant` - as that copy would only cost memory); else oneDNN's copy, or None (F.linear)."""
    kernel = gemv_kernel(weight)
    wants_dense = onednn and (kernel is None or gemv_max_rows(kernel) is not None
                              or prefill_rows_on_onednn(kernel, batch_invariant))
    dense = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint) if wants_dense else None
    return GemvLinear.pack(weight, dense, batch_invariant) if kernel is not None else dense


def quantize_linear(method: str, weight: torch.Tensor, packed_dense: torch.Tensor | GemvLinear | None,
                    int4_values: Int4Values | None = None) -> QuantizedLinear:
    """`weight` [N, K] quantized by `method` (one of QUANTIZATION_METHODS); int4 takes `int4_values`
    (a GGUF file's own blocks) when given instead of quantizing the dense weight. `packed_dense` serves the
    weight-only methods' calls of many rows."""
    if method == "w8a16_int8":
        return QuantizedLinear(Int8WeightOnly.quantize(weight, weight.dtype), packed_dense)
    if method in INT4_METHODS:
        values = int4_values if int4_values is not None else Int4Values.quantize(weight)
        if method == "w4a8_int4":
            # the int4 values rounded to int8 per output column take the calls of many rows: no dense form to keep
            packed_dense = QuantizedLinear(W8A8Int8(values.dequantize()), None, None)
            if w4a8_kernel_available():
                return QuantizedLinear(W4A8Int4(values), packed_dense, W4A8_MAX_ROWS)
        if avx2_int4_preferred():
            return QuantizedLinear(Int4Avx2(values), packed_dense, AVX2_INT4_MAX_ROWS)
        return QuantizedLinear(Int4WeightOnly(values, weight.dtype), packed_dense)
    if method == "w8a8_int8":  # every call: no dense form to keep
        return QuantizedLinear(W8A8Int8(weight), None, None)
    raise ValueError(f"unknown quantization {method!r}; expected one of {', '.join(QUANTIZATION_METHODS)}")
