"""A ModelRunner driven directly, without a scheduler: the benchmark scripts' way to time prefill, decode and
speculative-verification steps on chosen batches (bench_model.py, profile_step.py, bench_quant.py and others
import it from here).

The requests get rows of the runner's request-to-slot table and slots from an allocator of their own; each
step writes the new slots into the table, builds the ForwardBatch the scheduler would, runs the forward and
appends the sampled token, so that the runner sees exactly a served step's inputs.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_lite.runtime.managers.request import Req  # noqa: E402
from sgl_lite.runtime.mem_cache.memory_pool import SlotAllocator  # noqa: E402
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch  # noqa: E402
from sgl_lite.runtime.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_lite.runtime.protocol import SamplingParams  # noqa: E402

DTYPE_FLAGS = {"auto": "auto", "bf16": "bfloat16", "fp32": "float32"}  # --dtype choices -> ServerArgs.dtype


class RunnerBench:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.alloc = SlotAllocator(runner.num_slots)

    def _reqs(self, prompts: list[list[int]]) -> list[Req]:
        reqs = []
        for i, ids in enumerate(prompts):
            req = Req(rid=str(i), input_ids=ids, sampling_params=SamplingParams(max_new_tokens=10**6, temperature=0.0))
            req.req_pool_idx = self.runner.req_to_token.alloc()
            reqs.append(req)
        return reqs

    def _step(self, reqs: list[Req], extend_lens: list[int]) -> None:
        slots = self.alloc.alloc(sum(extend_lens))
        offset = 0
        for req, extend in zip(reqs, extend_lens):
            self.runner.req_to_token.table[req.req_pool_idx, req.kv_len : req.kv_len + extend] = slots[offset : offset + extend]
            offset += extend
        batch = ForwardBatch(reqs=reqs, prefix_lens=[r.kv_len for r in reqs], extend_lens=extend_lens, out_cache_loc=slots,
                             sample=[True] * len(reqs), is_decode=all(e == 1 for e in extend_lens))
        out = self.runner.forward(batch)
        for req, extend, tok in zip(reqs, extend_lens, out.next_token_ids):
            req.kv_len += extend
            req.output_ids.append(tok)

    def _verify_step(self, reqs: list[Req], draft_len: int, rng: random.Random) -> None:
        """A decode step in which every request verifies `draft_len` random draft tokens (a speculative step's
        shape and cost): the drafts' slots are freed after it and each request advances by one token."""
        extend = 1 + draft_len
        slots = self.alloc.alloc(len(reqs) * extend)
        for i, req in enumerate(reqs):
            self.runner.req_to_token.table[req.req_pool_idx, req.kv_len : req.kv_len + extend] = slots[i * extend : (i + 1) * extend]
        batch = ForwardBatch(reqs=reqs, prefix_lens=[r.kv_len for r in reqs], extend_lens=[extend] * len(reqs), out_cache_loc=slots,
                             sample=[True] * len(reqs), draft_ids=[[rng.randrange(1000, 40000) for _ in range(draft_len)] for _ in reqs])
        out = self.runner.forward(batch)
        for i, (req, tok) in enumerate(zip(reqs, out.next_token_ids)):
            self.alloc.free(slots[i * extend + 1 : (i + 1) * extend])
            req.kv_len += 1
            req.output_ids.append(tok)

    def _release(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.alloc.free(self.runner.req_to_token.table[req.req_pool_idx, : req.kv_len].clone())
            self.runner.req_to_token.free(req.req_pool_idx)

    def prefill(self, prompt: list[int], repeats: int) -> float:
        best = 0.0
        for _ in range(repeats):
            reqs = self._reqs([prompt])
            start = time.perf_counter()
            self._step(reqs, [len(prompt)])
            best = max(best, len(prompt) / (time.perf_counter() - start))
            self._release(reqs)
        return best

    def decode(self, prompts: list[list[int]], steps: int, repeats: int) -> float:
        """Best of `repeats` windows of `steps` decode steps (the box may be shared: best = least disturbed)."""
        reqs = self._reqs(prompts)
        self._step(reqs, [len(p) for p in prompts])
        self._step(reqs, [1] * len(reqs))  # warm-up step
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                self._step(reqs, [1] * len(reqs))
            best = max(best, len(reqs) * steps / (time.perf_counter() - start))
        self._release(reqs)
        return best
