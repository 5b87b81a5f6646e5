"""Virtual time: a clock, a per-step cost model, and a runner whose forward only advances the clock.

One forward of the real runtime costs  t = a + b * prefill_tokens + c(decode_batch)  seconds here:
- a: what every forward pays (weights streamed once, LM head, sampling, Python);
- b: seconds per prompt token computed in a prefill batch;
- c(B): the extra of a decode step over a, piecewise linear in the batch size B through the
  measured points (extrapolated from the last two), c(0) = 0.
Calibration reads scripts/bench_model.py's JSON: b from the prefill row, and a, c from the decode
rows (step time d(B) = B / tokens_per_s; a = d extrapolated to B = 0 from the two smallest batches).
Not modelled: attention's growth with context length, chunk boundaries beyond their token counts.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path

from sgl_lite.runtime.mem_cache.memory_pool import ReqToTokenPool
from sgl_lite.runtime.model_executor.forward_batch import ForwardBatch, ForwardOutput, ModelRunnerBase

# The built-in calibration (CostModel.default): scripts/bench_model.py's figures for SmolLM2-135M in bfloat16
# on 2 CPU cores, 2 threads - prompt tokens per second of a 1024-token prefill, output tokens per second of
# decode by batch size. from_bench_model_json takes a machine's own instead.
DEFAULT_MEASUREMENT = {"prefill_tokens": 1024, "prefill_tokens_per_s": 863.1,
                       "decode_tokens_per_s": {1: 20.93, 8: 148.1, 32: 290.7}}


class VirtualClock:
    """Seconds of simulated time; the Scheduler reads it through its `clock` argument."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class CostModel:
    step_overhead_s: float  # a
    prefill_s_per_token: float  # b
    decode_batches: tuple[int, ...]  # points of c, ascending
    decode_extra_s: tuple[float, ...]  # c at those batch sizes
    source: str = "built-in"

    def __post_init__(self) -> None:
        if self.step_overhead_s < 0 or self.prefill_s_per_token <= 0:
            raise ValueError(f"cost model needs a >= 0 and b > 0; got a={self.step_overhead_s}, b={self.prefill_s_per_token}")
        if not self.decode_batches or len(self.decode_batches) != len(self.decode_extra_s):
            raise ValueError("cost model needs one decode cost per decode batch size (at least one)")

    def decode_cost(self, batch: int) -> float:
        if batch <= 0:
            return 0.0
        xs, ys = (0, *self.decode_batches), (0.0, *self.decode_extra_s)
        i = min(max(bisect.bisect_left(xs, batch), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (batch - x0) / (x1 - x0), 0.0)

    def step_time(self, prefill_tokens: int, decode_batch: int) -> float:
        return self.step_overhead_s + self.prefill_s_per_token * prefill_tokens + self.decode_cost(decode_batch)

    @classmethod
    def from_measurement(cls, prefill_tokens: int, prefill_tokens_per_s: float,
                         decode_tokens_per_s: dict[int, float], source: str) -> CostModel:
        points = sorted((int(b), b / tps) for b, tps in decode_tokens_per_s.items() if tps > 0)
        if not points or prefill_tokens_per_s <= 0:
            raise ValueError(f"{source}: needs a prefill rate and at least one decode rate")
        if len(points) >= 2:
            (b0, d0), (b1, d1) = points[0], points[1]
            overhead = max(d0 - (d1 - d0) / (b1 - b0) * b0, 0.0)
        else:
            overhead = 0.0
        overhead = min(overhead, points[0][1])
        prefill_time = prefill_tokens / prefill_tokens_per_s
        per_token = max(prefill_time - overhead, prefill_time * 0.5) / prefill_tokens
        return cls(overhead, per_token, tuple(b for b, _ in points), tuple(d - overhead for _, d in points), source)

    @classmethod
    def default(cls) -> CostModel:
        m = DEFAULT_MEASUREMENT
        return cls.from_measurement(m["prefill_tokens"], m["prefill_tokens_per_s"], m["decode_tokens_per_s"], "built-in")

    @classmethod
    def from_bench_model_json(cls, path: str | Path) -> CostModel:
        """Calibrate from `scripts/bench_model.py --out FILE` (its "results" rows, column "sgl_lite")."""
        try:
            rows = json.loads(Path(path).read_text())["results"]
            prefill = next(r for r in rows if str(r["phase"]).startswith("prefill"))
            tokens = int(str(prefill["phase"]).split()[1])
            decode = {int(r["batch"]): float(r["sgl_lite"]) for r in rows if r["phase"] == "decode"}
        except (OSError, KeyError, StopIteration, ValueError, IndexError, TypeError) as e:
            raise ValueError(f"{path}: not a scripts/bench_model.py JSON ({type(e).__name__}: {e})") from None
        return cls.from_measurement(tokens, float(prefill["sgl_lite"]), decode, str(path))

    def to_json(self) -> dict:
        return {"a_step_overhead_s": self.step_overhead_s, "b_prefill_s_per_token": self.prefill_s_per_token,
                "c_decode_extra_s": dict(zip(self.decode_batches, self.decode_extra_s)), "source": self.source}


def sim_token(fill_ids: list[int], vocab_size: int) -> int:
    """A deterministic next token from the last few tokens and the length (O(1) per token)."""
    return hash((len(fill_ids), *fill_ids[-4:])) % (vocab_size - 3) + 3


@dataclass
class CostModelRunner(ModelRunnerBase):
    """No model: forward advances the clock by the cost model's step time and returns sim_token()s."""

    cost: CostModel
    clock: VirtualClock
    num_slots: int
    max_running_requests: int
    context_length: int
    vocab_size: int
    first_scheduled: dict[str, float] = field(default_factory=dict)  # rid -> start of its first prefill
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        self.req_to_token = ReqToTokenPool(self.max_running_requests, self.context_length)

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if batch.is_decode:
            cost = self.cost.step_time(0, len(batch.reqs))
        else:
            for req in batch.reqs:
                self.first_scheduled.setdefault(req.rid, self.clock.now)
            cost = self.cost.step_time(batch.num_tokens, 0)
        self.clock.now += cost
        self.busy_s += cost
        tokens = [sim_token(r.fill_ids[: p + n], self.vocab_size) if s else None
                  for r, p, n, s in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample)]
        return ForwardOutput(tokens)
