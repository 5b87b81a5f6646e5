"""Tensor parallelism (`--tp-size N`): one model sharded over N processes with torch.distributed.

Megatron-style sharding of the Llama layers: rank r holds query heads [r*H/N, (r+1)*H/N) and KV
heads [r*Hkv/N, (r+1)*Hkv/N) of every layer (its slice of the fused QKV rows and of the o-projection
columns, and its own KV pool with only those heads), and columns [r*I/N, (r+1)*I/N) of the MLP (its
slice of the gate and up rows and of the down-projection columns). The o- and down-projection
outputs are partial sums, all-reduced after each (`LlamaDecoderLayer.tp_reduce`), so every rank holds
the same full hidden state after each layer. Embeddings, norms and the LM head stay replicated; a bias
of a row-parallel projection lives on rank 0 only, so that the all-reduce adds it exactly once.

Process layout: the runtime process is rank 0. It runs the scheduler and the sampler alone; its
ModelRunner spawns ranks 1..N-1 (`python -m sgl_lite.runtime.model_executor.tp`, each a ModelRunner of its own
with the same flags) and broadcasts every forward step (input ids, positions, KV slots) to them before
running it. Other ranks only run the model's forward in lockstep and drop the hidden states. Backend:
gloo on CPU, NCCL on CUDA (rank r on cuda:r).

Invariants: every rank runs exactly the collectives rank 0 runs, in the same order (one broadcast pair
per step, two all-reduces per layer); all ranks agree on the KV pool size (the minimum of their own).
A rank that dies takes the group down: rank 0's next collective raises, and the other ranks exit when
rank 0's process is gone.

Each rank loads the full checkpoint and then drops what is not its shard: simple, and the peak memory
of one replicated model per rank is fine for the CPU-sized models this serves.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from sgl_lite.runtime.free_port import free_port
from sgl_lite.runtime.layers.attention.base import AttentionMetadata
from sgl_lite.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_ENV_RANK = "SGL_LITE_TP_RANK"
_ENV_WORLD = "SGL_LITE_TP_WORLD_SIZE"
_ENV_INIT = "SGL_LITE_TP_INIT_METHOD"
_ENV_ARGS = "SGL_LITE_TP_SERVER_ARGS"
_ENV_MODEL_DIR = "SGL_LITE_TP_MODEL_DIR"
_GROUP_TIMEOUT = timedelta(seconds=600)
_PARENT_POLL_S = 1.0
_STEP, _STOP = 1, 0


def check_shardable(config: Any, tp_size: int) -> None:
    """Raise ValueError naming the count that does not divide by tp_size."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    counts = {"attention heads (num_attention_heads)": heads, "KV heads (num_key_value_heads)": kv_heads,
              "MLP columns (intermediate_size)": config.intermediate_size}
    for what, count in counts.items():
        if count % tp_size:
            raise ValueError(f"--tp-size {tp_size} does not divide the model's {count} {what}; "
                             f"choose a tp size that divides {heads} heads and {kv_heads} KV heads")


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[start:start + size].clone()


def shard_layer(layer: nn.Module, rank: int, size: int) -> None:
    """Keep rank `rank`'s heads and MLP columns of a LlamaDecoderLayer (loaded, not yet packed)."""
    d = layer.head_dim
    heads, kv_heads, inter = layer.num_heads // size, layer.num_kv_heads // size, layer.intermediate // size
    q_size, kv_size = layer.q_size, layer.kv_size

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        q = _rows(t, rank * heads * d, heads * d)
        k = _rows(t, q_size + rank * kv_heads * d, kv_heads * d)
        v = _rows(t, q_size + kv_size + rank * kv_heads * d, kv_heads * d)
        return torch.cat((q, k, v), 0)

    def param(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.contiguous(), requires_grad=False)

    layer.qkv_weight = param(qkv_rows(layer.qkv_weight.data))
    if layer.qkv_bias is not None:
        layer.qkv_bias = param(qkv_rows(layer.qkv_bias.data))
    layer.o_weight = param(layer.o_weight.data[:, rank * heads * d:(rank + 1) * heads * d])
    if layer.o_bias is not None and rank != 0:
        layer.o_bias = param(torch.zeros_like(layer.o_bias.data))
    gate_up = layer.gate_up_weight.data
    layer.gate_up_weight = param(torch.cat((_rows(gate_up, rank * inter, inter),
                                            _rows(gate_up, layer.intermediate + rank * inter, inter)), 0))
    layer.down_weight = param(layer.down_weight.data[:, rank * inter:(rank + 1) * inter])
    layer.num_heads, layer.num_kv_heads, layer.intermediate = heads, kv_heads, inter
    layer.q_size, layer.kv_size = heads * d, kv_heads * d


