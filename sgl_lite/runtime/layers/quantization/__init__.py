"""Weight-only quantization for CPU decoding (`--quantization`): int8 per row, int4 in groups of 32.

The method names follow SGLang's `w8a8_int8` pattern (weight bits, activation bits, integer type);
activations stay in the model dtype. The names are repeated in server_args (which must not import
torch); a test keeps the two lists equal.
"""

from __future__ import annotations

QUANTIZATION_METHODS = ("w8a16_int8", "w4a16_int4")
