"""`launch_cluster` (what `sgl-lite serve --dp-size N` runs) serves through sglang-router and, on
SIGTERM, stops every process it started: router, HTTP fronts and runtime replicas. Loopback only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

pytest.importorskip("sglang_router")

from waiting import wait_until_exited

from sgl_lite.cluster import READY_PREFIX, cpu_sets, free_port  # noqa: E402

pytestmark = pytest.mark.timeout(90)


def children_of(pid: int) -> set[int]:
    """Live processes whose parent is `pid` (from /proc; no psutil needed)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def cluster_processes(cluster: subprocess.Popen) -> set[int]:
    """The router, the replicas and each replica's HTTP front of a running 2-replica cluster."""
    started = children_of(cluster.pid)
    assert len(started) == 3  # 2 replicas, 1 router
    started |= {front for pid in started for front in children_of(pid)}
    assert len(started) == 5
    return started


def test_cpu_sets_are_disjoint_and_cover_the_cpus() -> None:
    assert cpu_sets(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert cpu_sets(3, [0, 1]) == [[0], [1], [0]]  # more replicas than CPUs: shared, one each
    with pytest.raises(ValueError, match="--dp must be >= 1"):
        cpu_sets(0)


def launch(model_dir: Path, port: int, policy: str, *, as_shell_job: bool = False) -> subprocess.Popen:
    """`launch_cluster` (2 replicas) in a process of its own, as `serve --dp-size 2` runs it; as a shell job:
    in a process group of its own (the one a terminal's Ctrl-C signals), its stderr kept."""
    script = ("import sys; from sgl_lite.cluster import launch_cluster; "
              "from sgl_lite.runtime.server_args import ServerArgs; "
              f"sys.exit(launch_cluster(ServerArgs(model_path={str(model_dir)!r}, dtype='float32', "
              f"log_level='warning', port={port}), 2, {policy!r}))")
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if as_shell_job else subprocess.DEVNULL, start_new_session=as_shell_job,
                            text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})


def test_sigterm_stops_router_fronts_and_replicas(tiny_llama_dir: Path) -> None:
    cluster = launch(tiny_llama_dir, free_port(), "cache_aware")
    try:
        assert cluster.stdout is not None
        line = cluster.stdout.readline()
        assert line.startswith(READY_PREFIX), f"cluster did not start (exit code {cluster.poll()})"
        url = line.split()[1]
        reply = requests.post(url + "/generate", timeout=30,
                              json={"text": "hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] >= 1
        started = cluster_processes(cluster)
        cluster.send_signal(signal.SIGTERM)
        assert cluster.wait(30) == 0
        wait_until_exited(started, 10)
        with pytest.raises(requests.ConnectionError):
            requests.get(url + "/health", timeout=5)
    finally:
        if cluster.poll() is None:
            cluster.kill()
            cluster.wait()


def test_a_killed_cluster_leaves_nothing_running_and_port_0_picks_one(tiny_llama_dir: Path) -> None:
    """SIGKILL gives `serve --dp-size N` no chance to stop its children: replicas watch its pid, and the
    router (which cannot) gets the parent-death signal. `--port 0` means a free port, announced."""
    cluster = launch(tiny_llama_dir, 0, "round_robin")
    try:
        assert cluster.stdout is not None
        line = cluster.stdout.readline()
        assert line.startswith(READY_PREFIX), f"cluster did not start (exit code {cluster.poll()})"
        url = line.split()[1]
        assert not url.endswith(":0") and requests.get(url + "/health", timeout=10).status_code == 200
        started = cluster_processes(cluster)
        cluster.kill()
        cluster.wait()
        wait_until_exited(started, 20)
    finally:
        if cluster.poll() is None:
            cluster.kill()
            cluster.wait()


def test_a_terminal_ctrl_c_stops_the_cluster_quietly(tiny_llama_dir: Path) -> None:
    """Ctrl-C signals the whole foreground process group: the children are the cluster's to stop (router
    first). When they took the SIGINT themselves, the router's exit was logged as a failure."""
    cluster = launch(tiny_llama_dir, 0, "round_robin", as_shell_job=True)
    try:
        assert cluster.stdout is not None and cluster.stderr is not None
        line = cluster.stdout.readline()
        assert line.startswith(READY_PREFIX), f"cluster did not start (exit code {cluster.poll()})"
        started = cluster_processes(cluster)
        os.killpg(cluster.pid, signal.SIGINT)
        assert cluster.wait(30) == 0
        stderr = cluster.stderr.read()
        assert "exited" not in stderr and "Traceback" not in stderr, stderr
        wait_until_exited(started, 10)
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGKILL)
            cluster.wait()
