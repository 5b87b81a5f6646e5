"""Quantization on CPU (`--quantization`): weight-only int8 per row and int4 in groups of 32 (weight_only.py,
activations stay in the model dtype, for decode steps with few rows), SGLang's `w8a8_int8` (w8a8.py:
int8 weights and per-token int8 activations, integer products, every call), and `w4a8_int4` (w4a8.py): int4
weights by per-token int8 activations for calls of few rows, and the same values rounded to int8 with
w8a8_int8's kernels for calls of many (prefill, large decode batches), where weight-only int4 keeps dense
copies for them.

The names are SGLang's pattern (weight bits, activation bits, integer type). They are repeated in
server_args (which must not import torch); a test keeps the two lists equal.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("w8a16_int8", "w4a16_int4", "w8a8_int8", "w4a8_int4")
KEEPS_NO_DENSE_WEIGHTS = ("w8a8_int8", "w4a8_int4")  # their quantized forms take every call
INT4_METHODS = ("w4a16_int4", "w4a8_int4")  # 4-bit values in groups of 32 (a GGUF's own Q4 blocks where it has them)
