"""Client processes SIGKILLed mid-stream, for the soak (soak.py): each streams a long greedy request and is
killed once its first chunk arrived, so the runtime sees a peer vanish with a request in flight."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

_KILLED_CLIENT = (
    "import sys\n"
    "from sgl_lite.runtime.client import RuntimeClient\n"
    "c = RuntimeClient(sys.argv[1], api_key=sys.argv[2] or None, timeout=600)\n"
    "params = {'max_new_tokens': 200, 'temperature': 0.0, 'ignore_eos': True}\n"
    "while True:\n"
    "    try:\n"
    "        stream = c.generate_stream(sys.argv[3], sampling_params=params, priority=100)\n"
    "        next(stream)\n"
    "        break\n"
    "    except Exception:\n"
    "        pass  # queue full: try again\n"
    "print('streaming', flush=True)\n"
    "for _ in stream:\n"
    "    pass\n"
)


def kill_client_processes(address: str, api_key: str | None, count: int, env: dict[str, str],
                          stop: threading.Event, rng: random.Random, killed: list[int], words: Sequence[str]) -> None:
    """Start `count` streaming client processes one after another and SIGKILL each mid-stream."""
    for _ in range(count):
        if stop.wait(rng.uniform(0.5, 3.0)):
            return
        prompt = " ".join(rng.choice(words) for _ in range(20))
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_CLIENT, address, api_key or "", prompt],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        watchdog = threading.Timer(120.0, proc.kill)  # never wait forever for it to start streaming
        watchdog.start()
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() == "streaming":
                killed.append(proc.pid)
        finally:
            watchdog.cancel()
            proc.send_signal(signal.SIGKILL)
            proc.wait()
