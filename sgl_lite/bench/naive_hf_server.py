"""The transformers baseline: an in-process server that runs `AutoModelForCausalLM.generate` on
static batches, the way a naive serving loop would.

One worker thread takes whatever requests are queued (up to `batch_size`) as a batch, left-pads
them, and runs greedy `generate` for the longest `max_new_tokens` in the batch; nothing new joins
until the batch is done (no continuous batching) and nothing is reused across requests (no prefix
cache; within a request the usual KV cache). EOS is ignored, as with the runtime's ignore_eos.

Timing: a generate streamer stamps every decode step, so TTFT and ITL are measured per token, in
process (no wire hop, which slightly favours this baseline). A request completes when its whole
batch returns from generate: that is its e2e latency, as a non-streaming server's client would see.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from sgl_lite.bench.backends import GenerationBackend, StreamEvent
from sgl_lite.runtime.model_executor.model_runner import choose_device, choose_dtype

logger = logging.getLogger(__name__)

_Sink = Callable[[StreamEvent | BaseException], None]


@dataclass
class _Job:
    input_ids: list[int]
    max_new_tokens: int
    sink: _Sink
    emitted: int = 0  # output tokens already passed to the sink


@dataclass
class _StepStamper(BaseStreamer):
    """Receives generate's per-step token batch ([B] ids; the first call is the prompt) and forwards
    each row's token, with the time it was produced, to that row's request."""

    jobs: list[_Job]
    seen_prompt: bool = field(default=False)

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        now = time.perf_counter()
        for job, tok in zip(self.jobs, value.reshape(-1).tolist()):
            if job.emitted < job.max_new_tokens:
                job.emitted += 1
                job.sink(StreamEvent(now, [int(tok)]))

    def end(self) -> None:
        pass


class NaiveHFServer:
    def __init__(self, model_dir: str | Path, *, batch_size: int = 8, dtype: str = "auto", device: str = "cpu") -> None:
        """`device`: the runtime's --device (auto: CUDA when torch sees one), so both systems run on the same one."""
        if batch_size < 1:
            raise ValueError(f"--naive-batch-size must be positive; got {batch_size}")
        self.batch_size = batch_size
        self.device = choose_device(device)
        self.dtype = choose_dtype(dtype, self.device, own_kernels=False)  # transformers: torch's kernels
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype).to(self.device).eval()
        # generate() merges the model's generation config into any it is given, so ignore_eos needs
        # the model's own EOS unset; greedy needs sampling off.
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.do_sample = False
        self.pad_token_id = 0
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="naive-hf-server", daemon=True)
        self._thread.start()

    def submit(self, input_ids: list[int], max_new_tokens: int, sink: _Sink) -> None:
        """`sink` gets one StreamEvent per token, then one with meta_info, or an exception."""
        self._queue.put(_Job(list(input_ids), max_new_tokens, sink))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _serve(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            batch = [job]
            stop = False
            while len(batch) < self.batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            try:
                self._run_batch(batch)
            except Exception as e:  # the error goes to every request of the batch; the server keeps serving
                logger.exception("naive HF batch of %d failed", len(batch))
                for j in batch:
                    j.sink(e)
            if stop:
                return

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Job]) -> None:
        width = max(len(j.input_ids) for j in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, job in enumerate(batch):  # left padding: every row's last prompt token is aligned
            input_ids[row, width - len(job.input_ids):] = torch.tensor(job.input_ids, dtype=torch.long)
            attention_mask[row, width - len(job.input_ids):] = 1
        max_new = max(j.max_new_tokens for j in batch)
        self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), max_new_tokens=max_new,
                            do_sample=False, pad_token_id=self.pad_token_id, streamer=_StepStamper(batch))
        done = time.perf_counter()
        for job in batch:
            meta = {"prompt_tokens": len(job.input_ids), "completion_tokens": job.emitted, "cached_tokens": 0,
                    "finish_reason": {"type": "length", "length": job.max_new_tokens}}
            job.sink(StreamEvent(done, [], meta))


class HFBackend(GenerationBackend):
    name = "hf"
    latency_note = ("transformers generate, static batches: TTFT/ITL stamped in process per decode step; "
                    "e2e when the batch returns")

    def __init__(self, server: NaiveHFServer) -> None:
        self.server = server

    async def stream(self, input_ids: list[int], max_new_tokens: int) -> AsyncIterator[StreamEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()

        def sink(event: StreamEvent | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:
                pass  # the event loop is closed: nobody is waiting for this request any more

        self.server.submit(input_ids, max_new_tokens, sink)
        while True:
            ev = await events.get()
            if isinstance(ev, BaseException):
                raise ev
            yield ev
            if ev.meta_info is not None:
                return

    def reset(self) -> None:
        """Nothing persists across requests."""

    def close(self) -> None:
        self.server.close()
