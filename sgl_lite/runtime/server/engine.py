"""Engine: the runtime in-process, driven from the calling thread (SGLang's `sgl.Engine` shape).

    with Engine(model_path="smollm2-135m", max_total_tokens=8192) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
        out["text"], out["output_ids"], out["meta_info"]["cached_tokens"]

`generate` queues the request(s) and steps the scheduler until they finish. A list of prompts (or
of input_ids lists) gives a list of outputs, in input order, with a progress bar above
PROGRESS_BAR_MIN requests. `stream=True` (single prompt) yields dicts, as SGLang's Engine does, whose
"text" and "output_ids" are everything so far; the last one is the whole output with its meta_info.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.protocol import SamplingParams
from sgl_lite.runtime.server.core import RuntimeCore
from sgl_lite.runtime.server_args import ServerArgs

PROGRESS_BAR_MIN = 32
# While only grammar compiles or disk-tier loads are pending, the loop waits this long between looks instead of
# spinning: a spinning loop holds the GIL their threads need.
IDLE_WAIT_S = 0.002
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: str = "smollm2-135m", **server_args: Any) -> None:
        self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        _show_logs(self.args.log_level)
        logger.info("Engine: loading model %s (the first use of an alias fetches and converts it once)", model_path)
        self.core = RuntimeCore.from_args(self.args)
        self._ids = itertools.count()
        self._closed = False

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | SamplingParams | list | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        priority: int | None = None,
        stream: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        if self._closed:
            raise RuntimeError("this Engine was shut down; create a new one to generate")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        is_batch = isinstance(prompt, list) or (isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list))
        texts: list[str | None]
        ids: list[list[int] | None]
        if is_batch:
            n = len(prompt) if prompt is not None else len(input_ids)  # type: ignore[arg-type]
            texts = list(prompt) if prompt is not None else [None] * n
            ids = list(input_ids) if input_ids is not None else [None] * n  # type: ignore[arg-type]
        else:
            texts, ids = [prompt], [input_ids]  # type: ignore[list-item]
        n = len(texts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {n} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * n
        reqs = [
            self.core.make_req(
                f"engine-{next(self._ids)}", texts[i], ids[i], params_list[i],
                return_logprob=return_logprob,
                logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                top_logprobs_num=top_logprobs_num or 0, priority=priority, stream=stream,
            )
            for i in range(n)
        ]
        if stream:
            if is_batch:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(reqs[0])
        self._submit_all(reqs)
        self._run(reqs, progress=n > PROGRESS_BAR_MIN)
        outputs = [self._output(r) for r in reqs]
        return outputs if is_batch else outputs[0]

    def _submit_all(self, reqs: list[Req]) -> None:
        """Queue all or none: a rejected request aborts those queued before it."""
        for i, req in enumerate(reqs):
            try:
                self.core.submit(req)
            except ValueError:
                for queued in reqs[:i]:
                    self.core.abort(queued.rid)
                self._drain()
                raise

    def _run(self, reqs: list[Req], progress: bool) -> None:
        pending = {r.rid for r in reqs}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        try:
            while pending:
                for req in self._step():
                    if req.finished and req.rid in pending:
                        pending.discard(req.rid)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:  # e.g. KeyboardInterrupt: leave nothing behind in the scheduler
                self.core.abort(rid)
            self._drain()
            raise
        finally:
            if bar is not None:
                bar.close()

    def _stream(self, req: Req) -> Iterator[dict]:
        """SGLang's Engine stream: each chunk holds the text and output ids *so far* and a meta_info
        (prompt/completion tokens, finish_reason None until the last chunk, which is the full output).
        The text comes from the server's streaming state (RuntimeCore.stream_state): incremental
        detokenizing, and the last characters withheld while a stop string could still be completing,
        so every chunk's text is a prefix of the final text."""
        self._submit_all([req])
        state = self.core.stream_state(req)
        text = ""
        try:
            while not req.finished:
                changed = self._step()
                if req not in changed or req.finished:
                    continue
                delta = state.update(req.output_ids)
                if not delta:
                    continue  # an incomplete UTF-8 character, or text a stop string may still cut
                text += delta
                meta_info = {"id": req.rid, "finish_reason": None, "prompt_tokens": len(req.input_ids),
                             "completion_tokens": len(req.output_ids)}
                yield {"text": text, "output_ids": list(state.settled(req.output_ids)), "meta_info": meta_info}
        finally:
            if not req.finished:
                self.core.abort(req.rid)
                self._drain()
        yield self._output(req)

    def _step(self) -> list[Req]:
        """One scheduler step, or a wait of IDLE_WAIT_S when it would only look at pending compiles or loads."""
        if self.core.has_work() and not self.core.has_ready_work():
            time.sleep(IDLE_WAIT_S)
            return []
        return self.core.step()

    def _drain(self) -> None:
        """Drop the reports of requests this engine aborted (nobody waits for them)."""
        self.core.take_reports()

    def _output(self, req: Req) -> dict:
        return {"text": self.core.output_text(req), "output_ids": list(req.output_ids), "meta_info": self.core.meta_info(req)}

    # ------------------------------------------------------------------ admin

    def flush_cache(self) -> bool:
        return self.core.flush_cache()

    def get_server_info(self) -> dict:
        return self.core.server_info()

    def shutdown(self) -> None:
        """Abort what is in flight and stop the processes the runtime started (tensor-parallel ranks).

        Idempotent. The engine generates nothing afterwards: with --tp-size > 1 its ranks are gone.
        """
        if self._closed:
            return
        self._closed = True
        for rid in self.core.live_request_ids():
            self.core.abort(rid)
        self._drain()
        self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _show_logs(level: str) -> None:
    """Print sgl_lite's logs (start-up progress, batch lines) to stderr at `level`, as SGLang's Engine
    does, unless the application has configured logging itself (a handler on the root or ours)."""
    ours = logging.getLogger("sgl_lite")
    if logging.getLogger().handlers or ours.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    ours.addHandler(handler)
    ours.setLevel(level.upper())
