"""How many tokens the KV pool holds: what the device has left once the weights are loaded, less a prefill
chunk's activations, times `--mem-fraction-static` (SGLang's flag; `--max-total-tokens` overrides it all).

On CUDA the fraction is of the GPU's free memory (0.85 by default, as SGLang gives weights and KV together
most of the card). On CPU it is of MemAvailable after the weights (0.5 by default): the pool is virtual
memory until tokens are written, so a fraction of what is left costs nothing until the radix cache fills
it, while the other half stays for what shares the machine with the runtime: the HTTP front and its
tokenizer, grammar compiles, the page cache of the model files, and other processes. A pool sized so holds
many full contexts of the model being served (an agent's session returns to its cached prefix instead of
recomputing it); the start-up log says how many.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

CPU_MEM_FRACTION = 0.5
CUDA_MEM_FRACTION = 0.85
MAX_CONTEXTS = 64  # never size the pool beyond this many full-context requests
ACTIVATION_BYTES_PER_ELEMENT = 4  # float32 intermediates, the widest a forward keeps


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; pass --max-total-tokens")


@dataclass(frozen=True)
class KVBudget:
    slots: int
    bytes_per_slot: int
    context_length: int
    available_bytes: int  # what the device had left after the weights
    activation_bytes: int  # kept back for a prefill chunk's activations
    fraction: float

    @property
    def full_contexts(self) -> float:
        return self.slots / self.context_length

    def describe(self) -> str:
        gib = 2**30
        return (f"KV pool: {self.slots} tokens ({self.slots * self.bytes_per_slot / gib:.2f} GiB), {self.full_contexts:.1f} full "
                f"contexts of {self.context_length}; {self.fraction:g} of the {self.available_bytes / gib:.1f} GiB left after the "
                f"weights, less {self.activation_bytes / gib:.2f} GiB for a prefill chunk's activations "
                f"(--mem-fraction-static; --max-total-tokens sets it directly)")


def kv_budget(device: torch.device, available_bytes: int, bytes_per_slot: int, context_length: int, hidden_size: int,
              intermediate_size: int, chunk_tokens: int, fraction: float | None = None, ranks_sharing_memory: int = 1) -> KVBudget:
    """The pool for a model whose weights are loaded; `ranks_sharing_memory`: TP ranks on one CPU machine."""
    fraction = fraction or (CUDA_MEM_FRACTION if device.type == "cuda" else CPU_MEM_FRACTION)
    activations = chunk_tokens * (4 * hidden_size + 2 * intermediate_size) * ACTIVATION_BYTES_PER_ELEMENT
    budget = int(max(0, available_bytes - activations) * fraction) // ranks_sharing_memory
    slots = min(budget // bytes_per_slot, MAX_CONTEXTS * context_length)
    return KVBudget(slots, bytes_per_slot, context_length, available_bytes, activations, fraction)
