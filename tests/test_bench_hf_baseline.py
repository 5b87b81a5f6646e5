"""bench_serving's transformers baseline (sgl_lite/bench/naive_hf_server.py): requests run as
generate() batches (up to --naive-batch-size) on the runtime's device, each request streaming exactly its own tokens, then one final event with its totals."""

from __future__ import annotations

import threading

import torch

from sgl_lite.bench.naive_hf_server import NaiveHFServer


def test_each_request_streams_its_own_tokens_then_its_totals(tiny_llama_dir) -> None:
    server = NaiveHFServer(tiny_llama_dir, batch_size=4, dtype="float32", device="auto")
    assert server.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    events: dict[int, list] = {0: [], 1: []}
    done = {0: threading.Event(), 1: threading.Event()}

    def sink_for(i: int):
        def sink(event) -> None:
            events[i].append(event)
            if isinstance(event, BaseException) or event.meta_info is not None:
                done[i].set()
        return sink

    try:
        server.submit([5, 6, 7, 8, 9], 3, sink_for(0))
        server.submit([11, 12], 6, sink_for(1))
        assert done[0].wait(120) and done[1].wait(120)
    finally:
        server.close()
    for i, (prompt_len, wanted) in enumerate([(5, 3), (2, 6)]):
        *tokens, final = events[i]
        assert [len(e.new_ids) for e in tokens] == [1] * wanted
        assert final.meta_info["prompt_tokens"] == prompt_len and final.meta_info["completion_tokens"] == wanted
