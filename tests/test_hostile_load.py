"""sgl_lite/testing/hostile_load.py, the load scripts/bench_hostile.py runs beside its chats, against an HTTP
front over a scripted runtime: its hog keeps batches at the front's limit coming and its one batch over the
limit is refused, the runaway compile is resent, /health is probed, and leaving the `with` stops it all."""

from __future__ import annotations

import time
from pathlib import Path

from test_batch_prompt_budget import PREFILL, Front

from sgl_lite.runtime import protocol
from sgl_lite.testing.hostile_load import RUNAWAY_REGEX, HogPlan, HostileLoad, StreamStats, hostile_load_problems


def test_the_hostile_load_runs_until_its_with_ends(tiny_llama_dir: Path) -> None:
    front = Front(tiny_llama_dir, {"max_prefill_tokens": PREFILL})
    # Two prompts fill the limit exactly, as HogPlan.for_server plans them from the front's server_info.
    hog = HogPlan(streams=2, prompts=2, prompt_tokens=PREFILL // 2, over_limit_prompts=3)
    info = {"context_length": PREFILL, "server_args": {"max_prefill_tokens": PREFILL}}
    assert HogPlan.for_server(info, streams=2, prompt_tokens=PREFILL // 2) == hog
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


def test_the_problems_of_a_hostile_loads_report() -> None:
    def stats(*statuses: str) -> StreamStats:
        s = StreamStats(sent=len(statuses) + 1)
        for status in statuses:
            s.record(status, 0.1, "" if status == "200" else f"error {status}")
        return s

    good = {"health": stats("200", "200"), "hog": stats("200", "500 tolerated"), "hog over the limit": stats("400"),
            "runaway compile": stats("400")}
    assert hostile_load_problems({name: s.to_json() for name, s in good.items()}) == []
    bad = {**good, "hog": stats("200", "500"), "runaway compile": stats(), "health": stats("200", "503")}
    problems = hostile_load_problems({name: s.to_json() for name, s in bad.items()})
    assert len(problems) == 3, problems
    assert any(p.startswith("hog: answers {'500': 1}") and "error 500" in p for p in problems)
    assert any(p.startswith("runaway compile: 1 sent, none answered") for p in problems)
    assert any(p.startswith("health: answers {'503': 1}") for p in problems)
