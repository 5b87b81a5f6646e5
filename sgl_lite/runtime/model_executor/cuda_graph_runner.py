"""Decode steps replayed from CUDA graphs captured at start-up (CUDA only; `--cuda-graph-max-bs`,
`--disable-cuda-graph`, SGLang's flags).

A decode step of a small model on a GPU is mostly kernel launches: hundreds of small kernels whose launch
costs more than their work. One graph per batch-size bucket (1, 2, 4, 8, then every 8 up to the largest) holds
the whole step - embedding, every layer with FlashInfer's graph-safe decode attention, the final norm and the
LM head - over fixed input buffers. A batch of n requests replays the smallest bucket >= n: its rows past n
are padding (token 0 at position 0, writing and reading only padding slot 0, which no request owns), and the
first n logits rows are the batch's. Prefill, mixed and speculative steps, and batches above the largest
bucket, run eagerly.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from typing import TYPE_CHECKING

import torch

from sgl_lite.runtime.layers.attention.base import AttentionMetadata
from sgl_lite.runtime.layers.attention.flashinfer import FlashInferBackend
from sgl_lite.runtime.mem_cache.memory_pool import KVPool

if TYPE_CHECKING:
    from sgl_lite.runtime.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_WARMUP_RUNS = 2  # eager runs before a capture: kernels chosen and lazy workspaces allocated outside the graph


def capture_sizes(max_batch_size: int) -> list[int]:
    """The batch-size buckets captured for `max_batch_size`: 1, 2, 4, 8, then every 8, and the maximum itself."""
    if max_batch_size < 1:
        raise ValueError(f"--cuda-graph-max-bs must be positive; got {max_batch_size}")
    base = [1, 2, 4, 8, *range(16, max_batch_size + 1, 8)]
    return sorted({size for size in base if size < max_batch_size} | {max_batch_size})


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch_size` requests, or None when none does."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def padded_decode_metadata(meta: AttentionMetadata, batch_size: int) -> AttentionMetadata:
    """`meta` (a decode step of n <= batch_size requests) with batch_size - n padding requests appended:
    each one a single token at padding slot 0, attending over that slot alone."""
    n = meta.batch_size
    pad = batch_size - n
    if pad < 0 or not meta.is_decode:
        raise ValueError(f"cannot pad a batch of {meta.extend_lens} to {batch_size} decode rows")
    if pad == 0:
        return meta
    device = meta.kv_indices.device
    seq_lens = [p + e for p, e in zip(meta.prefix_lens, meta.extend_lens)] + [1] * pad
    zeros = torch.zeros(pad, dtype=torch.int64, device=device)
    padded_rows = torch.zeros(pad, meta.padded_kv_indices.shape[1], dtype=meta.padded_kv_indices.dtype, device=device)
    return AttentionMetadata(
        qo_indptr=torch.arange(batch_size + 1, dtype=torch.int32, device=meta.qo_indptr.device),
        kv_indptr=torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=meta.kv_indptr.device),
        kv_indices=torch.cat([meta.kv_indices, zeros]),
        out_cache_loc=torch.cat([meta.out_cache_loc, zeros]),
        prefix_lens=[*meta.prefix_lens, *[0] * pad],
        extend_lens=[1] * batch_size,
        padded_kv_indices=torch.cat([meta.padded_kv_indices, padded_rows]),
        seq_lens=torch.cat([meta.seq_lens, torch.ones(pad, dtype=meta.seq_lens.dtype, device=device)]),
    )


class CudaGraphRunner:
    """Captures, then replays, one graph per bucket of `capture_sizes(max_batch_size)` of `model`'s decode
    step over `kv_pool`. `max_context` bounds each request's sequence (the graphs' index buffers hold
    max_context tokens a row)."""

    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, max_batch_size: int, max_context: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        from sgl_lite.runtime.layers.attention.flashinfer import FlashInferGraphDecode, flashinfer_workspace

        self.model = model
        self.kv_pool = kv_pool
        self.sizes = capture_sizes(max_batch_size)
        self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        # One graph replays at a time and each plans right before it replays, so they share the workspace and
        # the slot-index buffer (a batch's sequences hold at most max_context tokens each).
        workspace = flashinfer_workspace(device)
        kv_indices = torch.zeros(self.sizes[-1] * max_context, dtype=torch.int32, device=device)
        self.attention = {size: FlashInferGraphDecode(model.num_heads, model.num_kv_heads, model.head_dim, size,
                                                      kv_indices, dtype, kv_pool.dtype, workspace)
                          for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph leaves its logits here, so what one step allocates inside a graph is freed with the capture
        # and the graphs' shared memory pool holds one step's scratch, not one vocabulary-wide output per bucket.
        self.logits = torch.empty(self.sizes[-1], model.vocab_size, dtype=torch.float32, device=device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool's blocks
            self._capture(size, pool)
        logger.info("CUDA graphs: captured decode batch sizes %s in %.1f s (--cuda-graph-max-bs %d; "
                    "--disable-cuda-graph turns them off)", self.sizes, time.perf_counter() - start, self.sizes[-1])

    @classmethod
    def for_model_runner(cls, runner: ModelRunner) -> CudaGraphRunner | None:
        """The graphs of `runner`'s decode steps where they apply: on CUDA with FlashInfer attention, in one process
        (under TP every rank would have to replay in lockstep), unless --disable-cuda-graph. They take batches of
        up to --cuda-graph-max-bs (default 256) requests, and never more than the runner runs at once."""
        args = runner.args
        if runner.device.type != "cuda" or args.disable_cuda_graph or runner.tp is not None or not isinstance(runner.attn, FlashInferBackend):
            return None
        max_batch_size = min(args.cuda_graph_max_bs or 256, runner.max_running_requests)
        return cls(runner.model, runner.kv_pool, max_batch_size, runner.context_length, runner.dtype, runner.device)

    def bucket_for(self, batch_size: int) -> int | None:
        return bucket_for(batch_size, self.sizes)

    @torch.inference_mode()
    def _step(self, size: int) -> None:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.attention[size], self.kv_pool)
        self.logits[:size].copy_(self.model.compute_logits(hidden))

    def _capture(self, size: int, pool) -> None:
        device = self.input_ids.device
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        idle = AttentionMetadata(qo_indptr=torch.zeros(1, dtype=torch.int32, device=device),
                                 kv_indptr=torch.zeros(1, dtype=torch.int32, device=device), kv_indices=empty,
                                 out_cache_loc=empty, prefix_lens=[], extend_lens=[],
                                 padded_kv_indices=torch.zeros(0, 1, dtype=torch.int64, device=device), seq_lens=empty)
        self.attention[size].prepare(padded_decode_metadata(idle, size))  # every row padding
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(_WARMUP_RUNS):
                self._step(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._step(size)
        self.graphs[size] = graph

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Float32 logits [n, vocab] of a decode step of n requests (input_ids, positions [n] on the device)."""
        n = meta.batch_size
        size = self.bucket_for(n)
        if size is None or not meta.is_decode:
            raise ValueError(f"no CUDA graph takes a step of {meta.extend_lens} new tokens (largest: {self.sizes[-1]} decode rows)")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions, non_blocking=True)
        self.positions[n:size].zero_()
        self.attention[size].prepare(padded_decode_metadata(meta, size))
        self.graphs[size].replay()
        return self.logits[:n]
