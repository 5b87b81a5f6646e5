"""The 4-bit weights of a GGUF file as Int4Values, read from its Q4_0 / Q4_1 blocks without rounding.

A GGUF tensor of shape [N, K] (stored as ne = [K, N]) is N rows of K/32 blocks. Q4_0 block: fp16 d,
16 bytes of nibbles, w = d * (q - 8). Q4_1 block: fp16 d, fp16 m, 16 bytes, w = d * q + m. Byte j of a
block holds element j in its low nibble and element j + 16 in its high nibble. Both are groups of 32
with w = scale * q + min, exactly Int4Values' form.

llama.cpp's converter permutes the rows of a Llama's q and k projections (its RoPE layout); the
inverse permutation is applied here, as transformers' GGUF loader does, so the rows come in the
checkpoint's (HF) order. Tensors in other formats (Q8_0, F32, K-quants) are not returned: callers
quantize those from the dense weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sgl_lite.runtime.layers.quantization.weight_only import INT4_GROUP_SIZE, Int4Values

_GGUF_TO_HF = {  # per-layer GGUF tensor -> HF module name
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PERMUTED_ARCHS = ("llama",)  # the converters that permute q/k rows (Mistral files are "llama" too)


def read_int4_blocks(gguf_file: str | Path) -> dict[str, Int4Values]:
    """HF weight name (e.g. model.layers.0.self_attn.q_proj.weight) -> its 4-bit values, for every
    Q4_0 / Q4_1 tensor of the file."""
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(str(gguf_file))
    arch = _field_str(reader, "general.architecture")
    heads = {"attn_q": _field_int(reader, f"{arch}.attention.head_count"),
             "attn_k": _field_int(reader, f"{arch}.attention.head_count_kv")}
    out: dict[str, Int4Values] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
            continue
        name = _hf_name(tensor.name)
        if name is None:
            continue
        k, n = (int(d) for d in tensor.shape[:2])
        values = _decode(np.asarray(tensor.data).reshape(n, -1), k, with_min=kind == GGMLQuantizationType.Q4_1)
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if arch in _PERMUTED_ARCHS and part in heads and heads[part]:
            order = _unpermute_rows(n, heads[part])
            values = Int4Values(values.q[order], values.scales[order], values.mins[order])
        out[name] = values
    return out


def _decode(rows: np.ndarray, k: int, *, with_min: bool) -> Int4Values:
    n = rows.shape[0]
    block_bytes = 20 if with_min else 18
    blocks = rows.reshape(n, k // INT4_GROUP_SIZE, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if with_min:
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[..., 4:]
    else:
        mins = -8.0 * scales
        nibbles = blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)
    return Int4Values(torch.from_numpy(q.astype(np.uint8)), torch.from_numpy(scales), torch.from_numpy(mins))


def _unpermute_rows(n: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: HF row i is GGUF row order[i]."""
    half = n // num_heads // 2
    return torch.arange(n).reshape(num_heads, half, 2).transpose(1, 2).reshape(n)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_TO_HF and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.weight"
    return None


def _field_str(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"GGUF file has no {key}")
    return bytes(field.parts[field.data[0]]).decode()


def _field_int(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.parts[field.data[0]][0])