def shard_model(model: nn.Module, rank: int, size: int, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Shard every layer of a loaded LlamaForCausalLM and install the all-reduce hook."""
    check_shardable(model.config, size)
    for layer in model.layers:
        shard_layer(layer, rank, size)
        layer.tp_reduce = reduce
    model.num_heads //= size
    model.num_kv_heads //= size


class TensorParallel:
    """This process's place in the TP group, and the step broadcast between rank 0 and the others."""

    def __init__(self, rank: int, size: int, device: torch.device, workers: list[subprocess.Popen[bytes]]) -> None:
        self.rank = rank
        self.size = size
        self.backend = dist.get_backend()
        # NCCL moves CUDA tensors only; gloo moves CPU tensors.
        self.comm_device = device if self.backend == "nccl" else torch.device("cpu")
        self._workers = workers
        self._closed = False
        self._saved_num_threads: int | None = None

    @classmethod
    def from_args(cls, args: ServerArgs, model_dir: Path, device: torch.device,
                  config: Any = None) -> TensorParallel | None:
        """None for tp_size 1. Rank 0 (the runtime process) spawns the other ranks; they join here too.

        With the model `config`, raises ValueError before starting any process when the model cannot
        be split in tp_size parts (without it, `shard` raises the same error after the group formed).
        """
        size = args.tp_size
        if size == 1:
            return None
        if config is not None:
            check_shardable(config, size)
        if dist.is_initialized() and os.environ.get(_ENV_RANK) is None:
            raise RuntimeError("this process already runs a tensor-parallel model; one per process")
        if os.environ.get(_ENV_RANK) is not None:  # a worker rank: main() already joined the group
            return cls(dist.get_rank(), dist.get_world_size(), device, [])
        init_method = f"tcp://127.0.0.1:{free_port()}"
        workers = [_spawn_rank(r, size, init_method, args, model_dir) for r in range(1, size)]
        backend = "nccl" if device.type == "cuda" else "gloo"
        logger.info("tensor parallel: %d ranks (%s), waiting for ranks 1..%d", size, backend, size - 1)
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=size, timeout=_GROUP_TIMEOUT)
        tp = cls(0, size, device, workers)
        if device.type == "cpu":
            # Rank 0 takes its share of the CPUs like the other ranks (restored by close()): ranks that
            # oversubscribe the cores make every all-reduce wait for a descheduled thread.
            tp._saved_num_threads = torch.get_num_threads()
            torch.set_num_threads(_threads_per_rank(size))
        atexit.register(tp.close)
        return tp

    def shard(self, model: nn.Module) -> None:
        shard_model(model, self.rank, self.size, self.all_reduce)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        # Low-precision partial sums are added in float32 (gloo's bf16 support varies, and fewer roundings).
        if t.dtype in (torch.bfloat16, torch.float16) and self.backend == "gloo":
            wide = t.float()
            dist.all_reduce(wide)
            return wide.to(t.dtype)
        dist.all_reduce(t)
        return t

    def agree_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """Rank 0: send one forward step to the other ranks (they rebuild the same metadata)."""
        b, n, max_kv = meta.batch_size, meta.num_tokens, meta.max_kv_len
        self._broadcast(torch.tensor([_STEP, b, n, max_kv], dtype=torch.int64))
        payload = torch.cat([input_ids.to(torch.int64).cpu(), positions.to(torch.int64).cpu(),
                             meta.out_cache_loc.to(torch.int64).cpu(), torch.tensor(meta.prefix_lens, dtype=torch.int64),
                             torch.tensor(meta.extend_lens, dtype=torch.int64),
                             torch.tensor([i in meta.verify_rows for i in range(b)], dtype=torch.int64),
                             meta.padded_kv_indices.to(torch.int64).cpu().reshape(-1)])
        self._broadcast(payload)

    def receive_step(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata] | None:
        """Other ranks: the next step from rank 0, or None when rank 0 stops the group."""
        header = self._broadcast(torch.zeros(4, dtype=torch.int64))
        kind, b, n, max_kv = (int(x) for x in header.tolist())
        if kind == _STOP:
            return None
        payload = self._broadcast(torch.zeros(3 * n + 3 * b + b * max_kv, dtype=torch.int64)).to(device)
        input_ids, positions, out_cache_loc = payload[:n], payload[n:2 * n], payload[2 * n:3 * n]
        prefix_lens = payload[3 * n:3 * n + b].tolist()
        extend_lens = payload[3 * n + b:3 * n + 2 * b].tolist()
        verify_rows = payload[3 * n + 2 * b:3 * n + 3 * b].nonzero().flatten().tolist()
        padded = payload[3 * n + 3 * b:].reshape(b, max_kv)
        return input_ids, positions, metadata_from_padded(padded, prefix_lens, extend_lens, out_cache_loc, verify_rows)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.comm_device)
        dist.broadcast(t, src=0)
        return t.cpu()

    def exited_ranks(self) -> list[tuple[int, int]]:
        """Rank 0: (rank, exit code) of each other rank that has exited while the group was open; after
        that every collective fails, so rank 0 cannot serve any more."""
        if self._closed:
            return []
        return [(rank, code) for rank, code in enumerate((w.poll() for w in self._workers), start=1) if code is not None]

    def close(self) -> None:
        """Rank 0: stop the other ranks and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)  # the exit hook would only keep this object alive
        if self.rank == 0:
            try:
                self._broadcast(torch.tensor([_STOP, 0, 0, 0], dtype=torch.int64))
            except RuntimeError as e:  # a rank already died; stop the rest below
                logger.warning("tensor parallel: stop broadcast failed (%s)", e)
            for worker in self._workers:
                try:
                    worker.wait(10)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._saved_num_threads is not None:
            torch.set_num_threads(self._saved_num_threads)


def metadata_from_padded(padded: torch.Tensor, prefix_lens: list[int], extend_lens: list[int],
                         out_cache_loc: torch.Tensor, verify_rows: list[int] | None = None) -> AttentionMetadata:
    """AttentionMetadata from the padded slot rows (what AttentionMetadata.build derives from the table)."""
    device = padded.device
    extend = torch.tensor(extend_lens, dtype=torch.int64, device=device)
    seq = torch.tensor(prefix_lens, dtype=torch.int64, device=device) + extend
    valid = torch.arange(padded.shape[1], device=device)[None, :] < seq[:, None]
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    return AttentionMetadata(
        qo_indptr=torch.cat((zero, torch.cumsum(extend, 0).to(torch.int32))),
        kv_indptr=torch.cat((zero, torch.cumsum(seq, 0).to(torch.int32))),
        kv_indices=padded[valid], out_cache_loc=out_cache_loc, prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens), padded_kv_indices=padded, seq_lens=seq, verify_rows=list(verify_rows or []),
    )


def run_worker(runner: Any) -> None:
    """Ranks 1..N-1: run rank 0's steps in lockstep until it stops the group."""
    tp: TensorParallel = runner.tp
    with torch.inference_mode():
        while True:
            step = tp.receive_step(runner.device)
            if step is None:
                break
            input_ids, positions, meta = step
            runner.attn.prepare(meta)
            try:
                runner.model(input_ids, positions, runner.attn, runner.kv_pool, prefill=meta.has_prefill_rows)
            except ValueError as e:  # rank 0 meets the same check before any collective of this step
                logger.warning("tensor parallel rank %d: step rejected: %s", tp.rank, e)
    tp.close()


