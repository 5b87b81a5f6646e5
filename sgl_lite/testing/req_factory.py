"""`make_req`: a scheduler-side Req for unit tests, with only the fields a test cares about given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sgl_lite.runtime.managers.request import Req
from sgl_lite.runtime.mem_cache.memory_pool import ReqToTokenPool
from sgl_lite.runtime.protocol import SamplingParams


def make_req(rid: str = "r", input_ids: Sequence[int] = (5, 6), arrival_time: float | None = None, *,
             output_ids: Sequence[int] = (), priority: int | None = None, req_pool: ReqToTokenPool | None = None,
             **sampling_params: Any) -> Req:
    """A Req with `SamplingParams(**sampling_params)`; `arrival_time` None keeps Req's default (now);
    with `req_pool`, the request holds a row of it, as an admitted request does."""
    extra = {} if arrival_time is None else {"arrival_time": arrival_time}
    req = Req(rid, list(input_ids), SamplingParams(**sampling_params), priority=priority, **extra)
    req.output_ids = list(output_ids)
    if req_pool is not None:
        req.req_pool_idx = req_pool.alloc()
    return req
