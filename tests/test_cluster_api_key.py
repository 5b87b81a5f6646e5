"""`serve --dp-size N --api-key K`: the key reaches every process through its environment, never its
command line (which any local user reads with `ps`), and the router still enforces it. Loopback only."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import requests

pytest.importorskip("sglang_router")

from sgl_lite.cluster import Cluster, free_port  # noqa: E402
from sgl_lite.runtime.client import RuntimeClient, RuntimeRequestError  # noqa: E402
from sgl_lite.runtime.client.discovery import discover_zmq_address  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

pytestmark = pytest.mark.timeout(90)

KEY = "cluster-test-key-7f3a9c"
GREEDY = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}


def front_pid(replica_pid: int) -> int:
    found = subprocess.run(["pgrep", "-P", str(replica_pid), "-f", "sgl_lite.http.launch"], capture_output=True,
                           text=True)
    return int(found.stdout.split()[0])


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_the_key_is_on_no_command_line_and_the_router_enforces_it(tiny_llama_dir: Path) -> None:
    args = ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", log_level="warning", api_key=KEY)
    cluster = Cluster(args.replace(port=free_port()), dp=2, startup_timeout=80)
    try:
        cluster.start()
        assert cluster.router is not None
        pids = [c.process.pid for c in [*cluster.replicas, cluster.router]]
        pids += [front_pid(r.process.pid) for r in cluster.replicas]  # each replica's own HTTP front
        assert len(pids) == 5
        for pid in pids:
            assert KEY not in command_line(pid), command_line(pid)
        body = {"text": "hello", "sampling_params": GREEDY}
        refused = requests.post(cluster.url + "/generate", json=body, timeout=30)
        assert refused.status_code == 401, refused.text
        wrong = requests.post(cluster.url + "/generate", json=body, timeout=30,
                              headers={"Authorization": "Bearer not-the-key"})
        assert wrong.status_code == 401, wrong.text
        # Twice: with cache-aware routing both requests may land on one replica, but each replica's
        # front forwards the key to its runtime, which checks it too.
        for _ in range(2):
            served = requests.post(cluster.url + "/generate", json=body, timeout=30,
                                   headers={"Authorization": f"Bearer {KEY}"})
            assert served.status_code == 200, served.text
            assert served.json()["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
        # The router holds the key itself: it asks it from clients of its own routes and sends it on
        # its fan-out to the replicas (without it, their fronts would refuse the flush).
        assert requests.post(cluster.url + "/flush_cache", timeout=30).status_code == 401
        flushed = requests.post(cluster.url + "/flush_cache", timeout=30, headers={"Authorization": f"Bearer {KEY}"})
        assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2, flushed.text
        # Each replica's runtime read the key from its environment (the fronts alone checking it would
        # let the requests above through too): asked directly, without the key, it refuses.
        for worker_url in cluster.worker_urls:
            address = discover_zmq_address(worker_url, KEY)
            with RuntimeClient(address, timeout=30) as anonymous:
                with pytest.raises(RuntimeRequestError) as refused_by_runtime:
                    anonymous.generate("hello", sampling_params=GREEDY)
                assert refused_by_runtime.value.code == "unauthorized"
            with RuntimeClient(address, api_key=KEY, timeout=30) as client:
                assert len(client.generate("hello", sampling_params=GREEDY).output_ids) == GREEDY["max_new_tokens"]
    finally:
        cluster.stop()