def _threads_per_rank(size: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // size)


def _spawn_rank(rank: int, size: int, init_method: str, args: ServerArgs, model_dir: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    server_args = dataclasses.asdict(args)
    server_args.pop("api_key", None)  # the other ranks serve no requests
    env.update({_ENV_RANK: str(rank), _ENV_WORLD: str(size), _ENV_INIT: init_method,
                _ENV_ARGS: json.dumps(server_args), _ENV_MODEL_DIR: str(model_dir)})
    env["OMP_NUM_THREADS"] = str(_threads_per_rank(size))
    # Its own session: a terminal's Ctrl-C (sent to the whole foreground process group) reaches rank 0 alone,
    # which stops the ranks once it has stopped serving; a rank that took it died mid-collective with a traceback.
    return subprocess.Popen([sys.executable, "-m", "sgl_lite.runtime.model_executor.tp", "--parent-pid", str(os.getpid())],
                            env=env, stdout=sys.stderr, start_new_session=True)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)  # rank 0 is gone: a collective would wait for it forever

    threading.Thread(target=watch, name="sgl-lite-tp-parent-watch", daemon=True).start()


def main() -> None:
    """Entry point of ranks 1..N-1 (spawned by rank 0; not meant to be started by hand)."""
    _exit_with_parent(int(sys.argv[sys.argv.index("--parent-pid") + 1]))
    rank, size = int(os.environ[_ENV_RANK]), int(os.environ[_ENV_WORLD])
    args = ServerArgs(**json.loads(os.environ[_ENV_ARGS]))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[tp]: %(message)s")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=os.environ[_ENV_INIT], rank=rank,
                            world_size=size, timeout=_GROUP_TIMEOUT)
    from sgl_lite.runtime.model_executor.model_runner import ModelRunner

    runner = ModelRunner(args, Path(os.environ[_ENV_MODEL_DIR]))
    logger.info("tensor parallel rank %d/%d ready", rank, size)
    run_worker(runner)


if __name__ == "__main__":
    main()
