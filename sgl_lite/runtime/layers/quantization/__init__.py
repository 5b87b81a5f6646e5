"""Quantization on CPU (`--quantization`): weight-only int8 per row and int4 in groups of 32 (weight_only.py,
activations stay in the model dtype, for decode steps with few rows), and SGLang's `w8a8_int8` (w8a8.py:
int8 weights and per-token int8 activations, integer products, every call).

The names are SGLang's pattern (weight bits, activation bits, integer type). They are repeated in
server_args (which must not import torch); a test keeps the two lists equal.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("w8a16_int8", "w4a16_int4", "w8a8_int8")
