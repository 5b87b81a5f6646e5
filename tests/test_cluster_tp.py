"""`serve --dp-size 2 --tp-size 2`: two replicas behind sglang-router, each a TP group of two processes
(rank 0 serves, rank 1 is its child). Results match one unsharded process; stopping the cluster ends
all seven processes (router, 2 replicas with their HTTP fronts, 2 TP ranks). Loopback only."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

pytest.importorskip("sglang_router")

from waiting import wait_until_exited

from sgl_lite.cluster import Cluster, free_port  # noqa: E402
from sgl_lite.runtime.server.engine import Engine  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["The quick brown fox jumps over", "What is the capital of France? Paris is"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


def process_state(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc, None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def tp_ranks_of(parents: set[int]) -> set[int]:
    return children_running(parents, b"sgl_lite.runtime.model_executor.tp")


def fronts_of(parents: set[int]) -> list[int]:
    return sorted(children_running(parents, b"sgl_lite.http.launch"))


def children_running(parents: set[int], module: bytes) -> set[int]:
    ranks = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        state = process_state(int(entry.name))
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if state is not None and state[1] in parents and module in cmdline:
            ranks.add(int(entry.name))
    return ranks


def test_dp2_tp2_serves_like_one_process_and_stops_every_rank(tiny_llama_dir: Path) -> None:
    with Engine(str(tiny_llama_dir), dtype="float32", max_total_tokens=1024) as reference:
        expected = [reference.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    args = ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", log_level="warning", tp_size=2,
                      max_total_tokens=1024)
    cluster = Cluster(args.replace(port=free_port()), dp=2, router_policy="round_robin", startup_timeout=100)
    ranks: set[int] = set()
    try:
        cluster.start()
        replicas = {r.process.pid for r in cluster.replicas}
        ranks = tp_ranks_of(replicas)
        assert len(ranks) == 2  # one rank 1 per replica
        # Round robin: both replicas (both TP groups) serve; each prompt is sent twice.
        for prompt, ids in zip(PROMPTS * 2, expected * 2):
            reply = requests.post(cluster.url + "/generate", json={"text": prompt, "sampling_params": GREEDY},
                                  timeout=60)
            assert reply.status_code == 200, reply.text
            assert reply.json()["output_ids"] == ids
        assert requests.post(cluster.url + "/flush_cache", timeout=30).json()["workers_flushed"] == 2
    finally:
        started = [c.process.pid for c in cluster.replicas] + fronts_of({c.process.pid for c in cluster.replicas})
        cluster.stop()
    # A replica stops its rank before it exits; a rank whose replica died anyway follows within a second.
    wait_until_exited([*started, *ranks], 10)
