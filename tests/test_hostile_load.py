"""sgl_lite/testing/hostile_load.py, the load scripts/bench_hostile.py runs beside its chats, against an HTTP
front over a scripted runtime: its hog keeps batches at the front's limit coming and its one batch over the
limit is refused, the runaway compile is resent, /health is probed, and leaving the `with` stops it all."""

from __future__ import annotations

import time
from pathlib import Path

from test_batch_prompt_budget import PREFILL, Front

from sgl_lite.runtime import protocol
from sgl_lite.testing.hostile_load import RUNAWAY_REGEX, HogPlan, HostileLoad


def test_the_hostile_load_runs_until_its_with_ends(tiny_llama_dir: Path) -> None:
    front = Front(tiny_llama_dir, {"max_prefill_tokens": PREFILL})
    hog = HogPlan(streams=2, prompts=2, prompt_tokens=PREFILL // 2)  # two prompts fill the limit exactly
    try:
        with HostileLoad(front.http.url, lambda n: [5] * n, hog=hog, compile_streams=1, health_every_s=0.05) as load:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (len(load.stats["hog"].seconds) < 4
                                                   or len(load.stats["runaway compile"].seconds) < 2):
                time.sleep(0.05)
        report = load.report()
        assert report["hog over the limit"]["statuses"] == {"400": 1}
        assert "one request may prefill at most" in report["hog over the limit"]["messages"][0]
        assert set(report["hog"]["statuses"]) == {"200"} and report["hog"]["answered"] >= 4
        assert report["runaway compile"]["answered"] >= 2  # the scripted runtime answers at once: resent
        assert set(report["health"]["statuses"]) == {"200"}
        regexes = [m.sampling_params.regex for m in front.runtime.received
                   if isinstance(m, protocol.GenerateReq) and m.sampling_params.regex]
        assert regexes and set(regexes) == {RUNAWAY_REGEX}
        time.sleep(0.3)  # requests the front had taken before the `with` ended reach the runtime
        sent = front.generates_received()
        time.sleep(0.5)
        assert front.generates_received() == sent  # and nothing more: the hostile streams have stopped
    finally:
        front.close()
