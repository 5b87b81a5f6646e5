"""The real ModelRunner: loads a Llama-family model, owns the KV pool, runs a ForwardBatch, samples.

Per step: build positions and attention metadata with tensor ops, run the model over all new
tokens, compute logits only for rows that are sampled or scored, score input tokens for requests
that asked for logprobs, and sample through the Sampler.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from sgl_lite.runtime.layers.attention import AttentionMetadata, create_backend
from sgl_lite.runtime.layers.linear import gemv_kernel
from sgl_lite.runtime.layers.quantization import INT4_METHODS
from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.memory_pool import KVPool, ReqToTokenPool, kv_cache_dtype
from sgl_lite.runtime.model_executor.cpu_host.huge_pages import advise_huge_pages, tensors_of
from sgl_lite.runtime.model_executor.cpu_host.thread_governor import ThreadGovernor
from sgl_lite.runtime.model_executor.cuda_graph_runner import CudaGraphRunner
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput, ModelRunnerBase
from sgl_lite.runtime.model_executor.kv_budget import available_memory_bytes, kv_budget
from sgl_lite.runtime.model_executor.tp import TensorParallel
from sgl_lite.runtime.models import build_model
from sgl_lite.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# glibc malloc tuning (see keep_freed_heap_memory): below this size allocations stay on the heap, and
# freed heap memory is only returned to the OS beyond this much.
_MALLOC_MMAP_THRESHOLD = 32 << 20
_MALLOC_TRIM_THRESHOLD = 256 << 20
_SLOTS_PER_RUNNING_REQUEST = 16  # default max_running_requests = num_slots // this, capped


def cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(amx_bf16|avx512_bf16)\b", flags) is not None


def choose_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available")
    return torch.device(name)


def cpu_has_bf16_kernels() -> bool:
    """Whether sgl_lite's own CPU kernels serve bf16 matmuls here (AVX2 + FMA with the C++ ops built:
    kernels/csrc/matmul/avx2_gemv.cpp widens bf16 weights in registers), so that bf16 is the fast path even
    without native bf16 instructions: half the bytes per decode step of float32, as fast in prefill."""
    return gemv_kernel(torch.empty(16, 2, dtype=torch.bfloat16)) is not None


def choose_dtype(name: str, device: torch.device, own_kernels: bool = True) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, on CPUs with native bf16 matmul (amx_bf16 / avx512_bf16) and, when
    `own_kernels` (False: for a model that runs on torch's kernels alone), on CPUs where sgl_lite's AVX2
    kernels serve bf16; else float32."""
    if name == "auto":
        fast = device.type == "cuda" or cpu_has_fast_bf16() or (own_kernels and device.type == "cpu" and cpu_has_bf16_kernels())
        return torch.bfloat16 if fast else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def keep_freed_heap_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS (CPU serving).

    A forward step allocates and frees the same MB-sized activations every layer; with glibc's
    defaults each of them is a fresh mmap or a heap trim, so every step pays thousands of page
    faults (at batch 32 they cost an attention call several times its own work). Process-wide, like the
    jemalloc/tcmalloc preload that CPU inference stacks recommend. Returns whether it applied.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, _MALLOC_MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, _MALLOC_TRIM_THRESHOLD))


def return_free_heap_memory() -> None:
    """Give the OS back the free pages inside glibc's heap (malloc_trim): once, after loading, when the weights
    the packed forms replaced were freed, so that the KV pool's budget, taken from available memory, sees them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _new_token_ids(req: Req, prefix: int, extend: int) -> list[int]:
    """fill_ids[prefix : prefix + extend] without building fill_ids (a decode step needs one token)."""
    num_prompt = len(req.input_ids)
    if prefix >= num_prompt:
        return req.output_ids[prefix - num_prompt : prefix - num_prompt + extend]
    if prefix + extend <= num_prompt:
        return req.input_ids[prefix : prefix + extend]
    return req.input_ids[prefix:] + req.output_ids[: prefix + extend - num_prompt]


class ModelRunner(ModelRunnerBase):
    def __init__(self, args: ServerArgs, model_dir: Path | None = None, eos_token_ids: Iterable[int] | None = None,
                 keep_dense_weights: bool = False) -> None:
        """`eos_token_ids`: what the sampler keeps from being sampled before min_new_tokens; the runtime
        passes the set its stop check uses (RuntimeCore.from_args), None takes the model config's.
        `keep_dense_weights`: keep the loaded matmul weights that the packed forms make unread (benchmarks
        and tests that run them through F.linear too); the runtime frees them."""
        from sgl_lite.runtime.model_executor import loader

        self.args = args
        self.device = choose_device(args.device)
        if self.device.type == "cpu":
            keep_freed_heap_memory()
        self.dtype = choose_dtype(args.dtype, self.device)
        if args.quantization is not None and self.device.type != "cpu":
            raise ValueError(f"--quantization {args.quantization} runs on torch's CPU kernels; the device is {self.device.type}")
        model_dir = Path(model_dir) if model_dir is not None else loader.resolve_model_path(args.model_path)
        self.model_dir = model_dir
        self.config = loader.load_config(model_dir)
        max_positions = self.config.max_position_embeddings
        if args.context_length is not None and args.context_length > max_positions:
            raise ValueError(f"--context-length {args.context_length} exceeds the model's max_position_embeddings {max_positions}")
        self.context_length = args.context_length or max_positions
        self.model = build_model(self.config, self.dtype, self.device, max_positions=self.context_length)
        self.model.load_weights(loader.iter_weights(model_dir))
        self.model.eval()
        # --tp-size > 1: join (rank 0: start) the TP group and keep only this rank's shard of the weights.
        self.tp = TensorParallel.from_args(args, model_dir, self.device, self.config)
        if self.tp is not None:
            self.tp.shard(self.model)
        self.packed_weights = self.model.pack_weights(quantization=args.quantization, int4_values=self._gguf_int4_values(),
                                                      batch_invariant=args.enable_deterministic_inference,
                                                      drop_unread=not keep_dense_weights)
        if self.device.type == "cpu":
            return_free_heap_memory()
        self.vocab_size = self.config.vocab_size

        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        self.num_slots = self._pool_size()
        if self.tp is not None:
            self.num_slots = self.tp.agree_min(self.num_slots)  # every rank's pool holds the same slots
        self.kv_pool = KVPool(
            self.config.num_hidden_layers, self.num_slots, self.model.num_kv_heads, self.model.head_dim, self.kv_dtype, self.device
        )
        if self.device.type == "cpu":  # 2 MiB pages under the weights and the pool (huge_pages.py)
            self.huge_page_bytes = (advise_huge_pages(tensors_of(self.model), written=True)
                                    + advise_huge_pages([*self.kv_pool.k, *self.kv_pool.v], written=False))
        else:
            self.huge_page_bytes = 0
        self.max_running_requests = args.max_running_requests or max(1, min(256, self.num_slots // _SLOTS_PER_RUNNING_REQUEST))
        self.req_to_token = ReqToTokenPool(self.max_running_requests, self.context_length, self.device)
        self.attn = create_backend(args.attention_backend, self.device, self.model.num_heads, self.model.num_kv_heads,
                                   self.model.head_dim, deterministic=args.enable_deterministic_inference)
        self.sampler = self._make_sampler(eos_token_ids)
        self.graph_runner = CudaGraphRunner.for_model_runner(self)
        # One thread or all, chosen per batch size by measurement (thread_governor.py); not under TP (each
        # rank's share is fixed), nor with deterministic inference (a matmul may split work by thread count).
        adaptive = self.device.type == "cpu" and self.tp is None and not (args.disable_adaptive_threads or args.enable_deterministic_inference)
        self.thread_governor = ThreadGovernor.for_this_process() if adaptive else None
        logger.info(
            "model %s: %s on %s, context %d, KV pool %d slots of %s (%.1f MiB), max running requests %d, attention %s, "
            "%.0f MiB advised onto huge pages",
            model_dir, self.dtype, self.device, self.context_length, self.num_slots, self.kv_dtype,
            self.kv_pool.total_bytes / 2**20, self.max_running_requests, type(self.attn).__name__, self.huge_page_bytes / 2**20,
        )

    def _gguf_int4_values(self) -> dict | None:
        """`--quantization w4a16_int4` or `w4a8_int4` on a model converted from a GGUF file: that file's own Q4 blocks
        (exact), not a second rounding of their dequantized values. Not under TP (the blocks are unsharded)."""
        from sgl_lite.runtime.model_executor import loader

        if self.args.quantization not in INT4_METHODS or self.tp is not None:
            return None
        gguf_file = loader.gguf_source(self.model_dir)
        if gguf_file is None:
            return None
        from sgl_lite.runtime.layers.quantization.gguf_blocks import read_int4_blocks

        return read_int4_blocks(gguf_file)

    def _pool_size(self) -> int:
        if self.args.max_total_tokens is not None:
            return self.args.max_total_tokens
        config = self.config
        budget = kv_budget(
            self.device, available_memory_bytes(self.device),
            KVPool.bytes_per_slot(config.num_hidden_layers, self.model.num_kv_heads, self.model.head_dim, self.kv_dtype),
            self.context_length, config.hidden_size, config.intermediate_size, self.args.chunked_prefill_size or 8192,
            self.args.mem_fraction_static,
            # the ranks share one machine's memory (on CUDA each has its own GPU)
            ranks_sharing_memory=self.tp.size if self.device.type == "cpu" and self.tp is not None else 1,
        )
        logger.info("%s", budget.describe())
        if budget.slots < self.context_length:
            logger.warning("KV pool holds %d tokens, less than one full context (%d)", budget.slots, self.context_length)
        if budget.slots <= 0:
            raise ValueError("no memory left for the KV pool; pass --max-total-tokens or raise --mem-fraction-static")
        return budget.slots

    def _make_sampler(self, eos_token_ids: Iterable[int] | None):
        from sgl_lite.runtime.sampling.sampler import Sampler

        if eos_token_ids is None:
            eos = self.config.eos_token_id
            eos_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return Sampler(self.vocab_size, eos_token_ids, self.args.random_seed)

    def kv_cache_summary(self) -> dict:
        return {
            "slots": self.num_slots,
            "bytes": self.kv_pool.total_bytes,
            "dtype": str(self.kv_dtype).removeprefix("torch."),
            "layers": self.config.num_hidden_layers,
            "kv_heads": self.model.num_kv_heads,
            "head_dim": self.model.head_dim,
        }

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if self.thread_governor is None or not batch.reqs:
            return self._forward(batch)
        with self.thread_governor.forward(sum(batch.extend_lens)) as after_layer:
            return self._forward(batch, after_layer)

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch, after_layer: Callable[[], object] | None = None) -> ForwardOutput:
        reqs = batch.reqs
        num_reqs = len(reqs)
        if not num_reqs:
            return ForwardOutput(next_token_ids=[])
        drafts = batch.draft_ids or [[] for _ in reqs]
        for req, prefix, extend, draft in zip(reqs, batch.prefix_lens, batch.extend_lens, drafts):
            own = extend - len(draft)
            if own <= 0 or prefix + own > req.seq_len:
                raise ValueError(f"request {req.rid}: prefix {prefix} + extend {own} does not fit its {req.seq_len} tokens")
            if req.req_pool_idx is None:
                raise ValueError(f"request {req.rid} has no req_to_token row")
        device = self.device
        ids: list[int] = []
        for req, prefix, extend, draft in zip(reqs, batch.prefix_lens, batch.extend_lens, drafts):
            ids.extend(_new_token_ids(req, prefix, extend - len(draft)))
            ids.extend(draft)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        meta = AttentionMetadata.build(
            [r.req_pool_idx for r in reqs], batch.prefix_lens, batch.extend_lens, batch.out_cache_loc, self.req_to_token,
            verify_rows=[i for i, d in enumerate(drafts) if d],
        )
        positions = self._positions(meta)
        if self.tp is not None:
            self.tp.broadcast_step(input_ids, positions, meta)  # the other ranks run this step in lockstep
        graph_logits = hidden = None
        if self.graph_runner is not None and meta.is_decode and not any(drafts) and self.graph_runner.bucket_for(num_reqs):
            graph_logits = self.graph_runner.replay(input_ids, positions, meta)  # every row's logits
        else:
            self.attn.prepare(meta)
            hidden = self.model(input_ids, positions, self.attn, self.kv_pool, after_layer, meta.has_prefill_rows)

        # Rows whose logits are needed: the last row of each sampling request, and the rows that
        # score the next prompt token for requests with input logprobs.
        # Rows that verify a draft need logits at every position of their draft (the last ones).
        qo = [0, *itertools.accumulate(batch.extend_lens)]  # meta.qo_indptr, without a device read that waits for the forward
        spec_idx = [i for i in range(num_reqs) if batch.sample[i] and drafts[i]]
        sample_idx = [i for i in range(num_reqs) if batch.sample[i] and not drafts[i]]
        score_ranges = self._input_logprob_ranges(batch)
        rows = [qo[i + 1] - 1 for i in sample_idx]
        for i, first, last in score_ranges:
            rows.extend(range(qo[i] + first - batch.prefix_lens[i], qo[i] + last - batch.prefix_lens[i]))
        num_scored = len(rows)
        for i in spec_idx:
            rows.extend(range(qo[i + 1] - len(drafts[i]) - 1, qo[i + 1]))
        next_ids: list[int | None] = [None] * num_reqs
        accepted: list[list[int] | None] = [None] * num_reqs
        if not rows:
            return ForwardOutput(next_token_ids=next_ids, accepted_ids=accepted)
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        logits = graph_logits[row_index] if graph_logits is not None else self.model.compute_logits(hidden[row_index])
        num_sample = len(sample_idx)
        self._score_inputs(batch, score_ranges, logits[num_sample:num_scored])
        if spec_idx:
            from sgl_lite.runtime.speculative.verification import verify_drafts

            spec_logits = logits[num_scored:]
            verified = verify_drafts(self.sampler, spec_logits, [reqs[i] for i in spec_idx],
                                     [drafts[i] for i in spec_idx])
            offset = 0
            for i, tokens in zip(spec_idx, verified):
                accepted[i] = tokens
                next_ids[i] = tokens[0]
                if reqs[i].return_logprob:  # the raw model logprob of each emitted token, as when sampled
                    rows_i = spec_logits[offset : offset + len(tokens)].float()
                    chosen = torch.log_softmax(rows_i, dim=-1).gather(1, torch.tensor(tokens, device=device)[:, None])
                    for j, logprob in enumerate(chosen.squeeze(1).tolist()):
                        self._record_output_logprobs(reqs[i], logprob, rows_i[j])
                offset += len(drafts[i]) + 1
        if num_sample:
            sample_reqs = [reqs[i] for i in sample_idx]
            sample_logits = logits[:num_sample]
            with_logprobs = any(r.return_logprob for r in sample_reqs)
            tokens, token_logprobs = self.sampler.sample(sample_logits, sample_reqs, with_logprobs=with_logprobs)
            tokens_list = tokens.tolist()
            logprob_list = token_logprobs.tolist() if with_logprobs else []
            for j, i in enumerate(sample_idx):
                next_ids[i] = tokens_list[j]
                if reqs[i].return_logprob:
                    self._record_output_logprobs(reqs[i], logprob_list[j], sample_logits[j])
        return ForwardOutput(next_token_ids=next_ids, accepted_ids=accepted)

    def _positions(self, meta: AttentionMetadata) -> torch.Tensor:
        """Position of every new token: prefix_len + offset within its request (no per-token Python)."""
        if meta.is_decode:  # one token per request, at its last position: one op (a GPU step launches each)
            return meta.seq_lens - 1
        device = meta.out_cache_loc.device
        extend = torch.tensor(meta.extend_lens, dtype=torch.int64, device=device)
        starts = torch.tensor(meta.prefix_lens, dtype=torch.int64, device=device) - meta.qo_indptr[:-1].to(torch.int64)
        return torch.arange(meta.num_tokens, device=device) + torch.repeat_interleave(starts, extend)

    @staticmethod
    def _input_logprob_ranges(batch: ForwardBatch) -> list[tuple[int, int, int]]:
        """Per request with return_logprob: positions [first, last) whose logits this forward computes
        and that score a prompt token (the row at position p scores the token at p + 1 when
        p + 1 >= max(logprob_start_len, 1) and p + 1 is a prompt position)."""
        out = []
        for i, req in enumerate(batch.reqs):
            if not req.return_logprob or req.logprob_start_len < 0:
                continue
            prefix, extend = batch.prefix_lens[i], batch.extend_lens[i]
            first = max(prefix, max(req.logprob_start_len, 1) - 1)
            last = min(prefix + extend, len(req.input_ids) - 1)
            if first < last:
                out.append((i, first, last))
        return out

    @staticmethod
    def _score_inputs(batch: ForwardBatch, ranges: list[tuple[int, int, int]], logits: torch.Tensor) -> None:
        offset = 0
        for i, first, last in ranges:
            req = batch.reqs[i]
            n = last - first
            targets = torch.tensor(req.input_ids[first + 1 : last + 1], dtype=torch.int64, device=logits.device)
            logprobs = torch.log_softmax(logits[offset : offset + n], dim=-1)
            req.input_token_logprobs.extend(logprobs.gather(1, targets[:, None]).squeeze(1).tolist())
            offset += n

    @staticmethod
    def _record_output_logprobs(req: Req, logprob: float, logits_row: torch.Tensor) -> None:
        req.output_token_logprobs.append(logprob)
        if req.top_logprobs_num > 0:
            top = torch.log_softmax(logits_row, dim=-1).topk(req.top_logprobs_num)
            req.output_top_logprobs.append(list(zip(top.indices.tolist(), top.values.tolist())))
